"""Differential property tests: random NNX module trees, filters, axes, batch sizes, shapes,
dtypes, values and computations.

Each example builds a random tree of Modules holding Params, BatchStats, a
custom Variable subclass, possibly a Variable shared by two Modules and an
``nnx.Rngs``, all of one drawn shape and floating dtype with random values;
draws a computation (small expressions over elementwise ops for the output
and for each write); runs it once against Variables and once against a plain
dict of arrays; and compares brainnx with an independent oracle: a Python loop
over batch elements (vmap), ``jax.lax.scan`` (scan) or ``jax.jit`` (jit) on
the pure state. Outputs and every Variable are compared after the call. The
example count comes from the hypothesis profile of ``conftest.py``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from hypothesis import given
from hypothesis import strategies as st

import brainnx as bnx


class Counter(nnx.Variable):
  """A user-defined Variable type."""


TYPES = {'param': nnx.Param, 'stat': nnx.BatchStat, 'counter': Counter}


class Node(nnx.Module):
  """A Module whose attributes are set by the generator."""


@dataclasses.dataclass
class Leaf:
  name: str
  kind: str  # key of TYPES
  axis: int | None  # batch axis when mapped (vmap); None = broadcast
  role: str  # 'read' | 'batched' (written per element) | 'once' (written, same for all)
  where: tuple  # path of Modules under the root where it is attached
  shared_at: tuple | None  # a second place holding the same Variable


SHAPES = [(2,), (3,), (2, 3)]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
# a few ulps: a fused compiled expression and the same ops run one by one may round differently
TOL = {jnp.float32: dict(rtol=1e-5, atol=1e-6), jnp.bfloat16: dict(rtol=4e-2, atol=4e-2),
       jnp.float16: dict(rtol=4e-3, atol=4e-3)}
UNARY = {'tanh': jnp.tanh, 'sin': jnp.sin, 'neg': jnp.negative, 'abs': jnp.abs, 'half': lambda a: a * 0.5}
BINARY = {'add': jnp.add, 'sub': jnp.subtract, 'mul': jnp.multiply, 'max': jnp.maximum}


def expressions(*terminals):
  """Small expression trees over ``terminals`` (names) with elementwise ops."""
  return st.recursive(
    st.sampled_from(terminals),
    lambda sub: st.one_of(st.tuples(st.sampled_from(sorted(UNARY)), sub), st.tuples(st.sampled_from(sorted(BINARY)), sub, sub)),
    max_leaves=4,
  )


def evaluate(expr, env):
  if isinstance(expr, str):
    return env[expr]
  if len(expr) == 2:
    return UNARY[expr[0]](evaluate(expr[1], env))
  return BINARY[expr[0]](evaluate(expr[1], env), evaluate(expr[2], env))


@dataclasses.dataclass
class Program:
  """What an example computes: the output from (x, sum of states, noise), each write from (old, h)."""
  shape: tuple
  dtype: object
  seed: int
  out: object
  batched: object  # new value of a 'batched' leaf, from old and h
  once: object  # new value of a 'once' leaf, from old alone


programs = st.builds(
  Program,
  shape=st.sampled_from(SHAPES),
  dtype=st.sampled_from(DTYPES),
  seed=st.integers(0, 2**16),
  out=st.tuples(st.just('add'), st.just('s'), expressions('x', 's', 'noise')),  # every leaf reaches h
  batched=expressions('old', 'h'),
  once=expressions('old'),
)


def _assert_close(got, want, program):
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **TOL[program.dtype])


def _values(program, k, shape=None):
  key = jax.random.fold_in(jax.random.key(program.seed), k)
  return jax.random.uniform(key, shape or program.shape, minval=-2.0, maxval=2.0).astype(program.dtype)


@st.composite
def trees(draw, mapping: bool):
  n = draw(st.integers(1, 5))
  leaves = []
  for k in range(n):
    axis = draw(st.sampled_from([None, 0, 1])) if mapping else None
    roles = ['read', 'once'] + (['batched'] if axis is not None or not mapping else [])
    leaves.append(
      Leaf(
        name=f'v{k}',
        kind=draw(st.sampled_from(sorted(TYPES))),
        axis=axis,
        role=draw(st.sampled_from(roles)),
        where=tuple(draw(st.lists(st.sampled_from(['a', 'b']), max_size=2))),
        shared_at=None,
      )
    )
  if draw(st.booleans()):
    victim = draw(st.sampled_from(leaves))
    victim.shared_at = ('c',) + victim.where
  return leaves, draw(st.booleans())  # (leaves, with_rngs)


def build(leaves, with_rngs, size, program):
  """The root Module and a ``name -> Variable`` map; values drawn from the program's seed."""
  root = Node()
  variables = {}
  for k, leaf in enumerate(leaves):
    base = _values(program, k)
    if leaf.axis is not None:
      base = jnp.stack([_values(program, 100 * (b + 1) + k) for b in range(size)], axis=leaf.axis)
    var = TYPES[leaf.kind](base, tag=leaf.name)
    variables[leaf.name] = var
    for place in (leaf.where, leaf.shared_at):
      if place is None:
        continue
      node = root
      for step in place:
        if not hasattr(node, step):
          setattr(node, step, Node())
        node = getattr(node, step)
      setattr(node, leaf.name, var)
  if with_rngs:
    root.rngs = nnx.Rngs(3)
  return root, variables


