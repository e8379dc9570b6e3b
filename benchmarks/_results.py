"""Stamped result tables: every table under benchmarks/results/ says which code, when, with which
versions and which statistic produced it (read by benchmarks/check_readme.py)."""

from __future__ import annotations

import datetime
import subprocess
from pathlib import Path

RESULTS = Path(__file__).parent / 'results'
# one statistic for every timing: the median over rounds in which the variants take turns;
# run_all.py repeats each script in fresh processes, and ranges quoted in the README are the
# min-max of those medians over runs
STATISTIC = 'median of interleaved rounds'


def commit() -> str:
  root = Path(__file__).resolve().parents[1]
  run = lambda *a: subprocess.run(['git', *a], cwd=root, capture_output=True, text=True).stdout.strip()  # noqa: E731
  head = run('rev-parse', '--short=12', 'HEAD') or 'unknown'
  dirty = run('status', '--porcelain', '--untracked-files=no', '--', 'brainnx', 'benchmarks')
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
