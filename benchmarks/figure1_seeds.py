"""Figure 1's four panels over many seeds: is the widening outside the data a property of the
defaults or of one lucky seed?

Run: ``python benchmarks/figure1_seeds.py [--seeds 20]`` (writes ``results/figure1_seeds.md``).

Each seed is the main job at its default flags (``brainnx.demo.train``: new data, new
initialisation), in this one process. For each panel the table gives, over the seeds, the
smallest and the median ratio of the predictive std outside the data to the std inside it, on
each side separately (``x < -4`` and ``x > 4``), how many seeds widen on both sides, and the
median share of ``[-6, 6]`` where ``y = x**3`` lies within ± 3 std. A second table sets each
panel's share, seed by seed, beside the same run with the hidden biases started in ``[-1, 1]``
(``bias_range=1``, the demo's start before it took twice the data's range).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from _results import publish  # noqa: E402

from brainnx import demo  # noqa: E402


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--seeds', type=int, default=20, help='seeds 0..N-1 (default 20)')
  parser.add_argument('--no-write', action='store_true', help='print only')
  args = parser.parse_args(argv)
  ratios, seconds, narrow = [], [], []  # ratios: seeds x panels x (left, right, covered)
  for seed in range(args.seeds):
    start = time.perf_counter()
    run = demo.train(seed=seed, progress=False)
    seconds.append(time.perf_counter() - start)
    ratios.append([[r['ratio_left'], r['ratio_right'], r['covered'], r['std_inside']] for r in run['reports']])
    narrow.append([r['covered'] for r in demo.train(seed=seed, progress=False, bias_range=1.0)['reports']])
    print(f'seed {seed}: ' + '  '.join(f'{p.label} {a:.1f}x {b:.1f}x' for p, (a, b, _, _) in
                                       zip(run['panels'], ratios[-1])), flush=True)
  ratios = np.array(ratios)
  n = args.seeds
  lines = [f'### The four panels at the default flags, seeds 0-{n - 1}', '',
           '| panel | left: min | left: median | right: min | right: median | seeds wider on both sides '
           '| x³ within ± 3 std (median share of [-6, 6]) |',
           '|---|---|---|---|---|---|---|']
  for k, panel in enumerate(run['panels']):
    left, right, covered, _ = ratios[:, k].T
    both = int(((left > 1) & (right > 1)).sum())
    lines.append(f'| {panel.title} | {left.min():.2f}x | {np.median(left):.2f}x | {right.min():.2f}x '
                 f'| {np.median(right):.2f}x | {both} of {n} | {np.median(covered):.0%} |')
  lines += ['', f'Ratios: the mean predictive std on one side outside the data over the mean std on |x| <= 4. '
            f'One training of all four panels took {np.median(seconds):.1f} s (median over the seeds, '
            f'compile included, one process).']
  narrow = np.array(narrow)
  lines += ['', f'### Coverage of x³ on [-6, 6], seed by seed: biases started in [-{demo.BIAS_RANGE:g}, '
            f'{demo.BIAS_RANGE:g}] (the default) against [-1, 1]', '',
            '| panel | default: min | default: median | [-1, 1]: min | [-1, 1]: median '
            '| seeds where the default covers more | std inside the data (median) |',
            '|---|---|---|---|---|---|---|']
  for k, panel in enumerate(run['panels']):
    wide, small = ratios[:, k, 2], narrow[:, k]
    lines.append(f'| {panel.title} | {wide.min():.0%} | {np.median(wide):.0%} | {small.min():.0%} '
                 f'| {np.median(small):.0%} | {int((wide > small).sum())} of {n} | {np.median(ratios[:, k, 3]):.2f} |')
  publish('\n'.join(lines), 'figure1_seeds.py', dry_run=args.no_write, statistic='min and median over seeds')


if __name__ == '__main__':
  main()
