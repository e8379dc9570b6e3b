"""Figure 1 of Deep Ensembles as a problem: its data, its network, its losses, its four panels,
and the predictions and reports made from a trained stack of networks.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from brainnx.examples.ensemble import MLP, figure_panels, make_data
  >>> x, y, grid = make_data(seed=0)
  >>> x.shape, grid.shape, MLP(8, rngs=nnx.Rngs(0))(x).shape
  ((20, 1), (241, 1), (20, 2))
  >>> [p.title for p in figure_panels(2)][3]
  '(iv) Ensemble of 2 (NLL + adversarial)'
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


DATA_RANGE = 4.0  # x ~ U[-DATA_RANGE, DATA_RANGE]


GRID_RANGE = 6.0  # predictions on [-GRID_RANGE, GRID_RANGE]


NOISE_STD = 3.0


MIN_VARIANCE = 1e-6


HIDDEN = 100


LEARNING_RATE = 3e-3


ADVERSARIAL_FRACTION = 0.01  # the paper's eps: 1% of the range of the training inputs


#: The hidden biases start uniform in ``[-BIAS_RANGE, BIAS_RANGE]`` (see :class:`MLP`).
BIAS_RANGE = 2 * DATA_RANGE


class MLP(nnx.Module):
  """1 -> ``hidden`` ReLU -> (mean, variance): the paper's toy network.

  ``model(x)`` for ``x`` of shape ``(n, 1)`` is ``(n, 2)``: column 0 the mean,
  column 1 the variance ``softplus(.) + 1e-6``. The hidden biases start
  uniform in ``[-bias_range, bias_range]`` (default twice the data's range), so
  the ReLU kinks (at ``-bias / weight``) start spread over and beyond the data:
  a unit whose kink lies outside the data is trained little and keeps much of
  its random start there, which is where the members of an ensemble then
  disagree. flax's zero biases put every kink at ``x = 0``.
  """

  def __init__(self, hidden: int, *, bias_range: float = BIAS_RANGE, rngs: nnx.Rngs):
    spread = nnx.initializers.uniform(2.0 * bias_range)
    self.l1 = nnx.Linear(1, hidden, bias_init=lambda k, s, d: spread(k, s, d) - bias_range, rngs=rngs)
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
