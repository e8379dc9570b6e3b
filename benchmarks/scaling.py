"""How the per-call overhead, the ensemble step and the first call scale: brainnx vs raw jax, nnx, equinox, brainstate.

Run: ``python benchmarks/scaling.py`` (about 6 minutes on a 2-core CPU; ``--quick``
for a smoke run of under a minute). With the bench extra
(``pip install -e ".[bench]"``) the equinox and brainstate rows are there too;
without it they are skipped, with a note.

Writes, under ``benchmarks/results/`` (``--out``):
  scaling_overhead.md    warm per-call time vs depth (2 ... 500 layers)
  scaling_ensemble.md    warm adam ensemble step vs members (8, 64, 512)
  scaling_first_call.md  first call (trace + compile of a fresh function) vs depth
  scaling_import.md      ``import brainnx`` vs ``import flax.nnx`` in a fresh interpreter
  scaling.png            the curves, with the ratios to raw ``jax.jit`` in the lower panels

The models and variants are those of ``overhead.py`` (an MLP of Linear(W, W)
layers, ReLU between; here W=8, batch 4, so that dispatch, not arithmetic,
sets the time) and ``ensemble_train.py`` (the demo's MLP at H=16, 32 points,
optax.adam, one optimizer per member). Every row computes the same thing from
the same arrays. Warm times are the median over interleaved rounds (each
round ~10 ms of back-to-back calls of one variant at one size; all variants
at all sizes take their turn in every round, so each median is taken over
the whole part's span); first calls the median over fresh functions (trial
by trial, every size and variant in turn); import times the median over
fresh interpreters. The median is the statistic of every other table here.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import statistics
import sys
import tempfile
import time
from pathlib import Path

import flax
import jax
import jaxlib
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import _peers  # noqa: E402
import ensemble_train  # noqa: E402
import overhead  # noqa: E402
from _timing import best_of, first_calls  # noqa: E402

WIDTH, BATCH = 8, 4
DEPTHS = [2, 10, 50, 100, 200, 500]
MEMBERS = [8, 64, 512]
QUICK_DEPTHS, QUICK_MEMBERS = [2, 10, 50], [8, 64]
from _results import RESULTS  # noqa: E402

RAW = 'raw jax.jit'
FORWARD = [RAW, 'brainnx.jit (closure)', 'brainnx.jit (arg)', 'nnx.jit', 'eqx.filter_jit', 'brainstate jit']
ENSEMBLE = [ensemble_train.RAW, ensemble_train.BNX, ensemble_train.NNX, ensemble_train.EQX, ensemble_train.BST]
STYLE = {  # one colour per framework, in both the forward and the ensemble panels
  RAW: ('black', 'o'), ensemble_train.RAW: ('black', 'o'),
  'brainnx.jit (closure)': ('tab:blue', 's'), ensemble_train.BNX: ('tab:blue', 's'),
  'brainnx.jit (arg)': ('tab:cyan', 'D'),
  'nnx.jit': ('tab:orange', 'v'), ensemble_train.NNX: ('tab:orange', 'v'),
  'eqx.filter_jit': ('tab:green', '^'), ensemble_train.EQX: ('tab:green', '^'),
  'brainstate jit': ('tab:red', 'x'), ensemble_train.BST: ('tab:red', 'x'),
}


def header() -> str:
  return (
    f'jax {jax.__version__}, jaxlib {jaxlib.__version__}, flax {flax.__version__}, {_peers.versions()}; '
    f'{jax.devices()[0].platform}, {os.cpu_count()} cores, Python {platform.python_version()}; '
    f'{datetime.date.today().isoformat()}'
  )


def cell(value: float, base: float, fmt: str) -> str:
  return f'{value:{fmt}} ({value / base:.2f}x)'


def markdown(title: str, note: str, key: str, rows: dict, unit: str, fmt: str, extra: dict | None = None) -> str:
  """A table: one row per ``rows`` key, one column per variant, each cell ``value (ratio to raw)``."""
  names = list(next(iter(rows.values())))
  lines = [f'## {title}', '', note, '', f'| {key} | ' + ' | '.join(f'{n} ({unit})' for n in names) + ' |']
  lines.append('|---:|' + '---:|' * len(names))
  for label, result in rows.items():
    base = result[names[0]]
    lines.append(f'| {label} | ' + ' | '.join(cell(result[n], base, fmt) for n in names) + ' |')
  for label, values in (extra or {}).items():
    lines.append(f'| {label} | ' + ' | '.join(values.get(n, '') for n in names) + ' |')
  return '\n'.join(lines)


def growth(rows: dict[int, dict[str, float]], name: str, base: str) -> float:
  """Least-squares slope (µs per layer) of ``name``'s time minus ``base``'s over the depths ≥ 10."""
  depths = [d for d in rows if d >= 10]
  if len(depths) < 2:
    depths = list(rows)
  extra = [rows[d][name] - rows[d][base] for d in depths]
  return float(np.polyfit(depths, extra, 1)[0])


# -- the four parts -------------------------------------------------------------------


def _medians(timed: dict) -> dict:
  """``best_of``'s results as their medians (the statistic of every table)."""
  return {key: t.median for key, t in timed.items()}