def computation(get, put, x, noise, program):
  """The function under test, on any state accessors; returns the output."""

  def run(leaves):
    s = sum(get(leaf.name) for leaf in leaves)
    h = evaluate(program.out, {'x': x, 's': s, 'noise': noise()})
    for leaf in leaves:
      if leaf.role == 'batched':
        put(leaf.name, evaluate(program.batched, {'old': get(leaf.name), 'h': h}))
      elif leaf.role == 'once':
        put(leaf.name, evaluate(program.once, {'old': get(leaf.name)}))
    return h

  return run


def in_filter(leaves, variables, style, paths):
  """``state_in_axes`` selecting exactly the mapped leaves, in a chosen style."""
  spec = {}
  for axis in (0, 1):
    group = [leaf for leaf in leaves if leaf.axis == axis]
    if not group:
      continue
    if style == 'instances':
      spec[axis] = [variables[leaf.name] for leaf in group]
    elif style == 'tags':
      spec[axis] = tuple(leaf.name for leaf in group)
    elif style == 'paths':
      spec[axis] = nnx.Any(*[nnx.PathContains(leaf.name) for leaf in group])
    else:
      ids = {id(variables[leaf.name]) for leaf in group}
      spec[axis] = lambda path, v, ids=ids: id(v) in ids
  return spec


@given(
  trees(mapping=True),
  st.integers(1, 4),
  st.sampled_from([0, None]),
  st.sampled_from(['instances', 'tags', 'paths', 'predicate']),
  st.booleans(),
  st.booleans(),
  programs,
)
def test_vmap_matches_a_loop_over_elements(tree, size, x_axis, style, broadcast_rest, as_argument, program):
  leaves, with_rngs = tree
  root, variables = build(leaves, with_rngs, size, program)
  before = {n: v[...] for n, v in variables.items()}
  x = jnp.stack([_values(program, 10_000 + b) for b in range(size)]) if x_axis == 0 else _values(program, 10_000)
  spec = in_filter(leaves, variables, style, None)
  if broadcast_rest:
    spec[None] = ...  # also matches the RNG stream: then used as given (one key for all)
  rng_split = with_rngs and not broadcast_rest
  key0 = root.rngs.default.key[...] if with_rngs else None
  count0 = root.rngs.default.count[...] if with_rngs else None

  def noise_of(rngs):
    return (lambda: rngs.normal(program.shape, program.dtype)) if with_rngs else (lambda: 0.0)

  def body(model, x):
    get = lambda name: _find(model, name)[...]  # noqa: E731
    put = lambda name, value: _find(model, name).set_value(value)  # noqa: E731
    return computation(get, put, x, noise_of(model.rngs) if with_rngs else noise_of(None), program)(leaves)

  kwargs = dict(in_axes=(None, x_axis) if as_argument else x_axis, state_in_axes=spec, axis_size=size)
  if as_argument:
    out = bnx.vmap(body, **kwargs)(root, x)
  else:
    out = bnx.vmap(lambda x: body(root, x), **kwargs)(x)

  # oracle: a Python loop over elements on the pure state
  if with_rngs:
    keys = jax.random.split(jax.random.fold_in(key0, count0), size) if rng_split else [key0] * size
  outs, news = [], []
  for b in range(size):
    state = {leaf.name: (before[leaf.name] if leaf.axis is None else jnp.take(before[leaf.name], b, axis=leaf.axis)) for leaf in leaves}
    new = {}
    noise = (lambda k=keys[b] if with_rngs else None: jax.random.normal(jax.random.fold_in(k, count0), program.shape, program.dtype)) if with_rngs else (lambda: 0.0)
    outs.append(computation(state.__getitem__, new.__setitem__, x[b] if x_axis == 0 else x, noise, program)(leaves))
    news.append(new)
  assert out.dtype == outs[0].dtype == program.dtype
  _assert_close(out, jnp.stack(outs), program)
  for leaf in leaves:
    got = variables[leaf.name][...]
    assert got.dtype == program.dtype, leaf
    if leaf.role == 'read':
      np.testing.assert_array_equal(got, before[leaf.name])
    elif leaf.axis is None:
      _assert_close(got, news[0][leaf.name], program)
    else:
      _assert_close(got, jnp.stack([nw[leaf.name] for nw in news], axis=leaf.axis), program)
  if with_rngs:
    np.testing.assert_array_equal(root.rngs.default.count[...], count0 + 1)
    np.testing.assert_array_equal(jax.random.key_data(root.rngs.default.key[...]), jax.random.key_data(key0))


