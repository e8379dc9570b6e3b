"""What importing brainnx costs programs that never call it: flax-only workloads, timed in fresh
processes with and without ``import brainnx``.

Run: ``python benchmarks/import_tax.py [--rounds 9]`` (writes ``results/import_tax.md``).

Importing brainnx wraps some of flax's methods (see the reference's "What importing brainnx
changes in flax"): every Variable value write, every edit of a Pytree's attributes or a
Variable's metadata, and Variable creation. Those wrappers run in programs that use only flax.
Workloads, each plain flax code:

  construct      build a 20-layer ``nnx.Linear`` MLP (Module and Variable construction)
  split/merge    ``nnx.split`` then ``nnx.merge`` of that MLP
  1,000 writes   ``v[...] = x`` on one ``nnx.Param``, 1,000 times
  nnx.update     ``nnx.update(model, state)`` of the MLP
  nnx.jit step   one warm ``nnx.jit`` train step of the MLP with ``nnx.Optimizer`` (adam)
  nnx.vmap step  one warm ``nnx.jit(nnx.vmap(...))`` step of an ensemble of 4 MLPs of 4 layers

Each sample is one fresh process that imports flax (and brainnx, in the "with" column), builds
the workload, warms it, then times it: the median over 15 repetitions of the per-repetition
time. Rounds alternate which column goes first; the table holds the median over rounds, and
the ratio of the medians. The last column counts the Python function calls (``sys.setprofile``
'call' events) one repetition makes, with and without: deterministic, so it shows what the
wrappers add where the timing is within the machine's noise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
WORKLOADS = ('construct', 'split/merge', '1,000 writes', 'nnx.update', 'nnx.jit step', 'nnx.vmap step')


_CLASSES: dict = {}


def _mlp(layers: int, rngs=None):
  """An MLP of ``layers`` ``nnx.Linear(32, 32)`` (its class made once per process)."""
  from flax import nnx

  if 'MLP' not in _CLASSES:
    class MLP(nnx.Module):
      def __init__(self, layers, rngs):
        self.layers = nnx.List([nnx.Linear(32, 32, rngs=rngs) for _ in range(layers)])

      def __call__(self, x):
        for layer in self.layers:
          x = nnx.relu(layer(x))
        return x

    _CLASSES['MLP'] = MLP
  return _CLASSES['MLP'](layers, rngs if rngs is not None else nnx.Rngs(0))


def workload(name: str):
  """A function of no arguments running one repetition of ``name``."""
  import jax
  import jax.numpy as jnp
  import optax
  from flax import nnx

  x = jnp.ones((16, 32))
  if name == 'construct':
    return lambda: _mlp(20)
  if name == 'split/merge':
    model = _mlp(20)
    return lambda: nnx.merge(*nnx.split(model))
  if name == '1,000 writes':
    param, value = nnx.Param(jnp.zeros(3)), jnp.ones(3)

    def writes():
      for _ in range(1000):
        param[...] = value

    return writes
  if name == 'nnx.update':
    model = _mlp(20)
    state = nnx.state(model)
    return lambda: nnx.update(model, state)
  if name == 'nnx.jit step':
    model = _mlp(20)
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, x):
      loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
      optimizer.update(model, grads)
      return loss

    return lambda: jax.block_until_ready(train_step(model, optimizer, x))
  if name == 'nnx.vmap step':
    @nnx.split_rngs(splits=4)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return _mlp(4, rngs)

    ensemble = make(nnx.Rngs(0))

    @nnx.jit
    def step(ensemble, x):
      @nnx.vmap(in_axes=(0, None), out_axes=0)
      def forward(member, x):
        return member(x)

      return forward(ensemble, x).mean()

    return lambda: jax.block_until_ready(step(ensemble, x))
  raise SystemExit(f'unknown workload {name!r}')


def _timed(run, reps: int) -> float:
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    run()
    times.append((time.perf_counter() - t0) * 1e6)
  return statistics.median(times)


def _python_calls(run) -> int:
  calls = [0]

  def count(frame, event, arg):
    if event == 'call':
      calls[0] += 1

  sys.setprofile(count)
  run()
  sys.setprofile(None)
  return calls[0]


def child(name: str, mode: str, reps: int) -> None:
  """``mode``: 'alone' (flax only), 'imported' (``import brainnx`` first), or 'swapped'
  (imported, then rounds that alternate brainnx's hooks removed and put back)."""
  if mode != 'alone':
    import brainnx  # noqa: F401
  run = workload(name)
  for _ in range(3):
    run()
  if mode != 'swapped':
    print(json.dumps({'us': _timed(run, reps), 'calls': _python_calls(run)}))
    return
  from brainnx._compat import flax_hooks

  samples = {False: [], True: []}
  try:
    for r in range(reps):
      for on in ((False, True) if r % 2 == 0 else (True, False)):
        flax_hooks.use_hooks(on)
        samples[on].append(_timed(run, 3))
  finally:
    flax_hooks.use_hooks(True)
  print(json.dumps({'off': statistics.median(samples[False]), 'on': statistics.median(samples[True])}))


def sample(name: str, mode: str, reps: int) -> dict:
  done = subprocess.run([sys.executable, __file__, '--child', name, mode, str(reps)],
                        capture_output=True, text=True, timeout=300, check=False,
                        env={**os.environ, 'PYTHONHASHSEED': '0'})
  if done.returncode:
    raise SystemExit(f'{name} ({mode}) failed:\n{done.stderr[-2000:]}')
  return json.loads(done.stdout.strip().splitlines()[-1])


def measure(names, rounds: int, reps: int) -> dict:
  results = {}
  for name in names:
    times = {'alone': [], 'imported': []}
    swapped = {'off': [], 'on': []}
    calls = {}
    for r in range(rounds):
      for mode in (('alone', 'imported') if r % 2 == 0 else ('imported', 'alone')):
        got = sample(name, mode, reps)
        times[mode].append(got['us'])
        calls[mode] = got['calls']
      got = sample(name, 'swapped', reps)
      for key in swapped:
        swapped[key].append(got[key])
    row = {key: statistics.median(v) for key, v in {**times, **swapped}.items()}
    row['calls'] = calls
    results[name] = row
    print(f"  {name}: fresh processes {row['alone']:.1f} / {row['imported']:.1f} µs "
          f"({row['imported'] / row['alone']:.3f}x); one process, hooks off / on {row['off']:.1f} / "
          f"{row['on']:.1f} µs ({row['on'] / row['off']:.3f}x); Python calls {calls['alone']} / {calls['imported']}",
          flush=True)
  return results


def render(results: dict, rounds: int, reps: int) -> str:
  lines = [
    '### flax-only workloads, with and without `import brainnx`',
    '',
    f'Per repetition, µs, median over {rounds} rounds. Fresh processes: one process per column and '
    f'round, each the median of {reps} repetitions after 3 warm ones. One process: brainnx imported, '
    f'its hooks removed and put back in alternation, {reps} turns of 3 repetitions each. Python '
    'calls: one repetition, counted.',
    '',
    '| workload | flax alone | brainnx imported | ratio | one process: hooks off | hooks on | ratio '
    '| Python calls (alone / imported) |',
    '|---|---:|---:|---:|---:|---:|---:|---:|',
  ]
  for name, row in results.items():
    calls = row['calls']
    lines.append(f"| {name} | {row['alone']:.1f} µs | {row['imported']:.1f} µs | {row['imported'] / row['alone']:.2f}x "
                 f"| {row['off']:.1f} µs | {row['on']:.1f} µs | {row['on'] / row['off']:.2f}x "
                 f"| {calls['alone']:,} / {calls['imported']:,} |")
  return '\n'.join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--child', nargs=3, metavar=('WORKLOAD', 'MODE', 'REPS'), help=argparse.SUPPRESS)
  parser.add_argument('--rounds', type=int, default=9)
  parser.add_argument('--reps', type=int, default=21, help='timed repetitions per process')
  parser.add_argument('--only', nargs='+', choices=WORKLOADS, default=list(WORKLOADS))
  parser.add_argument('--no-write', dest='write', action='store_false', help='print only')
  args = parser.parse_args(argv)
  if args.child:
    return child(args.child[0], args.child[1], int(args.child[2]))
  sys.path.insert(0, str(HERE))
  from _results import publish

  body = render(measure(args.only, args.rounds, args.reps), args.rounds, args.reps)
  publish(body, 'import_tax.py', dry_run=not args.write)


if __name__ == '__main__':
  main()
