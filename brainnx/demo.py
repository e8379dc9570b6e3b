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
its row of the stack. The first layer's biases start uniform in ``[-1, 1]``
(flax's default is zero, which puts every ReLU kink at ``x = 0`` at the start).
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
import dataclasses
import functools
import os
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

DATA_RANGE = 4.0  # x ~ U[-DATA_RANGE, DATA_RANGE]
GRID_RANGE = 6.0  # predictions on [-GRID_RANGE, GRID_RANGE]
NOISE_STD = 3.0
MIN_VARIANCE = 1e-6
HIDDEN = 100
LEARNING_RATE = 3e-3
ADVERSARIAL_FRACTION = 0.01  # the paper's eps: 1% of the range of the training inputs


class MLP(nnx.Module):
  """1 -> ``hidden`` ReLU -> (mean, variance): the paper's toy network.

  ``model(x)`` for ``x`` of shape ``(n, 1)`` is ``(n, 2)``: column 0 the mean,
  column 1 the variance ``softplus(.) + 1e-6``. The hidden biases start
  uniform in ``[-1, 1]``, so the ReLU kinks start spread over the inputs.
  """

  def __init__(self, hidden: int, *, rngs: nnx.Rngs):
    spread = nnx.initializers.uniform(2.0)
    self.l1 = nnx.Linear(1, hidden, bias_init=lambda k, s, d: spread(k, s, d) - 1.0, rngs=rngs)
    self.l2 = nnx.Linear(hidden, 2, rngs=rngs)

  def __call__(self, x):
    out = self.l2(jax.nn.relu(self.l1(x)))
    return jnp.concatenate([out[:, :1], jax.nn.softplus(out[:, 1:]) + MIN_VARIANCE], axis=-1)


def target(x):
  return x**3


def make_data(seed: int, n: int = 20):
  """``n`` noisy samples of ``x**3`` on ``[-4, 4]`` and a grid on ``[-6, 6]`` (shapes ``(n, 1)``, ``(241, 1)``)."""
  kx, kn = jax.random.split(jax.random.key(seed))
  x = jax.random.uniform(kx, (n, 1), minval=-DATA_RANGE, maxval=DATA_RANGE)
  y = target(x) + NOISE_STD * jax.random.normal(kn, (n, 1))
  grid = jnp.linspace(-GRID_RANGE, GRID_RANGE, 241)[:, None]
  return x, y, grid


def gaussian_nll(out, y):
  """Mean negative log-likelihood of ``y`` under ``N(out[:, 0], out[:, 1])``, without the constant."""
  mean, var = out[:, :1], out[:, 1:]
  return (0.5 * jnp.log(var) + 0.5 * (y - mean) ** 2 / var).mean()


def squared_error(out, y):
  """Mean squared error of the predicted mean ``out[:, 0]`` (the variance column is unused)."""
  return ((out[:, :1] - y) ** 2).mean()


@dataclasses.dataclass(frozen=True)
class Panel:
  """One panel of Figure 1: its rows of the network stack and how they train."""

  label: str
  rows: slice
  nll: bool  # trained on the Gaussian NLL; else on the squared error of the mean
  adversarial: bool

  @property
  def size(self) -> int:
    return self.rows.stop - self.rows.start

  @property
  def title(self) -> str:
    who = f'Ensemble of {self.size}' if self.size > 1 else 'One network'
    return f'{self.label} {who} ({"NLL" if self.nll else "MSE"}{" + adversarial" if self.adversarial else ""})'


def figure_panels(members: int) -> tuple[Panel, ...]:
  """The four panels of Figure 1 over a stack of ``2 * members + 2`` networks."""
  m = members
  return (Panel('(i)', slice(0, m), nll=False, adversarial=False),
          Panel('(ii)', slice(m, m + 1), nll=True, adversarial=False),
          Panel('(iii)', slice(m + 1, m + 2), nll=True, adversarial=True),
          Panel('(iv)', slice(m + 2, 2 * m + 2), nll=True, adversarial=True))


def roles(panels) -> tuple[np.ndarray, np.ndarray]:
  """Per network of the stack: trained on the NLL? with the adversarial step? (two bool arrays)."""
  nll = np.concatenate([np.full(p.size, p.nll) for p in panels])
  adversarial = np.concatenate([np.full(p.size, p.adversarial) for p in panels])
  return nll, adversarial


def build(networks: int, seed: int, hidden: int = HIDDEN, lr: float = LEARNING_RATE):
  """The stacked networks (one ``bnx.vmap`` over the constructor) and one adam optimizer per
  network, made in one compiled program (run eagerly, the mapped constructor dispatches and
  compiles its operations one by one: seconds, where the program takes one compilation)."""
  return _build(networks, seed, hidden, lr)


@functools.partial(bnx.jit, static_argnums=(0, 1, 2, 3))
def _build(networks: int, seed: int, hidden: int, lr: float):
  rngs = nnx.Rngs(seed)
  ensemble = bnx.vmap(lambda: MLP(hidden, rngs=rngs), axis_size=networks)()
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
    # numpy step indices: the same value in every process, as jax.distributed needs
    return bnx.for_loop(lambda _: train_step(ensemble, optimizers, nll, adversarial, x, y),
                        np.arange(steps), pbar=pbar)

  layout = None if mesh is None else {NamedSharding(mesh, P('ens')): ...}
  compiled = bnx.jit(loop, static_argnums=0, donate_states=True, state_shardings=layout)
  network_roles = roles(panels) if mesh is None else place(mesh, P('ens'), *roles(panels))

  def run(steps: int, x, y):
    return compiled(steps, x, y, *network_roles)

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
          progress: bool = True) -> dict:
  """``python -m brainnx.demo`` without the command line: trains the four panels' networks and
  returns ``panels``, ``ensemble``, ``losses`` (steps, networks), ``predictions`` on the grid
  (networks, 241, 2), ``reports`` (``std_report`` per panel) and ``data`` (x, y, grid)."""
  x, y, grid = make_data(seed)
  panels = figure_panels(members)
  ensemble, optimizers = build(2 * members + 2, seed)
  run = make_trainer(ensemble, optimizers, panels, adversarial_epsilon(x, adversarial), progress=progress)
  losses = to_host(run(steps, x, y))
  preds = predict(ensemble, grid)
  reports = panel_reports(panels, preds, grid)
  return {'panels': panels, 'ensemble': ensemble, 'losses': losses, 'predictions': preds,
          'reports': reports, 'data': (x, y, grid)}


