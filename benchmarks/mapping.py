"""Per-call cost of a jitted vmap over an 8-member ensemble.

Run: ``python benchmarks/mapping.py`` (prints a markdown table).

Model: MLP 32 -> 64 -> 32, 8 members stacked on axis 0, batch 16 shared.
Variants, interleaved in one process, each checked equal to the raw result before timing:
  raw jax.jit(jax.vmap), flat       pure function of the four stacked arrays, passed flat (the baseline)
  raw jax.jit(jax.vmap), nested     the same arrays as the nested dict users write
  brainnx jit(vmap) (closure)       ensemble captured, ``state_in_axes={0: nnx.Param}``
  brainnx jit(vmap) (arg)           ensemble passed with ``in_axes=(0, None)``
  brainnx vmap, eager               no outer jit: brainnx compiles it itself
  nnx.jit(nnx.vmap)                 ensemble passed with ``in_axes=(0, None)``
  nnx.cached_partial                the same, the ensemble bound once with ``nnx.cached_partial``
  eqx.filter_jit(eqx.filter_vmap)   the same arrays as an equinox module, ``in_axes=(0, None)`` (bench extra)
  brainstate jit(vmap2)             the same arrays as ``ParamState``s, captured, ``state_in_axes=ParamState``
                                    (bench extra)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).parent))
import _peers  # noqa: E402
from _results import write  # noqa: E402
from _models import MLP, pure_mlp  # noqa: E402
from _timing import interleaved, table  # noqa: E402

import brainnx as bnx  # noqa: E402

MEMBERS = 8


def pure_flat(k1, b1, k2, b2, x):
  return pure_mlp({'l1': {'kernel': k1, 'bias': b1}, 'l2': {'kernel': k2, 'bias': b2}}, x)


def variants():
  rngs = nnx.Rngs(0)
  ens = bnx.vmap(lambda: MLP(32, 64, 32, rngs=rngs), axis_size=MEMBERS)()
  x = jnp.ones((16, 32))
  params = {n: {'kernel': getattr(ens, n).kernel[...], 'bias': getattr(ens, n).bias[...]} for n in ('l1', 'l2')}
  raw = jax.jit(jax.vmap(pure_mlp, in_axes=(0, None)))
  flat = [params[n][k] for n in ('l1', 'l2') for k in ('kernel', 'bias')]
  raw_flat = jax.jit(jax.vmap(pure_flat, in_axes=(0, 0, 0, 0, None)))
  closure = bnx.jit(bnx.vmap(lambda x: ens(x), in_axes=None, state_in_axes={0: nnx.Param}))
  arg = bnx.jit(bnx.vmap(lambda m, x: m(x), in_axes=(0, None)))
  eager = bnx.vmap(lambda m, x: m(x), in_axes=(0, None))
  flax_ens = nnx.clone(ens)  # its own Variables: nnx.jit writes back into those it is given
  nnx_fn = nnx.jit(nnx.vmap(lambda m, x: m(x), in_axes=(0, None)))
  cached = nnx.cached_partial(nnx_fn, flax_ens)
  ref = raw_flat(*flat, x)
  found = {
    'raw jax.jit(jax.vmap), flat': lambda: raw_flat(*flat, x),
    'raw jax.jit(jax.vmap), nested dict': lambda: raw(params, x),
    'brainnx jit(vmap) (closure)': lambda: closure(x),
    'brainnx jit(vmap) (arg)': lambda: arg(ens, x),
    'brainnx vmap (eager)': lambda: eager(ens, x),
    'nnx.jit(nnx.vmap)': lambda: nnx_fn(flax_ens, x),
    'nnx.cached_partial(nnx.jit(nnx.vmap))': lambda: cached(x),
  }
  pairs = [(params[n]['kernel'], params[n]['bias']) for n in ('l1', 'l2')]
  if _peers.HAVE_EQX:
    eqx_ens, eqx_fn = _peers.eqx_model(pairs, jax.nn.relu), _peers.eqx_ensemble_forward()
    found['eqx.filter_jit(eqx.filter_vmap)'] = lambda: eqx_fn(eqx_ens, x)
  if _peers.HAVE_BST:
    bst_fn = _peers.bst_ensemble_forward(_peers.bst_model(pairs, jax.nn.relu), MEMBERS)
    found['brainstate jit(vmap2)'] = lambda: bst_fn(x)
  for name, fn in found.items():
    np.testing.assert_allclose(fn(), ref, rtol=1e-6, atol=1e-6, err_msg=f'{name} disagrees with raw')
  return found


def one_off_variants():
  """Eager calls of a function made anew each call (a one-off), against a reused one."""
  rngs = nnx.Rngs(0)
  ens = bnx.vmap(lambda: MLP(32, 64, 32, rngs=rngs), axis_size=MEMBERS)()
  flax_ens = nnx.clone(ens)
  x = jnp.ones((16, 32))
  reused = bnx.vmap(lambda m, x: m(x), in_axes=(0, None))
  return {
    'nnx.vmap, new lambda each call': lambda: nnx.vmap(lambda m, x: m(x), in_axes=(0, None))(flax_ens, x),
    'brainnx vmap, new lambda each call': lambda: bnx.vmap(lambda m, x: m(x), in_axes=(0, None))(ens, x),
    'brainnx vmap, reused': lambda: reused(ens, x),
  }


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--rounds', type=int, default=30)
  parser.add_argument('--calls', type=int, default=200)
  parser.add_argument('--no-write', dest='write', action='store_false', help='print only')
  args = parser.parse_args(argv)
  results = interleaved(variants(), rounds=args.rounds, calls=args.calls)
  once = interleaved(one_off_variants(), rounds=max(5, args.rounds // 3), calls=10)
  text = '\n\n'.join([
    f'{_peers.versions()}. {_peers.notes()}',
    table(f'{MEMBERS}-member ensemble forward, batch 16, {args.rounds} rounds of {args.calls} calls', results, 'µs',
          'raw jax.jit(jax.vmap), flat'),
    table('Eager one-off calls (a fresh function each call) vs a reused one', once, 'µs', 'nnx.vmap, new lambda each call'),
  ])
  print(text)
  if args.write:
    print('wrote', write('mapping.md', 'mapping.py', text))


if __name__ == '__main__':
  main()
