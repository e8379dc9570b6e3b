"""Per-call overhead of brainnx.jit against raw jax.jit, nnx.jit and nnx.cached_partial.

Run: ``python benchmarks/overhead.py`` (prints markdown tables).

Model: MLP of ``depth`` Linear(32, 32) layers (ReLU between), batch 16.
Variants, interleaved in one process:
  raw jax.jit        pure function of a list of arrays
  brainnx (closure)  ``bnx.jit(lambda x: model(x))``
  brainnx (arg)      ``bnx.jit(lambda m, x: m(x))(model, x)``
  nnx.jit            ``nnx.jit(lambda m, x: m(x))(model, x)``
  nnx.cached_partial ``nnx.cached_partial(nnx.jit(f), model)(x)``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import flax
import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, str(Path(__file__).parent))
import brainnx as bnx  # noqa: E402
from _timing import first_calls, interleaved, table  # noqa: E402


class Stack(nnx.Module):
  def __init__(self, depth: int, rngs: nnx.Rngs):
    self.layers = nnx.List([nnx.Linear(32, 32, rngs=rngs) for _ in range(depth)])

  def __call__(self, x):
    for i, layer in enumerate(self.layers):
      x = layer(x)
      if i + 1 < len(self.layers):
        x = jax.nn.relu(x)
    return x


def pure(params, x):
  for i, (w, b) in enumerate(params):
    x = x @ w + b
    if i + 1 < len(params):
      x = jax.nn.relu(x)
  return x


def variants(depth: int):
  model = Stack(depth, nnx.Rngs(0))
  x = jnp.ones((16, 32))
  params = [(l.kernel[...], l.bias[...]) for l in model.layers]
  raw = jax.jit(pure)
  closure = bnx.jit(lambda x: model(x))
  arg = bnx.jit(lambda m, x: m(x))
  nnx_jit = nnx.jit(lambda m, x: m(x))
  cached = nnx.cached_partial(nnx_jit, model)
  ref = raw(params, x)
  for out in (closure(x), arg(model, x), nnx_jit(model, x), cached(x)):
    assert jnp.allclose(out, ref, atol=1e-5), 'variants disagree'
  return {
    'raw jax.jit': lambda: raw(params, x),
    'brainnx.jit (closure)': lambda: closure(x),
    'brainnx.jit (arg)': lambda: arg(model, x),
    'nnx.jit': lambda: nnx_jit(model, x),
    'nnx.cached_partial': lambda: cached(x),
  }


def first_call_makers(depth: int):
  x = jnp.ones((16, 32))

  def raw():
    model = Stack(depth, nnx.Rngs(0))
    params = [(l.kernel[...], l.bias[...]) for l in model.layers]
    f = jax.jit(lambda p, x: pure(p, x))
    return lambda: f(params, x)

  def closure():
    model = Stack(depth, nnx.Rngs(0))
    f = bnx.jit(lambda x: model(x))
    return lambda: f(x)

  def arg():
    model = Stack(depth, nnx.Rngs(0))
    f = bnx.jit(lambda m, x: m(x))
    return lambda: f(model, x)

  def nnx_jit():
    model = Stack(depth, nnx.Rngs(0))
    f = nnx.jit(lambda m, x: m(x))
    return lambda: f(model, x)

  return {'raw jax.jit': raw, 'brainnx.jit (closure)': closure, 'brainnx.jit (arg)': arg, 'nnx.jit': nnx_jit}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--rounds', type=int, default=40)
  parser.add_argument('--calls', type=int, default=500)
  parser.add_argument('--deep', type=int, default=100, help='depth of the deep stack')
  args = parser.parse_args(argv)
  print(f'jax {jax.__version__}, flax {flax.__version__} on {jax.devices()[0].platform}\n')

  shallow = interleaved(variants(2), rounds=args.rounds, calls=args.calls)
  print(table('2-layer MLP 32x32, batch 16: per-call median', shallow, 'us', 'raw jax.jit'))
  first = first_calls(first_call_makers(2))
  print()
  print(table('2-layer MLP: first call (trace + compile)', first, 'ms', 'raw jax.jit'))
  first_deep = first_calls(first_call_makers(args.deep), trials=3)
  print()
  print(table(f'{args.deep}-layer stack: first call (trace + compile)', first_deep, 'ms', 'raw jax.jit'))

  deep = interleaved(variants(args.deep), rounds=max(10, args.rounds // 4), calls=max(10, args.calls // 4))
  print()
  print(table(f'{args.deep}-layer stack: per-call median', deep, 'us', 'raw jax.jit'))
  extra_vars = 2 * (args.deep - 2)
  print()
  print('### Overhead growth per extra Variable (brainnx minus raw, deep minus shallow)')
  print()
  for name in ('brainnx.jit (closure)', 'brainnx.jit (arg)', 'nnx.jit'):
    growth = ((deep[name] - deep['raw jax.jit']) - (shallow[name] - shallow['raw jax.jit'])) / extra_vars
    print(f'- {name}: {growth:.3f} us per Variable')


if __name__ == '__main__':
  main()
