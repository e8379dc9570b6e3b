"""Discovery: which Variables a call can reach, with which paths."""

import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import brainnx as bnx
from brainnx._engine.discovery import discover
from helpers import MLP, concrete, linear

X = jax.random.normal(jax.random.key(0), (4, 3))
Y = jax.random.normal(jax.random.key(1), (4, 2))

GLOBAL_MODEL = MLP(2, 3, 1, rngs=nnx.Rngs(0))


def _uses_global(x):
  return GLOBAL_MODEL(x)


def _helper_uses_global(x):
  return _uses_global(x) * 2


def paths(disc):
  return list(disc.paths)


def test_positional_and_keyword_arguments():
  a, b = nnx.Param(jnp.ones(2)), nnx.BatchStat(jnp.zeros(2))
  disc = discover(lambda x, y: None, (a,), {'y': b})
  assert tuple(disc.variables) == (a, b)
  assert paths(disc) == [(0,), ('y',)]


def test_module_argument_paths_follow_nnx():
  model = MLP(2, 3, 1, rngs=nnx.Rngs(0))
  disc = discover(lambda m: None, (model,), {})
  expected = [(0, *path) for path, _ in nnx.to_flat_state(nnx.state(model))]  # nnx's own order
  assert paths(disc) == expected
  assert disc.variables[0] is model.l1.bias


def test_closure_cells():
  model = MLP(2, 3, 1, rngs=nnx.Rngs(0))
  disc = discover(lambda x: model(x), (), {})
  assert paths(disc)[0] == ('model', 'l1', 'bias')  # nnx's order: sorted attribute names


def test_a_class_called_as_the_function_has_its_constructors_closures_found():
  """``bnx.vmap(Cls, axis_size=n)()``: the Rngs ``Cls.__init__`` closes over is a root, so it is
  split per member and advanced once, exactly as through ``lambda: Cls()``."""

  def stack(via_lambda: bool):
    rngs = nnx.Rngs(3)

    class Net(nnx.Module):
      def __init__(self):
        self.l = nnx.Linear(2, 2, rngs=rngs)

    made = bnx.vmap((lambda: Net()) if via_lambda else Net, axis_size=3)()
    return made, rngs

  (by_class, rngs_class), (by_lambda, rngs_lambda) = stack(False), stack(True)
  assert paths(discover(by_class.__class__, (), {}))[0] == ('rngs', 'default', 'count')
  kernels = np.asarray(by_class.l.kernel[...])
  assert kernels.shape == (3, 2, 2) and not np.allclose(kernels[0], kernels[1])  # own keys each
  np.testing.assert_array_equal(kernels, by_lambda.l.kernel[...])
  assert int(rngs_class.default.count[...]) == int(rngs_lambda.default.count[...]) == 1


def test_globals_and_helper_functions_are_followed():
  assert paths(discover(_uses_global, (), {}))[0] == ('GLOBAL_MODEL', 'l1', 'bias')
  disc = discover(_helper_uses_global, (), {})
  assert disc.variables[0] is GLOBAL_MODEL.l1.bias


def test_attribute_names_are_not_mistaken_for_globals():
  holder = nnx.Dict(model=MLP(2, 3, 1, rngs=nnx.Rngs(1)))
  disc = discover(lambda: holder.GLOBAL_MODEL, (), {})  # attribute access, not a global load
  assert all(v is not GLOBAL_MODEL.l1.kernel for v in disc.variables)


def test_bound_method_self():
  model = MLP(2, 3, 1, rngs=nnx.Rngs(0))
  disc = discover(model.__call__, (), {})
  assert paths(disc)[0] == ('self', 'l1', 'bias')
  assert discover(model, (), {}).variables == disc.variables


def test_partial_arguments_named_by_parameter():
  model = MLP(2, 3, 1, rngs=nnx.Rngs(0))

  def loss(m, x):
    return m(x)

  disc = discover(functools.partial(loss, model), (), {})
  assert paths(disc)[0] == ('m', 'l1', 'bias')
  disc = discover(functools.partial(loss, m=model), (), {})
  assert paths(disc)[0] == ('m', 'l1', 'bias')


def test_shared_variable_is_one_variable():
  shared = nnx.Param(jnp.ones(2))
  first, second = nnx.Dict(w=shared), nnx.Dict(w=shared)
  disc = discover(lambda a, b: None, (first, second), {})
  assert tuple(disc.variables) == (shared,)
  assert paths(disc) == [(0, 'w')]


def test_shared_submodule_walked_once():
  layer = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
  seq = nnx.List([layer, layer])
  disc = discover(lambda s: None, (seq,), {})
  assert paths(disc) == [(0, *path) for path, _ in nnx.to_flat_state(nnx.state(seq))] == [(0, 0, 'bias'), (0, 0, 'kernel')]


