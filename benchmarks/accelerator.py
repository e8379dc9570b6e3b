"""Step times on the default backend (written for an accelerator; runs anywhere): the demo's
training loop against the same loop hand-written as ``jax.jit(lax.scan)`` over ``nnx.split``
state, ensemble adam steps at three sizes against raw ``jax.jit(jax.vmap)`` (donated and not) and
``nnx.jit(nnx.vmap)``, and a forward call's per-call time against raw ``jax.jit`` and ``nnx.jit``.

Every row times the variants interleaved in one process (median of rounds, each call blocked on
its result). The table's header names the backend.

Run: ``python benchmarks/accelerator.py`` (``--quick``: small sizes, few rounds, a temporary folder).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, str(Path(__file__).parent))

import _results
import program_cost
from _models import MLP
from _timing import block, interleaved

import brainnx as bnx


def demo_loop(steps: int, rounds: int) -> str:
  """The demo's loop per step: ``make_trainer``'s program (bar off, and on as the demo runs it)
  against the expert's loop on the same networks."""
  from brainnx import demo
  from brainnx.examples.ensemble import figure_panels, make_data, roles

  x, y, _ = make_data(0)
  panels = figure_panels(5)
  eps = demo.adversarial_epsilon(x)
  runs = {}
  for progress in (False, True):
    models, opts = demo.build(12, 0)
    runs[progress] = demo.make_trainer(models, opts, panels, eps, progress=progress)
  models, opts = demo.build(12, 0)
  graphdef, params, opt_state, count = program_cost.split_ensemble(models, opts)
  nll, adv = (jnp.asarray(r) for r in roles(panels))

  def hand_written(progress: bool):
    loop = program_cost.expert_demo_loop(graphdef, opts.tx, panels, eps, steps, progress)
    state = list(jax.tree.map(jnp.copy, [params, opt_state, count]))

    def call():
      carry, values = loop(*state, x, y, nll, adv)
      state[:] = carry
      return values

    return call

  variants = {'hand-written jax.jit(lax.scan)': hand_written(False), 'brainnx (no bar)': lambda: runs[False](steps, x, y),
              'hand-written, with a bar\'s 20 host calls': hand_written(True),
              'brainnx (the demo: with its bar)': lambda: runs[True](steps, x, y)}
  import contextlib
  import io

  with contextlib.redirect_stderr(io.StringIO()):  # the bar's drawing
    times = interleaved(variants, rounds=rounds, calls=1)
  base = times['hand-written jax.jit(lax.scan)']
  rows = [f'| {name} | {t / steps:.2f} | {t / base:.3f}x |' for name, t in times.items()]
  return (f'### The demo\'s training loop: {steps} adam steps of 12 networks, per step\n\n'
          '| variant | µs per step | ratio |\n|---|---|---|\n' + '\n'.join(rows))


def ensemble_steps(sizes, rounds: int) -> str:
  lines = ['### Ensemble adam step (jit of vmap over members), per call', '',
           '| members x (in-hidden-out), batch | raw jax.jit donated (µs) | brainnx default | brainnx donate_states=True '
           '| raw jax.jit, not donated | nnx.jit(nnx.vmap) |', '|---|---|---|---|---|---|']
  for members, (n_in, hidden, n_out), batch in sizes:
    x, y = jnp.ones((batch, n_in)), jnp.zeros((batch, n_out))
    made = {}
    for name in ('default', 'donated', 'nnx', 'raw'):
      made[name] = program_cost.ensemble(members, (n_in, hidden, n_out))
    step_fn = program_cost.mse

    def stepper(donate):
      @bnx.jit(donate_states=donate or None)
      @bnx.vmap(in_axes=(0, 0, None, None))
      def step(model, opt, x, y):
        value, grads = bnx.value_and_grad(step_fn)(model, x, y)
        opt.update(model, grads)
        return value

      return step

    ours, ours_donated = stepper(False), stepper(True)

    @nnx.jit
    @nnx.vmap(in_axes=(0, 0, None, None))
    def nnx_step(model, opt, x, y):
      value, grads = nnx.value_and_grad(step_fn)(model, x, y)
      opt.update(model, grads)
      return value

    models, opts = made['raw']
    graphdef, params, opt_state, count = program_cost.split_ensemble(models, opts)
    member = program_cost.pure_adam_step(nnx.graphdef(MLP(n_in, hidden, n_out, rngs=nnx.Rngs(0))), opts.tx)
    vm = jax.vmap(member, in_axes=(0, 0, 0, None, None))
    raw_donated, raw_kept = jax.jit(vm, donate_argnums=(0, 1, 2)), jax.jit(vm)
    state = {'d': [params, opt_state, count], 'k': jax.tree.map(jnp.copy, [params, opt_state, count])}

    def raw(fn, key):
      def call():
        *new, value = fn(*state[key], x, y)
        state[key] = new
        return value

      return call

    variants = {
      'raw donated': raw(raw_donated, 'd'),
      'default': lambda: ours(*made['default'], x, y),
      'donated': lambda: ours_donated(*made['donated'], x, y),
      'raw': raw(raw_kept, 'k'),
      'nnx': lambda: nnx_step(*made['nnx'], x, y),
    }
    times = interleaved({k: (lambda f=f: block(f())) for k, f in variants.items()}, rounds=rounds, calls=20)
    base = times['raw donated']
    cells = [f'{base:.1f}'] + [f'{times[k] / base:.3f}x' for k in ('default', 'donated', 'raw', 'nnx')]
    lines.append(f'| {members} x ({n_in}-{hidden}-{n_out}), {batch} | ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


def forward_call(rounds: int) -> str:
  model = MLP(32, 32, 32, rngs=nnx.Rngs(0))
  x = jnp.ones((16, 32))
  params = jax.tree.map(lambda v: v, nnx.as_pure(nnx.state(model)))
  graphdef = nnx.graphdef(model)
  raw = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))
  ours = bnx.jit(lambda x: model(x))
  other = MLP(32, 32, 32, rngs=nnx.Rngs(0))
  theirs = nnx.jit(lambda m, x: m(x))
  times = interleaved({'raw jax.jit': lambda: block(raw(params, x)), 'brainnx': lambda: block(ours(x)),
                       'nnx.jit': lambda: block(theirs(other, x))}, rounds=rounds, calls=200)
  base = times['raw jax.jit']
  rows = [f'| {name} | {t:.1f} | {t / base:.2f}x |' for name, t in times.items()]
  return ('### Forward of a 2-layer MLP 32x32, batch 16, per call (blocked)\n\n'
          '| variant | µs | ratio |\n|---|---|---|\n' + '\n'.join(rows))


