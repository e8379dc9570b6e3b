"""The main job: the whole Figure 1 of Deep Ensembles, twelve networks in one compiled loop.

Run ``python -m brainnx.demo`` (``--help`` for flags). It reproduces the toy
regression of Lakshminarayanan, Pritzel & Blundell, "Simple and Scalable
Predictive Uncertainty Estimation using Deep Ensembles" (NeurIPS 2017),
Figure 1: 20 points ``x ~ U[-4, 4]``, ``y = x**3 + eps`` with
``eps ~ N(0, 3**2)``; every network has one hidden layer of 100 ReLU units and
predicts a mean and a variance (softplus + 1e-6). The figure's four panels are
trained together:

- (i) an ensemble of ``--members`` networks trained on the squared error of the
  mean; its uncertainty is the empirical spread of their means;
- (ii) one network trained on the Gaussian negative log-likelihood (NLL);
- (iii) one network, NLL with the paper's adversarial training (fast gradient
  sign at ``eps = 0.01 * range(x)``: the loss at ``x + eps * sign(d loss/d x)``
  is added);
- (iv) an ensemble of ``--members`` networks, NLL with adversarial training; its
  prediction is the uniform mixture of the members' Gaussians.

All ``2 * members + 2`` networks are built stacked by one ``brainnx.vmap`` over
the constructor (each draws its own initial keys) and train in one
``brainnx.jit`` program, a ``brainnx.for_loop`` over adam steps with a
``brainnx.ProgressBar``; each network's loss and adversarial step are chosen by
its row of the stack. The first layer's biases start uniform in ``[-8, 8]``, twice
the data's range (flax's default is zero, which puts every ReLU kink at ``x = 0``):
units whose kink lies beyond the data keep much of their random start there, and
the members disagree where there is no data.
The run prints, per panel, the predictive standard deviation inside the data
(``|x| <= 4``) and its ratio on each side outside it, and the share of
``[-6, 6]`` where ``y = x**3`` lies within ± 3 std; it writes the four panels
to ``ensemble.png`` when matplotlib is installed.

With ``--checkpoint-dir DIR`` the networks, their optimizers and a fixed-size
record (step, first and last loss of every network) are saved with orbax every
``--checkpoint-every`` steps, and each chunk's losses are appended to
``DIR/losses.f32``, so a save costs the same at step 100 as at step 100,000.
Running the same command again resumes from the latest checkpoint, and the
resumed run ends exactly where an uninterrupted one does.

With ``--devices N`` the networks are split over the first N devices (a mesh
axis ``'ens'``; on CPU, ``XLA_FLAGS=--xla_force_host_platform_device_count=N``
makes N devices). With ``--distributed HOST:PORT --num-processes P
--process-id I`` the same training runs as one of P processes under
``jax.distributed.initialize`` (gloo collectives on CPU), the networks split
over every process's devices.
"""

from __future__ import annotations

import argparse
import functools
import signal
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import brainnx as bnx
from brainnx.examples.ensemble import (
  ADVERSARIAL_FRACTION, BIAS_RANGE, HIDDEN, LEARNING_RATE, MLP, figure_panels, gaussian_nll, make_data, panel_reports, report_table,
  roles, squared_error,
)
from brainnx.examples.ensemble_output import Checkpoints, check_writable, have_matplotlib, plot, resolve_out


def build(networks: int, seed: int, hidden: int = HIDDEN, lr: float = LEARNING_RATE, bias_range: float = BIAS_RANGE):
  """The stacked networks (one ``bnx.vmap`` over the constructor) and one adam optimizer per
  network, made in one compiled program (run eagerly, the mapped constructor dispatches and
  compiles its operations one by one: seconds, where the program takes one compilation)."""
  return _build(networks, seed, hidden, lr, bias_range)


@functools.partial(bnx.jit, static_argnums=(0, 1, 2, 3, 4))
def _build(networks: int, seed: int, hidden: int, lr: float, bias_range: float):
  rngs = nnx.Rngs(seed)
  ensemble = bnx.vmap(lambda: MLP(hidden, bias_range=bias_range, rngs=rngs), axis_size=networks)()
  return ensemble, bnx.vmap(lambda m: nnx.Optimizer(m, optax.adam(lr), wrt=nnx.Param))(ensemble)