def _find(model, name):
  for path, v in nnx.iter_graph(model):
    if isinstance(v, nnx.Variable) and path and path[-1] == name:
      return v
  raise KeyError(name)


@given(trees(mapping=False), st.integers(1, 5), st.booleans(), programs)
def test_scan_matches_lax_scan(tree, length, reverse, program):
  leaves, with_rngs = tree
  root, variables = build(leaves, with_rngs, 1, program)
  before = {n: v[...] for n, v in variables.items()}
  xs = _values(program, 10_000, (length, *program.shape))
  key0 = root.rngs.default.key[...] if with_rngs else None

  def step(carry, x):
    get = lambda name: variables[name][...]  # noqa: E731
    put = lambda name, value: variables[name].set_value(value)  # noqa: E731
    noise = (lambda: root.rngs.normal(program.shape, program.dtype)) if with_rngs else (lambda: 0.0)
    h = computation(get, put, x, noise, program)(leaves)
    return carry + h.sum(), h

  carry, ys = bnx.scan(step, 0.0, xs, reverse=reverse)

  def pure_step(c, x):
    total, state, count = c
    new = dict(state)

    def noise():
      return jax.random.normal(jax.random.fold_in(key0, count), program.shape, program.dtype) if with_rngs else 0.0

    h = computation(state.__getitem__, new.__setitem__, x, noise, program)(leaves)
    return (total + h.sum(), new, count + 1), h

  # jitted: an eager lax.scan of a fresh closure leaves a compiled program in jax's
  # dispatch cache every time, which thousands of examples would pile up
  (ref_carry, ref_state, _), ref_ys = jax.jit(lambda init, xs: jax.lax.scan(pure_step, init, xs, reverse=reverse))(
    (0.0, before, jnp.uint32(0)), xs
  )
  _assert_close(carry, ref_carry, program)
  _assert_close(ys, ref_ys, program)
  for leaf in leaves:
    _assert_close(variables[leaf.name][...], ref_state[leaf.name], program)
  if with_rngs:
    assert int(root.rngs.default.count[...]) == length


@given(trees(mapping=False), st.integers(1, 3), programs)
def test_jit_matches_pure_jit(tree, calls, program):
  leaves, with_rngs = tree
  root, variables = build(leaves, with_rngs, 1, program)
  state = {n: v[...] for n, v in variables.items()}
  key0 = root.rngs.default.key[...] if with_rngs else None

  @bnx.jit
  def f(x):
    get = lambda name: variables[name][...]  # noqa: E731
    put = lambda name, value: variables[name].set_value(value)  # noqa: E731
    return computation(get, put, x, (lambda: root.rngs.normal(program.shape, program.dtype)) if with_rngs else (lambda: 0.0), program)(leaves)

  @jax.jit
  def pure(state, count, x):
    new = dict(state)
    noise = (lambda: jax.random.normal(jax.random.fold_in(key0, count), program.shape, program.dtype)) if with_rngs else (lambda: 0.0)
    return computation(state.__getitem__, new.__setitem__, x, noise, program)(leaves), new

  for k in range(calls):
    x = _values(program, 10_000 + k)
    out = f(x)
    ref, state = pure(state, jnp.uint32(k), x)
    _assert_close(out, ref, program)
    for leaf in leaves:
      _assert_close(variables[leaf.name][...], state[leaf.name], program)