# ------------------------------------------------------------------ predictions


def predict(ensemble, grid) -> np.ndarray:
  """Every network's (mean, variance) on ``grid``: shape ``(networks, len(grid), 2)``."""
  return to_host(bnx.vmap(lambda m, g: m(g), in_axes=(0, None))(ensemble, grid))


def mixture(preds: np.ndarray):
  """Mean and std of the uniform mixture of the members' Gaussians (the paper's ensemble prediction)."""
  means, variances = preds[..., 0], preds[..., 1]
  mean = means.mean(0)
  variance = (variances + means**2).mean(0) - mean**2
  return mean, np.sqrt(np.maximum(variance, 0.0))


def panel_prediction(panel: Panel, preds: np.ndarray):
  """A panel's predictive mean and std on the grid: the mixture of its networks' Gaussians, or for
  networks trained on the squared error, the mean and spread (std) of their means."""
  rows = preds[panel.rows]
  if panel.nll:
    return mixture(rows)
  return rows[..., 0].mean(0), rows[..., 0].std(0)


def std_report(grid, mean, std) -> dict:
  """The predictive std inside the data (``|x| <= 4``) and its ratio on each side outside it
  (``x < -4``, ``x > 4``); the share of the whole grid where ``x**3`` is within ± 3 std; the RMSE
  of the mean against ``x**3`` inside the data."""
  g = np.asarray(grid)[:, 0]
  inside = np.abs(g) <= DATA_RANGE
  std_inside = float(std[inside].mean())
  left, right = float(std[g < -DATA_RANGE].mean()), float(std[g > DATA_RANGE].mean())
  return {'std_inside': std_inside, 'std_left': left, 'std_right': right,
          'ratio_left': left / std_inside, 'ratio_right': right / std_inside,
          'covered': float((np.abs(target(g) - mean) <= 3 * std).mean()),
          'rmse_inside': float(np.sqrt(((mean - target(g))[inside] ** 2).mean()))}


