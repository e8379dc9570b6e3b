"""The differential program generator's long profile: draws many programs (tests/differential.py),
runs each under brainnx and its oracle, and writes the count per transform, the failures and
the time to benchmarks/results/differential_long.md.

    python benchmarks/differential_long.py                      # 20,000 programs on 2 processes
    python benchmarks/differential_long.py --programs 2000 --processes 1 --no-write

Each process draws its share with its own seed (hypothesis, generation only: a failure is
reported with the program as drawn, not shrunk; rerun it through tests/differential.check).
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing
import sys
import time
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / 'tests'))
from _results import publish

SCRIPT = 'differential_long.py'


def _draw(args) -> tuple[collections.Counter, list]:
  seed, n = args
  warnings.simplefilter('ignore')
  from hypothesis import HealthCheck, Phase, given, settings
  from hypothesis import seed as with_seed

  from differential import check, programs

  check = _fresh_caches(check)

  counts, failures = collections.Counter(), []

  @with_seed(seed)
  @settings(max_examples=n, deadline=None, suppress_health_check=list(HealthCheck), phases=[Phase.generate],
            database=None)
  @given(programs())
  def run(program):
    counts[program.transform] += 1
    try:
      check(program)
    except Exception as e:  # noqa: BLE001 - every difference is reported
      failures.append((program.transform, f'{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ""}',
                       str(program), traceback.format_exc(limit=-3)))

  run()
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
  parser.add_argument('--programs', type=int, default=20_000)
  parser.add_argument('--processes', type=int, default=2)
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--no-write', action='store_true', help='print the table only')
  args = parser.parse_args()
  share = -(-args.programs // args.processes)
  start = time.perf_counter()
  with multiprocessing.get_context('spawn').Pool(args.processes) as pool:
    results = pool.map(_draw, [(args.seed + k, share) for k in range(args.processes)])
  minutes = (time.perf_counter() - start) / 60
  counts, failures = collections.Counter(), []
  for c, f in results:
    counts.update(c)
    failures.extend(f)
  by_transform = collections.Counter(t for t, *_ in failures)
  rows = [f'| {t} | {counts[t]} | {by_transform[t]} |' for t in sorted(counts)]
  body = (
    '### Generated programs against their oracles\n\n'
    f'{sum(counts.values())} programs drawn by {args.processes} processes (seeds {args.seed}'
    f'..{args.seed + args.processes - 1}), {minutes:.1f} minutes in all on this machine; each program '
    'runs 1 to 4 calls with edits between them and is compared after every call (outputs, every '
    'Variable, array types, returned objects).\n\n'
    '| transform | programs | failures |\n|---|---:|---:|\n' + '\n'.join(rows) +
    f'\n| all | {sum(counts.values())} | {len(failures)} |\n'
  )
  if failures:
    body += '\n### Failures (first 10)\n\n' + '\n\n'.join(
      f'{t}: {msg}\n\n```python\n{src}```' for t, msg, src, _ in failures[:10])
  publish(body, SCRIPT, dry_run=args.no_write, statistic='count')
  if failures:
    print(failures[0][3])
    sys.exit(1)


if __name__ == '__main__':
  main()
