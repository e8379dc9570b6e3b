"""The errors brainnx raises, and the checks every transform shares.

Example:
  >>> from brainnx._engine.errors import check_callable
  >>> try:
  ...   check_callable(3, 'vmap')
  ... except TypeError as e:
  ...   print(e)
  vmap needs a callable, got int
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

from brainnx._engine.nodes import is_library_file


class BatchAxisError(ValueError):
  """A Variable's batch axis is not what the mapping needs (see ``vmap``).

  Raised by :func:`vmap`, :func:`vmap_new_states` and :func:`pmap` when a
  Variable's batch axis cannot be decided or contradicts itself: a broadcast
  Variable whose new value differs per batch element (with
  ``unexpected_out_state_mapping='raise'``), a Variable declared
  ``state_out_axes=None`` whose new value depends on the batch, one Variable
  reached two ways with two different batch axes, an in-axis that
  disagrees with the declared ``state_out_axes``, or a Variable created
  inside the mapped function that differs per element outside
  ``vmap_new_states``. The message names the Variable and the fix. It is a
  ``ValueError``, so ``except ValueError`` catches it too.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import brainnx as bnx
    >>> last = nnx.Variable(jnp.zeros(()))
    >>> def f(x):
    ...   last[...] = x                # broadcast Variable, per-element value
    ...   return x
    >>> try:
    ...   bnx.vmap(f)(jnp.arange(3.0))
    ... except bnx.BatchAxisError as e:
    ...   print(type(e).__name__, isinstance(e, ValueError))
    BatchAxisError True
  """


def check_callable(fun: Any, name: str) -> None:
  """``TypeError`` naming the transform when ``fun`` is not a callable, or is a generator function
  (whose call returns a generator, not values a JAX transform can trace)."""
  if not callable(fun):
    raise TypeError(f'{name} needs a callable, got {type(fun).__name__}')
  target = getattr(fun, '__func__', fun)
  if inspect.isgeneratorfunction(target) or inspect.isasyncgenfunction(target) or inspect.iscoroutinefunction(target):
    raise TypeError(
      f'{name} needs a function that returns values, got the generator or coroutine function '
      f'{getattr(fun, "__qualname__", fun)!r}: JAX transforms cannot trace generators'
    )


def user_stacklevel() -> int:
  """The ``warnings.warn`` stacklevel of the first frame outside brainnx, jax and flax."""
  frame, level = sys._getframe(1), 1
  while frame is not None and is_library_file(frame.f_code.co_filename):
    frame, level = frame.f_back, level + 1
  return level
