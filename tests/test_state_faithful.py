"""The state brainnx manages is the state ``nnx.split`` / ``nnx.state`` reports.

Oracles: ``nnx.state`` (paths and values), ``nnx.jit`` / ``nnx.vmap`` of the same function on
the same module.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given
from hypothesis import strategies as st

import brainnx as bnx
from brainnx._engine.discovery import discover
from helpers import no_tracers


class Custom(nnx.Variable):
  """A user Variable subclass."""


class Node(nnx.Module):
  def __init__(self):
    pass


class Loose(nnx.Module, pytree=False):
  def __init__(self):
    pass


def _flat_state(node):
  return {path: (v.get_value() if isinstance(v, nnx.Variable) else v) for path, v in nnx.to_flat_state(nnx.state(node))}


SHAPES = [(1,), (3,), (2, 2)]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
# elementwise steps a drawn computation chains; each keeps the dtype
STEPS = {'inc': lambda a: a + 1, 'tanh': jnp.tanh, 'neg': jnp.negative, 'square': jnp.square, 'half': lambda a: a * 0.5}


@st.composite
def module_trees(draw, depth=0, shared=None, dtype=None):
  """A random Module tree: Params, custom Variables, data arrays, nnx.List / nnx.Dict children,
  shared submodules, ``pytree=False`` modules; leaves of drawn shapes and values, one dtype."""
  shared = [] if shared is None else shared
  dtype = draw(st.sampled_from(DTYPES)) if dtype is None else dtype
  node = (Loose if draw(st.booleans()) else Node)()
  for k in range(draw(st.integers(1, 4))):
    kind = draw(st.sampled_from(['param', 'custom', 'array', 'list', 'dict', 'child', 'shared']))
    name = f'{kind}{k}'
    shape = draw(st.sampled_from(SHAPES))
    value = jnp.asarray(np.asarray(draw(st.lists(st.floats(-4, 4, width=16), min_size=int(np.prod(shape)),
                                                 max_size=int(np.prod(shape)))), np.float32).reshape(shape), dtype)
    if kind == 'param':
      setattr(node, name, nnx.Param(value))
    elif kind == 'custom':
      setattr(node, name, Custom(value))
    elif kind == 'array':
      setattr(node, name, nnx.data(value))
    elif kind in ('list', 'dict', 'child') and depth < 2:
      children = [draw(module_trees(depth + 1, shared, dtype)) for _ in range(draw(st.integers(1, 2)))]
      shared.extend(children)
      if kind == 'list':
        setattr(node, name, nnx.List(children))
      elif kind == 'dict':
        setattr(node, name, nnx.Dict({f'm{i}': c for i, c in enumerate(children)}))
      else:
        setattr(node, name, children[0])
    elif kind == 'shared' and shared:
      setattr(node, name, shared[draw(st.integers(0, len(shared) - 1))])
    else:
      setattr(node, name, nnx.Param(value))
  return node


def _apply_to_all(steps):
  """A function applying the chain of ``steps`` to every state leaf, through NNX's own view of the state."""
  def f(m):
    def chain(x):
      for step in steps:
        x = STEPS[step](x)
      return x

    nnx.update(m, jax.tree.map(chain, nnx.state(m)))

  return f


@given(module_trees(), st.lists(st.sampled_from(sorted(STEPS)), min_size=1, max_size=3))
def test_discovery_equals_nnx_state_and_jit_writes_like_nnx_jit(tree, steps):
  expected = _flat_state(tree)
  disc = discover(lambda m: m, (tree,), {})
  paths = [p[1:] for p in disc.paths]
  assert sorted(paths, key=repr) == sorted(expected, key=repr)
  assert len(set(map(id, disc.variables))) == len(disc.variables)  # shared state once
  for p, v in zip(paths, disc.variables):
    np.testing.assert_array_equal(_value(v), expected[p])

  oracle = nnx.clone(tree)
  nnx.jit(_apply_to_all(steps))(oracle)
  bnx.jit(_apply_to_all(steps))(tree)
  got, want = _flat_state(tree), _flat_state(oracle)
  assert got.keys() == want.keys()
  for p in want:
    assert isinstance(got[p], jax.Array) and not isinstance(got[p], jax.core.Tracer), p
    assert got[p].dtype == want[p].dtype, p
    np.testing.assert_array_equal(got[p], want[p], err_msg=str(p))  # same program on the same values


def _value(v):
  return v.get_value() if isinstance(v, nnx.Variable) else v.container[v.key]


class WithData(nnx.Module):
  def __init__(self):
    self.w = nnx.Param(jnp.full(3, 2.0))
    self.arr = nnx.data(jnp.ones(3))

  def __call__(self, x):
    self.arr = self.arr + 1
    return x * self.w[...] + self.arr


def test_data_attribute_is_read_live_and_written_back_concrete():
  m, ref = WithData(), WithData()
  f, g = bnx.jit(lambda m, x: m(x)), nnx.jit(lambda m, x: m(x))
  x = jnp.arange(3.0)
  for _ in range(2):
    np.testing.assert_array_equal(f(m, x), g(ref, x))
    np.testing.assert_array_equal(m.arr, ref.arr)
    assert isinstance(m.arr, jax.Array) and not isinstance(m.arr, jax.core.Tracer)
  m.arr = jnp.zeros(3)  # out-of-band write: the next call reads it
  ref.arr = jnp.zeros(3)
  np.testing.assert_array_equal(f(m, x), g(ref, x))
  read = bnx.jit(lambda: m.arr.sum())
  assert float(read()) == float(m.arr.sum())
  m.arr = m.arr + 10
  assert float(read()) == float(m.arr.sum())