def test_containers_lists_dicts_tuples_and_nnx_containers():
  a, b, c = (nnx.Variable(jnp.zeros(())) for _ in range(3))
  d = nnx.Variable(jnp.zeros(()))
  disc = discover(lambda x: None, ({'k': [a, (b,)], 'n': nnx.List([c]), 'm': nnx.Dict(z=d)},), {})
  assert paths(disc) == [(0, 'k', 0), (0, 'k', 1, 0), (0, 'n', 0), (0, 'm', 'z')]


def test_rngs_streams_are_recorded_as_key_count_pairs():
  rngs = nnx.Rngs(0, dropout=1)
  disc = discover(lambda: rngs, (), {})
  kinds = [type(v).__name__ for v in disc.variables]
  assert kinds.count('RngKey') == 2 and kinds.count('RngCount') == 2
  for k, c in disc.streams:
    assert isinstance(disc.variables[k], nnx.RngKey) and isinstance(disc.variables[c], nnx.RngCount)
    assert disc.paths[k][:-1] == disc.paths[c][:-1]


def test_optimizer_state_is_found_with_nnx_like_paths():
  model = MLP(2, 3, 1, rngs=nnx.Rngs(0))
  opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
  disc = discover(lambda: (model, opt), (), {})
  ps = paths(disc)
  assert ('opt', 'step') in ps
  assert ('opt', 'opt_state', 0, 'mu', 'l1', 'kernel') in ps
  assert ('opt', 'opt_state', 0, 'count') in ps


def test_guard_notices_rebinding_and_replacement():
  model = MLP(2, 3, 1, rngs=nnx.Rngs(0))
  disc = discover(lambda x: model(x), (), {})
  assert disc.guard.ok()
  model.l1.rate = 0.5  # adding an attribute changes the structure
  assert not disc.guard.ok()
  disc = discover(lambda x: model(x), (), {})
  model.l1.rate = 0.5  # re-setting an equal static value keeps the plan
  assert disc.guard.ok()
  model.l1.bias = nnx.Param(jnp.ones(3))
  assert not disc.guard.ok()


def test_guard_tells_equal_valued_variables_apart():
  holder = nnx.Dict(step=nnx.Variable(jnp.array(0)))
  disc = discover(lambda: holder, (), {})
  holder['step'] = nnx.Variable(jnp.array(0))  # same value, new object
  assert not disc.guard.ok()


def test_guard_notices_global_rebinding():
  global GLOBAL_MODEL
  disc = discover(_uses_global, (), {})
  old = GLOBAL_MODEL
  try:
    GLOBAL_MODEL = MLP(2, 3, 1, rngs=nnx.Rngs(9))
    assert not disc.guard.ok()
  finally:
    GLOBAL_MODEL = old
  assert disc.guard.ok()


@pytest.mark.parametrize('static', [True, False, 0.25])
def test_static_attributes_are_part_of_the_signature(static):
  a = nnx.Dropout(0.5, rngs=nnx.Rngs(0))
  b = nnx.Dropout(0.5, rngs=nnx.Rngs(0))
  b.deterministic = static
  sa = discover(lambda m: None, (a,), {}).signature
  sb = discover(lambda m: None, (b,), {}).signature
  assert (sa == sb) == (static is False)


# -- plain objects holding modules, found through their attributes -----------------------------------

def _trainer_step(self, x, y):
  def loss_fn():
    return ((self.model(x) - y) ** 2).mean()

  grads, loss = bnx.grad(loss_fn, grad_states=self.model, return_value=True)()
  self.opt.update(self.model, grads)
  return loss


class PlainTrainer:
  def __init__(self, model, opt):
    self.model, self.opt = model, opt

  step = bnx.jit(_trainer_step)


@dataclasses.dataclass
class DataclassTrainer:
  model: nnx.Linear
  opt: nnx.Optimizer

  step = bnx.jit(_trainer_step)


