"""The ensemble recipe: members stay independent and the recipe cannot silently go wrong.

Oracles: each member trained alone, ``jax.grad`` on the pure function, a per-member loop, exact
values."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import MLP

import brainnx as bnx

MEMBERS, STEPS = 8, 20
X = jax.random.normal(jax.random.key(0), (16, 3))
Y = jnp.sin(X[:, :2])


def loss_fn(model, x, y):
  return ((model(x) - y) ** 2).mean()


def make_ensemble():
  rngs = nnx.Rngs(0)
  return bnx.vmap(lambda: MLP(3, 8, 2, rngs=rngs), axis_size=MEMBERS)()


def member(ensemble, i):
  m = MLP(3, 8, 2, rngs=nnx.Rngs(99))
  for name in ('l1', 'l2'):
    getattr(m, name).kernel[...] = getattr(ensemble, name).kernel[i]
    getattr(m, name).bias[...] = getattr(ensemble, name).bias[i]
  return m


def train_alone(m):
  opt = nnx.Optimizer(m, optax.adam(1e-2), wrt=nnx.Param)
  for _ in range(STEPS):
    grads = nnx.grad(loss_fn)(m, X, Y)
    opt.update(m, grads)
  return m


def assert_members_match(ensemble, alone):
  for i, m in enumerate(alone):
    for name in ('l1', 'l2'):
      np.testing.assert_allclose(getattr(ensemble, name).kernel[i], getattr(m, name).kernel[...], rtol=2e-4, atol=1e-6)
      np.testing.assert_allclose(getattr(ensemble, name).bias[i], getattr(m, name).bias[...], rtol=2e-4, atol=1e-6)


def test_optimizer_per_member():
  ensemble = make_ensemble()
  alone = [train_alone(member(ensemble, i)) for i in range(MEMBERS)]
  optimizers = bnx.vmap(lambda m: nnx.Optimizer(m, optax.adam(1e-2), wrt=nnx.Param))(ensemble)

  @bnx.jit
  @bnx.vmap(in_axes=(0, 0, None, None))
  def train_step(model, opt, x, y):
    loss, grads = bnx.value_and_grad(loss_fn, argnums=0)(model, x, y)
    opt.update(model, grads)
    return loss

  for _ in range(STEPS):
    losses = train_step(ensemble, optimizers, X, Y)
  assert losses.shape == (MEMBERS,)
  assert_members_match(ensemble, alone)
  np.testing.assert_array_equal(optimizers.step[...], [STEPS] * MEMBERS)


def test_one_optimizer_over_the_stacked_model():
  ensemble = make_ensemble()
  alone = [train_alone(member(ensemble, i)) for i in range(MEMBERS)]
  optimizer = nnx.Optimizer(ensemble, optax.adam(1e-2), wrt=nnx.Param)  # adam is elementwise

  def total_loss(x, y):
    per_member = bnx.vmap(lambda x, y: loss_fn(ensemble, x, y), in_axes=None, state_in_axes={0: nnx.Param})
    return per_member(x, y).sum()

  @bnx.jit
  def train_step(x, y):
    grads = bnx.grad(total_loss, grad_states=ensemble)(x, y)
    optimizer.update(ensemble, grads)

  for _ in range(STEPS):
    train_step(X, Y)
  assert_members_match(ensemble, alone)


class OneLayer(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(2, 3, rngs=rngs)

  def __call__(self, x):
    return self.l1(x)


def test_identical_members_warn_and_name_the_fix():
  with pytest.warns(UserWarning, match=r"all members are identical \(first: Param at \('l1', 'kernel'\)\).*create it outside"):
    same = bnx.vmap(lambda: OneLayer(nnx.Rngs(0)), axis_size=4)()
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
    members = bnx.vmap(lambda: OneLayer(rngs), axis_size=4)()
    shared = bnx.vmap(lambda: OneLayer(nnx.Rngs(0)), axis_size=4, state_out_axes={None: nnx.Param})()
  kernels = np.asarray(members.l1.kernel[...])
  assert len({k.tobytes() for k in kernels}) == 4  # members differ
  assert shared.l1.kernel.shape == (2, 3)  # one copy, as nnx.StateAxes would keep it
  np.testing.assert_array_equal(shared.l1.kernel[...], OneLayer(nnx.Rngs(0)).l1.kernel[...])


def test_filter_gradients_are_nested_by_root_and_feed_the_optimizer():
  m = OneLayer(nnx.Rngs(0))
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
