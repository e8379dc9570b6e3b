"""Wall time and peak memory of the main job, and the property tests' CPU time, as the README states them.

Run: ``python benchmarks/demo_resources.py`` (writes ``results/demo_resources.md``).

Each row is one fresh process measured with GNU ``time`` (``/usr/bin/time -f '%e %U %S %M'``):
wall seconds, CPU seconds (user + system) and peak resident set size. The demo rows run
``python -m brainnx.demo --no-plot`` with the flags shown; the checkpointed rows save with orbax
every 100 steps into a fresh folder. The property-test row runs ``pytest tests/test_properties.py``
at the default hypothesis profile.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _results import publish  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TIME = '/usr/bin/time'


def measure(cmd: list[str], cwd: Path) -> tuple[float, float, float]:
  """``(wall s, CPU s, peak RSS MB)`` of one process."""
  done = subprocess.run([TIME, '-f', '%e %U %S %M', *cmd], cwd=cwd, capture_output=True, text=True)
  if done.returncode != 0:
    raise SystemExit(f'{" ".join(cmd)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}')
  wall, user, system, kb = done.stderr.strip().splitlines()[-1].split()
  return float(wall), float(user) + float(system), int(kb) / 1024


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--long-steps', type=int, default=20_000, help='steps of the long runs (default 20,000)')
  parser.add_argument('--no-write', action='store_true', help='print only')
  args = parser.parse_args(argv)
  demo = [sys.executable, '-m', 'brainnx.demo', '--no-plot']
  n = args.long_steps
  rows = []
  with tempfile.TemporaryDirectory() as scratch:
    work = Path(scratch)
    runs = [
      ('demo, default flags', demo),
      (f'demo, --steps {n}', demo + ['--steps', str(n)]),
      (f'demo, --steps {n} --checkpoint-every 100', demo + ['--steps', str(n), '--checkpoint-every', '100',
                                                             '--checkpoint-dir', str(work / 'a')]),
      (f'demo, --steps {2 * n} --checkpoint-every 100', demo + ['--steps', str(2 * n), '--checkpoint-every', '100',
                                                                 '--checkpoint-dir', str(work / 'b')]),
    ]
    for label, cmd in runs:
      rows.append((label, *measure(cmd, work)))
  rows.append(('pytest tests/test_properties.py', *measure([sys.executable, '-m', 'pytest', '-q', '-n', '0',
                                                             'tests/test_properties.py'], ROOT)))
  base = rows[1][3]
  lines = ['### Demo and property tests, one fresh process each', '',
           f'| run | wall (s) | CPU (s) | peak RSS (MB) | RSS over the {n}-step run without checkpoints (MB) |',
           '|---|---:|---:|---:|---:|']
  for label, wall, cpu, rss in rows:
    extra = f'{rss - base:.0f}' if 'checkpoint' in label else ''
    lines.append(f'| {label} | {wall:.1f} | {cpu:.0f} | {rss:.0f} | {extra} |')
  publish('\n'.join(lines), 'demo_resources.py', dry_run=args.no_write, statistic='one run per row')


if __name__ == '__main__':
  main()
