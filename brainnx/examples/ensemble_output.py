"""What the demo writes: checkpoints of a training run (resumed after an interruption) and
the plot of Figure 1's four panels.

Example:
  >>> from brainnx.examples.ensemble_output import resolve_out
  >>> str(resolve_out('results/')), str(resolve_out('fig.pdf'))
  ('results/ensemble.png', 'fig.pdf')
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from brainnx.examples.ensemble import DATA_RANGE, GRID_RANGE, panel_prediction, std_report, target


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


def check_writable(path: Path, flag: str, parser, *, directory: bool = False) -> None:
  """Probe, before training, that ``path`` (a file, or with ``directory`` a directory) can be
  written: create its missing directories, then create and remove a file there (an existing
  file is opened for appending, not changed). A failure is one line on stderr naming ``flag``
  and exit status 2, as argparse's errors: ``--out /proc/fig.png`` is refused before a step
  runs, not after all of them."""
  def refuse(message: str):
    parser.exit(2, f'{parser.prog}: error: {flag}: {message}\n')

  folder = path if directory else path.parent
  try:
    folder.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    refuse(f'cannot create the directory {folder} ({e.strerror or e})')
  probe = folder / f'.brainnx-probe-{os.getpid()}' if directory else path
  existed = probe.exists()
  try:
    with open(probe, 'ab'):
      pass
    if not existed:
      probe.unlink()
  except OSError as e:
    refuse(f'cannot write {probe if not directory else folder} ({e.strerror or e})')


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
    if panel.size > 1 and 3 * std.max() < 30:  # a spread too thin for this scale: show it magnified
      _spread_inset(ax, g, preds[panel.rows, :, 0], mean, std)
  axes[0].set_ylabel('y')
  # the legend of the panel with every kind of curve, where the first panel's inset leaves room
  with_all = max(axes, key=lambda a: len(a.get_legend_handles_labels()[1]))
  axes[1 if len(axes) > 1 else 0].legend(*with_all.get_legend_handles_labels(), loc='upper left', fontsize=7)
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=100)
  plt.close(fig)


def _spread_inset(ax, g, means, mean, std):
  """An inset under ``ax``'s curves: each network's mean minus the panel's mean, with ± 3 std, on
  its own scale (an MSE ensemble's members agree to a fraction of a unit on the data, invisible
  on the panel's ±300). Its tick labels and title sit inside its own box, never over the panel's
  curves; its x axis is the panel's. Returns the inset's axes."""
  inset = ax.inset_axes([0.5, 0.05, 0.47, 0.36])
  inset.axvspan(-GRID_RANGE, -DATA_RANGE, color='0.93', lw=0)
  inset.axvspan(DATA_RANGE, GRID_RANGE, color='0.93', lw=0)
  inset.fill_between(g, -3 * std, 3 * std, color='tab:grey', alpha=0.35)
  for p in means:
    inset.plot(g, p - mean, color='tab:red', alpha=0.6, lw=0.8)
  inset.set_xlim(-GRID_RANGE, GRID_RANGE)
  reach = float(np.max(np.abs(np.concatenate([np.ravel(means - mean), np.ravel(3 * std)]))))
  reach = reach if reach > 0 else 1.0
  inset.set_ylim(-reach, 1.4 * reach)  # headroom for the title inside the box
  inset.set_yticks([-reach, 0.0, reach])
  inset.tick_params(bottom=False, labelbottom=False, left=False, labelleft=False)  # the scale is in the title
  inset.axhline(0.0, color='0.6', lw=0.5)
  inset.text(0.5, 0.97, f'network means − mean (±{reach:.3g})', transform=inset.transAxes, ha='center', va='top',
             fontsize=6)
  return inset


def have_matplotlib() -> bool:
  try:
    import matplotlib  # noqa: F401
  except ImportError:
    return False
  return True
