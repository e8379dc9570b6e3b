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
  with pytest.raises(ValueError, match=r'scan: state_in_axes=\{1: .*\} is not honoured: a scan takes axis 0'):
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


# -- a stacked Module or split Rngs passed as xs, as nnx.scan takes them ----------------


def test_scan_over_a_stacked_module_in_xs_matches_nnx_scan():
  stack = _stack()
  ref = nnx.clone(stack)
  x = jnp.ones((2, WIDTH))
  h, ys = bnx.scan(lambda h, layer: (layer(h), h.sum()), x, stack)

  @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
  def oracle(h, layer):
    return layer(h), h.sum()

  h_ref, ys_ref = oracle(x, ref)
  np.testing.assert_allclose(h, h_ref, rtol=1e-6)
  np.testing.assert_allclose(ys, ys_ref, rtol=1e-6)
  np.testing.assert_allclose(stack.stat[...], ref.stat[...], rtol=1e-6)  # writes stacked back
  assert stack.stat.shape == (LAYERS, WIDTH)


def test_for_loop_over_a_stacked_module_in_xs_matches_nnx_scan():
  stack, ref = _stack(), None
  ref = nnx.clone(stack)
  xs = jnp.arange(LAYERS * WIDTH, dtype=jnp.float32).reshape(LAYERS, 1, WIDTH) / 100
  out = bnx.for_loop(lambda layer, x: layer(x), stack, xs)

  @nnx.scan(in_axes=(0, 0), out_axes=0)
  def oracle(layer, x):
    return layer(x)

  np.testing.assert_allclose(out, oracle(ref, xs), rtol=1e-6)
  np.testing.assert_allclose(stack.stat[...], ref.stat[...], rtol=1e-6)
  with pytest.raises(ValueError, match=r'for_loop: .* is scanned over \(it is in xs\) but its leading axis is \[12\], not the loop length 3'):
    bnx.for_loop(lambda layer, x: layer(x), stack, xs[:3])


def test_scan_over_split_rngs_in_xs_matches_nnx_scan_under_split_rngs():
  def draw(r):
    return jax.random.normal(r.dropout(), (2,))

  ours, theirs = nnx.Rngs(dropout=1), nnx.Rngs(dropout=1)
  with nnx.split_rngs(theirs, splits=4):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
    def oracle(c, r):
      return c, draw(r)

    _, ref = oracle(0.0, theirs)
    ref_count = np.asarray(theirs.dropout.count[...])
  with nnx.split_rngs(ours, splits=4):
    _, got = bnx.scan(lambda c, r: (c, draw(r)), 0.0, ours)
    got_count = np.asarray(ours.dropout.count[...])
  np.testing.assert_array_equal(got, ref)
  np.testing.assert_array_equal(got_count, ref_count)  # every slice's count advanced once


def test_checkpointed_scan_refuses_graph_nodes_in_xs():
  with pytest.raises(TypeError, match='checkpointed_scan: xs holds a graph node'):
    bnx.checkpointed_scan(lambda h, layer: (layer(h), None), jnp.ones((2, WIDTH)), _stack())