def _regroup(flat: dict, keys) -> dict:
  """``{(key, name): value}`` -> ``{key: {name: value}}``, keys and names in their order."""
  rows = {key: {} for key in keys}
  for (key, name), value in flat.items():
    rows[key][name] = value
  return rows


def warm_overhead(depths, rounds, round_ms):
  """Every (depth, variant) pair takes its turn in every round: each depth's median is taken over
  the whole part's span, not over the few seconds a depth alone would take."""
  flat = {}
  for depth in depths:
    variants = overhead.variants(depth, WIDTH, BATCH, cached_partial=False)
    flat.update({(depth, n): variants[n] for n in FORWARD if n in variants})
  rows = _regroup(_medians(best_of(flat, rounds=rounds, round_ms=round_ms)), depths)
  for depth, row in rows.items():
    print(f'  warm, {depth} layers: ' + ', '.join(f'{n} {t:.1f} us' for n, t in row.items()), flush=True)
  return rows


def ensemble(members_list, rounds, round_ms):
  hidden, points = ensemble_train.SIZES['small']
  flat = {}
  for members in members_list:
    variants = ensemble_train.variants(hidden, points, members)
    flat.update({(members, n): variants[n] for n in ENSEMBLE if n in variants})
  rows = _regroup(_medians(best_of(flat, rounds=rounds, round_ms=round_ms)), members_list)
  for members, row in rows.items():
    print(f'  ensemble, {members} members: ' + ', '.join(f'{n} {t:.1f} us' for n, t in row.items()), flush=True)
  return rows


def first_call(depths, trials):
  """Trial by trial, every depth and variant in turn (fresh model, fresh function each time)."""
  flat = {}
  for depth in depths:
    makers = overhead.first_call_makers(depth, WIDTH, BATCH)
    flat.update({(depth, n): makers[n] for n in FORWARD if n in makers})
  rows = _regroup(first_calls(flat, trials=trials, reduce=statistics.median), depths)
  for depth, row in rows.items():
    print(f'  first call, {depth} layers: ' + ', '.join(f'{n} {t:.0f} ms' for n, t in row.items()), flush=True)
  return rows


IMPORTS = {'import flax.nnx': 'flax.nnx', 'import brainnx': 'brainnx', 'import jax': 'jax'}


def import_times(repeats):
  """Per module: (median import time inside the fresh interpreter, median wall time of the whole process), ms."""
  code = 'import time; t = time.perf_counter(); import {}; print(time.perf_counter() - t)'
  inner: dict[str, list[float]] = {n: [] for n in IMPORTS}
  wall: dict[str, list[float]] = {n: [] for n in IMPORTS}
  for _ in range(repeats):
    for name, module in IMPORTS.items():  # interleaved
      t0 = time.perf_counter()
      out = subprocess.run([sys.executable, '-c', code.format(module)], capture_output=True, text=True, check=True)
      wall[name].append((time.perf_counter() - t0) * 1e3)
      inner[name].append(float(out.stdout.strip()) * 1e3)
  return {n: (statistics.median(inner[n]), statistics.median(wall[n])) for n in IMPORTS}


# -- output ---------------------------------------------------------------------------


