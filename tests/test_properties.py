"""Differential property tests: random NNX module trees, filters, axes and batch sizes.

Each example builds a random tree of Modules holding Params, BatchStats, a
custom Variable subclass, possibly a Variable shared by two Modules and an
``nnx.Rngs``; writes one computation once against Variables and once
against a plain dict of arrays; and compares brainnx with an independent
oracle: a Python loop over batch elements (vmap), ``jax.lax.scan`` (scan)
or ``jax.jit`` (jit) on the pure state. Outputs and every Variable are
compared after the call. The example count comes from the hypothesis
profile (300 by default, ``HYPOTHESIS_PROFILE=long`` for 2,000).
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


def build(leaves, with_rngs, size):
  """The root Module and a ``name -> Variable`` map; values are deterministic."""
  root = Node()
  variables = {}
  for k, leaf in enumerate(leaves):
    base = jnp.arange(2.0) + k
    if leaf.axis is not None:
      base = jnp.stack([base * (b + 1) for b in range(size)], axis=leaf.axis)
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


def computation(get, put, x, noise):
  """The function under test, on any state accessors; returns the output."""

  def run(leaves):
    h = x + sum(get(leaf.name) for leaf in leaves)
    h = h + noise()
    for leaf in leaves:
      if leaf.role == 'batched':
        put(leaf.name, get(leaf.name) + h)
      elif leaf.role == 'once':
        put(leaf.name, get(leaf.name) * 2.0 + 1.0)
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
)
def test_vmap_matches_a_loop_over_elements(tree, size, x_axis, style, broadcast_rest, as_argument):
  leaves, with_rngs = tree
  root, variables = build(leaves, with_rngs, size)
  before = {n: v[...] for n, v in variables.items()}
  x = jnp.stack([jnp.full(2, 0.5 * b) for b in range(size)]) if x_axis == 0 else jnp.full(2, 0.25)
  spec = in_filter(leaves, variables, style, None)
  if broadcast_rest:
    spec[None] = ...  # also matches the RNG stream: then used as given (one key for all)
  rng_split = with_rngs and not broadcast_rest
  key0 = root.rngs.default.key[...] if with_rngs else None
  count0 = root.rngs.default.count[...] if with_rngs else None

  def noise_of(rngs):
    return (lambda: rngs.normal((2,))) if with_rngs else (lambda: 0.0)

  def body(model, x):
    get = lambda name: _find(model, name)[...]  # noqa: E731
    put = lambda name, value: _find(model, name).set_value(value)  # noqa: E731
    return computation(get, put, x, noise_of(model.rngs) if with_rngs else noise_of(None))(leaves)

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
    noise = (lambda k=keys[b] if with_rngs else None: jax.random.normal(jax.random.fold_in(k, count0), (2,))) if with_rngs else (lambda: 0.0)
    outs.append(computation(state.__getitem__, new.__setitem__, x[b] if x_axis == 0 else x, noise)(leaves))
    news.append(new)
  np.testing.assert_allclose(out, jnp.stack(outs), rtol=1e-5, atol=1e-6)
  for leaf in leaves:
    got = variables[leaf.name][...]
    if leaf.role == 'read':
      np.testing.assert_array_equal(got, before[leaf.name])
    elif leaf.axis is None:
      np.testing.assert_allclose(got, news[0][leaf.name], rtol=1e-5)
    else:
      np.testing.assert_allclose(got, jnp.stack([nw[leaf.name] for nw in news], axis=leaf.axis), rtol=1e-5, atol=1e-6)
  if with_rngs:
    np.testing.assert_array_equal(root.rngs.default.count[...], count0 + 1)
    np.testing.assert_array_equal(jax.random.key_data(root.rngs.default.key[...]), jax.random.key_data(key0))


def _find(model, name):
  for path, v in nnx.iter_graph(model):
    if isinstance(v, nnx.Variable) and path and path[-1] == name:
      return v
  raise KeyError(name)


@given(trees(mapping=False), st.integers(1, 5), st.booleans())
def test_scan_matches_lax_scan(tree, length, reverse):
  leaves, with_rngs = tree
  root, variables = build(leaves, with_rngs, 1)
  before = {n: v[...] for n, v in variables.items()}
  xs = jnp.arange(length * 2.0).reshape(length, 2)
  key0 = root.rngs.default.key[...] if with_rngs else None

  def step(carry, x):
    get = lambda name: variables[name][...]  # noqa: E731
    put = lambda name, value: variables[name].set_value(value)  # noqa: E731
    noise = (lambda: root.rngs.normal((2,))) if with_rngs else (lambda: 0.0)
    h = computation(get, put, x, noise)(leaves)
    return carry + h.sum(), h

  carry, ys = bnx.scan(step, 0.0, xs, reverse=reverse)

  def pure_step(c, x):
    total, state, count = c
    new = dict(state)

    def noise():
      return jax.random.normal(jax.random.fold_in(key0, count), (2,)) if with_rngs else 0.0

    h = computation(state.__getitem__, new.__setitem__, x, noise)(leaves)
    return (total + h.sum(), new, count + 1), h

  # jitted: an eager lax.scan of a fresh closure leaves a compiled program in jax's
  # dispatch cache every time, which thousands of examples would pile up
  (ref_carry, ref_state, _), ref_ys = jax.jit(lambda init, xs: jax.lax.scan(pure_step, init, xs, reverse=reverse))(
    (0.0, before, jnp.uint32(0)), xs
  )
  np.testing.assert_allclose(carry, ref_carry, rtol=1e-5)
  np.testing.assert_allclose(ys, ref_ys, rtol=1e-5)
  for leaf in leaves:
    np.testing.assert_allclose(variables[leaf.name][...], ref_state[leaf.name], rtol=1e-5)
  if with_rngs:
    assert int(root.rngs.default.count[...]) == length


@given(trees(mapping=False), st.integers(1, 3))
def test_jit_matches_pure_jit(tree, calls):
  leaves, with_rngs = tree
  root, variables = build(leaves, with_rngs, 1)
  state = {n: v[...] for n, v in variables.items()}
  key0 = root.rngs.default.key[...] if with_rngs else None

  @bnx.jit
  def f(x):
    get = lambda name: variables[name][...]  # noqa: E731
    put = lambda name, value: variables[name].set_value(value)  # noqa: E731
    return computation(get, put, x, (lambda: root.rngs.normal((2,))) if with_rngs else (lambda: 0.0))(leaves)

  @jax.jit
  def pure(state, count, x):
    new = dict(state)
    noise = (lambda: jax.random.normal(jax.random.fold_in(key0, count), (2,))) if with_rngs else (lambda: 0.0)
    return computation(state.__getitem__, new.__setitem__, x, noise)(leaves), new

  for k in range(calls):
    x = jnp.full(2, float(k))
    out = f(x)
    ref, state = pure(state, jnp.uint32(k), x)
    np.testing.assert_allclose(out, ref, rtol=1e-5)
    for leaf in leaves:
      np.testing.assert_allclose(variables[leaf.name][...], state[leaf.name], rtol=1e-5)
