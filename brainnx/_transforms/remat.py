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

import functools
from typing import Any, Callable, Sequence

import jax

from brainnx._engine.arguments import StaticArgs, normalize_argnums
from brainnx._engine.call import StatefulCall
from brainnx._engine.eager import run
from brainnx._engine.errors import check_callable

__all__ = ['remat', 'checkpoint']


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
  statics = StaticArgs(argnums=normalize_argnums(static_argnums))

  @functools.wraps(fun)
  def rematted(*args, **kwargs):
    return run(_remat_impl, (fun,), (prevent_cse, policy, statics), args, kwargs, statics=statics)

  return rematted


checkpoint = remat


def _remat_impl(fun, *rest, **kwargs) -> Any:
  *args, prevent_cse, policy, statics = rest
  call = StatefulCall.enter(fun, tuple(args), kwargs, name='remat', statics=statics)
  with call.rolling_back():
    written, _, leaves = jax.checkpoint(call.pure, prevent_cse=prevent_cse, policy=policy)(call.values, call.call.dyn)
    call.write_back(written)
  return call.output(leaves)
