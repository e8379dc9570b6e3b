"""The main job: train an MLP ensemble with optax on synthetic 1-D data.

Run ``python -m brainnx.demo`` (``--help`` for flags). It makes a noisy
regression set in code (no download), creates an ensemble in one line
(``brainnx.vmap`` over the constructor: every member gets its own RNG keys),
gives each member its own ``nnx.Optimizer`` (adam), trains all members in one
compiled loop with a progress bar, prints each member's final loss, the
ensemble's error on a held-out grid and where the true function leaves the
ensemble's band, and writes ``ensemble.png`` (when matplotlib is installed).

With ``--checkpoint-dir DIR`` the ensemble, its optimizers and the loss
history are saved with orbax every ``--checkpoint-every`` steps; running the
same command again resumes from the latest checkpoint, and the resumed run
ends exactly where an uninterrupted one does.

With ``--devices N`` the members are split over the first N devices (a mesh
axis ``'ens'``; on CPU, ``XLA_FLAGS=--xla_force_host_platform_device_count=N``
makes N devices). With ``--distributed HOST:PORT --num-processes P
--process-id I`` the same training runs as one of P processes under
``jax.distributed.initialize`` (gloo collectives on CPU), the members split over
every process's devices; the result equals a one-process run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import brainnx as bnx


class MLP(nnx.Module):
  """1 -> hidden -> hidden -> 1 regressor."""

  def __init__(self, hidden: int, *, rngs: nnx.Rngs):
    self.l1 = nnx.Linear(1, hidden, rngs=rngs)
    self.l2 = nnx.Linear(hidden, hidden, rngs=rngs)
    self.l3 = nnx.Linear(hidden, 1, rngs=rngs)

  def __call__(self, x):
    x = jnp.tanh(self.l1(x))
    x = jnp.tanh(self.l2(x))
    return self.l3(x)


def target(x):
  return jnp.sin(2.0 * x) + 0.3 * x


def make_data(seed: int, n: int = 128):
  """Two clusters of noisy samples, and a held-out grid spanning the gap and beyond."""
  kx, kn = jax.random.split(jax.random.key(seed))
  x = jax.random.uniform(kx, (n, 1), minval=1.0, maxval=3.0) * jnp.where(jnp.arange(n)[:, None] % 2 == 0, 1.0, -1.0)
  y = target(x) + 0.1 * jax.random.normal(kn, (n, 1))
  grid = jnp.linspace(-4.0, 4.0, 200)[:, None]
  return x, y, grid


IMAGE_SUFFIXES = ('.png', '.pdf', '.svg', '.jpg', '.jpeg')


def build(members: int, seed: int, hidden: int = 64, lr: float = 1e-2):
  """The stacked ensemble (one ``bnx.vmap`` over the constructor) and one adam optimizer per member."""
  rngs = nnx.Rngs(seed)
  ensemble = bnx.vmap(lambda: MLP(hidden, rngs=rngs), axis_size=members)()
  optimizers = bnx.vmap(lambda m: nnx.Optimizer(m, optax.adam(lr), wrt=nnx.Param))(ensemble)
  return ensemble, optimizers


def make_trainer(ensemble, optimizers, mesh=None):
  """``run(steps, x, y) -> losses (steps, members)``: ``steps`` adam steps of every member in one
  compiled loop (one program per distinct ``steps``), with a progress bar.

  The parameters and adam state are donated (``donate_states=True``): XLA updates them in place.
  With a ``mesh`` (axis ``'ens'``) every Variable is laid out ``P('ens')`` (``state_shardings``),
  so each device holds and steps its own members (``spmd_axis_name='ens'``).
  """

  @bnx.vmap(in_axes=(0, 0, None, None), spmd_axis_name=None if mesh is None else 'ens')
  def train_step(model, opt, x, y):
    loss, grads = bnx.value_and_grad(lambda m: ((m(x) - y) ** 2).mean(), argnums=0)(model)
    opt.update(model, grads)
    return loss

  bars = {}  # one progress bar per loop length, made when that loop is traced

  def loop(steps: int, x, y):
    pbar = bars.setdefault(steps, bnx.ProgressBar(
      count=min(20, steps), disable=jax.process_index() != 0,
      desc=('loss (mean over members) {loss:.4f}', lambda d: {'loss': d['y'].mean()})))
    # numpy step indices: the same value in every process, as jax.distributed needs
    return bnx.for_loop(lambda _: train_step(ensemble, optimizers, x, y), np.arange(steps), pbar=pbar)

  layout = None if mesh is None else {NamedSharding(mesh, P('ens')): ...}
  return bnx.jit(loop, static_argnums=0, donate_states=True, state_shardings=layout)


def make_mesh(devices: int | None):
  """A 1-D mesh ``'ens'`` over the first ``devices`` devices (all of them with ``jax.distributed``)."""
  found = jax.devices()
  if devices is not None and devices > len(found):
    raise ValueError(
      f'--devices {devices}: only {len(found)} device(s) here; on CPU set '
      f'XLA_FLAGS=--xla_force_host_platform_device_count={devices} before starting'
    )
  return jax.make_mesh((devices or len(found),), ('ens',), devices=found[: devices or len(found)])


def replicate(mesh, *arrays):
  """The same arrays, replicated on every device of ``mesh`` (inputs of a many-process program)."""
  sharding = NamedSharding(mesh, P())
  return tuple(jax.make_array_from_callback(np.shape(a), sharding, lambda i, a=np.asarray(a): a[i]) for a in arrays)


def to_host(x) -> np.ndarray:
  """A numpy copy of ``x``, gathered from every process when it spans several."""
  if getattr(x, 'is_fully_addressable', True):
    return np.asarray(x)
  from jax.experimental import multihost_utils

  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def train(members: int, steps: int, seed: int, hidden: int = 64, lr: float = 1e-2):
  """Train the ensemble; returns (ensemble, per-step losses of shape (steps, members), data)."""
  x, y, grid = make_data(seed)
  ensemble, optimizers = build(members, seed, hidden, lr)
  losses = make_trainer(ensemble, optimizers)(steps, x, y)
  return ensemble, losses, (x, y, grid)


# ------------------------------------------------------------------ checkpoints


class Checkpoints:
  """Orbax checkpoints of ``{'model', 'optimizers', 'losses'}`` plus the run's settings.

  Each checkpoint is a step folder of ``directory`` (the latest two are kept).
  ``restore`` loads into the given (freshly built) ensemble and optimizers with
  ``nnx.update``, so the Variables keep their identity, and returns the step
  and the loss history so far.
  """

  def __init__(self, directory: Path, settings: dict):
    import orbax.checkpoint as ocp  # imported here: only runs that checkpoint pay for it

    self._ocp = ocp
    self.settings = settings
    self.manager = ocp.CheckpointManager(
      Path(directory).absolute(), options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True)
    )

  def latest_step(self):
    return self.manager.latest_step()

  def saved_settings(self, step: int) -> dict:
    ocp = self._ocp
    return dict(self.manager.restore(step, args=ocp.args.Composite(settings=ocp.args.JsonRestore())).settings)

  def save(self, step: int, ensemble, optimizers, losses) -> None:
    ocp = self._ocp
    state = {'model': nnx.state(ensemble), 'optimizers': nnx.state(optimizers), 'losses': jnp.asarray(losses)}
    self.manager.save(step, args=ocp.args.Composite(
      state=ocp.args.StandardSave(state), settings=ocp.args.JsonSave(self.settings)))
    self.manager.wait_until_finished()

  def restore(self, step: int, ensemble, optimizers):
    ocp = self._ocp
    members = self.settings['members']
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, {
      'model': nnx.state(ensemble), 'optimizers': nnx.state(optimizers),
      'losses': jnp.zeros((step, members), jnp.float32)})
    state = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))).state
    nnx.update(ensemble, state['model'])
    nnx.update(optimizers, state['optimizers'])
    return np.asarray(state['losses'])

  def close(self) -> None:
    self.manager.close()


# ------------------------------------------------------------------ report and plot


def band_report(grid, truth, preds, width: float = 2.0):
  """Where the true function lies outside ``mean ± width * std`` of the members.

  Returns ``(fraction of grid points outside, [(x_start, x_end), ...] intervals)``.
  """
  g = np.asarray(grid)[:, 0]
  mean, std = preds.mean(0), preds.std(0)
  outside = np.abs(truth - mean) > width * std
  intervals, start = [], None
  for i, out in enumerate(outside):
    if out and start is None:
      start = i
    if start is not None and (not out or i == len(outside) - 1):
      end = i if out else i - 1
      intervals.append((float(g[start]), float(g[end])))
      start = None
  return float(outside.mean()), intervals


def resolve_out(out: Path) -> Path:
  """``--out``: an image path (``.png``, ``.pdf``, ``.svg``, ``.jpg``) or a directory for ``ensemble.png``."""
  if out.suffix.lower() in IMAGE_SUFFIXES and not out.is_dir():
    return out
  return out / 'ensemble.png'


def predict(ensemble, grid) -> np.ndarray:
  """Every member's prediction on ``grid``: shape ``(members, len(grid))``."""
  return to_host(bnx.vmap(lambda m, g: m(g), in_axes=(0, None))(ensemble, grid))[..., 0]


