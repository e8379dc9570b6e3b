"""Stamped result tables: every table under benchmarks/results/ says which code, when, with which
versions and which statistic produced it (read by benchmarks/check_readme.py)."""

from __future__ import annotations

import datetime
import os
import re
import subprocess
from pathlib import Path

# BRAINNX_RESULTS_DIR sends every table elsewhere (the suite runs each script's quick mode into
# a temporary folder, so no committed table changes)
RESULTS = Path(os.environ.get('BRAINNX_RESULTS_DIR') or Path(__file__).parent / 'results')
# one statistic for every timing: the median over rounds in which the variants take turns;
# run_all.py repeats each script in fresh processes, and ranges quoted in the README are the
# min-max of those medians over runs
STATISTIC = 'median of interleaved rounds'


def commit() -> str:
  root = Path(__file__).resolve().parents[1]
  run = lambda *a: subprocess.run(['git', *a], cwd=root, capture_output=True, text=True).stdout.strip()  # noqa: E731
  head = run('rev-parse', '--short=12', 'HEAD') or 'unknown'
  # the code that measured: the tables a run rewrites do not make it uncommitted
  dirty = run('status', '--porcelain', '--untracked-files=no', '--', 'brainnx', 'benchmarks', ':!benchmarks/results')
  return head + ('+uncommitted' if dirty else '')


def stamp(script: str, statistic: str = STATISTIC) -> str:
  """The header every table starts with."""
  import flax
  import jax

  date = datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')
  return (f'<!-- written by benchmarks/{script}; do not edit -->\n'
          f'commit: {commit()} · date: {date} · jax {jax.__version__} · flax {flax.__version__} · '
          f'{jax.devices()[0].platform} · statistic: {statistic}\n')


def write(name: str, script: str, body: str, statistic: str = STATISTIC, out: Path | None = None) -> Path:
  path = (out or RESULTS) / name
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(stamp(script, statistic) + '\n' + body.rstrip() + '\n')
  return path



def publish(body: str, script: str, *, dry_run: bool = False, statistic: str = STATISTIC) -> None:
  """Print ``body`` and, unless ``dry_run`` (a script's ``--no-write``), write it stamped to
  ``results/<script's name>.md``."""
  print(body)
  if not dry_run:
    print('wrote', write(script.replace('.py', '.md'), script, body, statistic))

_UNITS = ('ms', 'µs', 'us', 'MB', 'MiB', 'GB', 's')
_NUMBER = r'^(-?\d+(?:\.\d+)?)(x|×|%)?$'  # a value, maybe a ratio or a share


def tables(text: str) -> list[tuple[str, list[list[str]]]]:
  """The markdown tables of ``text`` in order, each with the nearest heading above it."""
  found, heading, rows = [], '', []
  for line in text.splitlines() + ['']:
    if line.startswith('|'):
      rows.append([c.strip() for c in line.strip().strip('|').split('|')])
      continue
    if rows:
      found.append((heading, rows))
      rows = []
    if line.startswith('#'):
      heading = line.lstrip('#').strip()
  return found


def _with_unit(header: str) -> str:
  words = header.split()
  units = [w for w in words if w in _UNITS]
  if not units:
    return header
  rest = ' '.join(w.strip('()') for w in words if w != units[0])
  return f'{rest} ({units[0]})'


def ranges(runs: list[str]) -> str:
  """Per table the runs printed alike: each number as the min–max of its value over the runs.

  >>> one = '# t\\n| variant | ms (median) | ratio |\\n|---|---:|---:|\\n| a | 2.0 | 1.10x |'
  >>> print(ranges([one, one.replace('2.0', '3.5').replace('1.10x', '1.05x')]))
  ### min–max over 2 runs: t
  <BLANKLINE>
  | variant | median (ms) | ratio |
  |---|---|---|
  | a | 2.0–3.5 | 1.05–1.10x |
  """
  per_run = [tables(text) for text in runs]
  out = []
  for k, (heading, rows) in enumerate(per_run[0]):
    same = [tables[k][1] for tables in per_run if len(tables) > k and len(tables[k][1]) == len(rows)]
    lines = [f'### min–max over {len(same)} runs: {heading}', '',
             '| ' + ' | '.join(map(_with_unit, rows[0])) + ' |', '|' + '---|' * len(rows[0])]
    for i, row in enumerate(rows[2:], start=2):
      cells = []
      for j, cell in enumerate(row):
        texts = [t[i][j] for t in same if j < len(t[i])]
        found = [re.match(_NUMBER, v) for v in texts]
        if j == 0 or not all(found) or len({m.group(2) for m in found}) > 1:
          cells.append(cell if j == 0 or len(set(texts)) == 1 else '')  # text the runs agree on stays
          continue
        values, suffix = [m.group(1) for m in found], found[0].group(2) or ''
        lo, hi = min(values, key=float), max(values, key=float)
        cells.append(f'{lo}{suffix}' if lo == hi else f'{lo}–{hi}{suffix}')
      lines.append('| ' + ' | '.join(cells) + ' |')
    out.append('\n'.join(lines))
  return '\n\n'.join(out)
