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
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, str(Path(__file__).parent))

import _results
import program_cost
from _models import MLP, Layers
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


def stacked(members: int, sizes, lr: float = 1e-3):
  rngs = nnx.Rngs(0)
  models = bnx.vmap(lambda: Layers(sizes, rngs=rngs), axis_size=members)()
  return models, bnx.vmap(lambda m: nnx.Optimizer(m, optax.adam(lr), wrt=nnx.Param))(models)


def ensemble_steps(sizes, rounds: int) -> str:
  import _peers

  columns = ['brainnx default', 'brainnx donate_states=True', 'raw jax.jit, not donated', 'nnx.jit(nnx.vmap)']
  columns += ['equinox filter_jit(filter_vmap)'] if _peers.HAVE_EQX else []
  lines = ['### Ensemble adam step (jit of vmap over members), per call', '',
           '| members x (layer sizes), batch | raw jax.jit donated (µs) | ' + ' | '.join(columns) + ' |',
           '|---|---|' + '---|' * len(columns)]
  for members, layer_sizes, batch in sizes:
    x, y = jnp.ones((batch, layer_sizes[0])), jnp.zeros((batch, layer_sizes[-1]))
    made = {name: stacked(members, layer_sizes) for name in ('default', 'donated', 'nnx', 'raw', 'eqx')}

    def stepper(donate):
      @bnx.jit(donate_states=donate or None)
      @bnx.vmap(in_axes=(0, 0, None, None))
      def step(model, opt, x, y):
        value, grads = bnx.value_and_grad(program_cost.mse)(model, x, y)
        opt.update(model, grads)
        return value

      return step

    ours, ours_donated = stepper(False), stepper(True)

    @nnx.jit
    @nnx.vmap(in_axes=(0, 0, None, None))
    def nnx_step(model, opt, x, y):
      value, grads = nnx.value_and_grad(program_cost.mse)(model, x, y)
      opt.update(model, grads)
      return value

    models, opts = made['raw']
    graphdef, params, opt_state, count = program_cost.split_ensemble(models, opts)
    member = program_cost.pure_adam_step(nnx.graphdef(Layers(layer_sizes, rngs=nnx.Rngs(0))), opts.tx)
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
      'brainnx default': lambda: ours(*made['default'], x, y),
      'brainnx donate_states=True': lambda: ours_donated(*made['donated'], x, y),
      'raw jax.jit, not donated': raw(raw_kept, 'k'),
      'nnx.jit(nnx.vmap)': lambda: nnx_step(*made['nnx'], x, y),
    }
    if _peers.HAVE_EQX:
      trainer = _peers.EqxTrainer(optax.adam(1e-3), _peers.params_of(made['eqx'][0].layers), jax.nn.relu)
      variants['equinox filter_jit(filter_vmap)'] = lambda: trainer(x, y)
    times = interleaved({k: (lambda f=f: block(f())) for k, f in variants.items()}, rounds=rounds, calls=20)
    base = times['raw donated']
    cells = [f'{base:.1f}'] + [f'{times[k] / base:.3f}x' for k in columns]
    label = '-'.join(map(str, layer_sizes))
    lines.append(f'| {members} x ({label}), {batch} | ' + ' | '.join(cells) + ' |')
  if not _peers.HAVE_EQX:
    lines.append(f'\nequinox rows left out: {_peers.EQX_WHY}')
  return '\n'.join(lines)


def bf16_peak(n: int = 8192) -> float:
  """The chip's measured bf16 matmul rate (TFLOP/s): the best of ten ``n``-cubed products."""
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
  b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
  mm = jax.jit(lambda a, b: a @ b)
  block(mm(a, b))
  best = float('inf')
  for _ in range(10):
    start = time.perf_counter()
    block(mm(a, b))
    best = min(best, time.perf_counter() - start)
  return 2 * n**3 / best / 1e12


