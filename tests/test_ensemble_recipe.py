"""The ensemble recipe cannot silently go wrong, and gradients fit the optimizer.

Oracles: ``jax.grad`` on the pure function, a per-member loop, exact values.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import brainnx as bnx


class MLP(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(2, 3, rngs=rngs)

  def __call__(self, x):
    return self.l1(x)


def test_identical_members_warn_and_name_the_fix():
  with pytest.warns(UserWarning, match=r"all members are identical \(first: Param at \('l1', 'kernel'\)\).*create it outside"):
    same = bnx.vmap(lambda: MLP(nnx.Rngs(0)), axis_size=4)()
  assert bool(jnp.all(same.l1.kernel[...] == same.l1.kernel[0]))  # what the warning is about


def test_no_warning_for_constant_initialised_params():
  """A zero bias or unit scale alone is not a sign: nnx.BatchNorm made inside vmap is fine."""
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    norms = bnx.vmap(lambda: nnx.BatchNorm(3, rngs=nnx.Rngs(0)), axis_size=4)()
  assert norms.scale.shape == (4, 3)


def test_no_warning_with_an_outer_rngs_or_a_declared_shared_copy():
  rngs = nnx.Rngs(0)
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    members = bnx.vmap(lambda: MLP(rngs), axis_size=4)()
    shared = bnx.vmap(lambda: MLP(nnx.Rngs(0)), axis_size=4, state_out_axes={None: nnx.Param})()
  kernels = np.asarray(members.l1.kernel[...])
  assert len({k.tobytes() for k in kernels}) == 4  # members differ
  assert shared.l1.kernel.shape == (2, 3)  # one copy, as nnx.StateAxes would keep it
  np.testing.assert_array_equal(shared.l1.kernel[...], MLP(nnx.Rngs(0)).l1.kernel[...])


def test_filter_gradients_are_nested_by_root_and_feed_the_optimizer():
  m = MLP(nnx.Rngs(0))
  oracle = nnx.clone(m)
  opt = nnx.Optimizer(m, optax.sgd(0.1), wrt=nnx.Param)
  opt_ref = nnx.Optimizer(oracle, optax.sgd(0.1), wrt=nnx.Param)
  x = jnp.ones((4, 2))
  g = bnx.grad(lambda x: (m(x) ** 2).sum(), grad_states=nnx.Param)(x)
  assert list(g.keys()) == ['m']
  with pytest.raises(ValueError, match=r"nested by root name \('m'\): pass one root's entry .* e.g. optimizer.update\(m, grads\['m'\]\)"):
    opt.update(m, g)
  assert int(opt.step[...]) == 0  # refused before anything changed
  opt.update(m, g['m'])
  opt_ref.update(oracle, nnx.grad(lambda mm: (mm(x) ** 2).sum())(oracle))
  np.testing.assert_allclose(m.l1.kernel[...], oracle.l1.kernel[...], rtol=1e-6)


def test_argnums_may_select_containers_of_variables_and_aux_may_be_any_python_value():
  d = {'w': nnx.Param(jnp.array([1.0, 2.0]))}
  x = jnp.array([3.0, 4.0])
  ours = bnx.grad(lambda d, x: (d['w'][...] * x).sum(), argnums=0)(d, x)
  theirs = nnx.grad(lambda d, x: (d['w'][...] * x).sum(), argnums=0)(d, x)
  np.testing.assert_array_equal(ours['w'][...], theirs['w'][...])
  g, aux = bnx.grad(lambda x: ((x ** 2).sum(), 'a note'), has_aux=True)(x)
  g_ref, aux_ref = jax.grad(lambda x: ((x ** 2).sum(), 'a note'), has_aux=True)(x)
  np.testing.assert_array_equal(g, g_ref)
  assert aux == aux_ref == 'a note'


def test_aliasing_one_variable_through_two_axes_is_an_error_naming_both_paths():
  v = nnx.Param(jnp.arange(3.0))
  for in_axes in ((0, None), (None, 0)):
    with pytest.raises(bnx.BatchAxisError, match=r"Param at \(0,\) is also reached as \(1,\)"):
      bnx.vmap(lambda a, b: a[...] + b[...], in_axes=in_axes)(v, v)
  same = bnx.vmap(lambda a, b: a[...] + b[...], in_axes=(0, 0))(v, v)
  np.testing.assert_array_equal(same, jax.vmap(lambda a, b: a + b)(v[...], v[...]))


def test_warn_policy_points_at_the_callers_line_and_batchnorm_hint():
  s = nnx.BatchStat(jnp.zeros(()))

  def f(x):
    s[...] = x.sum()
    return x

  with pytest.warns(UserWarning, match='stacked on axis 0') as record:
    bnx.vmap(f, unexpected_out_state_mapping='warn')(jnp.ones((3, 2)))
  assert record[0].filename == __file__
  assert "pass unexpected_out_state_mapping='warn'" not in str(record[0].message)
  assert 'axis_name' in str(record[0].message)  # the BatchNorm hint
  with pytest.raises(bnx.BatchAxisError, match='axis_name'):
    bnx.vmap(f)(jnp.ones((3, 2)))
  with pytest.raises(TypeError, match='reverse'):
    bnx.checkpointed_scan(lambda c, x: (c, x), 0.0, jnp.ones(3), reverse=True)