def plot(path: Path, preds: np.ndarray, data) -> None:
  """Members, mean ± 2 std band, truth and data; the grid where the truth leaves the band is shaded."""
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  x, y, grid = (np.asarray(a) for a in data)
  truth = np.asarray(target(grid)[:, 0])
  mean, std = preds.mean(0), preds.std(0)
  g = np.asarray(grid[:, 0])
  fig, ax = plt.subplots(figsize=(7, 4))
  for k, (lo, hi) in enumerate(band_report(grid, truth, preds)[1]):
    ax.axvspan(lo, hi, color='tab:red', alpha=0.08, lw=0, label='truth outside band' if k == 0 else None)
  ax.fill_between(g, mean - 2 * std, mean + 2 * std, color='tab:blue', alpha=0.2, label='mean ± 2 std')
  for k, p in enumerate(preds):
    ax.plot(g, p, color='tab:blue', alpha=0.35, lw=1, label='members' if k == 0 else None)
  ax.plot(g, mean, color='tab:blue', lw=2, label='ensemble mean')
  ax.plot(g, truth, 'k--', lw=1, label='true function')
  ax.scatter(np.asarray(x[:, 0]), np.asarray(y[:, 0]), s=8, color='tab:orange', label='training data', zorder=3)
  ax.set_xlabel('x')
  ax.set_ylabel('y')
  ax.set_title(f'{len(preds)}-member MLP ensemble (brainnx + optax)')
  ax.legend(loc='upper left', fontsize=8)
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _have_matplotlib() -> bool:
  try:
    import matplotlib  # noqa: F401
  except ImportError:
    return False
  return True


