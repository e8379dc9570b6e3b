"""The peer frameworks' rows (equinox, brainstate) for the benchmark tables (not a test, not a library).

Both are optional (``pip install -e ".[bench]"``): a script leaves a peer's
rows out, and prints why, when it is not installed or does not import.

Every row computes the same thing as the script's other rows: the models here
are built from the very arrays of the script's NNX model (a list of
``(kernel, bias)`` pairs, an activation between layers), each layer holding
two leaves (equinox) or two ``ParamState``s (brainstate), as ``nnx.Linear``
holds two ``nnx.Param``s. Equinox passes the model as an argument
(``filter_jit`` / ``filter_vmap``, its idiom); brainstate finds its states in
the closure (``brainstate.transform.jit`` / ``vmap2``, its idiom).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import optax

try:
  import equinox as eqx
except Exception as err:  # noqa: BLE001 - any failure to import means: no rows
  eqx = None
  EQX_WHY = f'{type(err).__name__}: {err}'
else:
  EQX_WHY = ''

try:
  import brainstate
except Exception as err:  # noqa: BLE001
  brainstate = None
  BST_WHY = f'{type(err).__name__}: {err}'
else:
  BST_WHY = ''

HAVE_EQX = eqx is not None
HAVE_BST = brainstate is not None

Params = Sequence[tuple[jax.Array, jax.Array]]


def versions() -> str:
  """``equinox X, brainstate Y`` (or what is missing) for a script's header line."""
  parts = [f'equinox {eqx.__version__}' if HAVE_EQX else 'no equinox']
  parts.append(f'brainstate {brainstate.__version__}' if HAVE_BST else 'no brainstate')
  return ', '.join(parts)


def notes() -> str:
  """A line per missing peer, saying that its rows are skipped and why ('' when both are there)."""
  lines = []
  for name, why in (('equinox', EQX_WHY), ('brainstate', BST_WHY)):
    if why:
      lines.append(f'note: {name} rows skipped ({why}); install them with pip install -e ".[bench]"')
  return '\n'.join(lines)


def params_of(layers) -> list[tuple[jax.Array, jax.Array]]:
  """The ``(kernel, bias)`` arrays of a sequence of ``nnx.Linear`` layers."""
  return [(layer.kernel[...], layer.bias[...]) for layer in layers]


def pure_mlp(params: Params, x, act: Callable):
  """The reference computation: ``x @ kernel + bias`` per layer, ``act`` between layers."""
  for i, (w, b) in enumerate(params):
    x = x @ w + b
    if i + 1 < len(params):
      x = act(x)
  return x


# -- equinox --------------------------------------------------------------------------

if HAVE_EQX:

  class EqxLinear(eqx.Module):
    kernel: jax.Array
    bias: jax.Array

    def __call__(self, x):
      return x @ self.kernel + self.bias

  class EqxMLP(eqx.Module):
    layers: list
    act: Callable = eqx.field(static=True)

    def __call__(self, x):
      for i, layer in enumerate(self.layers):
        x = layer(x)
        if i + 1 < len(self.layers):
          x = self.act(x)
      return x


def eqx_model(params: Params, act: Callable):
  return EqxMLP([EqxLinear(w, b) for w, b in params], act)


def eqx_forward():
  """``eqx.filter_jit(lambda m, x: m(x))``: call it as ``f(model, x)``."""
  return eqx.filter_jit(lambda m, x: m(x))


def eqx_ensemble_forward():
  """``eqx.filter_jit(eqx.filter_vmap(lambda m, x: m(x), in_axes=(0, None)))``."""
  return eqx.filter_jit(eqx.filter_vmap(lambda m, x: m(x), in_axes=(0, None)))


def eqx_ensemble_step(tx: optax.GradientTransformation):
  """One adam step per member: ``step(model, opt_state, x, y) -> (model, opt_state, loss)``."""

  @eqx.filter_jit
  @eqx.filter_vmap(in_axes=(0, 0, None, None))
  def step(model, opt_state, x, y):
    loss, grads = eqx.filter_value_and_grad(lambda m: ((m(x) - y) ** 2).mean())(model)
    updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, loss

  return step


def eqx_opt_init(tx: optax.GradientTransformation, model):
  return eqx.filter_vmap(tx.init)(eqx.filter(model, eqx.is_array))


class EqxTrainer:
  """Holds an equinox ensemble and its adam state; ``__call__`` runs one step, returns the losses."""

  def __init__(self, tx, params: Params, act: Callable):
    self.model = eqx_model(params, act)
    self.opt_state = eqx_opt_init(tx, self.model)
    self.step = eqx_ensemble_step(tx)

  def __call__(self, x, y):
    self.model, self.opt_state, loss = self.step(self.model, self.opt_state, x, y)
    return loss


# -- brainstate -----------------------------------------------------------------------

if HAVE_BST:

  class BstLinear(brainstate.nn.Module):
    def __init__(self, w, b):
      super().__init__()
      self.kernel = brainstate.ParamState(w)
      self.bias = brainstate.ParamState(b)

    def __call__(self, x):
      return x @ self.kernel.value + self.bias.value

  class BstMLP(brainstate.nn.Module):
    def __init__(self, params: Params, act: Callable):
      super().__init__()
      self.layers = [BstLinear(w, b) for w, b in params]
      self.act = act

    def __call__(self, x):
      for i, layer in enumerate(self.layers):
        x = layer(x)
        if i + 1 < len(self.layers):
          x = self.act(x)
      return x


def bst_model(params: Params, act: Callable):
  return BstMLP(params, act)


def bst_forward(model):
  """``brainstate.transform.jit(lambda x: model(x))``: the model is found in the closure."""
  return brainstate.transform.jit(lambda x: model(x))


def bst_ensemble_forward(model, members: int):
  """``jit(vmap2(lambda x: model(x), in_axes=None, state_in_axes=ParamState))``."""
  return brainstate.transform.jit(
    brainstate.transform.vmap2(lambda x: model(x), in_axes=None, state_in_axes=brainstate.ParamState, axis_size=members)
  )


def bst_ensemble_step(tx: optax.GradientTransformation, model, members: int):
  """One adam step per member, all states batched on axis 0: ``step(x, y) -> loss``.

  brainstate 0.5 has no optimizer of its own, so optax's state lives in a
  ``brainstate.ShortTermState`` and the step writes the new parameters back.
  """
  param_states = model.states(brainstate.ParamState)
  opt = brainstate.ShortTermState(jax.vmap(tx.init)({k: s.value for k, s in param_states.items()}))

  @brainstate.transform.jit
  @brainstate.transform.vmap2(
    in_axes=(None, None), state_in_axes=brainstate.State, state_out_axes=brainstate.State, axis_size=members
  )
  def step(x, y):
    grads, loss = brainstate.transform.grad(
      lambda: ((model(x) - y) ** 2).mean(), grad_states=param_states, return_value=True
    )()
    values = {k: s.value for k, s in param_states.items()}
    updates, opt.value = tx.update(grads, opt.value, values)
    new = optax.apply_updates(values, updates)
    for k, s in param_states.items():
      s.value = new[k]
    return loss

  return step
