"""``state_in_axes`` / ``state_out_axes``: from NNX filters to a batch axis per Variable.

A rule set is ``None`` (no rules), a filter (shorthand for ``{0: filter}``),
a dict ``{axis: filter}`` with ``axis`` an int or ``None`` (broadcast), or
flax's ``nnx.StateAxes({filter: axis})``, read in its order. A filter is
anything ``nnx.filterlib.to_predicate`` accepts, or a Variable instance, or a
list/tuple of Variable instances (matched by identity). The first matching
entry wins.

Variables a brainnx ``vmap`` builds stacked carry a :class:`Stacked` record
as their ``stacked`` metadata (kept by ``nnx.state``, ``nnx.split``,
``nnx.merge`` and ``nnx.clone``), so that a transform can tell a stack being
broadcast by mistake from a Variable meant to be shared.

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
  >>> AxisRules(nnx.StateAxes({nnx.Param: 0, ...: None}), 'state_in_axes').axis_of(('s',), s)
  (True, None)
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Hashable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from brainnx import _compat
from brainnx._engine.nodes import is_int


class _SameObject:
  """Filter matching given Variable instances by identity."""

  def __init__(self, variables: Sequence[Any]):
    self._ids = frozenset(map(id, variables))
    self._names = ', '.join(type(v).__name__ for v in variables)

  def __call__(self, path, variable) -> bool:
    return id(variable) in self._ids

  def __repr__(self) -> str:
    return f'Variables({self._names})'


class _InArgument:
  """An ``nnx.StateAxes`` filter given in ``in_axes`` for positional argument ``index`` (``None``:
  every positional argument): it sees that argument's Variables only, with paths relative to it
  (as flax's filters do)."""

  def __init__(self, index: int | None, predicate):
    self.index, self.predicate = index, predicate

  def __call__(self, path, variable) -> bool:
    if not path or not isinstance(path[0], int) or isinstance(path[0], bool):
      return False
    return (self.index is None or path[0] == self.index) and self.predicate(path[1:], variable)

  def __repr__(self) -> str:
    return f'{self.predicate!r} in argument {self.index}'


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


def _is_axis(x) -> bool:
  return x is None or is_int(x)


class AxisRules:
  """Ordered ``(axis, predicate)`` entries built from a user's rule spec."""

  def __init__(self, spec: Any, what: str, owner: str | None = None):
    """``what``: the keyword, as errors name it; ``owner``: the transform, which starts them."""
    self.what = what
    start = f'{owner}: ' if owner else ''
    self.entries: list[tuple[int | None, Any, Any]] = []  # (axis, predicate, original filter)
    if spec is None:
      return
    if isinstance(spec, nnx.StateAxes):
      items = [(axis, flt) for flt, axis in spec.items()]
    elif isinstance(spec, dict):
      items = list(spec.items())
      if items and not all(_is_axis(axis) for axis, _ in items) and all(_is_axis(v) for _, v in items):
        raise TypeError(
          f'{start}{what} maps batch axes to filters, {{axis: filter}}, the other way round from '
          f'nnx.StateAxes: did you mean {what}={rules_code([(v, k) for k, v in items])}? (Or keep '
          f'your dict as {what}=nnx.StateAxes({_dict_code(items)}), which brainnx reads in its order.)'
        )
    else:
      items = [(0, spec)]
    for axis, flt in items:
      if not _is_axis(axis):
        raise TypeError(f'{start}{what}: axis keys must be int or None, got {axis!r} for filter {flt!r}')
      self.entries.append((axis, to_filter(flt), flt))

  @classmethod
  def in_argument(cls, state_axes, index: int | None, what: str) -> 'AxisRules':
    """Rules from an ``nnx.StateAxes`` given in ``in_axes`` for positional argument ``index``."""
    rules = cls(state_axes, what)
    rules.entries = [(axis, _InArgument(index, pred), flt) for axis, pred, flt in rules.entries]
    return rules

  def __add__(self, other: 'AxisRules') -> 'AxisRules':
    rules = AxisRules(None, self.what)
    rules.entries = self.entries + other.entries
    return rules

  def __bool__(self) -> bool:
    return bool(self.entries)

  def axis_of(self, path: tuple[Hashable, ...], variable) -> tuple[bool, int | None]:
    """``(matched, axis)`` of the first entry whose filter accepts the Variable."""
    for axis, predicate, _ in self.entries:
      if predicate(path, variable):
        return True, axis
    return False, None

  def unmatched(self, named: Sequence[tuple[tuple, Any]]) -> list[tuple[int | None, Any, Any]]:
    """The entries whose filter accepts none of the ``(path, Variable)`` pairs."""
    return [e for e in self.entries if not any(e[1](path, v) for path, v in named)]

  def entry_code(self, entry) -> str:
    """How a message shows one entry, e.g. ``state_in_axes entry {0: 'params'}``."""
    axis, predicate, flt = entry
    shown = filter_code(flt) or repr(flt)
    if isinstance(predicate, _InArgument):
      where = 'in_axes' if predicate.index is None else f'in_axes[{predicate.index}]'
      return f'{where} nnx.StateAxes entry {{{shown}: {axis}}}'
    return f'{self.what} entry {{{axis}: {shown}}}'


# -- the stacked record ------------------------------------------------------------


class Stacked(NamedTuple):
  """The ``stacked`` metadata of a Variable a brainnx ``vmap`` built stacked.

  ``axis`` and ``size`` are its batch axis and the number of members;
  ``ndim`` the rank of its value then. A value of another rank (one member's
  slice inside a mapped call, one layer's inside a scan) is not taken as
  stacked.
  """

  axis: int
  size: int
  ndim: int


def _first_leaf(variable):
  leaves = jax.tree.leaves(_compat.raw_value(variable))
  return leaves[0] if leaves else None


def mark_stacked(variable, axis: int, size: int, partition_name=None) -> None:
  """Record on ``variable`` that it is stacked on ``axis`` with ``size`` members; sharding
  metadata one dimension short (``out_sharding``, as ``nnx.with_partitioning`` sets it for
  one member) gains the new axis there, named ``partition_name`` (``None``: not sharded), as
  ``nnx.vmap(..., transform_metadata={nnx.PARTITION_NAME: name})`` gives it."""
  leaf = _first_leaf(variable)
  if leaf is None or not jnp.ndim(leaf):
    return
  ndim = jnp.ndim(leaf)
  variable.set_metadata(stacked=Stacked(axis % ndim, size, ndim))
  sharding = variable.get_metadata().get('out_sharding')
  if isinstance(sharding, (tuple, list)) and len(sharding) == ndim - 1:
    names = list(sharding)
    names.insert(axis % ndim, partition_name)
    variable.set_metadata(out_sharding=type(sharding)(names))


@contextlib.contextmanager
def members_metadata(mapped: Sequence[tuple[Any, int, int]]):
  """While it runs, each mapped ``(variable, axis, ndim)`` shows the sharding metadata of one
  member: ``out_sharding`` (of the stacked value's rank ``ndim``) without the mapped axis, as
  ``nnx.vmap``'s ``transform_metadata`` removes it. Restored on exit."""
  changed = []
  for variable, axis, ndim in mapped:
    if not isinstance(variable, nnx.Variable):  # an array attribute: no metadata
      continue
    sharding = variable.get_metadata().get('out_sharding')
    if isinstance(sharding, (tuple, list)) and len(sharding) == ndim:
      names = list(sharding)
      del names[axis % ndim]
      # the live dict: flax refuses set_metadata under the trace, and this is no edit of the user's
      _compat.metadata_of(variable)['out_sharding'] = type(sharding)(names)
      changed.append((variable, sharding))
  try:
    yield
  finally:
    for variable, sharding in reversed(changed):
      _compat.metadata_of(variable)['out_sharding'] = sharding


def stacked_of(variable) -> Stacked | None:
  """The Variable's :class:`Stacked` record while its value still has that layout, else ``None``."""
  record = variable.get_metadata().get('stacked') if isinstance(variable, nnx.Variable) else None
  if not isinstance(record, Stacked):
    return None
  leaf = _first_leaf(variable)
  shape = jnp.shape(leaf) if leaf is not None else ()
  if len(shape) != record.ndim or shape[record.axis] != record.size:
    return None
  return record


def note_whole_stacks(error: BaseException, disc) -> None:
  """Add a note to ``error`` (raised by the user's function) when Variables it saw hold a whole
  stack of members (an ensemble built by ``vmap``, used as one model): flax's own message is a
  shape mismatch (``dot_general requires contracting dimensions to have the same shape``)."""
  stacks = [(i, record) for i, v in enumerate(disc.variables) if (record := stacked_of(v)) is not None]
  if not stacks or any(note.startswith('brainnx:') for note in getattr(error, '__notes__', ())):
    return
  i, record = stacks[0]
  more = f' and {len(stacks) - 1} more Variables' if len(stacks) > 1 else ''
  error.add_note(
    f'brainnx: {disc.describe(i)}{more} hold a stack of {record.size} members (axis {record.axis}, built by '
    f'vmap) and were used whole, as one model. Call the model under bnx.vmap (in_axes=0 for a model '
    f'argument, or state_in_axes={{0: nnx.Param}} for one it closes over), or take one member: '
    f'graphdef, state = nnx.split(model); nnx.merge(graphdef, jax.tree.map(lambda a: a[k], state))'
  )


_HANDLED: contextvars.ContextVar = contextvars.ContextVar('brainnx_stacks_handled_by', default=())


@contextlib.contextmanager
def stacks_handled_by(*fns: Callable):
  """Within: mapped calls and loops of ``fns`` (brainnx's own, as ``map`` runs them) do not refuse
  stacked Variables broadcast whole; ``map`` has no ``state_in_axes`` to say so."""
  token = _HANDLED.set(_HANDLED.get() + fns)
  try:
    yield
  finally:
    _HANDLED.reset(token)


def stacks_exempt(fn: Callable) -> bool:
  """Whether ``fn`` (or the function it wraps) runs under :func:`stacks_handled_by`."""
  inner = getattr(fn, '__wrapped__', None)
  return any(fn is f or inner is f for f in _HANDLED.get())


# -- filters as code, for messages ------------------------------------------------


def _type_code(t: type) -> str:
  return f'nnx.{t.__name__}' if getattr(nnx, t.__name__, None) is t else t.__name__


def filter_code(flt: Any) -> str | None:
  """``flt`` as the Python a user would write (``nnx.Param``, ``'dropout'``), or ``None``."""
  if flt is Ellipsis:
    return '...'
  if flt is None or isinstance(flt, (bool, str, int)):
    return repr(flt)
  if isinstance(flt, type):
    return _type_code(flt)
  if isinstance(flt, (tuple, list)):
    parts = [filter_code(f) for f in flt]
    return None if None in parts else '(' + ', '.join(parts) + (',)' if len(parts) == 1 else ')')
  if isinstance(flt, nnx.OfType):
    return _type_code(flt.type)
  if isinstance(flt, nnx.WithTag):
    return repr(flt.tag)
  if isinstance(flt, nnx.PathContains):
    return f'nnx.PathContains({flt.key!r})'
  if isinstance(flt, nnx.Not):
    inner = filter_code(getattr(flt, 'predicate', None))
    return inner and f'nnx.Not({inner})'
  if isinstance(flt, (nnx.Any, nnx.All)):
    parts = [filter_code(p) for p in getattr(flt, 'predicates', ())]
    return None if not parts or None in parts else f'nnx.{type(flt).__name__}({", ".join(parts)})'
  return None


def types_code(variables: Sequence[Any]) -> str:
  """A filter selecting the types of ``variables``: ``nnx.Param`` or ``(nnx.Param, nnx.RngState)``."""
  names: list[str] = []
  for v in variables:
    name = 'nnx.RngState' if isinstance(v, (nnx.RngKey, nnx.RngCount)) else _type_code(type(v))
    if name not in names:
      names.append(name)
  return names[0] if len(names) == 1 else '(' + ', '.join(names) + ')'


def _dict_code(items: Sequence[tuple[Any, Any]]) -> str:
  return '{' + ', '.join(f'{filter_code(k) or repr(k)}: {filter_code(v) or repr(v)}' for k, v in items) + '}'


def rules_code(pairs: Sequence[tuple[int | None, Any]]) -> str:
  """``{axis: filter}`` code for ``(axis, filter)`` pairs (a filter may already be code, see
  :func:`code`); pairs sharing an axis are joined into one tuple."""
  grouped: dict = {}
  for axis, flt in pairs:
    text = flt if isinstance(flt, _Code) else (filter_code(flt) or repr(flt))
    grouped.setdefault(axis, []).append(text)

  def joined(texts):
    if len(texts) == 1:
      return texts[0]
    parts = [t[1:-1].rstrip(',') if t.startswith('(') else t for t in texts]
    return '(' + ', '.join(parts) + ')'

  return '{' + ', '.join(f'{axis}: {joined(texts)}' for axis, texts in grouped.items()) + '}'


class _Code(str):
  """A filter already written as code (see :func:`rules_code`)."""


def code(text: str) -> _Code:
  """Mark ``text`` as filter code for :func:`rules_code`."""
  return _Code(text)
