"""Scan over layers: a 48-layer residual stack, width 256, as one scan vs unrolled in Python.

Run: ``python benchmarks/layers.py`` (prints a markdown table).

Variants, side by side in one process, each a jitted training step (loss + gradients):
  brainnx scan over layers   ``bnx.scan(..., state_in_axes=nnx.Param)`` over the stacked module
  brainnx unrolled           a Python loop over the 48 layers (48 separate modules)
  nnx.scan                   ``nnx.scan`` over the same stacked module under ``nnx.jit``
First call = trace + compile of a fresh function; step = warm per-call time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import flax
import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, str(Path(__file__).parent))
import brainnx as bnx  # noqa: E402
from _timing import interleaved, table  # noqa: E402


class Block(nnx.Module):
  def __init__(self, width, rngs):
    self.lin = nnx.Linear(width, width, rngs=rngs)

  def __call__(self, x):
    return x + jnp.tanh(self.lin(x))


def makers(depth: int, width: int):
  x = jnp.ones((32, width))

  def scan_over_layers():
    rngs = nnx.Rngs(0)
    stack = bnx.vmap(lambda: Block(width, rngs), axis_size=depth)()

    def loss(x):
      h, _ = bnx.scan(lambda h, _: (stack(h), None), x, None, state_in_axes=nnx.Param)
      return (h ** 2).mean()

    step = bnx.jit(bnx.grad(loss, grad_states=stack))
    return lambda: step(x)

  def unrolled():
    rngs = nnx.Rngs(0)
    blocks = [Block(width, rngs) for _ in range(depth)]

    def loss(x):
      for b in blocks:
        x = b(x)
      return (x ** 2).mean()

    step = bnx.jit(bnx.grad(loss, grad_states=blocks))
    return lambda: step(x)

  def nnx_scan():
    rngs = nnx.Rngs(0)
    stack = nnx.vmap(lambda r: Block(width, r), in_axes=0)(nnx.Rngs(0).split(depth) if hasattr(nnx.Rngs, 'split') else rngs)

    @nnx.jit
    def step(stack, x):
      def loss(stack):
        forward = nnx.scan(lambda h, block: (block(h), None), in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
        h, _ = forward(x, stack)
        return (h ** 2).mean()

      return nnx.grad(loss)(stack)

    return lambda: step(stack, x)

  return {'brainnx scan over layers': scan_over_layers, 'brainnx unrolled (Python loop)': unrolled, 'nnx.scan': nnx_scan}


def first_call_ms(make) -> float:
  fn = make()
  t0 = time.perf_counter()
  jax.block_until_ready(fn())
  return (time.perf_counter() - t0) * 1e3


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--depth', type=int, default=48)
  parser.add_argument('--width', type=int, default=256)
  parser.add_argument('--rounds', type=int, default=10)
  parser.add_argument('--calls', type=int, default=20)
  args = parser.parse_args(argv)
  print(f'jax {jax.__version__}, flax {flax.__version__} on {jax.devices()[0].platform}\n')
  made = makers(args.depth, args.width)
  first = {name: min(first_call_ms(m) for _ in range(2)) for name, m in made.items()}
  print(table(f'{args.depth}-layer stack, width {args.width}: first call (trace + compile)', first, 'ms', 'brainnx unrolled (Python loop)'))
  steps = interleaved({name: m() for name, m in made.items()}, rounds=args.rounds, calls=args.calls)
  print()
  print(table(f'{args.depth}-layer stack, width {args.width}: training step (loss + grads)', steps, 'us', 'nnx.scan'))


if __name__ == '__main__':
  main()