def panel_reports(panels, preds: np.ndarray, grid) -> list[dict]:
  """``std_report`` of every panel's prediction on ``grid``."""
  return [std_report(grid, *panel_prediction(panel, preds)) for panel in panels]


def report_table(panels, reports, last_losses) -> str:
  """The per-panel table the run prints (one line per panel)."""
  lines = [f'{"panel":<40}{"loss":>8}{"std |x|<=4":>12}{"x<-4":>6}{"x>4":>6}{"x^3 in ±3 std":>15}']
  for panel, r in zip(panels, reports):
    loss = float(np.mean(last_losses[panel.rows]))
    lines.append(f'{panel.title:<40}{loss:>8.3f}{r["std_inside"]:>12.2f}{r["ratio_left"]:>5.1f}x'
                 f'{r["ratio_right"]:>5.1f}x{r["covered"]:>15.0%}')
  lines.append('loss: at the last step, mean over the panel\'s networks; std: the predictive std inside\n'
               'the data and its ratio on each side outside it; the last column is a share of [-6, 6]')
  return '\n'.join(lines)


# ------------------------------------------------------------------ checkpoints


class Checkpoints:
  """Orbax checkpoints of ``{'model', 'optimizers', 'record'}`` plus the run's settings.

  Each checkpoint is a step folder of ``directory`` (the latest two are kept);
  ``record`` is fixed-size (``first``, ``last``: each network's first and latest
  loss), so every save writes the same number of bytes. The losses of every
  step go to ``directory/losses.f32`` (float32, ``networks`` per step),
  appended once per chunk. ``restore`` loads into the given (freshly built)
  ensemble and optimizers with ``nnx.update``, so the Variables keep their
  identity.
  """

  def __init__(self, directory: Path, settings: dict, networks: int):
    import orbax.checkpoint as ocp  # imported here: only runs that checkpoint pay for it

    self._ocp = ocp
    self.settings = settings
    self.networks = networks
    self.directory = Path(directory).absolute()
    self.manager = ocp.CheckpointManager(
      self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True)
    )
    self.log = self.directory / 'losses.f32'

  def latest_step(self):
    return self.manager.latest_step()

  def saved_settings(self, step: int) -> dict:
    ocp = self._ocp
    return dict(self.manager.restore(step, args=ocp.args.Composite(settings=ocp.args.JsonRestore())).settings)

  def append_losses(self, losses: np.ndarray) -> None:
    with open(self.log, 'ab') as f:
      f.write(np.asarray(losses, '<f4').tobytes())

  def save(self, step: int, ensemble, optimizers, record: dict) -> None:
    ocp = self._ocp
    state = {'model': nnx.state(ensemble), 'optimizers': nnx.state(optimizers), 'record': record}
    self.manager.save(step, args=ocp.args.Composite(
      state=ocp.args.StandardSave(state), settings=ocp.args.JsonSave(self.settings)))
    self.manager.wait_until_finished()

  def restore(self, step: int, ensemble, optimizers) -> dict:
    ocp = self._ocp
    record = {'first': np.zeros(self.networks, np.float32), 'last': np.zeros(self.networks, np.float32)}
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, {
      'model': nnx.state(ensemble), 'optimizers': nnx.state(optimizers), 'record': record})
    state = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))).state
    nnx.update(ensemble, state['model'])
    nnx.update(optimizers, state['optimizers'])
    # a run stopped between appending a chunk's losses and saving its checkpoint logged steps
    # that the checkpoint does not hold: they are trained again, so drop them from the log
    keep = step * self.networks * 4
    if self.log.exists() and self.log.stat().st_size > keep:
      os.truncate(self.log, keep)
    return {k: np.asarray(v) for k, v in state['record'].items()}

  def losses(self, step: int) -> np.ndarray:
    """The logged losses of steps ``1..step``, shape ``(step, networks)`` (NaN where the log lacks them)."""
    members = self.networks
    logged = np.fromfile(self.log, '<f4') if self.log.exists() else np.zeros(0, np.float32)
    out = np.full(step * members, np.nan, np.float32)
    out[: min(len(logged), len(out))] = logged[: len(out)]
    return out.reshape(step, members)

  def close(self) -> None:
    self.manager.close()


