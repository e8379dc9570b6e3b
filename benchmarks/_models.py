"""The models the benchmark scripts time (not a test, not a library): one two-layer MLP of any
sizes and activation, and its pure-pytree twin.

Every script's model is this one class at its own sizes, so a table's rows differ only by the
transform that runs it; ``params_of`` reads the very arrays a script's NNX model holds, so the
pure-jax rows compute the same thing (``_peers.pure_mlp`` on them).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from flax import nnx


class MLP(nnx.Module):
  """``Linear(n_in, hidden)``, ``act``, ``Linear(hidden, n_out)``."""

  def __init__(self, n_in: int, hidden: int, n_out: int, *, rngs: nnx.Rngs, act: Callable = jax.nn.relu):
    self.l1 = nnx.Linear(n_in, hidden, rngs=rngs)
    self.l2 = nnx.Linear(hidden, n_out, rngs=rngs)
    self.act = act

  def __call__(self, x):
    return self.l2(self.act(self.l1(x)))


def params_dict(model: MLP) -> dict:
  """``{'l1': {'kernel', 'bias'}, 'l2': {...}}``: the model's arrays as a plain pytree."""
  return {name: {'kernel': layer.kernel[...], 'bias': layer.bias[...]}
          for name, layer in (('l1', model.l1), ('l2', model.l2))}


def pure_mlp(params: dict, x, act: Callable = jax.nn.relu):
  """The same MLP on :func:`params_dict`'s pytree."""
  h = act(x @ params['l1']['kernel'] + params['l1']['bias'])
  return h @ params['l2']['kernel'] + params['l2']['bias']


class Layers(nnx.Module):
  """``Linear`` layers of the given sizes with ReLU between (``(64, 256, 256, 64)``: three layers)."""

  def __init__(self, sizes, *, rngs: nnx.Rngs):
    self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in zip(sizes[:-1], sizes[1:])])

  def __call__(self, x):
    for i, layer in enumerate(self.layers):
      x = layer(x)
      if i + 1 < len(self.layers):
        x = jax.nn.relu(x)
    return x
