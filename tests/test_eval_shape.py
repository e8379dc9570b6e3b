"""eval_shape: shapes without computing, no Variable changed, abstract modules (oracle: jax/nnx)."""

import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import brainnx as bnx
from helpers import MLP, assert_same_values, values_of


def test_outputs_match_jax_eval_shape_and_nothing_changes():
  model = MLP(3, 4, 2, rngs=nnx.Rngs(0))
  count = nnx.Variable(jnp.array(0))
  before = values_of(model)

  def f(x):
    count[...] += 1
    model.l1.kernel[...] = model.l1.kernel[...] * 0
    return model(x), x.sum()

  x = jax.ShapeDtypeStruct((5, 3), jnp.float32)
  ours = bnx.eval_shape(f, x)
  params = jax.tree.map(lambda v: v[...], nnx.state(model, nnx.Param))
  theirs = jax.eval_shape(lambda p, x: (nnx.merge(nnx.graphdef(model), p)(x), x.sum()), params, x)
  assert jax.tree.map(lambda s: (s.shape, s.dtype), ours) == jax.tree.map(lambda s: (s.shape, s.dtype), theirs)
  assert_same_values(before, values_of(model))
  assert int(count[...]) == 0


def test_modules_created_inside_are_abstract_like_nnx_eval_shape():
  rngs = nnx.Rngs(0)
  ours = bnx.eval_shape(lambda: MLP(3, 4, 2, rngs=rngs))
  theirs = nnx.eval_shape(lambda: MLP(3, 4, 2, rngs=nnx.Rngs(0)))
  ours_state = jax.tree.map(lambda s: (s.shape, s.dtype), nnx.state(ours))
  theirs_state = jax.tree.map(lambda s: (s.shape, s.dtype), nnx.state(theirs))
  assert ours_state == theirs_state
  assert isinstance(ours.l1.kernel.get_value(), jax.ShapeDtypeStruct)
  assert int(rngs.default.count[...]) == 0  # the draws were undone
  np.testing.assert_array_equal(MLP(3, 4, 2, rngs=rngs).l1.kernel[...], MLP(3, 4, 2, rngs=nnx.Rngs(0)).l1.kernel[...])


def test_a_second_call_with_the_same_signature_does_not_trace_again():
  traces = []

  def f(x):
    traces.append(1)
    return x * 2

  for _ in range(3):
    got = bnx.eval_shape(f, jnp.ones(3))
  assert (got.shape, got.dtype) == (jax.eval_shape(f, jnp.ones(3)).shape, jnp.float32)
  assert len(traces) == 2  # ours once, jax's once
  bnx.eval_shape(f, jnp.ones(4))
  assert len(traces) == 3


def test_eval_shape_keeps_no_function_alive():
  def make():
    scale = nnx.Param(jnp.ones(3))

    def f(x):
      return x * scale[...]

    return f

  f = make()
  bnx.eval_shape(f, jnp.ones(3))
  gone = weakref.ref(f)
  del f
  gc.collect()
  assert gone() is None


def test_results_are_shape_dtype_structs_as_jax_eval_shape_gives():
  count = nnx.Variable(jnp.zeros(()))

  def f(x):
    count[...] += 1
    return {'y': x * 2, 'n': x.sum().astype(jnp.int32)}

  got, want = bnx.eval_shape(f, jnp.ones(3)), jax.eval_shape(lambda x: {'y': x * 2, 'n': x.sum().astype(jnp.int32)}, jnp.ones(3))
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert type(g) is jax.ShapeDtypeStruct and (g.shape, g.dtype) == (w.shape, w.dtype)
  assert float(count[...]) == 0.0  # nothing ran
