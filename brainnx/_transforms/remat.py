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

from brainnx import _compat
from brainnx._engine.arguments import CallArgs, StaticArgs, normalize_argnums
from brainnx._engine.discovery import discover
from brainnx._engine.eager import run
from brainnx._engine.tracing import state_step, write_values
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
    return run(_remat_impl, (fun,), (prevent_cse, policy, statics), args, kwargs)

  return rematted


checkpoint = remat


def _remat_impl(fun, *rest, **kwargs) -> Any:
  *args, prevent_cse, policy, statics = rest
  call = CallArgs.split(tuple(args), kwargs, statics)
  disc = discover(fun, tuple(args), kwargs)
  found: list = []  # (written indices, output spec): no tracers, which must not outlive the trace

  def pure(state_values, dyn):
    step = state_step(fun, disc, call, state_values, dyn, keep_new=False)
    if step.new_vars:
      raise ValueError('remat: the function creates Variables; create them before the rematerialised call')
    spec, leaves = step.split_out(disc)
    found.append((step.written, spec))
    return step.written_values(), leaves

  values = [_compat.raw_value(v) for v in disc.variables]
  written_values, out_leaves = jax.checkpoint(pure, prevent_cse=prevent_cse, policy=policy)(values, call.dyn)
  written, spec = found[-1]
  write_values(disc, written, written_values)
  return spec.rebuild(list(out_leaves), disc)
