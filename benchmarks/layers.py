"""Scan over layers: a deep residual stack as one scan vs unrolled in Python vs nnx.scan.

Run: ``python benchmarks/layers.py`` (prints markdown tables; about 3-6 minutes on 2 CPU cores).

Variants, side by side in one process, each a jitted program over the same residual stack
(``x + tanh(Linear(x))`` per layer, batch 32):

  brainnx scan over layers   ``bnx.scan(..., state_in_axes=nnx.Param)`` over a stacked module
                             built with ``bnx.vmap(lambda: Block(rngs), axis_size=depth)()``
  brainnx unrolled           a Python loop over ``depth`` separate modules under ``bnx.jit``
  nnx.scan                   ``nnx.scan`` over the same kind of stacked module under ``nnx.jit``
  raw jax.lax.scan           the same scan on the stacked arrays with ``jax.jit``/``jax.grad``/optax:
                             the floor any framework's scan over layers starts from

Two programs for each variant:

  grads       loss + gradients w.r.t. every Param
  train step  loss + gradients + an ``nnx.Optimizer`` (adam) update: the unrolled model has
              ``2 * depth`` parameter arrays, so ``depth`` times more update ops

For each (depth, program, variant) the first-call cost is split into
``trace + lower`` (``jitted.lower(x)``) and ``compile`` (``lowered.compile()``), and the
first call of a freshly built function (trace + lower + compile + one run) is timed on its
own; each figure is the minimum over ``--trials`` fresh builds. ``HLO lines`` is the size
of the lowered (StableHLO) program. Warm per-call step times are measured at the first
depth only, interleaved.

Why the compile step barely favours the scan on CPU: XLA's CPU backend generates code (LLVM)
once per *distinct* fused kernel and reuses it for identical fusions ("Reusing kernel" under
``TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=thunk_emitter=2,ir_compiler=2,cpu_compiler=1``), and
that code generation, ~25-100 ms a kernel, is most of a compile ("backend" below: XLA's CPU
code generation and thunk emission; "HLO passes": its optimization pipeline). Counted for the grads program
at width 256 (jax 0.10.2, 2 CPU cores):

  unrolled, 48 layers   332 fusions,   7 distinct kernels; HLO passes  30 ms, backend 190 ms
  unrolled, 192 layers  1340 fusions,  7 distinct kernels; HLO passes 170 ms, backend 300 ms
  scan, any depth       23 fusions,   17 distinct kernels; HLO passes  ~8 ms, backend 320 ms

The scan's kernels are few but all different (dynamic-slice of the stacked Params,
dynamic-update-slice into the stacked gradients and residuals, zero-filled stacked buffers), so
at 48 layers it compiles about as long as the unrolled program. With an adam update the counts
are 627 / 2499 fusions and 20 distinct kernels unrolled (HLO passes 280 ms at 48 layers, 1.5 s at
192) against 35 fusions and 28 kernels for the scan. What grows with depth is the unrolled
program's tracing, lowering, HLO passes and per-op thunk emission; that is where the scan wins.
The raw ``jax.lax.scan`` row is the floor: the same scan written by hand compiles as slowly, so
the scan's compile time on CPU is XLA's, not brainnx's (``benchmarks/results/layers.md``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import flax
import jax
import jax.numpy as jnp
import optax
from flax import nnx

sys.path.insert(0, str(Path(__file__).parent))
import brainnx as bnx  # noqa: E402
from _timing import block, interleaved, table  # noqa: E402

SCAN, UNROLLED, NNX = 'brainnx scan over layers', 'brainnx unrolled (Python loop)', 'nnx.scan'
RAW = 'raw jax.lax.scan (pure arrays)'


class Block(nnx.Module):
  def __init__(self, width, rngs):
    self.lin = nnx.Linear(width, width, rngs=rngs)

  def __call__(self, x):
    return x + jnp.tanh(self.lin(x))


class Unrolled(nnx.Module):
  def __init__(self, depth, width, rngs):
    self.blocks = nnx.List([Block(width, rngs) for _ in range(depth)])

  def __call__(self, x):
    for b in self.blocks:
      x = b(x)
    return x


def _tx():
  return optax.adam(1e-3)


def builders(depth: int, width: int, train: bool):
  """``{variant: build}``; ``build()`` makes a fresh model and returns ``(jitted, args)``."""

  def scan_over_layers():
    rngs = nnx.Rngs(0)
    stack = bnx.vmap(lambda: Block(width, rngs), axis_size=depth)()

    def loss(x):
      h, _ = bnx.scan(lambda h, _: (stack(h), None), x, None, state_in_axes=nnx.Param)
      return (h ** 2).mean()

    if not train:
      return bnx.jit(bnx.grad(loss, grad_states=stack))

    opt = nnx.Optimizer(stack, _tx(), wrt=nnx.Param)

    def step(x):
      value, grads = bnx.value_and_grad(loss, grad_states=stack)(x)
      opt.update(stack, grads)
      return value

    return bnx.jit(step)

  def unrolled():
    model = Unrolled(depth, width, nnx.Rngs(0))

    def loss(x):
      return (model(x) ** 2).mean()

    if not train:
      return bnx.jit(bnx.grad(loss, grad_states=model))

    opt = nnx.Optimizer(model, _tx(), wrt=nnx.Param)

    def step(x):
      value, grads = bnx.value_and_grad(loss, grad_states=model)(x)
      opt.update(model, grads)
      return value

    return bnx.jit(step)

  def nnx_scan():
    stack = nnx.vmap(lambda r: Block(width, r), in_axes=0)(nnx.Rngs(0).split(depth))

    def loss(stack, x):
      forward = nnx.scan(lambda h, block: (block(h), None), in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
      h, _ = forward(x, stack)
      return (h ** 2).mean()

    if not train:
      jitted = nnx.jit(lambda stack, x: nnx.grad(loss)(stack, x))
      return _bound(jitted, stack)

    opt = nnx.Optimizer(stack, _tx(), wrt=nnx.Param)

    @nnx.jit
    def step(stack, opt, x):
      value, grads = nnx.value_and_grad(loss)(stack, x)
      opt.update(stack, grads)
      return value

    return _bound(step, stack, opt)

  def raw_scan():
    # the floor: the same scan written by hand on the stacked arrays, no framework at all
    rngs = nnx.Rngs(0)
    stack = bnx.vmap(lambda: Block(width, rngs), axis_size=depth)()
    params = {'kernel': stack.lin.kernel[...], 'bias': stack.lin.bias[...]}

    def loss(params, x):
      h, _ = jax.lax.scan(lambda h, p: (h + jnp.tanh(h @ p['kernel'] + p['bias']), None), x, params)
      return (h ** 2).mean()

    if not train:
      return _bound(jax.jit(jax.grad(loss)), params)

    tx = _tx()

    @jax.jit
    def step(params, opt_state, x):
      value, grads = jax.value_and_grad(loss)(params, x)
      updates, opt_state = tx.update(grads, opt_state, params)
      return value, optax.apply_updates(params, updates), opt_state

    return _bound(step, params, tx.init(params))

  return {SCAN: scan_over_layers, UNROLLED: unrolled, NNX: nnx_scan, RAW: raw_scan}


class _bound:
  """An ``nnx.jit`` function with its graph arguments bound, called (and lowered) with ``x``."""

  def __init__(self, jitted, *nodes):
    self.jitted, self.nodes = jitted, nodes

  def __call__(self, x):
    return self.jitted(*self.nodes, x)

  def lower(self, x):
    return self.jitted.lower(*self.nodes, x)


def first_call(build, x, trials: int) -> dict:
  """Minimum over ``trials`` fresh builds of trace+lower, compile and the first call (ms)."""
  best = {'trace + lower': float('inf'), 'compile': float('inf'), 'first call': float('inf')}
  for _ in range(trials):
    fn = build()
    t0 = time.perf_counter()
    lowered = fn.lower(x)
    t1 = time.perf_counter()
    lowered.compile()
    t2 = time.perf_counter()
    lines = len(lowered.as_text().splitlines())
    fresh = build()
    t3 = time.perf_counter()
    block(fresh(x))
    t4 = time.perf_counter()
    for key, value in (('trace + lower', t1 - t0), ('compile', t2 - t1), ('first call', t4 - t3)):
      best[key] = min(best[key], value * 1e3)
  best['HLO lines'] = lines
  return best


def _calling(fn, x):
  return lambda: fn(x)


def first_call_table(title: str, rows: dict[str, dict]) -> str:
  base = rows[UNROLLED]
  lines = [
    f'### {title}', '',
    ('| variant | trace + lower (ms) | compile (ms) | first call (ms) | HLO lines '
     '| unrolled / variant: trace + lower | compile | first call |'),
    '|---|---:|---:|---:|---:|---:|---:|---:|',
  ]
  for name, r in rows.items():
    ratios = ' | '.join(f'{base[k] / r[k]:.2f}x' for k in ('trace + lower', 'compile', 'first call'))
    lines.append(
      f'| {name} | {r["trace + lower"]:.0f} | {r["compile"]:.0f} | {r["first call"]:.0f} | {r["HLO lines"]} | {ratios} |'
    )
  return '\n'.join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--depths', type=int, nargs='+', default=[48, 96, 192])
  parser.add_argument('--width', type=int, default=256)
  parser.add_argument('--trials', type=int, default=3)
  parser.add_argument('--rounds', type=int, default=10)
  parser.add_argument('--calls', type=int, default=20)
  args = parser.parse_args(argv)
  print(f'jax {jax.__version__}, flax {flax.__version__}, optax {optax.__version__} on '
        f'{jax.devices()[0].platform} ({jax.devices()[0].device_kind})\n', flush=True)
  x = jnp.ones((32, args.width))
  summary = []
  for depth in args.depths:
    for train, program in ((False, 'grads (loss + gradients)'), (True, 'train step (loss + gradients + adam update)')):
      rows = {name: first_call(build, x, args.trials) for name, build in builders(depth, args.width, train).items()}
      print(first_call_table(f'{depth} layers, width {args.width}, {program}: first call', rows) + '\n', flush=True)
      summary.append((depth, program.split(' (')[0], rows[UNROLLED]['first call'] / rows[SCAN]['first call'],
                      rows[UNROLLED]['compile'] / rows[SCAN]['compile'],
                      rows[UNROLLED]['first call'] / rows[RAW]['first call'],
                      rows[SCAN]['first call'] / rows[RAW]['first call']))

  depth = args.depths[0]
  for train, program in ((False, 'grads (loss + gradients)'), (True, 'train step (loss + gradients + adam update)')):
    fns = {name: _calling(build(), x) for name, build in builders(depth, args.width, train).items()}
    steps = interleaved(fns, rounds=args.rounds, calls=args.calls)
    print(table(f'{depth} layers, width {args.width}, {program}: warm step', steps, 'us', NNX) + '\n', flush=True)

  print('### Summary: first-call ratios\n')
  print('| depth | program | unrolled / brainnx scan: first call | compile alone '
        '| unrolled / raw lax.scan: first call | brainnx scan / raw lax.scan: first call |')
  print('|---:|---|---:|---:|---:|---:|')
  for depth, program, first, compile_, raw_first, scan_raw in summary:
    print(f'| {depth} | {program} | {first:.2f}x | {compile_:.2f}x | {raw_first:.2f}x | {scan_raw:.2f}x |')


if __name__ == '__main__':
  main()
