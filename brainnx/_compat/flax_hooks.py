"""What brainnx installs into flax's classes when it is imported, and the counters and locks
those hooks keep: every Variable value write is counted (the value lists warm calls keep stay
true), waits for a brainnx trace in another thread (``TRACE_LOCK``), and every edit of a
Pytree's attributes or a Variable's metadata is counted and logged (the guard of a cached
discovery reads the log); the Variables created during a call are logged.

Supported: flax 0.12.4 through 0.12.x. Version differences handled here: ``nnx.jit_partial``'s
raw write-back (``_apply_raw_updates``, from flax 0.12.8) is counted where it exists.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import threading
from typing import Callable

from flax.nnx import pytreelib as _pytreelib
from flax.nnx import tracers as _nnx_tracers

from brainnx._compat.flax_graph import graphlib as _graphlib
from brainnx._compat.jax_internals import ArrayImpl

# -- what is installed --------------------------------------------------------

#: Every flax method or registry entry brainnx replaced: ``(owner, name, original, hook)``, where
#: ``owner`` is a class, a module or a dict (the graph registry). ``docs/api/rules.md`` lists
#: them for users; ``benchmarks/import_tax.py`` swaps them to time flax without them.
INSTALLED: list = []


def install(owner, name: str, hook, original) -> None:
  """Put ``hook`` in place of ``original`` at ``owner.name`` (``owner[name]`` for a dict)."""
  (owner.__setitem__ if isinstance(owner, dict) else functools.partial(setattr, owner))(name, hook)
  INSTALLED.append((owner, name, original, hook))


def use_hooks(on: bool) -> None:
  """Put every hook (``on``) or every original back in place, in the graph registry entries of
  classes made since brainnx was imported too. For measuring what the hooks cost; brainnx is
  wrong without them: never call it with ``False`` around brainnx calls."""
  swap = {}
  for owner, name, original, hook in INSTALLED:
    old, new = (original, hook) if on else (hook, original)
    (owner.__setitem__ if isinstance(owner, dict) else functools.partial(setattr, owner))(name, new)
    swap[old] = new
  for node_type, impl in list(_graphlib.GRAPH_REGISTRY.items()):
    if isinstance(impl, _graphlib.GraphNodeImpl) and (impl.clear in swap or impl.init in swap):
      _graphlib.GRAPH_REGISTRY[node_type] = dataclasses.replace(
        impl, clear=swap.get(impl.clear, impl.clear), init=swap.get(impl.init, impl.init))


# -- Variable values ---------------------------------------------------------


def set_raw_value(variable, value) -> None:
  """Store ``value`` in ``variable`` without flax's trace-level check.

  brainnx only calls this after it has decided itself that the write is legal
  (eager write-back of a compiled result, or restoring a pre-call value).
  """
  try:
    object.__setattr__(variable, '_raw_value', value)
  finally:
    values_written()


def set_raw_values(variables, values) -> None:
  """``set_raw_value`` for many Variables at once (the jit write-back loop)."""
  store = object.__setattr__
  try:
    for variable, value in zip(variables, values):
      store(variable, '_raw_value', value)
  finally:
    values_written()


# A warm compiled call keeps the list of values it passed (reading 800 Variables costs as much
# as the rest of its Python). flax's setattr (set_value, ``v[...] = x``, nnx.update,
# update_from_state) puts a new value into each kept list holding the Variable; copy_from,
# unpickling, nnx.jit_partial's raw write-back and brainnx's own writes forget every list. Each
# counts the write, after storing it, under KEPT_LOCK. Writes that bypass flax
# (``object.__setattr__`` on a Variable) are not seen.

class EditCount:
  """A counter of edits, read by the caches to tell whether anything changed since they looked."""

  __slots__ = ('n',)

  def __init__(self):
    self.n = 0


#: How many times a Variable's value was written.
VALUE_WRITES = EditCount()

#: Per warm call (a key it chooses): ``(positions, values)``, where ``positions`` maps
#: ``id(variable)`` to its index in ``values``, the list the call passed last.
KEPT_VALUES: dict = {}

#: Held while Variables hold a brainnx trace's tracers and while values are written back. Every
#: flax write of a Variable takes it (reentrant: the traced function's own writes pass), so a
#: write from another thread waits for the trace instead of failing or landing inside it.
TRACE_LOCK = threading.RLock()

#: Held while counting a write, changing a kept list, and keeping one. The same lock as
#: ``TRACE_LOCK``: a flax write holds that one already, so counting it takes no second lock
#: (a reader that must not wait for a trace tries it without blocking).
KEPT_LOCK = TRACE_LOCK


class StateChanges:
  """Value changes other threads must not see half done, under ``TRACE_LOCK``: ``under_way`` now, ``begun`` ever."""

  __slots__ = ('under_way', 'begun')

  def __init__(self):
    self.under_way = self.begun = 0


STATE_CHANGES = StateChanges()


def values_written(variable=None) -> None:
  """Count a write of Variable values (after it is stored): every kept list holding
  ``variable`` gets its new value if that is a concrete array; otherwise, or with no
  ``variable`` (writes of many), every list is forgotten."""
  with KEPT_LOCK:
    VALUE_WRITES.n += 1
    if KEPT_VALUES:
      _patch_kept(variable)


def _patch_kept(variable) -> None:
  """Put ``variable``'s new value into every kept list holding it (under ``KEPT_LOCK``)."""
  if variable is None:
    KEPT_VALUES.clear()
    return
  new = variable._raw_value
  if type(new) is not ArrayImpl:  # a tracer (inside a trace), a pytree, a numpy array
    KEPT_VALUES.clear()
    return
  key = id(variable)
  try:
    entries = list(KEPT_VALUES.values())
  except RuntimeError:  # a dropped plan's list left while we copied (a weak reference's callback)
    KEPT_VALUES.clear()
    return
  for positions, values in entries:
    i = positions.get(key)
    if i is not None:
      values[i] = new