def plot(path: Path, warm, ens, first) -> str:
  try:
    import matplotlib

    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter
  except ImportError as err:
    return f'note: no plot written ({err}); install matplotlib (it is in the bench extra)'
  fig, axes = plt.subplots(2, 3, figsize=(15, 8.5), sharex='col', gridspec_kw={'height_ratios': [3, 2]})
  panels = [
    (warm, 'layers (Linear 8x8 + ReLU)', 'warm call (µs)', 'Warm call vs depth', 1.1),
    (ens, 'ensemble members', 'adam step (µs)', 'Ensemble adam step vs members (H=16)', 1.1),
    (first, 'layers (Linear 8x8 + ReLU)', 'first call (ms)', 'First call (trace + compile) vs depth', 1.15),
  ]
  for col, (rows, xlabel, ylabel, title, target) in enumerate(panels):
    xs = list(rows)
    names = list(rows[xs[0]])
    top, bottom = axes[0][col], axes[1][col]
    for name in names:
      colour, marker = STYLE.get(name, (None, '.'))
      ys = [rows[x][name] for x in xs]
      top.plot(xs, ys, marker=marker, color=colour, label=name)
      bottom.plot(xs, [y / rows[x][names[0]] for x, y in zip(xs, ys)], marker=marker, color=colour, label=name)
    top.set(xscale='log', yscale='log', ylabel=ylabel, title=title)
    bottom.set(xscale='log', yscale='log', xlabel=xlabel, ylabel=f'ratio to {names[0]}')
    bottom.axhline(1.0, color='black', lw=0.8)
    bottom.axhline(target, color='grey', lw=0.8, ls=':')
    bottom.text(xs[0], target, f' {target}x', va='bottom', fontsize=8, color='grey')
    bottom.set_xticks(xs, [str(x) for x in xs])
    bottom.xaxis.set_minor_formatter(NullFormatter())
    top.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f'{v:g}'))
    bottom.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f'{v:g}x'))
    top.yaxis.set_minor_formatter(NullFormatter())
    low, high = bottom.get_ylim()
    if high / low < 20:  # a narrow band of ratios: label the minor ticks too
      bottom.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f'{v:.2g}x'))
    else:
      bottom.yaxis.set_minor_formatter(NullFormatter())
    for ax in (top, bottom):
      ax.grid(True, which='both', alpha=0.25)
    top.legend(fontsize=8)
  fig.suptitle(f'brainnx scaling (median over interleaved repeats) — {header()}', fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return f'wrote {path}'


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--quick', action='store_true', help='a smoke run: fewer depths, sizes and repeats')
  parser.add_argument('--out', type=Path, help='folder for the tables and the plot (default: benchmarks/results; '
                      'with --quick a fresh temporary folder)')
  parser.add_argument('--parts', nargs='+', choices=['overhead', 'ensemble', 'first_call', 'import'],
                      default=['overhead', 'ensemble', 'first_call', 'import'])
  args = parser.parse_args(argv)
  out = args.out or (Path(tempfile.mkdtemp(prefix='brainnx-scaling-')) if args.quick else RESULTS)
  out.mkdir(parents=True, exist_ok=True)
  depths, members = (QUICK_DEPTHS, QUICK_MEMBERS) if args.quick else (DEPTHS, MEMBERS)
  rounds, round_ms, trials, repeats = (3, 5.0, 1, 2) if args.quick else (100, 10.0, 5, 7)
  print(header())
  if _peers.notes():
    print(_peers.notes())
  source = f'Regenerate: `python benchmarks/scaling.py{" --quick" if args.quick else ""}`. {header()}.'
  written = []

  warm = ens = first = None
  if 'overhead' in args.parts:
    warm = warm_overhead(depths, rounds, round_ms)
    per_layer = {n: f'{growth(warm, n, RAW):+.2f} µs/layer' for n in warm[depths[0]] if n != RAW}
    text = markdown(
      'Warm call vs depth',
      f'MLP of Linear({WIDTH}, {WIDTH}) layers, ReLU between, batch {BATCH}; two Variables per layer. Per-call '
      f'time, µs: median over {rounds} interleaved rounds of ~{round_ms:g} ms each; in brackets the ratio to raw '
      '`jax.jit` on pure pytrees. Last row: growth of (variant − raw) per extra layer, a least-squares fit over the depths '
      f'≥ 10. {source}',
      'layers', warm, 'µs', '.1f', {'extra per layer (fit)': per_layer},
    )
    written.append(('scaling_overhead.md', text))
  if 'ensemble' in args.parts:
    ens = ensemble(members, rounds, round_ms)
    hidden, points = ensemble_train.SIZES['small']
    text = markdown(
      'Ensemble adam step vs members',
      f'The demo MLP 1 -> {hidden} -> {hidden} -> 1 (tanh), {points} training points shared, optax.adam(1e-3), '
      f'one optimizer per member, vmapped over the members and jitted. Per-step time, µs: median over {rounds} '
      f'interleaved rounds of ~{round_ms:g} ms each; in brackets the ratio to raw `jax.jit(jax.vmap)`. {source}',
      'members', ens, 'µs', '.1f',
    )
    written.append(('scaling_ensemble.md', text))
  if 'first_call' in args.parts:
    first = first_call(depths, trials)
    text = markdown(
      'First call vs depth',
      f'The warm-call model; a fresh model and a fresh function per trial, so each trial traces and compiles anew. '
      f'Milliseconds: median over {trials} trials; in brackets the ratio to raw `jax.jit`. {source}',
      'layers', first, 'ms', '.0f',
    )
    written.append(('scaling_first_call.md', text))
  if 'import' in args.parts:
    times = import_times(repeats)
    base_inner, base_wall = times['import flax.nnx']
    lines = [
      '## Import time', '',
      (
        f'`python -c "import X"` in a fresh interpreter, median over {repeats} interleaved runs: the import '
        f'alone (timed inside the process) and the whole process (interpreter start included). {source}'
      ),
      '',
      '| statement | import (ms) | vs `import flax.nnx` | whole process (ms) | vs `import flax.nnx` |',
      '|---|---:|---:|---:|---:|',
    ]
    for name, (inner, wall) in times.items():
      lines.append(f'| `{name}` | {inner:.0f} | {inner / base_inner:.2f}x | {wall:.0f} | {wall / base_wall:.2f}x |')
    print('  ' + ', '.join(f'{n} {t[0]:.0f} ms' for n, t in times.items()), flush=True)
    written.append(('scaling_import.md', '\n'.join(lines)))

  print()
  for name, text in written:
    (out / name).write_text(text + '\n')
    print(text + '\n')
    print(f'wrote {out / name}\n')
  if warm and ens and first:
    print(plot(out / 'scaling.png', warm, ens, first))


if __name__ == '__main__':
  main()