def network_loss(model, x, y, nll):
  """The Gaussian NLL where ``nll`` is true, else the squared error of the mean."""
  out = model(x)
  return jnp.where(nll, gaussian_nll(out, y), squared_error(out, y))


def training_loss(model, x, y, nll, adversarial, epsilon: float):
  """``network_loss``, plus the same loss at the fast-gradient-sign point
  ``x + epsilon * sign(d loss / dx)`` where ``adversarial`` is true (the paper's adversarial
  training; ``epsilon == 0`` leaves it out of the program)."""
  loss = network_loss(model, x, y, nll)
  if not epsilon:
    return loss
  dx = bnx.grad(lambda x: network_loss(model, x, y, nll))(x)
  return loss + jnp.where(adversarial, network_loss(model, x + epsilon * jnp.sign(dx), y, nll), 0.0)


def make_trainer(ensemble, optimizers, panels, epsilon: float, mesh=None, progress: bool = True):
  """``run(steps, x, y) -> losses (steps, networks)``: ``steps`` adam steps of every network in one
  compiled loop (one program per distinct ``steps``), with a progress bar.

  Each network trains as its panel says (``roles``). The parameters and adam state are donated
  (``donate_states=True``): XLA updates them in place. With a ``mesh`` (axis ``'ens'``) every
  Variable is laid out ``P('ens')`` (``state_shardings``), so each device holds and steps its own
  networks (``spmd_axis_name='ens'``).
  """
  # the bar's losses: means over panel (i) and panel (iv), as weights (a slice of networks split
  # over devices is not a thing every layout allows)
  mse_mean, nll_mean = (np.zeros(sum(p.size for p in panels), np.float32) for _ in range(2))
  mse_mean[panels[0].rows], nll_mean[panels[-1].rows] = 1 / panels[0].size, 1 / panels[-1].size

  @bnx.vmap(in_axes=(0, 0, 0, 0, None, None), spmd_axis_name=None if mesh is None else 'ens')
  def train_step(model, opt, nll, adversarial, x, y):
    loss, grads = bnx.value_and_grad(training_loss, argnums=0)(model, x, y, nll, adversarial, epsilon)
    opt.update(model, grads)
    return loss

  bars = {}  # one progress bar per loop length, made when that loop is traced

  def summary(d):
    return {'mse': (d['y'] * mse_mean).sum(), 'nll': (d['y'] * nll_mean).sum()}

  def loop(steps: int, x, y, nll, adversarial):
    pbar = bars.setdefault(steps, bnx.ProgressBar(
      count=min(20, steps), disable=not progress or jax.process_index() != 0,
      desc=('loss: (i) {mse:.1f}, (iv) {nll:.3f}', summary)))
    return bnx.for_loop(lambda: train_step(ensemble, optimizers, nll, adversarial, x, y), length=steps, pbar=pbar)

  layout = None if mesh is None else {NamedSharding(mesh, P('ens')): ...}
  compiled = bnx.jit(loop, static_argnums=0, donate_states=True, state_shardings=layout)
  network_roles = roles(panels) if mesh is None else place(mesh, P('ens'), *roles(panels))

  def run(steps: int, x, y):
    return compiled(steps, x, y, *network_roles)

  run.lower = lambda steps, x, y: compiled.lower(steps, x, y, *network_roles)  # the program, for inspection
  return run


def adversarial_epsilon(x, fraction: float = ADVERSARIAL_FRACTION) -> float:
  """The adversarial step: ``fraction`` of the range of the training inputs (the paper's 1%)."""
  return fraction * float(np.ptp(np.asarray(x)))


def make_mesh(devices: int | None):
  """A 1-D mesh ``'ens'`` over the first ``devices`` devices (all of them with ``jax.distributed``)."""
  found = jax.devices()
  if devices is not None and devices > len(found):
    raise ValueError(
      f'--devices {devices}: only {len(found)} device(s) here; on CPU set '
      f'XLA_FLAGS=--xla_force_host_platform_device_count={devices} before starting'
    )
  return jax.make_mesh((devices or len(found),), ('ens',), devices=found[: devices or len(found)])


def place(mesh, spec, *arrays):
  """The same host arrays laid out on ``mesh`` by ``spec`` (``P()``: replicated; ``P('ens')``: split
  by their first axis, as the networks are), each process supplying its own devices' parts."""
  sharding = NamedSharding(mesh, spec)
  return tuple(jax.make_array_from_callback(np.shape(a), sharding, lambda i, a=np.asarray(a): a[i]) for a in arrays)


