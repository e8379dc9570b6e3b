"""``remat`` (alias ``checkpoint``): ``jax.checkpoint`` for functions that read and write Variables.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from flax import nnx
  >>> import brainnx as bnx
  >>> w = nnx.Param(jnp.array(2.0))
  >>> layer = bnx.remat(lambda x: jnp.sin(w[...] * x))
  >>> g = bnx.grad(lambda x: layer(layer(x)), grad_states=w)(1.0)
  >>> bool(jnp.allclose(g, jax.grad(lambda w: jnp.sin(w * jnp.sin(w * 1.0)))(2.0)))
  True
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax

from brainnx._engine.arguments import StaticArgs, normalize_argnums
from brainnx._engine.call import StatefulCall
from brainnx._engine.config import Config
from brainnx._engine.eager import call
from brainnx._engine.errors import check_callable
from brainnx._engine.jitted import JitOptions


@dataclasses.dataclass(frozen=True, kw_only=True)
class RematConfig(Config):
  """``remat``'s settings, as ``jax.checkpoint`` takes them, and the user's static arguments."""

  name: str = 'remat'
  prevent_cse: bool = True
  policy: Callable | None = None
  statics: StaticArgs = StaticArgs()


def remat(
  fun: Callable,
  *,
  prevent_cse: bool = True,
  policy: Callable | None = None,
  static_argnums: int | Sequence[int] = (),
) -> Callable:
  """``jax.checkpoint`` for a stateful function: its intermediates are recomputed in the
  backward pass instead of stored, and it may read and write Variables as anywhere else.

  Args:
    fun: the function.
    prevent_cse: as in ``jax.checkpoint`` (keep ``True`` unless inside ``scan``).
    policy: a ``jax.checkpoint_policies`` policy saying which intermediates may be saved.
    static_argnums: positional arguments treated as static (hashable) values.

  Returns:
    A function with ``fun``'s signature; gradients through it equal ``fun``'s.

  Raises:
    TypeError: ``fun`` is not callable.
    ValueError: ``fun`` creates Variables (create them before the remat'd call).

  Example:
    >>> import jax.numpy as jnp
    >>> import brainnx as bnx
    >>> float(bnx.remat(lambda x: x * 3)(2.0))
    6.0
  """
  check_callable(fun, 'remat')
  config = RematConfig(prevent_cse=prevent_cse, policy=policy, statics=StaticArgs(argnums=normalize_argnums(static_argnums)))
  options = JitOptions(statics=config.statics)

  @functools.wraps(fun)
  def rematted(*args, **kwargs):
    return call(_remat_impl, config, (fun,), args, kwargs, options=options)

  return rematted


checkpoint = remat


def _remat_impl(config: RematConfig, roots: tuple, *args, **kwargs) -> Any:
  (fun,) = roots
  stateful = StatefulCall.enter(fun, args, kwargs, name=config.name, statics=config.statics)
  with stateful.rolling_back():
    rematted = jax.checkpoint(stateful.pure, prevent_cse=config.prevent_cse, policy=config.policy)
    written, _, leaves = rematted(stateful.values, stateful.call.dyn)
    stateful.write_back(written)
  return stateful.output(leaves)