@pytest.mark.parametrize('trainer_cls', [PlainTrainer, DataclassTrainer])
def test_trainer_method_step_matches_optax(trainer_cls):
  """A @bnx.jit method on a plain/dataclass object holding model + Optimizer trains like optax."""
  model = linear()
  tx = optax.adam(1e-2)
  params = {'kernel': model.kernel[...], 'bias': model.bias[...]}
  trainer = trainer_cls(model, nnx.Optimizer(model, tx, wrt=nnx.Param))

  def pure_loss(p, x, y):
    return ((x @ p['kernel'] + p['bias'] - y) ** 2).mean()

  @jax.jit
  def pure_step(p, s, x, y):
    loss, g = jax.value_and_grad(pure_loss)(p, x, y)
    updates, s = tx.update(g, s, p)
    return optax.apply_updates(p, updates), s, loss

  opt_state = tx.init(params)
  for k in range(3):
    loss = trainer.step(X + k, Y)
    params, opt_state, loss_ref = pure_step(params, opt_state, X + k, Y)
    np.testing.assert_allclose(loss, loss_ref, rtol=1e-5)
  np.testing.assert_allclose(concrete(model.kernel), params['kernel'], rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(concrete(model.bias), params['bias'], rtol=1e-5, atol=1e-7)
  assert int(trainer.opt.step[...]) == 3


def test_module_through_namespace_is_not_baked():
  """A module reached via a plain object attribute is an input, not a jaxpr constant."""
  m = linear()
  t = types.SimpleNamespace(model=m)
  f = bnx.jit(lambda x: t.model(x))
  np.testing.assert_allclose(f(X), X @ m.kernel[...] + m.bias[...], rtol=1e-6)
  t.model.bias[...] = jnp.full((2,), 100.0)
  np.testing.assert_allclose(f(X), X @ m.kernel[...] + 100.0, rtol=1e-6)


def test_namespace_attribute_rebound_is_followed():
  """Rebinding a plain object's attribute to another module changes what the next call uses."""
  a, b = linear(seed=0), linear(seed=1)
  t = types.SimpleNamespace(model=a)
  f = bnx.jit(lambda x: t.model(x))
  np.testing.assert_allclose(f(X), X @ a.kernel[...] + a.bias[...], rtol=1e-6)
  t.model = b
  np.testing.assert_allclose(f(X), X @ b.kernel[...] + b.bias[...], rtol=1e-6)


def test_write_through_namespace_is_visible():
  """A Variable written through a plain object attribute is written back, concrete."""
  t = types.SimpleNamespace(count=nnx.Variable(jnp.array(0)))

  @bnx.jit
  def f(x):
    t.count[...] += 1
    return x * 2

  f(X), f(X)
  assert int(concrete(t.count)) == 2


class _Node:
  pass


def test_cyclic_plain_object():
  """An object whose attribute refers back to itself is discovered without recursion errors."""
  m = linear()
  h = _Node()
  h.me, h.model, h.family = h, m, [h]
  h.count = nnx.Variable(jnp.array(0))

  def body(holder, x):
    holder.me.count[...] += 1
    return holder.family[0].model(x)

  f = bnx.jit(lambda x: body(h, x))
  g = bnx.jit(body)
  np.testing.assert_allclose(f(X), X @ m.kernel[...] + m.bias[...], rtol=1e-6)
  np.testing.assert_allclose(g(h, X), X @ m.kernel[...] + m.bias[...], rtol=1e-6)
  m.bias[...] = jnp.full((2,), -5.0)
  np.testing.assert_allclose(f(X), X @ m.kernel[...] - 5.0, rtol=1e-6)
  np.testing.assert_allclose(g(h, X), X @ m.kernel[...] - 5.0, rtol=1e-6)
  assert int(concrete(h.count)) == 4



NESTED_GLOBAL = nnx.Variable(jnp.ones(2))


class _ReadsAPlainGlobal(nnx.Module):
  def __init__(self):
    self.w = nnx.Param(jnp.ones(3))

  def __call__(self, x):
    return x * self.w[...] * PLAIN_FACTOR


PLAIN_FACTOR = 2.0


def test_a_plain_global_read_in_a_method_of_a_reached_module_is_baked_in_as_jax_jit_bakes_it():
  """Methods of the Modules a function reaches are searched for state only: a float global they
  read is part of the trace (jax.jit gives the same values), and rebinding it retraces nothing."""
  global PLAIN_FACTOR
  traces = []
  model = _ReadsAPlainGlobal()

  def f(x):
    traces.append(1)
    return model(x)

  ours, theirs, x = bnx.jit(f), jax.jit(f), jnp.arange(3.0)
  try:
    PLAIN_FACTOR = 2.0
    first = (ours(x), theirs(x))
    PLAIN_FACTOR = 3.0
    second = (ours(x), theirs(x))
  finally:
    PLAIN_FACTOR = 2.0
  np.testing.assert_array_equal(first[0], first[1])
  np.testing.assert_array_equal(second[0], second[1])
  np.testing.assert_array_equal(second[0], x * 2.0)
  assert len(traces) == 2  # once each


def test_a_global_loaded_only_inside_a_nested_function_or_lambda_is_discovered():
  """Neither the function nor its own code names the global: a lambda and an inner function do.
  A value set between calls is read, and a write inside reaches it, as in eager Python."""
  def through_lambda(x):
    return (lambda: NESTED_GLOBAL[...] * x)()

  def through_inner(x):
    def bump():
      NESTED_GLOBAL[...] = NESTED_GLOBAL[...] + x
    bump()
    return NESTED_GLOBAL[...]

  f, g, x = bnx.jit(through_lambda), bnx.jit(through_inner), jnp.arange(2.0)
  f(x), f(x)
  NESTED_GLOBAL.set_value(jnp.full(2, 3.0))
  np.testing.assert_allclose(f(x), x * 3.0)
  np.testing.assert_allclose(g(x), jnp.full(2, 3.0) + x)
  np.testing.assert_allclose(NESTED_GLOBAL[...], jnp.full(2, 3.0) + x)