# ------------------------------------------------------------------ plot


IMAGE_SUFFIXES = ('.png', '.pdf', '.svg', '.jpg', '.jpeg')


def resolve_out(out: str) -> Path:
  """``--out``: an image path (``.png``, ``.pdf``, ``.svg``, ``.jpg``) or a directory for ``ensemble.png``.

  Raises:
    ValueError: if ``out`` is not an existing directory, does not end with ``/``, and its suffix is
      not one of those image types (``x.gif`` would otherwise become a directory).
  """
  path = Path(out)
  if path.is_dir() or out.endswith(('/', os.sep)) or not path.suffix:
    return path / 'ensemble.png'
  if path.suffix.lower() in IMAGE_SUFFIXES:
    return path
  raise ValueError(
    f'--out {out}: {path.suffix!r} is not an image type the demo writes ({", ".join(IMAGE_SUFFIXES)}); '
    f'give an image path such as {path.with_suffix(".png")}, or a directory (end it with "/" if its name has a dot)'
  )


def _check_writable(png: Path, out: str, parser) -> None:
  """Create ``png``'s missing parent directories and check that the plot can be written there,
  as an argparse error (exit 2) naming ``--out``."""
  try:
    png.parent.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    parser.error(f'--out {out}: cannot create the directory {png.parent} ({e.strerror})')
  if not os.access(png.parent, os.W_OK) or (png.exists() and not os.access(png, os.W_OK)):
    parser.error(f'--out {out}: {png if png.exists() else png.parent} is not writable')


def plot(path: Path, panels, preds: np.ndarray, data) -> None:
  """The four panels side by side, as the paper's Figure 1: data, truth, each network's mean, and
  the panel's predictive mean ± 3 std."""
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  x, y, grid = (np.asarray(a) for a in data)
  g = grid[:, 0]
  fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.6), sharey=True)
  for ax, panel in zip(axes, panels):
    mean, std = panel_prediction(panel, preds)
    report = std_report(grid, mean, std)
    ax.axvspan(-GRID_RANGE, -DATA_RANGE, color='0.93', lw=0)
    ax.axvspan(DATA_RANGE, GRID_RANGE, color='0.93', lw=0, label='no data')
    ax.fill_between(g, mean - 3 * std, mean + 3 * std, color='tab:grey', alpha=0.35, label='mean ± 3 std')
    if panel.size > 1:
      for k, p in enumerate(preds[panel.rows, :, 0]):
        ax.plot(g, p, color='tab:red', alpha=0.3, lw=0.8, label='network means' if k == 0 else None)
    ax.plot(g, mean, color='tab:red', lw=2, label='predictive mean')
    ax.plot(g, target(g), color='tab:blue', lw=1.5, label='$y = x^3$')
    ax.scatter(x[:, 0], y[:, 0], s=12, color='black', zorder=3, label='data (20 points)')
    ax.set_xlim(-GRID_RANGE, GRID_RANGE)
    ax.set_ylim(-300, 300)
    ax.set_xlabel('x')
    ax.set_title(f'{panel.title}\nstd outside / inside: left {report["ratio_left"]:.1f}x, '
                 f'right {report["ratio_right"]:.1f}x', fontsize=9)
  axes[0].set_ylabel('y')
  axes[0].legend(loc='upper left', fontsize=7)
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=100)
  plt.close(fig)


def _have_matplotlib() -> bool:
  try:
    import matplotlib  # noqa: F401
  except ImportError:
    return False
  return True


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
  parser.add_argument('--seed', type=int, default=0, help='seed for data and initialisation')
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
    _check_writable(png, args.out, parser)  # before training, not after: a bad path loses nothing
  if png is not None and not _have_matplotlib():
    print('matplotlib is not installed, so no plot will be written '
          "(pip install matplotlib, or pip install 'brainnx[plot]'; --no-plot silences this)", file=sys.stderr)
    png = None

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
    print(f'\ntrained {networks} networks (the four panels of Figure 1){where}: steps {resumed_at + 1}-{step} '
          f'in {time.perf_counter() - start:.1f} s')
  else:
    past = 'past' if step > args.steps else 'at'
    print(f'\nnothing to train: the checkpoint in {args.checkpoint_dir} is {past} step {step} '
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