def test_data_attribute_rolls_back_on_error_and_new_ones_are_concrete():
  m = WithData()
  before = np.asarray(m.arr)

  def bad():
    m.arr = m.arr + 5
    m.extra = m.arr * 2
    raise ValueError('boom')

  with pytest.raises(ValueError, match='boom'):
    bnx.jit(bad)()
  np.testing.assert_array_equal(m.arr, before)
  assert not hasattr(m, 'extra')

  def add():
    m.extra = m.arr * 2

  bnx.jit(add)()
  assert isinstance(m.extra, jax.Array) and not isinstance(m.extra, jax.core.Tracer)
  np.testing.assert_array_equal(m.extra, before * 2)


def test_pytree_false_module_arrays_are_state():
  m = Loose()
  m.arr = jnp.ones(2)
  triple = bnx.jit(lambda: setattr(m, 'arr', m.arr * 3))
  triple(), triple()
  np.testing.assert_array_equal(m.arr, jnp.full(2, 9.0))
  assert no_tracers(m)


def test_data_attributes_under_vmap_follow_the_variable_rules():
  m = WithData()
  xs = jnp.arange(6.0).reshape(2, 3)
  out = bnx.vmap(lambda x: x * m.arr.sum())(xs)  # broadcast read
  np.testing.assert_array_equal(out, jax.vmap(lambda x: x * m.arr.sum())(xs))
  stacked = WithData()
  stacked.arr = jnp.stack([jnp.ones(3), jnp.full(3, 2.0)])
  out = bnx.vmap(lambda x: x + stacked.arr, state_in_axes={0: nnx.PathContains('arr')})(xs)
  np.testing.assert_array_equal(out, xs + stacked.arr)


class Sower(nnx.Module):
  def __init__(self):
    self.l = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

  def __call__(self, x):
    h = self.l(x)
    self.sow(nnx.Intermediate, 'h', h)
    return h


@pytest.mark.filterwarnings('ignore::DeprecationWarning')
def test_sow_across_calls_equals_nnx_jit_and_vmap():
  ours, theirs = Sower(), Sower()
  f, g = bnx.jit(lambda m, x: m(x)), nnx.jit(lambda m, x: m(x))
  for k in range(3):
    f(ours, jnp.full(2, float(k))), g(theirs, jnp.full(2, float(k)))
  a, b = nnx.pop(ours, nnx.Intermediate), nnx.pop(theirs, nnx.Intermediate)
  assert jax.tree.structure(a) == jax.tree.structure(b)
  jax.tree.map(np.testing.assert_array_equal, a, b)

  xs = jnp.arange(6.0).reshape(3, 2)
  bnx.vmap(lambda x: ours(x), state_out_axes={0: nnx.Intermediate})(xs)
  axes = nnx.StateAxes({nnx.Intermediate: 0, ...: None})
  nnx.vmap(lambda m, x: m(x), in_axes=(axes, 0))(theirs, xs)
  a, b = nnx.pop(ours, nnx.Intermediate), nnx.pop(theirs, nnx.Intermediate)
  jax.tree.map(np.testing.assert_array_equal, a, b)


def test_value_structure_change_retraces_instead_of_crashing():
  v = nnx.Variable((jnp.zeros(1),))
  grow = bnx.jit(lambda x: v.set_value(v.get_value() + (x,)))
  for k in range(3):
    grow(jnp.full(1, float(k)))
  assert len(v.get_value()) == 4
  np.testing.assert_array_equal(jnp.concatenate(v.get_value()), jnp.array([0.0, 0.0, 1.0, 2.0]))


def test_loop_body_changing_a_carried_structure_is_named():
  v = nnx.Variable((jnp.zeros(1),))
  def step(c, x):
    v.set_value(v.get_value() + (x,))  # what Module.sow does
    return c, None

  with pytest.raises(ValueError, match=r"Variable at \('v',\) changes its value's structure"):
    bnx.scan(step, 0.0, jnp.ones((2, 1)))
  assert len(v.get_value()) == 1


def test_train_and_eval_between_calls():
  class Drop(nnx.Module):
    def __init__(self):
      self.d = nnx.Dropout(0.5, rngs=nnx.Rngs(0))

    def __call__(self, x):
      return self.d(x)

  m = Drop()
  f = bnx.jit(lambda x: m(x))
  m.eval()
  np.testing.assert_array_equal(f(jnp.ones(8)), jnp.ones(8))
  m.train()
  assert bool(jnp.any(f(jnp.ones(8)) == 0))
  m.eval()
  np.testing.assert_array_equal(f(jnp.ones(8)), jnp.ones(8))


@pytest.mark.filterwarnings('ignore::DeprecationWarning')
def test_sow_inside_scan_comes_out_stacked_with_the_loops_values():
  ours, theirs = Sower(), Sower()
  xs = jnp.arange(6.0).reshape(3, 2)
  bnx.scan(lambda c, x: (c + ours(x).sum(), None), 0.0, xs)
  for x in xs:  # oracle: the same steps as a Python loop under nnx.jit
    nnx.jit(lambda m, x: m(x))(theirs, x)
  (stacked,) = nnx.pop(ours, nnx.Intermediate)['h'].get_value()
  per_step = nnx.pop(theirs, nnx.Intermediate)['h'].get_value()
  assert isinstance(stacked, jax.Array) and not isinstance(stacked, jax.core.Tracer)
  np.testing.assert_allclose(stacked, jnp.stack(per_step), rtol=1e-6)