def to_host(x) -> np.ndarray:
  """A numpy copy of ``x``, gathered from every process when it spans several."""
  if getattr(x, 'is_fully_addressable', True):
    return np.asarray(x)
  from jax.experimental import multihost_utils

  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def train(members: int = 5, steps: int = 3000, seed: int = 0, adversarial: float = ADVERSARIAL_FRACTION,
          progress: bool = True, bias_range: float = BIAS_RANGE) -> dict:
  """``python -m brainnx.demo`` without the command line: trains the four panels' networks and
  returns ``panels``, ``ensemble``, ``losses`` (steps, networks), ``predictions`` on the grid
  (networks, 241, 2), ``reports`` (``std_report`` per panel) and ``data`` (x, y, grid)."""
  x, y, grid = make_data(seed)
  panels = figure_panels(members)
  ensemble, optimizers = build(2 * members + 2, seed, bias_range=bias_range)
  run = make_trainer(ensemble, optimizers, panels, adversarial_epsilon(x, adversarial), progress=progress)
  losses = to_host(run(steps, x, y))
  preds = predict(ensemble, grid)
  reports = panel_reports(panels, preds, grid)
  return {'panels': panels, 'ensemble': ensemble, 'losses': losses, 'predictions': preds,
          'reports': reports, 'data': (x, y, grid)}


def predict(ensemble, grid) -> np.ndarray:
  """Every network's (mean, variance) on ``grid``: shape ``(networks, len(grid), 2)``."""
  return to_host(bnx.vmap(lambda m, g: m(g), in_axes=(0, None))(ensemble, grid))


# ------------------------------------------------------------------ command line


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    prog='python -m brainnx.demo',
    description='Figure 1 of Deep Ensembles (Lakshminarayanan et al. 2017), all four panels: MLPs on '
                'y = x^3 + noise trained with squared error, Gaussian NLL and adversarial training, '
                'every network in one program with brainnx and optax.')
  parser.add_argument('--members', type=int, default=5,
                      help='networks in each ensemble, panels (i) and (iv) (default 5, as in the paper); '
                           '2 * members + 2 networks train in all')
  parser.add_argument('--steps', type=int, default=3000, help='total adam steps, full batch (default 3000)')
  parser.add_argument('--seed', type=int, default=0, help='seed for data and initialisation (default 0)')
  parser.add_argument('--adversarial', type=float, nargs='?', const=ADVERSARIAL_FRACTION,
                      default=ADVERSARIAL_FRACTION, metavar='FRACTION',
                      help='the fast-gradient-sign step of panels (iii) and (iv) as a fraction of the range of x '
                           f'(default {ADVERSARIAL_FRACTION}, the paper\'s; 0 turns adversarial training off; '
                           'the bare flag keeps the default)')
  parser.add_argument('--out', default='.',
                      help='where the plot goes: an image path such as fig1.png (.png/.pdf/.svg/.jpg), '
                           'or a directory for ensemble.png (default .); missing directories are created, and '
                           'a path that cannot be written is refused before training')
  parser.add_argument('--no-plot', action='store_true', help='skip the plot')
  parser.add_argument('--checkpoint-dir', type=Path, default=None,
                      help='save the networks, their optimizers and a fixed-size loss record here with orbax; '
                           'if it already holds a checkpoint of the same run, resume from the latest one')
  parser.add_argument('--checkpoint-every', type=int, default=500,
                      help='steps between checkpoints with --checkpoint-dir (default 500)')
  parser.add_argument('--devices', type=int, default=None,
                      help='split the networks over the first N devices (a mesh axis "ens"; 2 * --members + 2 '
                           'must be a multiple of N; on CPU set XLA_FLAGS=--xla_force_host_platform_device_count=N)')
  parser.add_argument('--distributed', metavar='HOST:PORT', default=None,
                      help='run as one process of a jax.distributed job whose coordinator (process 0) listens at '
                           'HOST:PORT; the networks are split over every process\'s devices')
  parser.add_argument('--num-processes', type=int, default=None, help='with --distributed: how many processes')
  parser.add_argument('--process-id', type=int, default=None, help='with --distributed: this process\'s index')
  parser.add_argument('--save', type=Path, default=None,
                      help='write the trained parameters and the losses to this .npz file (process 0 only)')
  return parser


