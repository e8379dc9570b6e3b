"""Edges of the mapping and loop transforms that used to end in raw errors or wrong state.

Oracles: ``jax.vmap`` / ``jax.lax.while_loop`` on the pure function, or exact values.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import brainnx as bnx


def test_zero_size_batch_works_like_jax_vmap():
  xs = jnp.ones((0, 3))
  out = bnx.vmap(lambda x: x * 2)(xs)
  assert out.shape == jax.vmap(lambda x: x * 2)(xs).shape == (0, 3)
  const = bnx.vmap(lambda x: jnp.float32(1.5), out_axes=None)(xs)
  assert float(const) == float(jax.vmap(lambda x: jnp.float32(1.5), out_axes=None)(xs))
  calls = nnx.Variable(jnp.array(0))

  def counted(x):
    calls[...] += 1  # unbatched: written once, as for any batch
    return x

  assert bnx.vmap(counted)(xs).shape == (0, 3) and int(calls[...]) == 1


def test_negative_axis_size_and_pmap_over_too_many_elements_are_named():
  with pytest.raises(ValueError, match='axis_size=-1'):
    bnx.vmap(lambda: 1.0, axis_size=-1)
  n = jax.local_device_count()
  with pytest.raises(ValueError, match=rf'{n + 1} elements but there are only {n} devices'):
    bnx.pmap(lambda x: x * 2)(jnp.ones(n + 1))


def test_loop_error_under_disable_jit_leaves_state_exact():
  acc = nnx.Variable(jnp.array(0.0))

  def step(c, x):
    acc[...] += 1.0
    if int(x) == 3:
      raise RuntimeError('step 3')
    return c, x

  def body(c):
    acc[...] += 1.0
    if int(c) == 3:
      raise RuntimeError('step 3')
    return c + 1

  with jax.disable_jit():
    with pytest.raises(RuntimeError, match='step 3'):
      bnx.scan(step, 0, jnp.arange(5))
    assert float(acc[...]) == 0.0
    with pytest.raises(RuntimeError, match='step 3'):
      bnx.while_loop(lambda c: c < 10, body, 0)
    assert float(acc[...]) == 0.0


def test_while_loop_inside_vmap_under_disable_jit_matches_lax():
  xs = jnp.zeros(3, jnp.int32)
  with jax.disable_jit():
    ours = jax.vmap(lambda x: bnx.while_loop(lambda c: c < 3, lambda c: c + 1, x))(xs)
    theirs = jax.vmap(lambda x: jax.lax.while_loop(lambda c: c < 3, lambda c: c + 1, x))(xs)
  np.testing.assert_array_equal(ours, theirs)


def test_progress_bar_keywords_and_sizes_are_checked_early():
  with pytest.raises(TypeError, match="'bogus' is not a tqdm keyword"):
    bnx.ProgressBar(bogus=1)
  with pytest.raises(ValueError, match=r'freq=100 is larger than the loop \(4 steps\)'):
    bnx.scan(lambda c, x: (c, x), 0.0, jnp.ones(4), pbar=bnx.ProgressBar(freq=100))
  with pytest.raises(ValueError, match=r'count=100 is larger than the loop \(4 steps\)'):
    bnx.for_loop(lambda x: x, jnp.ones(4), pbar=bnx.ProgressBar(count=100))


def test_vmap_new_states_honours_state_out_axes_and_side_effect_boxes():
  box = {}

  def init(x):
    box['a'] = nnx.BatchStat(x * 2)

  xs = jnp.arange(6.0).reshape(3, 2)
  bnx.vmap_new_states(init, state_out_axes={1: nnx.BatchStat})(xs)
  value = box['a'].get_value()
  assert isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer)
  np.testing.assert_array_equal(value, jnp.moveaxis(jax.vmap(lambda x: x * 2)(xs), 0, 1))