def transformer(cfg_kwargs: dict, rounds: int, steps_per_round: int, peak_n: int = 8192) -> str:
  """The example transformer's adamw training step, brainnx against flax (same model, dropout off,
  no remat, donated), at the default matmul precision: tokens/s, and model FLOP utilisation as
  XLA's flop count of the step over its time against the measured bf16 peak."""
  from brainnx.examples import transformer as tf

  cfg = tf.Config(**cfg_kwargs)
  data = np.random.default_rng(0).integers(0, cfg.vocab, (cfg.batch, cfg.seq + 1))
  x, y = jnp.asarray(data[:, :-1]), jnp.asarray(data[:, 1:])
  model, opt = tf.build(cfg, 0)
  ours = tf.train_step(model, opt, donate=True, deterministic=True)
  flops = float(ours.lower(x, y).compile().cost_analysis()['flops'])
  fmodel, fopt = tf.build_flax(cfg, 0)
  theirs = tf.flax_train_step(donate=True, deterministic=True)
  np.testing.assert_allclose(float(ours(x, y)), float(theirs(fmodel, fopt, x, y)), rtol=2e-2)

  def run(step):
    def steps():
      for _ in range(steps_per_round):
        out = step()
      return block(out)

    return steps

  times = interleaved({'brainnx': run(lambda: ours(x, y)), 'flax (nnx.jit)': run(lambda: theirs(fmodel, fopt, x, y))},
                      rounds=rounds, calls=1)
  peak = bf16_peak(peak_n)
  tokens = cfg.batch * cfg.seq
  rows = []
  for name, t in times.items():
    step_s = t / steps_per_round / 1e6
    rows.append(f'| {name} | {step_s * 1e3:.2f} | {tokens / step_s:,.0f} | {flops / step_s / 1e12:.1f} | '
                f'{flops / step_s / 1e12 / peak:.1%} |')
  sizes = ', '.join(f'{k}={v}' for k, v in cfg_kwargs.items())
  return (f'### The example transformer\'s training step ({sizes}; float32 parameters, default precision)\n\n'
          f'XLA counts {flops / 1e9:.1f} GFLOP per step; measured bf16 peak of this chip: {peak:.1f} TFLOP/s.\n\n'
          '| variant | ms per step | tokens/s | TFLOP/s | model FLOP utilisation |\n|---|---|---|---|---|\n'
          + '\n'.join(rows))


def forward_call(rounds: int) -> str:
  model = MLP(32, 32, 32, rngs=nnx.Rngs(0))
  x = jnp.ones((16, 32))
  params = program_cost.pure_values(nnx.state(model))
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
    out = fn()
    out = block(out) if not hasattr(out, 'compile') else out
    rows.append(f'| {name} | {(time.perf_counter() - t) * 1e3:.0f} |')
    return out

  x, y, grid = phase('make_data (eager random draws)', lambda: make_data(0))
  panels = figure_panels(5)
  lowered = phase('build: trace and lower the stacked constructor', lambda: demo._build.lower(
    12, 0, demo.HIDDEN, demo.LEARNING_RATE, demo.BIAS_RANGE))
  phase('build: compile it (XLA alone)', lambda: lowered.compile() and 0)
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
  parser.add_argument('--only', nargs='+', default=None, metavar='SECTION',
                      help='run only these sections (phases, first_call, demo_loop, ensemble, forward, transformer)')
  parser.add_argument('--out', type=Path, default=None, help='write the table into this folder (default benchmarks/results)')
  args = parser.parse_args(argv)
  if args.quick:
    sizes, rounds, steps = [(4, (8, 16, 4), 8)], 3, 20
    model = dict(layers=2, width=32, heads=2, seq=16, batch=2, dropout=0.0, remat=False)
  else:
    sizes = [(8, (16, 64, 16), 64), (8, (64, 256, 256, 64), 256), (8, (256, 1024, 256), 256),
             (16, (512, 2048, 2048, 512), 1024)]
    rounds, steps = 15, 3000
    model = dict(layers=6, width=768, heads=12, seq=256, batch=16, dropout=0.0, remat=False)
  device = jax.devices()[0]
  head = (f'Backend: {device.platform} ({device.device_kind}), {len(jax.devices())} device(s); float32; '
          'the MLP rows at matmul precision highest, the transformer at the default.')
  parts = [head]

  def section(make, name):
    if args.only is not None and name not in args.only:
      return
    parts.append(make())
    print(parts[-1], flush=True)  # a section at a time: a later failure loses none

  with jax.default_matmul_precision('highest'):
    section(lambda: demo_phases(steps), 'phases')
    section(first_call, 'first_call')
    section(lambda: demo_loop(steps, rounds), 'demo_loop')
    section(lambda: ensemble_steps(sizes, rounds), 'ensemble')
    section(lambda: forward_call(rounds), 'forward')
  jax.clear_caches()
  section(lambda: transformer(model, rounds=max(3, rounds // 3), steps_per_round=3 if args.quick else 10,
                              peak_n=512 if args.quick else 8192), 'transformer')
  body = '\n\n'.join(parts)
  out = Path(tempfile.mkdtemp()) if args.quick else args.out
  name = f'accelerator_{device.platform}.md'
  print('wrote', _results.write(name, 'accelerator.py', body, out=out))
  return 0


if __name__ == '__main__':
  raise SystemExit(main())
