"""What rebuilding a call's object graph costs: warm calls, and calls that create and return.

Run: ``python benchmarks/object_graph.py`` (writes ``results/object_graph.md``).

Every call merges what the function attached and returned onto that call's own objects
(``nnx.split`` → pure function → ``nnx.merge``). Variants, interleaved in one process, each
checked equal to its baseline before timing:

Warm call of a 2-layer MLP 32x32 (creates and returns nothing: must cost nothing extra)
  raw jax.jit, flat    pure function of the arrays as separate arguments (the baseline)
  brainnx.jit          ``bnx.jit(lambda x: model(x))``
  nnx.jit              ``nnx.jit(lambda m, x: m(x))(model, x)``

A function that creates and returns a Linear(32, 32) on every call
  raw jax.jit + merge  ``jax.jit`` of the initialisation returning the arrays, then ``nnx.merge``
                       with a graph definition split once (what a hand-written path does; baseline)
  brainnx.jit          ``bnx.jit(make)(x)``
  nnx.jit              ``nnx.jit(make)(x)``

A forward that attaches an ``nnx.Intermediate`` to its model on every call
  raw jax.jit + set    ``jax.jit`` returning the output and the intermediate, then ``setattr``
                       of a new ``nnx.Intermediate`` (baseline)
  brainnx.jit          ``bnx.jit(lambda m, x: m(x))(model, x)``
  nnx.jit              ``nnx.jit(lambda m, x: m(x))(model, x)``
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
from _results import publish  # noqa: E402
from _models import MLP  # noqa: E402
from _timing import interleaved, table  # noqa: E402

import brainnx as bnx  # noqa: E402


class Recording(MLP):
  def __call__(self, x):
    h = jax.nn.relu(self.l1(x))
    self.hidden = nnx.Intermediate(h)
    return self.l2(h)


def _same(a, b) -> None:
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-6)


def warm_calls(rounds: int, calls: int) -> dict:
  model = MLP(32, 32, 32, rngs=nnx.Rngs(0))
  x = jnp.ones((16, 32))
  arrays = [model.l1.kernel[...], model.l1.bias[...], model.l2.kernel[...], model.l2.bias[...]]
  raw = jax.jit(lambda k1, b1, k2, b2, x: jax.nn.relu(x @ k1 + b1) @ k2 + b2)
  ours = bnx.jit(lambda x: model(x))
  theirs = nnx.jit(lambda m, x: m(x))
  variants = {
    'raw jax.jit, flat': lambda: raw(*arrays, x),
    'brainnx.jit': lambda: ours(x),
    'nnx.jit': lambda: theirs(model, x),
  }
  want = variants['raw jax.jit, flat']()
  for fn in variants.values():
    _same(fn(), want)
  return interleaved(variants, rounds=rounds, calls=calls)


def make(x):
  return nnx.Linear(32, 32, rngs=nnx.Rngs(0)), x


def creating_calls(rounds: int, calls: int) -> dict:
  x = jnp.ones(3)
  graphdef, _ = nnx.split(nnx.Linear(32, 32, rngs=nnx.Rngs(0)))
  raw_init = jax.jit(lambda x: (nnx.split(make(x)[0])[1], x))

  def raw():
    state, out = raw_init(x)
    return nnx.merge(graphdef, state), out

  ours, theirs = bnx.jit(make), nnx.jit(make)
  variants = {'raw jax.jit + merge': raw, 'brainnx.jit': lambda: ours(x), 'nnx.jit': lambda: theirs(x)}
  want = raw()
  for fn in variants.values():
    got = fn()
    _same((got[0].kernel[...], got[0].bias[...], got[1]), (want[0].kernel[...], want[0].bias[...], want[1]))
  return interleaved({k: (lambda f=f: f()[1]) for k, f in variants.items()}, rounds=rounds, calls=calls)


def attaching_calls(rounds: int, calls: int) -> dict:
  models = {name: Recording(32, 32, 32, rngs=nnx.Rngs(0)) for name in ('raw', 'ours', 'theirs')}
  x = jnp.ones((16, 32))
  arrays = [models['raw'].l1.kernel[...], models['raw'].l1.bias[...], models['raw'].l2.kernel[...], models['raw'].l2.bias[...]]

  @jax.jit
  def forward(k1, b1, k2, b2, x):
    h = jax.nn.relu(x @ k1 + b1)
    return h @ k2 + b2, h

  def raw():
    out, h = forward(*arrays, x)
    models['raw'].hidden = nnx.Intermediate(h)
    return out

  ours, theirs = bnx.jit(lambda m, x: m(x)), nnx.jit(lambda m, x: m(x))
  variants = {
    'raw jax.jit + set': raw,
    'brainnx.jit': lambda: ours(models['ours'], x),
    'nnx.jit': lambda: theirs(models['theirs'], x),
  }
  want = raw()
  for fn in variants.values():
    _same(fn(), want)
  for m in models.values():
    _same(m.hidden[...], models['raw'].hidden[...])
  return interleaved(variants, rounds=rounds, calls=calls)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--rounds', type=int, default=30)
  parser.add_argument('--calls', type=int, default=200)
  parser.add_argument('--no-write', action='store_true', help='print only')
  args = parser.parse_args(argv)
  r, c = args.rounds, args.calls
  out = [
    table(f'Warm call, 2-layer MLP 32x32, batch 16, {r} rounds of {c} calls', warm_calls(r, c), 'µs',
          'raw jax.jit, flat'),
    table(f'Creates and returns a Linear(32, 32) every call, {r} rounds of {c // 4} calls',
          creating_calls(r, max(1, c // 4)), 'µs', 'raw jax.jit + merge'),
    table(f'Attaches an nnx.Intermediate every call, {r} rounds of {c // 4} calls',
          attaching_calls(r, max(1, c // 4)), 'µs', 'raw jax.jit + set'),
  ]
  publish('\n\n'.join(out), 'object_graph.py', dry_run=args.no_write)


if __name__ == '__main__':
  main()