# ------------------------------------------------------------------ command line


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog='python -m brainnx.demo', description='Train an MLP ensemble with brainnx and optax.')
  parser.add_argument('--members', type=int, default=8, help='ensemble size (default 8)')
  parser.add_argument('--steps', type=int, default=400, help='total adam steps (default 400)')
  parser.add_argument('--seed', type=int, default=0, help='seed for data and initialisation')
  parser.add_argument('--out', type=Path, default=Path('.'),
                      help='where the plot goes: an image path such as e4.png (.png/.pdf/.svg/.jpg), '
                           'or a directory for ensemble.png (default .)')
  parser.add_argument('--no-plot', action='store_true', help='skip the plot')
  parser.add_argument('--checkpoint-dir', type=Path, default=None,
                      help='save the ensemble, its optimizers and the losses here with orbax; '
                           'if it already holds a checkpoint of the same run, resume from the latest one')
  parser.add_argument('--checkpoint-every', type=int, default=100,
                      help='steps between checkpoints with --checkpoint-dir (default 100)')
  parser.add_argument('--devices', type=int, default=None,
                      help='split the members over the first N devices (a mesh axis "ens"; --members must be a '
                           'multiple of N; on CPU set XLA_FLAGS=--xla_force_host_platform_device_count=N)')
  parser.add_argument('--distributed', metavar='HOST:PORT', default=None,
                      help='run as one process of a jax.distributed job whose coordinator (process 0) listens at '
                           'HOST:PORT; the members are split over every process\'s devices')
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