def _count_value_writes() -> None:
  """Install the value-write hooks. A ``v[...] = x`` runs two of them (``set_value``, then
  ``__setattr__``), so the common routes have fixed signatures and count inline: each is one
  frame, a lock and no argument tuple (``benchmarks/import_tax.py`` measures what they cost)."""
  from flax import nnx
  from flax.nnx.transforms import compilation as _compilation

  def edited_metadata(variable) -> None:
    PYTREE_EDITS.n += 1
    EDIT_LOG.append((PYTREE_EDITS.n, id(variable)))

  def marked(hook: Callable, method: Callable) -> Callable:
    hook = functools.wraps(method)(hook)
    hook.__wrapped_for_values__ = method
    return hook

  variable = nnx.Variable
  setattr_, setstate, copy_from, set_value, set_raw_value_, update_from_state = (
    variable.__dict__[name]
    for name in ('__setattr__', '__setstate__', 'copy_from', 'set_value', 'set_raw_value', 'update_from_state'))
  if hasattr(setattr_, '__wrapped_for_values__'):  # installed already (a reload)
    return
  # bound once: ``with lock`` looks up __enter__/__exit__ on every write
  acquire, release, writes, kept = TRACE_LOCK.acquire, TRACE_LOCK.release, VALUE_WRITES, KEPT_VALUES
  lock = TRACE_LOCK

  def hooked_setattr(self, name, value):
    acquire()  # TRACE_LOCK, which is KEPT_LOCK too: the count below needs no other lock
    try:
      setattr_(self, name, value)
    finally:
      if name == '_raw_value':
        writes.n += 1
        if kept:
          _patch_kept(self)
      elif name == '_var_metadata':  # update_from_state replacing the metadata
        edited_metadata(self)
      release()

  def waiting(method: Callable) -> Callable:
    """``method(self, value, **kwargs)`` under ``TRACE_LOCK``: one frame, no argument tuple."""
    def hook(self, value, **kwargs):
      acquire()
      try:
        return method(self, value, **kwargs)
      finally:
        release()

    return hook

  def hooked_setstate(self, state):
    try:
      return setstate(self, state)
    finally:
      values_written()

  def hooked_copy_from(self, other):
    with lock:
      try:
        return copy_from(self, other)
      finally:
        values_written()
        edited_metadata(self)

  apply_raw_updates = getattr(_compilation, '_apply_raw_updates', None)  # flax >= 0.12.8

  def counting_raw_updates(*args, **kwargs):
    try:
      return apply_raw_updates(*args, **kwargs)
    finally:
      values_written()

  for name, hook, original in (('__setattr__', hooked_setattr, setattr_), ('__setstate__', hooked_setstate, setstate),
                                ('copy_from', hooked_copy_from, copy_from), ('set_value', waiting(set_value), set_value),
                                ('set_raw_value', waiting(set_raw_value_), set_raw_value_),
                                ('update_from_state', waiting(update_from_state), update_from_state)):
    install(variable, name, marked(hook, original), original)
  if apply_raw_updates is not None:
    install(_compilation, '_apply_raw_updates', marked(counting_raw_updates, apply_raw_updates), apply_raw_updates)


def restore_entries(current: dict, entries: dict, missing) -> None:
  """Put ``entries`` back into a dict or a node's ``attributes()`` (``missing``: delete the key).

  On a Module this bypasses flax's setattr checks: it is how a failed call's
  added or replaced attributes are rolled back.
  """
  try:
    for key, value in entries.items():
      if value is missing:
        current.pop(key, None)
      else:
        current[key] = value
  finally:
    PYTREE_EDITS.n += 1
    EDIT_LOG.append((PYTREE_EDITS.n, None))


# -- edits of flax Pytree attributes ------------------------------------------------
# A cached discovery stays valid while the attribute dicts it walked hold the same
# entries. Comparing every entry on every call costs ~20 ns an attribute (0.3 µs a
# Linear layer); instead, every way flax changes a Pytree's attributes (setattr, delattr,
# unpickling, and the clear + re-init that nnx transforms use to update a node in place)
# bumps one counter, and a guard compares the Pytree entries only when it moved. Writes
# that bypass flax (``vars(module)[k] = v``, ``object.__setattr__``) are not counted.

