"""Reverse-mode memory and time of a long scan: scan vs remat body vs checkpointed_scan.

Run: ``python benchmarks/checkpoint_memory.py`` (prints a markdown table).

A tanh RNN cell, width 256, batch 32, length 2000; gradient with respect
to the recurrent weights (a ``nnx.Param`` the body reads). Each variant runs
in its own process: compile ahead of time, reset the peak-RSS mark
(``/proc/self/clear_refs``), run the gradient, read the new peak (VmHWM).
"Peak RSS" is that peak minus the RSS just before the first run; "XLA temp"
is the compiled program's temporary buffer size. Time is the median of 5 runs in a process;
``--repeats`` processes per variant, in a rotated order, and the table gives the median over them.
Every variant's gradient is checked equal to ``jax.lax.scan``'s; ratios are to ``jax.lax.scan``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

WIDTH, BATCH = 256, 32
VARIANTS = ['jax.lax.scan', 'brainnx.scan', 'brainnx.scan + jax.checkpoint body', 'brainnx.checkpointed_scan']


def _status_kb(field: str) -> int:
  with open('/proc/self/status') as f:
    for line in f:
      if line.startswith(field):
        return int(line.split()[1])
  raise RuntimeError(field)


def worker(variant: str, base: int, length: int) -> dict:
  import jax
  import jax.numpy as jnp
  from flax import nnx

  import brainnx as bnx

  w = nnx.Param(jax.random.normal(jax.random.key(0), (WIDTH, WIDTH)) / WIDTH**0.5)
  xs = jax.random.normal(jax.random.key(1), (length, BATCH, WIDTH))
  h0 = jnp.zeros((BATCH, WIDTH))

  def cell(h, x):
    return jnp.tanh(h @ w[...] + x), None

  def pure_cell(wv):
    return lambda h, x: (jnp.tanh(h @ wv + x), None)

  if variant == 'jax.lax.scan':
    def loss(wv, xs):
      return (jax.lax.scan(pure_cell(wv), h0, xs)[0] ** 2).sum()

    step = jax.jit(jax.grad(loss))
    args = (w[...], xs)
  else:
    loop = {
      'brainnx.scan': lambda xs: bnx.scan(cell, h0, xs),
      'brainnx.scan + jax.checkpoint body': lambda xs: bnx.scan(jax.checkpoint(cell), h0, xs),
      'brainnx.checkpointed_scan': lambda xs: bnx.checkpointed_scan(cell, h0, xs, base=base),
    }[variant]
    # nothing is written, so the brainnx gradient can sit inside a plain jax.jit
    # and be compiled ahead of time like the jax.lax.scan variant
    step = jax.jit(bnx.grad(lambda xs: (loop(xs)[0] ** 2).sum(), grad_states=w))
    args = (xs,)

  compiled = step.lower(*args).compile()
  compiled_temp = compiled.memory_analysis().temp_size_in_bytes
  open('/proc/self/clear_refs', 'w').write('5')  # forget the compiler's peak
  before = _status_kb('VmRSS')
  times = []
  for _ in range(5):
    t0 = time.perf_counter()
    grad = jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - t0)
  peak = _status_kb('VmHWM')
  grad = jax.tree.leaves(grad)[0]
  return {'peak_mb': (peak - before) / 1024, 'temp_mb': compiled_temp / 2**20, 'ms': statistics.median(times) * 1e3,
          'grad': [float(v) for v in jnp.ravel(grad)[:64]] + [float((grad ** 2).sum())]}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--worker', choices=VARIANTS)
  parser.add_argument('--base', type=int, default=16)
  parser.add_argument('--length', type=int, default=2000)
  parser.add_argument('--repeats', type=int, default=3, help='processes per variant (default 3)')
  parser.add_argument('--no-write', dest='write', action='store_false', help='print only')
  args = parser.parse_args(argv)
  if args.worker:
    print(json.dumps(worker(args.worker, args.base, args.length)))
    return
  import numpy as np

  runs = {v: [] for v in VARIANTS}
  for r in range(args.repeats):
    for variant in VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]:
      out = subprocess.run(
        [sys.executable, __file__, '--worker', variant, '--base', str(args.base), '--length', str(args.length)],
        capture_output=True, text=True, check=True, env={**os.environ, 'JAX_PLATFORMS': 'cpu'},
      )
      runs[variant].append(json.loads(out.stdout.strip().splitlines()[-1]))
  rows = {v: {k: statistics.median(run[k] for run in rs) for k in ('peak_mb', 'temp_mb', 'ms')} for v, rs in runs.items()}
  for v, rs in runs.items():
    np.testing.assert_allclose(rs[0]['grad'], runs['jax.lax.scan'][0]['grad'], rtol=1e-4, atol=1e-6, err_msg=v)
  ref = rows['jax.lax.scan']
  lines = [f'### tanh RNN, width {WIDTH}, batch {BATCH}, length {args.length}: gradient w.r.t. weights '
           f'(base={args.base}; median over {args.repeats} processes per variant)', '',
           '| variant | peak RSS (MB) | RSS vs jax.lax.scan | XLA temp (MB) | temp vs jax.lax.scan | time (ms) | time vs jax.lax.scan |',
           '|---|---:|---:|---:|---:|---:|---:|']
  for name, r in rows.items():
    lines.append(
      f"| {name} | {r['peak_mb']:.1f} | {r['peak_mb'] / ref['peak_mb']:.1%} | {r['temp_mb']:.1f} "
      f"| {r['temp_mb'] / ref['temp_mb']:.1%} | {r['ms']:.1f} | {r['ms'] / ref['ms']:.2f}x |"
    )
  text = '\n'.join(lines)
  print(text)
  if args.write:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _results import write

    print('wrote', write('checkpoint_memory.md', 'checkpoint_memory.py', text))

if __name__ == '__main__':
  main()
