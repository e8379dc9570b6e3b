"""The first call of a fresh function (trace + compile), each timed in a fresh process.

Run: ``python benchmarks/first_call.py [--rounds 7] [--depths 100 500]``
(writes ``results/first_call.md``).

Model: the MLP of ``overhead.py`` (``depth`` Linear(32, 32) layers, ReLU between, batch 16).
Each sample is one process that imports everything, makes one call of the same variant on a
2-layer model (so starting JAX's backend is not counted), then times the first call of a fresh
function on a fresh deep model, result included (blocking), three times, and reports the median. Processes are
fresh so that no variant finds what another one compiled or lowered (JAX caches lowering
rules per primitive and process). Variants:

  raw jax.jit                          a pure function of the flat arrays (the floor)
  raw jax.jit, GC paused               the same with Python's cyclic garbage collector paused
                                       around the call, as brainnx pauses it around a cold call
  jax.jit over nnx.State (split once)  flax's performance-guide idiom: the same nnx model
                                       forward, merged inside the traced function
  brainnx.jit (closure)                ``bnx.jit(lambda x: model(x))``
  brainnx.jit (arg)                    ``bnx.jit(lambda m, x: m(x))(model, x)``
  nnx.jit                              ``nnx.jit(lambda m, x: m(x))(model, x)``

Statistic: the median over rounds in which the variants take turns, one process each.
Python's own cost is at most a few per cent of a first call (tracing is mostly JAX's work and
compiling all of it); the rest is the machine's noise, which fresh processes do not remove.
The split-once row is the cost of the nnx model's own forward (its Linear layers trace more
operations than ``x @ w + b``): what any library calling that model pays.
"""

from __future__ import annotations

import argparse
import gc
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
VARIANTS = ('raw jax.jit', 'raw jax.jit, GC paused', 'jax.jit over nnx.State (split once)', 'brainnx.jit (closure)',
            'brainnx.jit (arg)', 'nnx.jit')


