"""Per-call overhead of brainnx.jit against raw jax.jit, nnx.jit, nnx.cached_partial, equinox and brainstate.

Run: ``python benchmarks/overhead.py`` (prints markdown tables).

Model: MLP of ``depth`` Linear(32, 32) layers (ReLU between), batch 16.
Variants, interleaved in one process:
  raw jax.jit        pure function of a list of arrays
  brainnx (closure)  ``bnx.jit(lambda x: model(x))``
  brainnx (arg)      ``bnx.jit(lambda m, x: m(x))(model, x)``
  nnx.jit            ``nnx.jit(lambda m, x: m(x))(model, x)``
  nnx.cached_partial ``nnx.cached_partial(nnx.jit(f), model)(x)``
  eqx.filter_jit     ``eqx.filter_jit(lambda m, x: m(x))(model, x)``, the same arrays  (bench extra)
  brainstate jit     ``brainstate.transform.jit(lambda x: model(x))``, the same arrays (bench extra)
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
import _peers  # noqa: E402
from _timing import first_calls, interleaved, table  # noqa: E402

import brainnx as bnx  # noqa: E402


class Stack(nnx.Module):
  def __init__(self, depth: int, rngs: nnx.Rngs, width: int = 32):
    self.layers = nnx.List([nnx.Linear(width, width, rngs=rngs) for _ in range(depth)])

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


def variants(depth: int, width: int = 32, batch: int = 16, cached_partial: bool = True):
  model = Stack(depth, nnx.Rngs(0), width)
  x = jnp.ones((batch, width))
  params = _peers.params_of(model.layers)
  # nnx's rows get their own copy (same arrays): an nnx.jit call re-inserts the attributes of
  # the modules it updates, and brainnx, whose guard sees that, would re-discover on its next
  # call; sharing one model would time that, not the steady state.
  flax_model = nnx.merge(*nnx.split(model))
  raw = jax.jit(pure)
  closure = bnx.jit(lambda x: model(x))
  arg = bnx.jit(lambda m, x: m(x))
  nnx_jit = nnx.jit(lambda m, x: m(x))
  ref = raw(params, x)
  found = {
    'raw jax.jit': lambda: raw(params, x),
    'brainnx.jit (closure)': lambda: closure(x),
    'brainnx.jit (arg)': lambda: arg(model, x),
    'nnx.jit': lambda: nnx_jit(flax_model, x),
  }
  if cached_partial:
    cached = nnx.cached_partial(nnx_jit, flax_model)
    found['nnx.cached_partial'] = lambda: cached(x)
  if _peers.HAVE_EQX:
    eqx_model, eqx_fn = _peers.eqx_model(params, jax.nn.relu), _peers.eqx_forward()
    found['eqx.filter_jit'] = lambda: eqx_fn(eqx_model, x)
  if _peers.HAVE_BST:
    bst_fn = _peers.bst_forward(_peers.bst_model(params, jax.nn.relu))
    found['brainstate jit'] = lambda: bst_fn(x)
  for name, fn in found.items():
    assert jnp.allclose(fn(), ref, atol=1e-5), f'{name} disagrees with raw jax.jit'
  return found


def first_call_makers(depth: int, width: int = 32, batch: int = 16):
  x = jnp.ones((batch, width))

  def fresh_params():
    return _peers.params_of(Stack(depth, nnx.Rngs(0), width).layers)

  def raw():
    params = fresh_params()
    f = jax.jit(lambda p, x: pure(p, x))
    return lambda: f(params, x)

  def closure():
    model = Stack(depth, nnx.Rngs(0), width)
    f = bnx.jit(lambda x: model(x))
    return lambda: f(x)

  def arg():
    model = Stack(depth, nnx.Rngs(0), width)
    f = bnx.jit(lambda m, x: m(x))
    return lambda: f(model, x)

  def nnx_jit():
    model = Stack(depth, nnx.Rngs(0), width)
    f = nnx.jit(lambda m, x: m(x))
    return lambda: f(model, x)

  def equinox():
    model, f = _peers.eqx_model(fresh_params(), jax.nn.relu), _peers.eqx_forward()
    return lambda: f(model, x)

  def brainstate():
    f = _peers.bst_forward(_peers.bst_model(fresh_params(), jax.nn.relu))
    return lambda: f(x)

  makers = {'raw jax.jit': raw, 'brainnx.jit (closure)': closure, 'brainnx.jit (arg)': arg, 'nnx.jit': nnx_jit}
  if _peers.HAVE_EQX:
    makers['eqx.filter_jit'] = equinox
  if _peers.HAVE_BST:
    makers['brainstate jit'] = brainstate
  return makers


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--rounds', type=int, default=40)
  parser.add_argument('--calls', type=int, default=500)
  parser.add_argument('--deep', type=int, default=100, help='depth of the deep stack')
  args = parser.parse_args(argv)
  print(f'jax {jax.__version__}, flax {flax.__version__}, {_peers.versions()} on {jax.devices()[0].platform}')
  print(_peers.notes() + '\n')

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
  for name in [n for n in deep if n not in ('raw jax.jit', 'nnx.cached_partial')]:
    growth = ((deep[name] - deep['raw jax.jit']) - (shallow[name] - shallow['raw jax.jit'])) / extra_vars
    print(f'- {name}: {growth:.3f} us per Variable')


if __name__ == '__main__':
  main()