#: ``PYTREE_EDITS.n``: how many times any flax Pytree's attributes (or a Variable's metadata,
#: through ``set_metadata``/``del_metadata``) were changed.
PYTREE_EDITS = EditCount()

#: The latest edits as ``(count after the edit, id of the edited Pytree or Variable)``; the id
#: is ``None`` where the owner is unknown. A guard reads back to its last passing check and
#: compares its entries only if one of its own objects is among them (nnx transforms edit the
#: fresh nodes they merge on every call: those are nobody's). Older edits fall off the end.
EDIT_LOG: collections.deque = collections.deque(maxlen=4096)

_EDITING_METHODS = ('__setattr__', '__delattr__', '__setstate__', '_graph_node_clear', '_graph_node_init')


def _counting(method: Callable) -> Callable:
  edits, log = PYTREE_EDITS, EDIT_LOG

  @functools.wraps(method)
  def counted(*args, **kwargs):
    try:
      return method(*args, **kwargs)
    finally:  # after the edit: a guard that read the counter before it sees the move
      edits.n += 1
      log.append((edits.n, id(args[0])))

  counted.__wrapped_for_edits__ = method
  return counted


def _counting_setattr(method: Callable) -> Callable:
  """``_counting`` for ``__setattr__``, which Module construction runs per attribute: a fixed
  signature, so no argument tuple per call."""
  edits, log = PYTREE_EDITS, EDIT_LOG

  @functools.wraps(method)
  def counted(self, name, value):
    try:
      return method(self, name, value)
    finally:
      edits.n += 1
      log.append((edits.n, id(self)))

  counted.__wrapped_for_edits__ = method
  return counted


def _count_pytree_edits() -> None:
  pytree = _pytreelib.Pytree
  originals = {}
  for name in _EDITING_METHODS:
    method = pytree.__dict__[name]
    if hasattr(method, '__wrapped_for_edits__'):  # installed already (a reload)
      return
    originals[method] = (_counting_setattr if name == '__setattr__' else _counting)(method)
    install(pytree, name, originals[method], method)
  # classes created before this point registered the original clear/init with nnx's graph
  # registry; later ones pick up the counting methods from the class
  for node_type, impl in list(_graphlib.GRAPH_REGISTRY.items()):
    if isinstance(impl, _graphlib.GraphNodeImpl) and (impl.clear in originals or impl.init in originals):
      install(_graphlib.GRAPH_REGISTRY, node_type, dataclasses.replace(
        impl, clear=originals.get(impl.clear, impl.clear), init=originals.get(impl.init, impl.init)), impl)


_count_pytree_edits()


def _count_metadata_edits() -> None:
  from flax import nnx

  for name in ('set_metadata', 'del_metadata'):
    method = nnx.Variable.__dict__[name]
    if hasattr(method, '__wrapped_for_edits__'):  # installed already (a reload)
      return
    install(nnx.Variable, name, _counting(method), method)


_count_metadata_edits()
_count_value_writes()


# -- Variables created during a call -------------------------------------------------
# A Variable made inside a traced call holds a tracer and that trace's level. One kept
# somewhere brainnx cannot see (and so cannot adopt or roll back) must not stay so: while
# a brainnx call runs, the Variables flax creates in this thread are logged.

_CREATION = threading.local()


def _logging(make: Callable, returns: bool) -> Callable:
  @functools.wraps(make)
  def logged(*args, **kwargs):
    out = make(*args, **kwargs)
    log = getattr(_CREATION, 'log', None)
    if log is not None:
      log.append(out if returns else args[0])
    return out

  logged.__wrapped_for_log__ = make
  return logged


def _log_variable_creation() -> None:
  from flax import nnx

  init = nnx.Variable.__dict__['__init__']
  if hasattr(init, '__wrapped_for_log__'):  # installed already (a reload)
    return
  install(nnx.Variable, '__init__', _logging(init, returns=False), init)
  new = nnx.Variable.__dict__['_new']
  install(nnx.Variable, '_new', classmethod(_logging(new.__func__, returns=True)), new)


_log_variable_creation()


@contextlib.contextmanager
def created_variables(log: bool = True):
  """The block's log of Variables created in this thread (an inner block keeps its own).

  The outermost block also records the trace level it began at (:func:`outer_level`):
  where a created Variable nothing adopts is put back. ``log=False`` only marks that level.
  """
  outer_log, outer_level = getattr(_CREATION, 'log', None), getattr(_CREATION, 'level', None)
  if outer_level is None:
    _CREATION.level = _nnx_tracers.TraceState()
  entries: list | None = [] if log else outer_log
  _CREATION.log = entries
  try:
    yield entries
  finally:
    _CREATION.log = outer_log
    if outer_level is None:
      _CREATION.level = None


def outer_level():
  """The trace state recorded by the outermost :func:`created_variables` block of this thread."""
  return getattr(_CREATION, 'level', None) or _nnx_tracers.TraceState()