def _maker(name: str, depth: int):
  """A function of no arguments making the variant's first call on a fresh ``depth`` model."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  sys.path.insert(0, str(HERE))
  import _peers
  from overhead import Stack, pure_flat

  import brainnx as bnx

  x = jnp.ones((16, 32))
  model = Stack(depth, nnx.Rngs(0), 32)
  if name in ('raw jax.jit', 'raw jax.jit, GC paused'):
    flat = [a for pair in _peers.params_of(model.layers) for a in pair]
    first = lambda: jax.jit(lambda *flat: pure_flat(*flat))(*flat, x)  # noqa: E731
    if name == 'raw jax.jit':
      return first

    def paused():  # what brainnx's cold call does around its trace and compile
      gc.disable()
      try:
        return first()
      finally:
        gc.enable()

    return paused
  if name == 'jax.jit over nnx.State (split once)':
    graphdef, state = nnx.split(model)
    return lambda: jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))(state, x)
  if name == 'brainnx.jit (closure)':
    return lambda: bnx.jit(lambda x: model(x))(x)
  if name == 'brainnx.jit (arg)':
    return lambda: bnx.jit(lambda m, x: m(x))(model, x)
  if name == 'nnx.jit':
    return lambda: nnx.jit(lambda m, x: m(x))(model, x)
  raise SystemExit(f'unknown variant {name!r}')


def child(name: str, depth: int, trials: int) -> None:
  import jax

  jax.block_until_ready(_maker(name, 2)())  # the backend starts here, not in the timed call
  if trials == 0:  # --profile: one first call under cProfile, its top entries
    return print(profile(_maker(name, depth)))
  times = []
  for _ in range(trials):  # each trial a fresh model and a fresh function: a first call each
    first = _maker(name, depth)
    t0 = time.perf_counter()
    jax.block_until_ready(first())
    times.append((time.perf_counter() - t0) * 1e3)
  print(f'{statistics.median(times):.3f}')


def profile(first, top: int = 15) -> str:
  """The top entries by own time of one first call under ``cProfile``, as a markdown table."""
  import cProfile
  import pstats

  import jax

  profiler = cProfile.Profile()
  profiler.enable()
  jax.block_until_ready(first())
  profiler.disable()
  stats = pstats.Stats(profiler)
  rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]
  lines = [f'One first call under cProfile: {stats.total_tt * 1e3:.0f} ms in all (the profiler slows Python '
           'down, so shares, not times, carry over). Top entries by own time:', '',
           '| function | calls | own ms | cumulative ms |', '|---|---:|---:|---:|']
  for (path, line, fn), (_, calls, own, cumulative, _) in rows:
    where = 'built-in' if path == '~' else re.split(r'site-packages/|lib/python3\.\d+/|(?=brainnx/_)', path)[-1]
    lines.append(f'| `{fn}` ({where}:{line}) | {calls:,} | {own * 1e3:.1f} | {cumulative * 1e3:.1f} |')
  brainnx_own = sum(v[2] for (path, _, _), v in stats.stats.items() if '/brainnx/' in path)
  lines += ['', f'Own time in brainnx\'s files: {brainnx_own * 1e3:.0f} ms of {stats.total_tt * 1e3:.0f} ms '
            f'({brainnx_own / stats.total_tt:.1%}).']
  return '\n'.join(lines)


def sample(name: str, depth: int, trials: int, timeout: float = 300) -> float:
  done = subprocess.run([sys.executable, __file__, '--child', name, str(depth), str(trials)], capture_output=True,
                        text=True, timeout=timeout, check=False)
  if done.returncode:
    raise SystemExit(f'{name} at {depth} layers failed:\n{done.stderr[-2000:]}')
  return float(done.stdout.split()[-1])


def measure(depths, rounds: int, trials: int) -> dict[int, dict[str, float]]:
  results = {}
  for depth in depths:
    samples = {name: [] for name in VARIANTS}
    for r in range(rounds):
      order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]  # a different one first
      for name in order:
        samples[name].append(sample(name, depth, trials))
      print(f'  {depth} layers, round {r + 1}: '
            + ', '.join(f'{n} {samples[n][-1]:.0f} ms' for n in VARIANTS), flush=True)
    results[depth] = {name: statistics.median(s) for name, s in samples.items()}
  return results


def render(results: dict[int, dict[str, float]], rounds: int, trials: int) -> str:
  import flax
  import jax

  lines = [
    '### First call (trace + compile) of a fresh function, one fresh process per sample',
    '',
    f'Milliseconds, median over {rounds} rounds of one process per variant (each the median of '
    f'{trials} first calls of fresh functions on fresh models); in brackets the ratio to raw jax.jit. '
    f'jax {jax.__version__}, flax {flax.__version__}, cpu.',
    '',
    '| layers | ' + ' | '.join(VARIANTS) + ' | brainnx (closure) / raw, GC paused | brainnx (closure) / split once |',
    '|---:|' + '---:|' * (len(VARIANTS) + 2),
  ]
  for depth, row in results.items():
    base = row['raw jax.jit']
    cells = ' | '.join(f'{t:.0f} ({t / base:.2f}x)' for t in row.values())
    paused = row['brainnx.jit (closure)'] / row['raw jax.jit, GC paused']
    own = row['brainnx.jit (closure)'] / row['jax.jit over nnx.State (split once)']
    lines.append(f'| {depth} | {cells} | {paused:.2f}x | {own:.2f}x |')
  return '\n'.join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--child', nargs=3, metavar=('VARIANT', 'DEPTH', 'TRIALS'), help=argparse.SUPPRESS)
  parser.add_argument('--depths', type=int, nargs='+', default=[100, 500])
  parser.add_argument('--rounds', type=int, default=7)
  parser.add_argument('--trials', type=int, default=3, help='first calls per process')
  parser.add_argument('--no-write', dest='write', action='store_false', help='print only')
  args = parser.parse_args(argv)
  if args.child:
    return child(args.child[0], int(args.child[1]), int(args.child[2]))
  sys.path.insert(0, str(HERE))
  from _results import publish

  body = render(measure(args.depths, args.rounds, args.trials), args.rounds, args.trials)
  depth = max(args.depths)
  done = subprocess.run([sys.executable, __file__, '--child', 'brainnx.jit (closure)', str(depth), '0'],
                        capture_output=True, text=True, timeout=300, check=True)
  body += f'\n\n### Where a first call of brainnx.jit (closure) spends its time, {depth} layers\n\n' + done.stdout.strip()
  publish(body, 'first_call.py', dry_run=not args.write)


if __name__ == '__main__':
  main()