def first_call() -> str:
  """Trace and compile of the demo's loop: brainnx's first call against the hand-written loop's."""
  from brainnx import demo
  from brainnx.examples.ensemble import figure_panels, make_data, roles

  x, y, _ = make_data(0)
  panels = figure_panels(5)
  eps = demo.adversarial_epsilon(x)
  models, opts = demo.build(12, 0)
  run = demo.make_trainer(models, opts, panels, eps, progress=False)
  start = time.perf_counter()
  block(run(100, x, y))
  ours = time.perf_counter() - start
  models, opts = demo.build(12, 0)
  graphdef, params, opt_state, count = program_cost.split_ensemble(models, opts)
  loop = program_cost.expert_demo_loop(graphdef, opts.tx, panels, eps, 100)
  start = time.perf_counter()
  block(loop(params, opt_state, count, x, y, *(jnp.asarray(r) for r in roles(panels))))
  pure = time.perf_counter() - start
  return ('### First call of the demo\'s loop (100 steps: trace, compile, run)\n\n'
          f'| variant | ms | ratio |\n|---|---|---|\n| hand-written | {pure * 1e3:.0f} | 1.00x |\n'
          f'| brainnx | {ours * 1e3:.0f} | {ours / pure:.2f}x |')


def demo_phases(steps: int) -> str:
  """Where ``python -m brainnx.demo``'s reported time goes: each phase of ``train`` timed alone."""
  import contextlib
  import io

  from brainnx import demo
  from brainnx.examples.ensemble import figure_panels, make_data

  rows, start = [], time.perf_counter()

  def phase(name, fn):
    t = time.perf_counter()
    out = block(fn())
    rows.append(f'| {name} | {(time.perf_counter() - t) * 1e3:.0f} |')
    return out

  x, y, grid = phase('make_data (eager random draws)', lambda: make_data(0))
  panels = figure_panels(5)
  lowered = phase('build: trace and lower the stacked constructor', lambda: demo._build.lower(
    12, 0, demo.HIDDEN, demo.LEARNING_RATE, demo.BIAS_RANGE) and 0)
  del lowered
  models, opts = phase('build (the stacked constructor: trace, compile, run)', lambda: demo.build(12, 0))
  run = demo.make_trainer(models, opts, panels, demo.adversarial_epsilon(x))
  with contextlib.redirect_stderr(io.StringIO()):
    phase(f'first call: trace, compile and {steps} steps', lambda: run(steps, x, y))
    phase(f'second call: {steps} steps', lambda: run(steps, x, y))
  phase('predict on the grid', lambda: demo.predict(models, grid))
  rows.append(f'| all of the above | {(time.perf_counter() - start) * 1e3:.0f} |')
  return (f'### The demo\'s phases ({steps} steps, bar on), wall time\n\n| phase | ms |\n|---|---|\n' + '\n'.join(rows))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--quick', action='store_true', help='small sizes, few rounds, a temporary folder')
  args = parser.parse_args(argv)
  jax.config.update('jax_default_matmul_precision', 'highest')
  if args.quick:
    sizes, rounds, steps = [(4, (8, 16, 4), 8)], 3, 20
  else:
    sizes = [(8, (16, 64, 16), 64), (8, (256, 1024, 256), 256), (16, (512, 2048, 512), 1024)]
    rounds, steps = 15, 3000
  device = jax.devices()[0]
  parts = [f'Backend: {device.platform} ({device.device_kind}), {len(jax.devices())} device(s); '
           'float32, matmul precision highest.', demo_phases(steps), first_call(), demo_loop(steps, rounds),
           ensemble_steps(sizes, rounds), forward_call(rounds)]
  body = '\n\n'.join(parts)
  out = Path(tempfile.mkdtemp()) if args.quick else None
  name = f'accelerator_{device.platform}.md'
  print(body)
  print('wrote', _results.write(name, 'accelerator.py', body, out=out))
  return 0


if __name__ == '__main__':
  raise SystemExit(main())