def _start_distributed(args, parser) -> None:
  if args.num_processes is None or args.process_id is None:
    parser.error('--distributed needs --num-processes and --process-id')
  if args.checkpoint_dir is not None:
    parser.error('--checkpoint-dir is not supported with --distributed')
  if jax.config.jax_platforms in (None, '', 'cpu'):
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')  # CPU collectives across processes
  jax.distributed.initialize(args.distributed, num_processes=args.num_processes, process_id=args.process_id)


def _check_flags(args, parser) -> None:
  for flag, value in (('--members', args.members), ('--steps', args.steps), ('--checkpoint-every', args.checkpoint_every)):
    if value < 1:
      parser.error(f'{flag} must be at least 1')
  if not args.adversarial >= 0:
    parser.error(f'--adversarial {args.adversarial}: the step is a fraction of the range of x, 0 or more')
  if args.devices is not None and args.devices < 1:
    parser.error('--devices must be at least 1')
  if args.distributed is None and (args.num_processes is not None or args.process_id is not None):
    parser.error('--num-processes and --process-id go with --distributed')


class _HoldInterrupt:
  """Holds a Ctrl-C that arrives while a checkpoint is written until the write is complete.

  On leaving, a held Ctrl-C is raised as ``KeyboardInterrupt``, so a checkpoint is never left
  half-written and orbax's writer thread is never interrupted mid-save. (Only in the main
  thread, where Python delivers signals.)
  """

  def __enter__(self):
    self.held, self.previous = False, None
    if threading.current_thread() is threading.main_thread():
      self.previous = signal.signal(signal.SIGINT, self._hold)
    return self

  def _hold(self, signum, frame):
    self.held = True

  def __exit__(self, kind, value, tb):
    if self.previous is not None:
      signal.signal(signal.SIGINT, self.previous)
    if self.held and kind is None:
      raise KeyboardInterrupt


def _train_with_checkpoints(ckpt, run, ensemble, optimizers, x, y, progress: dict, steps: int, every: int,
                            lead: bool) -> None:
  """Train ``progress['step'] -> steps`` in chunks of ``every``; after each chunk log its losses and save.

  ``progress`` holds ``step`` (the latest saved step) and ``record`` (that checkpoint's record).
  """
  while progress['step'] < steps:
    step, record = progress['step'], progress['record']
    n = min(every, steps - step)
    if lead:
      print(f'steps {step + 1}-{step + n}:')
    losses = to_host(run(n, x, y))
    first = losses[0] if record is None else record['first']
    record = {'first': np.asarray(first, np.float32), 'last': losses[-1].astype(np.float32)}
    with _HoldInterrupt():
      ckpt.append_losses(losses)
      ckpt.save(step + n, ensemble, optimizers, record)
      progress.update(step=step + n, record=record)


def _interrupted(ckpt, step: int) -> None:
  """Ctrl-C: close the checkpoints, say where the run can resume from, exit 130."""
  if ckpt is not None:
    with _HoldInterrupt():
      ckpt.close()
  if ckpt is None:
    where = 'before the end of training: nothing was saved (--checkpoint-dir saves as training goes)'
  elif step:
    where = f'after step {step}, which is saved: run the same command to resume from there'
  else:
    where = 'before the first checkpoint: nothing was saved'
  print(f'\ninterrupted {where}', file=sys.stderr)
  raise SystemExit(130)


