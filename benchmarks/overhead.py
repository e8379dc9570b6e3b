"""Per-call overhead of brainnx.jit against raw jax.jit, nnx.jit, nnx.cached_partial, equinox and brainstate.

Run: ``python benchmarks/overhead.py`` (prints markdown tables).

Model: MLP of ``depth`` Linear(32, 32) layers (ReLU between), batch 16.
Variants, interleaved in one process, each checked equal to the flat raw result before timing:
  raw jax.jit, flat  pure function of the arrays as separate arguments (the baseline)
  raw jax.jit, list  the same arrays as the list of (kernel, bias) pairs users write
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

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).parent))
import _peers  # noqa: E402
from _models import Layers  # noqa: E402
from _results import write  # noqa: E402
from _timing import first_calls, interleaved, table  # noqa: E402

import brainnx as bnx  # noqa: E402


class Stack(Layers):
  """``depth`` ``Linear(width, width)`` layers with ReLU between."""

  def __init__(self, depth: int, rngs: nnx.Rngs, width: int = 32):
    super().__init__([width] * (depth + 1), rngs=rngs)


def pure(params, x):
  for i, (w, b) in enumerate(params):
    x = x @ w + b
    if i + 1 < len(params):
      x = jax.nn.relu(x)
  return x


def pure_flat(*flat):
  *arrays, x = flat
  return pure(list(zip(arrays[::2], arrays[1::2])), x)


def variants(depth: int, width: int = 32, batch: int = 16, cached_partial: bool = True):
  model = Stack(depth, nnx.Rngs(0), width)
  x = jnp.ones((batch, width))
  params = _peers.params_of(model.layers)
  # nnx's rows get their own copy (nnx.clone: new Variables, the same arrays). An nnx.jit call
  # writes its outputs back into the Variables it was given and re-inserts the attributes of the
  # modules it updates; brainnx's guard sees both, so sharing the Variables (as a copy made by
  # nnx.merge(*nnx.split(model)) does) would time that, not the steady state.
  flax_model = nnx.clone(model)
  raw = jax.jit(pure)
  flat = [a for pair in params for a in pair]
  raw_flat = jax.jit(pure_flat)
  closure = bnx.jit(lambda x: model(x))
  arg = bnx.jit(lambda m, x: m(x))
  nnx_jit = nnx.jit(lambda m, x: m(x))
  ref = raw_flat(*flat, x)
  found = {
    'raw jax.jit': lambda: raw_flat(*flat, x),
    'raw jax.jit, list of pairs': lambda: raw(params, x),
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
    np.testing.assert_allclose(fn(), ref, rtol=1e-6, atol=1e-6, err_msg=f'{name} disagrees with raw jax.jit')
  return found


def first_call_makers(depth: int, width: int = 32, batch: int = 16):
  x = jnp.ones((batch, width))

  def fresh_params():
    return _peers.params_of(Stack(depth, nnx.Rngs(0), width).layers)

  def raw():
    flat = [a for pair in fresh_params() for a in pair]
    f = jax.jit(lambda *flat: pure_flat(*flat))
    return lambda: f(*flat, x)

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
  parser.add_argument('--no-write', dest='write', action='store_false', help='print only')
  args = parser.parse_args(argv)
  out = [f'{_peers.versions()}. {_peers.notes()}']
  shallow = interleaved(variants(2), rounds=args.rounds, calls=args.calls)
  out.append(table(f'2-layer MLP 32x32, batch 16, {args.rounds} rounds of {args.calls} calls', shallow, 'µs', 'raw jax.jit'))
  first = first_calls(first_call_makers(2))
  out.append(table('2-layer MLP: first call (trace + compile)', first, 'ms', 'raw jax.jit'))
  first_deep = first_calls(first_call_makers(args.deep), trials=3)
  out.append(table(f'{args.deep}-layer stack: first call (trace + compile)', first_deep, 'ms', 'raw jax.jit'))
  deep_rounds, deep_calls = max(10, args.rounds // 4), max(10, args.calls // 4)
  deep = interleaved(variants(args.deep), rounds=deep_rounds, calls=deep_calls)
  out.append(table(f'{args.deep}-layer stack, {deep_rounds} rounds of {deep_calls} calls', deep, 'µs', 'raw jax.jit'))
  extra_vars = 2 * (args.deep - 2)
  lines = ['### Overhead growth per extra Variable (variant minus raw, deep minus shallow)', '',
           '| variant | µs per Variable |', '|---|---:|']
  for name in [n for n in deep if n not in ('raw jax.jit', 'nnx.cached_partial')]:
    growth = ((deep[name] - deep['raw jax.jit']) - (shallow[name] - shallow['raw jax.jit'])) / extra_vars
    lines.append(f'| {name} | {growth:.3f} |')
  out.append('\n'.join(lines))
  text = '\n\n'.join(out)
  print(text)
  if args.write:
    print('wrote', write('overhead.md', 'overhead.py', text))

if __name__ == '__main__':
  main()
