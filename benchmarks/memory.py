"""Resident memory of brainnx transforms: many distinct closures, many warm calls, dropped models.

Run: ``python benchmarks/memory.py`` (prints markdown tables).

1. RSS growth over ``--closures`` distinct closures, each decorated (or looped) once and
   called once, then dropped; the same with plain ``jax.jit`` / ``jax.lax.scan``.
2. RSS growth over ``--calls`` warm calls of one function per transform.
3. MB still resident after a model holding a 200 MB array is dropped (``del`` + ``gc.collect``).
RSS is read from ``/proc/self/statm`` after ``gc.collect()`` and glibc's ``malloc_trim``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os

import jax
import jax.numpy as jnp
from flax import nnx

import brainnx as bnx

_PAGE = os.sysconf('SC_PAGE_SIZE')


def rss_mb() -> float:
  gc.collect()
  try:
    ctypes.CDLL('libc.so.6').malloc_trim(0)
  except OSError:
    pass
  with open('/proc/self/statm') as f:
    return int(f.read().split()[1]) * _PAGE / 2**20


def closures(kind: str, n: int) -> float:
  x = jnp.ones(4)
  before = rss_mb()
  for k in range(n):
    scale = float(k)
    if kind == 'jax.jit':
      jax.jit(lambda x, scale=scale: x * scale)(x)
    elif kind == 'brainnx.jit':
      bnx.jit(lambda x, scale=scale: x * scale)(x)
    elif kind == 'jax.lax.scan':
      jax.lax.scan(lambda c, v, scale=scale: (c + v * scale, c), 0.0, x)
    elif kind == 'brainnx.scan':
      bnx.scan(lambda c, v, scale=scale: (c + v * scale, c), 0.0, x)
    elif kind == 'brainnx.vmap':
      bnx.vmap(lambda v, scale=scale: v * scale)(x)
    elif kind == 'jax.vmap':
      jax.vmap(lambda v, scale=scale: v * scale)(x)
  return rss_mb() - before


def warm_calls(kind: str, n: int) -> float:
  model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
  count = nnx.Variable(jnp.zeros((), jnp.int32))
  x, xs = jnp.ones(4), jnp.ones((3, 4))

  def step(x):
    count[...] += 1
    return model(x)

  fns = {
    'brainnx.jit': (bnx.jit(step), (x,)),
    'brainnx.vmap': (bnx.vmap(lambda x: model(x)), (xs,)),
    'brainnx.scan': (lambda xs: bnx.scan(lambda c, v: (c + step(v).sum(), c), 0.0, xs), (xs,)),
    'brainnx.grad': (bnx.grad(lambda x: model(x).sum(), grad_states=model), (x,)),
    'jax.jit': (jax.jit(lambda k, b, x: x @ k + b), (model.kernel[...], model.bias[...], x)),
  }
  fn, args = fns[kind]
  jax.block_until_ready(fn(*args))
  before = rss_mb()
  for _ in range(n):
    out = fn(*args)
  jax.block_until_ready(out)
  return rss_mb() - before


class Holder(nnx.Module):
  def __init__(self, mb: int):
    self.big = nnx.Param(jnp.ones((mb * 2**20 // 4,)))

  def __call__(self, x):
    return x + self.big[:4]


def retained_after_drop(kind: str, mb: int = 200) -> float:
  before = rss_mb()
  m = Holder(mb)
  x = jnp.ones(4)
  if kind == 'brainnx.jit (argument)':
    f = bnx.jit(lambda m, x: m(x))
    f(m, x)
  elif kind == 'brainnx.jit (closure)':
    f = bnx.jit(lambda x: m(x))  # noqa: F821 - called before the del below
    f(x)
  elif kind == 'brainnx.scan':
    f = None
    bnx.scan(lambda c, v: (c + m(v).sum(), c), 0.0, jnp.ones((2, 4)))  # noqa: F821 - called before the del below
  elif kind == 'brainnx.vmap':
    f = bnx.vmap(lambda v: m(v))  # noqa: F821 - called before the del below
    f(jnp.ones((2, 4)))
  elif kind == 'jax.jit':
    f = jax.jit(lambda big, x: x + big[:4])
    f(m.big[...], x)
  del m
  if kind == 'brainnx.jit (closure)' or kind == 'brainnx.vmap':
    del f  # the closure holds the model: dropping the function must free it
  return rss_mb() - before


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--closures', type=int, default=1000)
  parser.add_argument('--calls', type=int, default=20_000)
  args = parser.parse_args(argv)
  print(f'jax {jax.__version__} on {jax.devices()[0].platform}\n')
  print(f'### RSS growth over {args.closures} distinct closures, each called once\n')
  print('| variant | MB |\n|---|---:|')
  for kind in ('jax.jit', 'brainnx.jit', 'jax.lax.scan', 'brainnx.scan', 'jax.vmap', 'brainnx.vmap'):
    print(f'| {kind} | {closures(kind, args.closures):.1f} |', flush=True)
  print(f'\n### RSS growth over {args.calls} warm calls\n')
  print('| variant | MB |\n|---|---:|')
  for kind in ('jax.jit', 'brainnx.jit', 'brainnx.vmap', 'brainnx.scan', 'brainnx.grad'):
    n = args.calls if kind != 'brainnx.scan' else args.calls // 10
    print(f'| {kind} ({n} calls) | {warm_calls(kind, n):.1f} |', flush=True)
  print('\n### MB retained after dropping a model holding 200 MB\n')
  print('| variant | MB |\n|---|---:|')
  for kind in ('jax.jit', 'brainnx.jit (argument)', 'brainnx.jit (closure)', 'brainnx.scan', 'brainnx.vmap'):
    print(f'| {kind} | {retained_after_drop(kind):.1f} |', flush=True)


if __name__ == '__main__':
  main()
