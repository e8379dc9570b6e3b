"""The differential program generator's long profile: draws many programs (tests/differential.py),
runs each under brainnx and its oracle, and writes the count per transform, the failures and
the time to benchmarks/results/differential_long.md.

    python benchmarks/differential_long.py                      # 50,000 programs on 2 processes
    python benchmarks/differential_long.py --programs 2000 --processes 1 --no-write
    python benchmarks/differential_long.py --programs 20000 --processes 12 --seed 100 --json part1.json
    python benchmarks/differential_long.py --merge part1.json part2.json   # one table from runs elsewhere

Each process draws its share with its own seed (hypothesis, generation only: a failure is
reported with the program as drawn, not shrunk; rerun it through tests/differential.check).
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import os
import platform
import sys
import time
import traceback
import warnings
from pathlib import Path

# pmap programs run on CPU devices: at least 2 (set before any process imports jax)
if '--xla_force_host_platform_device_count' not in os.environ.get('XLA_FLAGS', ''):
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=4').strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')  # the oracles are exact on CPU
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / 'tests'))
from _results import commit, publish

SCRIPT = 'differential_long.py'


def _draw(args) -> tuple[collections.Counter, list]:
  """One process's share: ``n`` programs drawn with ``seed``, in rounds of 100 (round ``k`` seeded
  ``seed * 100_000 + k``) that stop at the first round ending after ``deadline`` (a
  ``time.time()``; ``None``: none)."""
  seed, n, deadline = args
  warnings.simplefilter('ignore')
  from hypothesis import HealthCheck, Phase, given, settings
  from hypothesis import seed as with_seed

  from differential import check, programs

  check = _fresh_caches(check)

  counts, failures = collections.Counter(), []

  def one(program):
    counts[program.transform] += 1
    try:
      check(program)
    except Exception as e:  # noqa: BLE001 - every difference is reported
      failures.append((program.transform, f'{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ""}',
                       str(program), traceback.format_exc(limit=-3)))

  done, k = 0, 0
  while done < n and (deadline is None or time.time() < deadline):
    size = min(100, n - done)
    run = with_seed(seed * 100_000 + k)(settings(
      max_examples=size, deadline=None, suppress_health_check=list(HealthCheck), phases=[Phase.generate],
      database=None)(given(programs())(one)))
    run()
    done, k = done + size, k + 1
  return counts, failures


def _fresh_caches(check):
  """``check`` that empties JAX's compilation caches every 200 programs (each program compiles
  its own functions; kept, they grew a process to gigabytes and slowed it)."""
  import jax

  seen = [0]

  def checking(program):
    seen[0] += 1
    if seen[0] % 200 == 0:
      jax.clear_caches()
    return check(program)

  return checking


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--programs', type=int, default=50_000)
  parser.add_argument('--processes', type=int, default=2)
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--no-write', action='store_true', help='print the table only')
  parser.add_argument('--json', help='also write the counts and failures of this run here')
  parser.add_argument('--minutes', type=float, help='stop drawing after this long (each process ends its round)')
  parser.add_argument('--commit', help="the code's commit, where git cannot tell it (a copy of the tree)")
  parser.add_argument('--merge', nargs='+', help='write one table from the --json files of several runs')
  args = parser.parse_args()
  if args.merge:
    runs = [json.loads(Path(p).read_text()) for p in args.merge]
  else:
    runs = [_run(args)]
    if args.json:
      Path(args.json).write_text(json.dumps(runs[0]))
  failures = _publish(runs, args.no_write)
  if failures:
    print(failures[0][3])
    sys.exit(1)


def _run(args) -> dict:
  share = -(-args.programs // args.processes)
  start = time.perf_counter()
  with multiprocessing.get_context('spawn').Pool(args.processes) as pool:
    deadline = None if args.minutes is None else time.time() + 60 * args.minutes
    results = pool.map(_draw, [(args.seed + k, share, deadline) for k in range(args.processes)])
  counts, failures = collections.Counter(), []
  for c, f in results:
    counts.update(c)
    failures.extend(f)
  return {'counts': dict(counts), 'failures': failures, 'minutes': (time.perf_counter() - start) / 60,
          'processes': args.processes, 'seeds': [args.seed, args.seed + args.processes - 1],
          'machine': f'{platform.machine()}, {os.cpu_count()} cores', 'commit': args.commit or commit()}


def _publish(runs: list, dry_run: bool) -> list:
  counts, failures = collections.Counter(), []
  for run in runs:
    counts.update(run['counts'])
    failures.extend(run['failures'])
  by_transform = collections.Counter(t for t, *_ in failures)
  rows = [f'| {t} | {counts[t]} | {by_transform[t]} |' for t in sorted(counts)]
  described = '; '.join(
    f"{sum(r['counts'].values())} by {r['processes']} processes (seeds {r['seeds'][0]}..{r['seeds'][1]}) in "
    f"{r['minutes']:.1f} minutes on {r['machine']} at commit {r.get('commit', 'unknown')}" for r in runs)
  body = (
    '### Generated programs against their oracles\n\n'
    f'{sum(counts.values())} programs over {len(counts)} transforms and nests, on CPU: {described}. '
    'Each program runs 1 to 4 calls with edits between them and is compared after every call '
    '(outputs, every Variable, array types, returned objects).\n\n'
    '| transform | programs | failures |\n|---|---:|---:|\n' + '\n'.join(rows) +
    f'\n| all | {sum(counts.values())} | {len(failures)} |\n'
  )
  if failures:
    body += '\n### Failures (first 10)\n\n' + '\n\n'.join(
      f'{t}: {msg}\n\n```python\n{src}```' for t, msg, src, _ in failures[:10])
  publish(body, SCRIPT, dry_run=dry_run, statistic='count')
  return failures


if __name__ == '__main__':
  main()
