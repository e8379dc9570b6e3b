"""Discovery: which Variables a call can reach, with which paths."""

import functools

import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from brainnx._engine.discovery import discover
from helpers import MLP

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
  assert disc.variables == (a, b)
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
  assert disc.variables == (shared,)
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
