"""``state_in_axes`` / ``state_out_axes``: from NNX filters to a batch axis per Variable.

A rule set is ``None`` (no rules), a filter (shorthand for ``{0: filter}``)
or a dict ``{axis: filter}`` with ``axis`` an int or ``None`` (broadcast).
A filter is anything ``nnx.filterlib.to_predicate`` accepts, or a Variable
instance, or a list/tuple of Variable instances (matched by identity).
The first matching entry wins.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from brainnx._engine.filters import AxisRules
  >>> w, s = nnx.Param(jnp.ones(3)), nnx.BatchStat(jnp.ones(3))
  >>> rules = AxisRules({0: nnx.Param, None: ...}, 'state_in_axes')
  >>> rules.axis_of(('w',), w), rules.axis_of(('s',), s)
  ((True, 0), (True, None))
  >>> AxisRules(None, 'state_in_axes').axis_of(('w',), w)
  (False, None)
"""

from __future__ import annotations

from typing import Any, Hashable, Sequence

from flax import nnx

from brainnx import _compat

__all__ = ['AxisRules']


class _SameObject:
  """Filter matching given Variable instances by identity."""

  def __init__(self, variables: Sequence[Any]):
    self._ids = frozenset(map(id, variables))
    self._names = ', '.join(type(v).__name__ for v in variables)

  def __call__(self, path, variable) -> bool:
    return id(variable) in self._ids

  def __repr__(self) -> str:
    return f'Variables({self._names})'


def to_filter(spec: Any):
  """A ``(path, variable) -> bool`` predicate for a brainnx filter."""
  if isinstance(spec, nnx.Variable):
    return _SameObject([spec])
  if isinstance(spec, (list, tuple)) and spec and all(isinstance(s, nnx.Variable) for s in spec):
    return _SameObject(spec)
  if isinstance(spec, (list, tuple)):
    return nnx.Any(*[to_filter(s) for s in spec])
  try:
    return _compat.to_predicate(spec)
  except (TypeError, ValueError) as e:
    raise TypeError(
      f'{spec!r} is not a filter: use a Variable type (nnx.Param), a tag string, '
      '..., True/False/None, nnx.PathContains/All/Any/Not, a callable (path, variable) -> bool, '
      'a Variable instance, or a list/tuple of those'
    ) from e


class AxisRules:
  """Ordered ``(axis, predicate)`` entries built from a user's rule spec."""

  def __init__(self, spec: Any, what: str):
    self.entries: list[tuple[int | None, Any, Any]] = []  # (axis, predicate, original filter)
    if spec is None:
      return
    items = spec.items() if isinstance(spec, dict) else [(0, spec)]
    for axis, flt in items:
      if axis is not None and (not isinstance(axis, int) or isinstance(axis, bool)):
        raise TypeError(f'{what}: axis keys must be int or None, got {axis!r} for filter {flt!r}')
      self.entries.append((axis, to_filter(flt), flt))

  def __bool__(self) -> bool:
    return bool(self.entries)

  def axis_of(self, path: tuple[Hashable, ...], variable) -> tuple[bool, int | None]:
    """``(matched, axis)`` of the first entry whose filter accepts the Variable."""
    for axis, predicate, _ in self.entries:
      if predicate(path, variable):
        return True, axis
    return False, None
