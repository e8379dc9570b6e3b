"""remat / checkpoint: gradients equal the plain function's, writes allowed, temp memory drops."""

import contextlib
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals

import brainnx as bnx
from helpers import reported_temp_bytes


class Block(nnx.Module):
  def __init__(self, width, rngs):
    self.w1 = nnx.Param(jax.random.normal(rngs.params(), (width, width)) / width**0.5)
    self.w2 = nnx.Param(jax.random.normal(rngs.params(), (width, width)) / width**0.5)
    self.calls = nnx.Variable(jnp.array(0))

  def __call__(self, x):
    self.calls[...] += 1
    return _pure_block(self.w1[...], self.w2[...], x)


def _pure_block(w1, w2, x):
  return jnp.tanh(jnp.tanh(x @ w1) @ w2)


def _stack(depth, width=64):
  rngs = nnx.Rngs(0)
  return [Block(width, rngs) for _ in range(depth)]


def _loss(blocks, layer, x):
  for b in blocks:
    x = layer(b, x)
  return (x ** 2).sum()


def test_gradients_equal_the_plain_function_and_writes_land():
  blocks = _stack(4)
  x = jnp.ones((8, 64))
  plain = bnx.grad(lambda x: _loss(blocks, lambda b, h: b(h), x), grad_states=blocks)(x)
  counts = [int(b.calls[...]) for b in blocks]
  rematted = bnx.grad(lambda x: _loss(blocks, lambda b, h: bnx.remat(b)(h), x), grad_states=blocks)(x)
  assert [int(b.calls[...]) for b in blocks] == [c + 1 for c in counts]  # the write is kept, once
  ws = [(b.w1[...], b.w2[...]) for b in blocks]
  pure = jax.grad(lambda ws, x: _loss(ws, lambda w, h: _pure_block(*w, h), x))(ws, x)
  for k in range(len(blocks)):
    for name, ref in zip(('w1', 'w2'), pure[k]):
      np.testing.assert_allclose(rematted[k][name][...], ref, rtol=1e-5, atol=1e-6)
      np.testing.assert_allclose(plain[k][name][...], ref, rtol=1e-5, atol=1e-6)


def test_reverse_mode_temp_memory_drops_on_a_deep_stack():
  """48 steps of a 256-wide block in a scan: remat keeps each step's input, not its intermediates."""
  block = Block(256, nnx.Rngs(0))
  x = jnp.ones((256, 256))

  def temp(layer):
    def loss(x):
      h, _ = bnx.scan(lambda h, _: (layer(h), None), x, None, length=48)
      return (h ** 2).sum()

    grad = bnx.jit(bnx.grad(loss, grad_states=nnx.Param))
    return reported_temp_bytes(grad.lower(x))

  plain = temp(block)
  rematted = temp(bnx.remat(block, prevent_cse=False))
  assert rematted < 0.6 * plain, (rematted, plain)


def _residuals(fn, x) -> list:
  """What the backward pass keeps, as jax prints it, without source lines: 'f32[2,4] output of cos'."""
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    print_saved_residuals(fn, x)
  return sorted(line.split(' from /')[0] for line in out.getvalue().strip().splitlines())


@pytest.mark.parametrize('policy', ['nothing_saveable', 'everything_saveable', 'dots_saveable'])
def test_a_policy_saves_what_it_saves_under_jax_checkpoint(policy):
  """remat(f, policy=p) keeps for the backward pass exactly what jax.checkpoint(g, policy=p) keeps,
  where g reads the Variable's array as a constant."""
  w = nnx.Param(jnp.linspace(-1.0, 1.0, 16).reshape(4, 4))
  held = w[...]
  ours = bnx.remat(lambda x: jnp.sin(jnp.sin(x @ w[...]) @ w[...]).sum(), policy=getattr(jax.checkpoint_policies, policy))
  theirs = jax.checkpoint(lambda x: jnp.sin(jnp.sin(x @ held) @ held).sum(), policy=getattr(jax.checkpoint_policies, policy))
  x = jnp.ones((2, 4))
  assert _residuals(ours, x) == _residuals(theirs, x)
  np.testing.assert_allclose(jax.grad(ours)(x), jax.grad(theirs)(x), rtol=1e-6)


def test_static_argnums_and_errors():
  scale = bnx.remat(lambda x, k: x * k, static_argnums=1)
  assert float(jax.grad(lambda x: scale(x, 3))(2.0)) == 3.0
  # eagerly too, where a Python branch on the static argument needs its concrete value
  branch = bnx.remat(lambda x, k: x * k if k > 1 else x - k, static_argnums=1)
  for k in (3, 1):
    np.testing.assert_allclose(branch(jnp.arange(3.0), k), jnp.arange(3.0) * k if k > 1 else jnp.arange(3.0) - k)
  with pytest.raises(TypeError, match='callable'):
    bnx.remat(3)
  box = nnx.Dict()
  with pytest.raises(ValueError, match='creates Variables'):
    bnx.remat(lambda: box.__setitem__('v', nnx.Variable(jnp.ones(1))))()
  assert bnx.checkpoint is bnx.remat