def main(argv=None) -> dict:
  parser = _parser()
  args = parser.parse_args(argv)
  if args.members < 1:
    parser.error('--members must be at least 1')
  if args.steps < 1:
    parser.error('--steps must be at least 1')
  if args.checkpoint_every < 1:
    parser.error('--checkpoint-every must be at least 1')
  if args.devices is not None and args.devices < 1:
    parser.error('--devices must be at least 1')
  if args.distributed is not None:
    _start_distributed(args, parser)
  elif args.num_processes is not None or args.process_id is not None:
    parser.error('--num-processes and --process-id go with --distributed')
  lead = jax.process_index() == 0  # the process that reports, plots and saves
  mesh = None
  if args.devices is not None or args.distributed is not None:
    try:
      mesh = make_mesh(args.devices)
    except ValueError as e:
      parser.error(str(e))
    if args.members % mesh.size:
      parser.error(f'--members {args.members} must be a multiple of the {mesh.size} devices it is split over')
  png = None if args.no_plot or not lead else resolve_out(args.out)
  if png is not None and not _have_matplotlib():
    print('matplotlib is not installed, so no plot will be written '
          "(pip install matplotlib, or pip install 'brainnx[plot]'; --no-plot silences this)", file=sys.stderr)
    png = None

  start = time.perf_counter()
  hidden, lr = 64, 1e-2
  x, y, grid = make_data(args.seed)
  host_data = tuple(np.asarray(a) for a in (x, y, grid))
  ensemble, optimizers = build(args.members, args.seed, hidden, lr)
  if mesh is not None:
    x, y, grid = replicate(mesh, x, y, grid)
  run = make_trainer(ensemble, optimizers, mesh)
  history = np.zeros((0, args.members), np.float32)
  step = 0

  ckpt = None
  if args.checkpoint_dir is not None:
    settings = {'members': args.members, 'seed': args.seed, 'hidden': hidden, 'lr': lr}
    ckpt = Checkpoints(args.checkpoint_dir, settings)
    latest = ckpt.latest_step()
    if latest is not None:
      saved = ckpt.saved_settings(latest)
      if saved != settings:
        ckpt.close()
        parser.error(f'{args.checkpoint_dir} holds a checkpoint of another run ({saved}); '
                     f'this run is {settings}: pass the same flags or another --checkpoint-dir')
      history = ckpt.restore(latest, ensemble, optimizers)
      step = latest
      print(f'resumed from {args.checkpoint_dir} at step {step}')
      if step >= args.steps:
        print(f'the checkpoint is at step {step}, at or past --steps {args.steps}: nothing left to train')

  try:
    chunk = args.checkpoint_every if ckpt is not None else args.steps
    while step < args.steps:
      n = min(chunk, args.steps - step)
      if ckpt is not None and lead:
        print(f'steps {step + 1}-{step + n}:')
      losses = to_host(run(n, x, y))
      history = np.concatenate([history, losses])
      step += n
      if ckpt is not None:
        ckpt.save(step, ensemble, optimizers, history)
  finally:
    if ckpt is not None:
      ckpt.close()

  preds = predict(ensemble, grid)  # in every process: gathering is a collective
  grid = host_data[2]
  truth = np.asarray(target(grid)[:, 0])
  member_rmse = np.sqrt(((preds - truth) ** 2).mean(1))
  mean_rmse = float(np.sqrt(((preds.mean(0) - truth) ** 2).mean()))
  outside, intervals = band_report(grid, truth, preds)
  if png is not None:
    plot(png, preds, host_data)
  if args.save is not None:  # every process gathers (a collective), the lead one writes
    flat = {'/'.join(map(str, path)): to_host(v.get_value()) for path, v in nnx.to_flat_state(nnx.state(ensemble))}
    if lead:
      np.savez(args.save, losses=history, **flat)
  if not lead:
    return {'losses': history, 'step': step, 'ensemble': ensemble, 'optimizers': optimizers}
  where = '' if mesh is None else f' on {mesh.size} device(s) in {jax.process_count()} process(es)'

  print(f'\ntrained {args.members} members{where} to step {step} in {time.perf_counter() - start:.1f} s')
  for k in range(args.members):
    print(f'  member {k}: final train loss {history[-1, k]:.4f} (first {history[0, k]:.4f})')
  print(f'held-out grid [-4, 4]: member RMSE {member_rmse.mean():.3f} ± {member_rmse.std():.3f}, '
        f'ensemble-mean RMSE {mean_rmse:.3f}, mean predictive std {preds.std(0).mean():.3f}')
  if intervals:
    support = (np.abs(np.asarray(grid[:, 0])) >= 1.0) & (np.abs(np.asarray(grid[:, 0])) <= 3.0)
    off = np.abs(truth - preds.mean(0)) > 2 * preds.std(0)
    widest = sorted(intervals, key=lambda iv: iv[0] - iv[1])[:3]
    where = ', '.join(f'[{lo:.2f}, {hi:.2f}]' for lo, hi in sorted(widest))
    print(f'overconfident: the true function is outside the ensemble mean ± 2 std on {outside:.0%} of the '
          f'held-out grid ({off[~support].mean():.0%} away from the training data, {off[support].mean():.0%} '
          f'within 1 <= |x| <= 3); widest gaps at x in {where}. The members agree where they are wrong: '
          f'their spread is not a calibrated error bar.')
  else:
    print('the true function is inside the ensemble mean ± 2 std everywhere on the held-out grid')
  if ckpt is not None:
    print(f'checkpoints in {args.checkpoint_dir} (latest: step {step}); the same command resumes from there')
  if png is not None:
    print(f'wrote {png}')
  if args.save is not None:
    print(f'wrote {args.save}')
  return {'losses': history, 'png': png, 'member_rmse': member_rmse, 'mean_rmse': mean_rmse,
          'outside_band': outside, 'outside_intervals': intervals, 'step': step,
          'ensemble': ensemble, 'optimizers': optimizers}


if __name__ == '__main__':
  main()
