"""Scan over layers: Variables stacked on axis 0, one slice per step (oracle: a Python loop)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import brainnx as bnx

LAYERS, WIDTH = 12, 8


class Block(nnx.Module):
  def __init__(self, rngs):
    self.lin = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
    self.stat = nnx.BatchStat(jnp.zeros(WIDTH))

  def __call__(self, x):
    h = x + jnp.tanh(self.lin(x))
    self.stat[...] = h.mean(0)
    return h


def _stack():
  rngs = nnx.Rngs(0)
  return bnx.vmap(lambda: Block(rngs), axis_size=LAYERS)()


def _pure(ks, bs, x):
  stats = []
  for k, b in zip(ks, bs):
    x = x + jnp.tanh(x @ k + b)
    stats.append(x.mean(0))
  return x, jnp.stack(stats)


LAYER_STATE = nnx.Any(nnx.Param, nnx.BatchStat)


@pytest.mark.parametrize('rematted', [False, True])
def test_residual_stack_forward_stats_and_gradients_equal_a_python_loop(rematted):
  stack = _stack()
  ks, bs = stack.lin.kernel[...], stack.lin.bias[...]
  x = jax.random.normal(jax.random.key(1), (4, WIDTH))
  layer = bnx.remat(stack, prevent_cse=False) if rematted else stack

  def apply(x):
    return bnx.scan(lambda h, _: (layer(h), None), x, None, state_in_axes=LAYER_STATE)[0]

  ref_out, ref_stats = _pure(ks, bs, x)
  np.testing.assert_allclose(apply(x), ref_out, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(stack.stat[...], ref_stats, rtol=1e-5, atol=1e-6)  # written per layer, stacked
  g = bnx.grad(lambda x: (apply(x) ** 2).sum(), grad_states=stack)(x)
  gk, gb = jax.grad(lambda ks, bs: (_pure(ks, bs, x)[0] ** 2).sum(), argnums=(0, 1))(ks, bs)
  np.testing.assert_allclose(g['lin']['kernel'][...], gk, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(g['lin']['bias'][...], gb, rtol=1e-4, atol=1e-5)


def test_for_loop_over_layers_and_lengths_are_checked():
  stack = _stack()
  ys = bnx.for_loop(lambda x: stack(x).sum(), jnp.ones((LAYERS, 2, WIDTH)), state_in_axes=LAYER_STATE)
  ks, bs = stack.lin.kernel[...], stack.lin.bias[...]
  ref = jnp.stack([(jnp.ones((2, WIDTH)) + jnp.tanh(jnp.ones((2, WIDTH)) @ ks[i] + bs[i])).sum() for i in range(LAYERS)])
  np.testing.assert_allclose(ys, ref, rtol=1e-5)
  with pytest.raises(ValueError, match=r"leading axis is \[12\], not the loop length 5"):
    bnx.scan(lambda h, x: (stack(h), None), jnp.ones((2, WIDTH)), jnp.ones(5), state_in_axes=LAYER_STATE)
  with pytest.raises(ValueError, match='axis 0 only'):
    bnx.scan(lambda h, _: (stack(h), None), jnp.ones((2, WIDTH)), None, length=LAYERS, state_in_axes={1: nnx.Param})


STEPS = 4


def _pure_in_time(ks, bs, h, xs):
  """The loss of the oracle on pure arrays: ``jax.lax.scan`` over time steps, each a Python loop
  over the layers; its aux is the last step's per-layer stats."""
  def step(h, x):
    h_next, stats = _pure(ks, bs, h + x)
    return h_next, (h.sum(), stats)

  h, (ys, stats) = jax.lax.scan(step, h, xs)
  return (h ** 2).mean() + ys.mean(), stats[-1]


_oracle = jax.jit(jax.value_and_grad(_pure_in_time, argnums=(0, 1), has_aux=True))


@pytest.mark.parametrize('rematted', [False, True])
def test_scan_over_layers_inside_checkpointed_scan_equals_loops_over_time_and_layers(rematted):
  stack = _stack()
  data = np.random.default_rng(1)  # numpy: no eager jax ops to compile
  h0 = jnp.asarray(data.normal(size=(4, WIDTH)), jnp.float32)
  xs = jnp.asarray(0.1 * data.normal(size=(STEPS, 4, WIDTH)), jnp.float32)
  layer = bnx.remat(stack, prevent_cse=False) if rematted else stack

  def layers(h):  # one time step: the whole stack, as one scan over its layers
    return bnx.scan(lambda h, _: (layer(h), None), h, None, state_in_axes=LAYER_STATE)[0]

  def loss(h0, xs):
    h, ys = bnx.checkpointed_scan(lambda h, x: (layers(h + x), h.sum()), h0, xs, base=2)
    return (h ** 2).mean() + ys.mean()

  (ref_value, ref_stats), ref_grads = _oracle(stack.lin.kernel[...], stack.lin.bias[...], h0, xs)
  value, g = bnx.jit(bnx.value_and_grad(loss, grad_states=stack))(h0, xs)
  np.testing.assert_allclose(value, ref_value, rtol=1e-5)
  np.testing.assert_allclose(stack.stat[...], ref_stats, rtol=1e-5, atol=1e-6)  # per layer, the last step's
  for got, want in zip((g['lin']['kernel'][...], g['lin']['bias'][...]), ref_grads):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * float(jnp.abs(want).max()))