def main(argv=None) -> dict:
  parser = _parser()
  args = parser.parse_args(argv)
  _check_flags(args, parser)
  if args.distributed is not None:
    _start_distributed(args, parser)
  lead = jax.process_index() == 0  # the process that reports, plots and saves
  panels = figure_panels(args.members)
  networks = 2 * args.members + 2
  mesh = None
  if args.devices is not None or args.distributed is not None:
    try:
      mesh = make_mesh(args.devices)
    except ValueError as e:
      parser.error(str(e))
    if networks % mesh.size:
      fits = next(m for m in range(args.members, args.members + mesh.size) if (2 * m + 2) % mesh.size == 0)
      parser.error(f'--members {args.members} makes {networks} networks (2 * members + 2), which do not split '
                   f'evenly over {mesh.size} devices; --members {fits} does')
  png = None
  if not args.no_plot and lead:
    try:
      png = resolve_out(args.out)
    except ValueError as e:
      parser.error(str(e))
    check_writable(png, f'--out {args.out}', parser)  # before training, not after: a bad path loses nothing
  if png is not None and not have_matplotlib():
    print('matplotlib is not installed, so no plot will be written '
          "(pip install matplotlib, or pip install 'brainnx[plot]'; --no-plot silences this)", file=sys.stderr)
    png = None

  if args.save is not None and lead:  # np.savez adds .npz to a name without it
    npz = args.save if args.save.suffix == '.npz' else args.save.with_name(args.save.name + '.npz')
    check_writable(npz, f'--save {args.save}', parser)
  if args.checkpoint_dir is not None:
    check_writable(args.checkpoint_dir, f'--checkpoint-dir {args.checkpoint_dir}', parser, directory=True)

  start = time.perf_counter()
  x, y, grid = make_data(args.seed)
  host_data = tuple(np.asarray(a) for a in (x, y, grid))
  ensemble, optimizers = build(networks, args.seed)
  eps = adversarial_epsilon(x, args.adversarial)
  if mesh is not None:
    x, y, grid = place(mesh, P(), x, y, grid)
  run = make_trainer(ensemble, optimizers, panels, eps, mesh)
  step, record, ckpt = 0, None, None  # step: the latest step trained (and saved, with checkpoints)
  if args.checkpoint_dir is not None:
    settings = {'members': args.members, 'seed': args.seed, 'hidden': HIDDEN, 'lr': LEARNING_RATE,
                'adversarial': args.adversarial}
    ckpt = Checkpoints(args.checkpoint_dir, settings, networks)
    latest = ckpt.latest_step()
    if latest is not None:
      saved = ckpt.saved_settings(latest)
      if saved != settings:
        ckpt.close()
        parser.error(f'{args.checkpoint_dir} holds a checkpoint of another run ({saved}); '
                     f'this run is {settings}: pass the same flags or another --checkpoint-dir')
      record = ckpt.restore(latest, ensemble, optimizers)
      step = latest
      print(f'resumed from {args.checkpoint_dir} at step {step}')
  resumed_at = step

  progress = {'step': step, 'record': record}
  try:
    if ckpt is None:
      history = to_host(run(args.steps, x, y))
      progress['step'] = args.steps
    else:
      _train_with_checkpoints(ckpt, run, ensemble, optimizers, x, y, progress, args.steps,
                              args.checkpoint_every, lead)
      history = ckpt.losses(progress['step'])
  except KeyboardInterrupt:
    _interrupted(ckpt, progress['step'])
  finally:
    if ckpt is not None:
      ckpt.close()
  step, record = progress['step'], progress['record']
  trained = step - resumed_at

  preds = predict(ensemble, grid)  # in every process: gathering is a collective
  reports = panel_reports(panels, preds, host_data[2])
  if png is not None:
    plot(png, panels, preds, host_data)
  if args.save is not None:  # every process gathers (a collective), the lead one writes
    flat = {'/'.join(map(str, path)): to_host(v.get_value()) for path, v in nnx.to_flat_state(nnx.state(ensemble))}
    if lead:
      np.savez(args.save, losses=history, **flat)
  result = {'losses': history, 'step': step, 'trained': trained, 'ensemble': ensemble, 'optimizers': optimizers,
            'png': png, 'panels': panels, 'reports': reports, 'predictions': preds}
  if not lead:
    return result

  where = '' if mesh is None else f' on {mesh.size} device(s) in {jax.process_count()} process(es)'
  if trained:
    print(f'trained {networks} networks (the four panels of Figure 1){where}: steps {resumed_at + 1}-{step} '
          f'in {time.perf_counter() - start:.1f} s')
  else:
    past = 'past' if step > args.steps else 'at'
    print(f'nothing to train: the checkpoint in {args.checkpoint_dir} is {past} step {step} '
          f'(--steps {args.steps}); the report below is of that checkpoint')
  last = history[-1] if len(history) else record['last']
  print(report_table(panels, reports, last))
  if ckpt is not None:
    print(f'checkpoints in {args.checkpoint_dir} (latest: step {step}); the same command resumes from there')
  if png is not None:
    print(f'wrote {png}')
  if args.save is not None:
    print(f'wrote {args.save}')
  return result


if __name__ == '__main__':
  main()
