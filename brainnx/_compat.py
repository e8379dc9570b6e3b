"""The one place that touches private JAX and Flax APIs.

Everything here is a thin, named wrapper so that a version bump of jax or
flax touches this file only. ``tests/test_compat.py`` fails if any other
module imports ``jax._src`` or a private flax module, reads a private
attribute of a Variable or Pytree, or writes into an object's ``vars()``.
Importing this module does not start a JAX backend.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import operator
import threading
from typing import Any, Callable

import jax
from flax.nnx import filterlib as _filterlib
from flax.nnx import graphlib as _graphlib
from flax.nnx import pytreelib as _pytreelib
from flax.nnx import tracers as _nnx_tracers
from jax._src import array as _jax_array
from jax._src import core as _jax_core
from jax._src import pjit as _jax_pjit
from jax._src import stages as _jax_stages
from jax._src import traceback_util as _traceback_util
from jax._src.interpreters import batching as _batching
from jax._src.lax import lax as _jax_lax

from brainnx._engine.slots import SlotAttributes, slot_names


Tracer = _jax_core.Tracer

#: The concrete array type a compiled call returns (a class lookup: no backend starts).
ArrayImpl = _jax_array.ArrayImpl

# -- Variable values ---------------------------------------------------------

#: ``raw_value(variable)``: the stored value, without the copy ``get_value`` makes.
raw_value = operator.attrgetter('_raw_value')


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

#: Held while counting a write, changing a kept list, and keeping one.
KEPT_LOCK = threading.Lock()


#: Held while Variables hold a brainnx trace's tracers and while values are written back. Every
#: flax write of a Variable takes it (reentrant: the traced function's own writes pass), so a
#: write from another thread waits for the trace instead of failing or landing inside it.
TRACE_LOCK = threading.RLock()


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
    if not KEPT_VALUES:
      return
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
  from flax import nnx
  from flax.nnx.transforms import compilation as _compilation

  def edited_metadata(variable) -> None:
    PYTREE_EDITS.n += 1
    EDIT_LOG.append((PYTREE_EDITS.n, id(variable)))

  def marked(counting: Callable, method: Callable) -> Callable:
    counting = functools.wraps(method)(counting)
    counting.__wrapped_for_values__ = method
    return counting

  variable = nnx.Variable
  setattr_, setstate, copy_from = (variable.__dict__[name] for name in ('__setattr__', '__setstate__', 'copy_from'))
  if hasattr(setattr_, '__wrapped_for_values__'):  # installed already (a reload)
    return

  def counting_setattr(self, name, value):
    try:
      return setattr_(self, name, value)
    finally:
      if name == '_raw_value':
        values_written(self)
      elif name == '_var_metadata':  # update_from_state replacing the metadata
        edited_metadata(self)

  def counting_setstate(self, state):
    try:
      return setstate(self, state)
    finally:
      values_written()

  def counting_copy_from(self, other):
    try:
      return copy_from(self, other)
    finally:
      values_written()
      edited_metadata(self)

  apply_raw_updates = _compilation._apply_raw_updates

  def counting_raw_updates(*args, **kwargs):
    try:
      return apply_raw_updates(*args, **kwargs)
    finally:
      values_written()

  def waiting(method: Callable) -> Callable:
    def waits(*args, **kwargs):
      with TRACE_LOCK:
        return method(*args, **kwargs)

    return marked(waits, method)

  variable.__setattr__ = waiting(marked(counting_setattr, setattr_))
  variable.__setstate__ = marked(counting_setstate, setstate)
  variable.copy_from = waiting(marked(counting_copy_from, copy_from))
  for name in ('set_value', 'set_raw_value', 'update_from_state'):
    setattr(variable, name, waiting(variable.__dict__[name]))
  _compilation._apply_raw_updates = marked(counting_raw_updates, apply_raw_updates)


# -- attributes of graph nodes and plain objects --------------------------------


def attributes(obj) -> dict:
  """The live attribute dict of a Module, Pytree or plain object (a live view of its slots for
  an object without a ``__dict__``)."""
  try:
    return vars(obj)
  except TypeError:
    return SlotAttributes(obj, slot_names(type(obj)))


def is_node_attributes(container) -> bool:
  """Whether ``container`` is a flax Pytree's attribute dict (its bookkeeping entries live there)."""
  return isinstance(container, dict) and '_pytree__state' in container


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


# -- flax's graph split and merge with known objects ------------------------------------
# What a call creates is split against the objects it already knew (so a new node holding a
# known one records a reference to it, not a copy) and merged per call against that call's
# objects: flax's own ``ref_index``/``index_ref`` mechanism of ``nnx.split``/``nnx.merge``.


def known_ref_map(objects) -> Any:
  """A flax ``RefMap`` giving ``objects[k]`` the graph index ``k`` (``None`` entries hold a
  place: their index is used by no object)."""
  ref_map = _graphlib.RefMap()
  for k, obj in enumerate(objects):
    ref_map[object() if obj is None else obj] = k
  return ref_map


def graph_flatten(x, ref_map) -> tuple[Any, list, list]:
  """``(graphdef, paths, leaves)`` of ``x`` as ``nnx.split`` sees it; objects in ``ref_map``
  become references; leaves are Variables (or arrays held as attributes)."""
  graphdef, flat = _graphlib.flatten(x, ref_index=ref_map, with_paths=True, graph=True)
  return graphdef, list(flat.paths), list(flat.leaves)


def graph_unflatten(graphdef, values: list, index_ref) -> Any:
  """The object ``graphdef`` describes, with fresh Variables holding ``values`` (raw values,
  in ``graph_flatten``'s leaf order) and references resolved through ``index_ref``."""
  return _graphlib.unflatten(graphdef, list(values), index_ref=index_ref)


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
  @functools.wraps(method)
  def counted(*args, **kwargs):
    try:
      return method(*args, **kwargs)
    finally:  # after the edit: a guard that read the counter before it sees the move
      PYTREE_EDITS.n += 1
      EDIT_LOG.append((PYTREE_EDITS.n, id(args[0])))

  counted.__wrapped_for_edits__ = method
  return counted


def _count_pytree_edits() -> None:
  pytree = _pytreelib.Pytree
  originals = {}
  for name in _EDITING_METHODS:
    method = pytree.__dict__[name]
    if hasattr(method, '__wrapped_for_edits__'):  # installed already (a reload)
      return
    originals[method] = _counting(method)
    setattr(pytree, name, originals[method])
  # classes created before this point registered the original clear/init with nnx's graph
  # registry; later ones pick up the counting methods from the class
  for node_type, impl in list(_graphlib.GRAPH_REGISTRY.items()):
    if isinstance(impl, _graphlib.GraphNodeImpl) and (impl.clear in originals or impl.init in originals):
      _graphlib.GRAPH_REGISTRY[node_type] = dataclasses.replace(
        impl, clear=originals.get(impl.clear, impl.clear), init=originals.get(impl.init, impl.init)
      )


_count_pytree_edits()


def _count_metadata_edits() -> None:
  from flax import nnx

  for name in ('set_metadata', 'del_metadata'):
    method = nnx.Variable.__dict__[name]
    if hasattr(method, '__wrapped_for_edits__'):  # installed already (a reload)
      return
    setattr(nnx.Variable, name, _counting(method))


_count_metadata_edits()
_count_value_writes()

#: ``metadata_of(variable)``: the Variable's live metadata dict (no copy).
metadata_of = operator.attrgetter('_var_metadata')


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
  nnx.Variable.__init__ = _logging(init, returns=False)
  new = nnx.Variable.__dict__['_new'].__func__
  nnx.Variable._new = classmethod(_logging(new, returns=True))


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


class DataAttribute:
  """An array held as a data attribute of a graph node (``self.arr = nnx.data(x)``, or any
  array attribute, which ``nnx.state`` lists as state), managed by brainnx like a Variable.

  It stands for ``container[key]`` (a node's attribute dict, or a list or dict held in a data
  attribute): brainnx reads and writes its value through the same ``raw_value`` /
  ``set_raw_value`` as a Variable's, which here read and write the container directly.
  """

  __slots__ = ('container', 'key', '_trace_state', '__weakref__')
  hijax = ref = False

  def __init__(self, container, key):
    self.container, self.key = container, key
    self._trace_state = _nnx_tracers.TraceState()

  @property
  def _raw_value(self):
    return self.container[self.key]

  @_raw_value.setter
  def _raw_value(self, value):
    self.container[self.key] = value

  @property
  def _can_update(self) -> bool:
    return self._trace_state.is_valid()

  def __repr__(self) -> str:
    return f'DataAttribute({self.key!r})'


def refuse_nnx_flatten(cls: type, message: Callable[[Any], str]) -> None:
  """Make flax's graph functions (``nnx.state``, ``Optimizer.update``) refuse ``cls`` objects
  with ``ValueError(message(obj))``; ``jax.tree`` functions are unaffected."""

  def refuse(node):
    raise ValueError(message(node))

  _graphlib.register_graph_node_type(cls, refuse, None, None, None, None, None)


def is_internal_attribute(name: str) -> bool:
  """Whether a Pytree attribute is flax's own bookkeeping (``_pytree__state``, ...), not state."""
  return name.startswith('_pytree__')


def pytree_has_int_keys(node_type) -> bool:
  """Whether an ``nnx.Pytree`` type names its children by int (``nnx.List``)."""
  return bool(getattr(node_type, '_pytree__has_int_keys', False))


# -- trace levels --------------------------------------------------------------
# Flax refuses to mutate a Variable or a Pytree from a trace level other than the
# one it was created in. brainnx owns the values it swaps in, so it moves the
# object's recorded trace level to the current trace for the duration of a call
# and puts the original back afterwards.


def new_trace_state():
  """A flax ``TraceState`` recording the current JAX trace."""
  return _nnx_tracers.TraceState()


def get_node_trace_state(obj):
  """The recorded trace state of a Variable or a Pytree (Module, Rngs, ...)."""
  if hasattr(obj, '_pytree__state'):
    return obj._pytree__state._trace_state
  return obj._trace_state


def set_node_trace_state(obj, trace_state) -> None:
  if hasattr(obj, '_pytree__state'):
    object.__setattr__(obj._pytree__state, '_trace_state', trace_state)
  else:
    object.__setattr__(obj, '_trace_state', trace_state)


def can_update(variable) -> bool:
  """Whether flax allows writing ``variable`` from the current trace level."""
  return variable._can_update


def current_trace():
  """The innermost active JAX trace object (an ``EvalTrace`` at top level)."""
  return _jax_core.trace_ctx.trace


def at_top_level() -> bool:
  """True when no JAX transformation is being traced right now."""
  return isinstance(_jax_core.trace_ctx.trace, _jax_core.EvalTrace)


def is_batched_here(x, trace) -> bool:
  """Whether ``x`` carries a batch axis of the vmap whose trace is ``trace``."""
  return (
    isinstance(x, _batching.BatchTracer)
    and x._trace is trace
    and x.batch_dim is not None  # jax spells "not mapped" as None
  )


# -- jaxprs --------------------------------------------------------------------


#: Raised for arguments committed to other devices than the compiled call's.
DEVICE_MISMATCH_ERRORS = (ValueError, _jax_stages.DeviceAssignmentMismatchError)


def is_device_mismatch(error: BaseException) -> bool:
  return type(error) is not ValueError or 'incompatible devices' in str(error)


def call_jaxpr(closed, *args) -> list:
  """``closed`` applied to ``args`` inside a trace: one inlined ``jit`` call, as ``jax.jit``
  nests a jitted function. Under a tracing ``jit`` its equations are copied into the trace
  as they are, instead of being bound again one by one (``jax.core.eval_jaxpr``); under
  ``vmap``, ``grad`` and the rest, JAX's rules for nested ``jit`` apply."""
  if at_top_level():
    outs = _jax_core.eval_jaxpr(closed.jaxpr, closed.consts, *args)
    # a constant output (a literal in the jaxpr) comes back as jax's typed Python scalar or numpy
    # array, an input passed through as the very object given (a numpy array, a float): each
    # gets the new Array that jax.jit would return
    return [x if isinstance(x, jax.Array) else jax.device_put(x) for x in outs]
  n_in, n_out = len(closed.in_avals), len(closed.out_avals)
  unspecified = _jax_pjit.UNSPECIFIED
  return _jax_pjit.jit_p.bind(
    *args,
    jaxpr=closed,
    in_shardings=(unspecified,) * n_in,
    out_shardings=(unspecified,) * n_out,
    in_layouts=(None,) * n_in,
    out_layouts=(None,) * n_out,
    donated_invars=(False,) * n_in,
    ctx_mesh=_jax_pjit.get_ctx_mesh(False),
    name='brainnx_call',
    keep_unused=False,
    inline=True,
    compiler_options_kvs=(),
  )


def with_debug_names(debug_info, arg_names: tuple, result_paths: tuple):
  """A jaxpr's ``debug_info`` with its argument and result names replaced (or None)."""
  if debug_info is None:
    return None
  return debug_info._replace(arg_names=arg_names, result_paths=result_paths)


# -- filters -------------------------------------------------------------------

to_predicate = _filterlib.to_predicate


# -- a Ctrl-C inside a host callback ------------------------------------------
# On CPU a host callback (a ProgressBar's, a jax.debug.print) runs in the thread
# that called the compiled program, so that is where Python delivers a Ctrl-C.
# JAX logs the KeyboardInterrupt as a failed callback and the program ends with
# a JaxRuntimeError whose text carries the callback's traceback.

_CALLBACK_LOGGERS = ('jax._src.callback', 'jax._src.debugging')


def _not_an_interrupt(record) -> bool:
  exc = record.exc_info
  return not (exc and exc[0] is not None and issubclass(exc[0], KeyboardInterrupt))


def quiet_interrupted_callbacks() -> None:
  """Stop JAX logging a Ctrl-C that lands in a host callback as a callback failure."""
  for name in _CALLBACK_LOGGERS:
    logger = logging.getLogger(name)
    if _not_an_interrupt not in logger.filters:
      logger.addFilter(_not_an_interrupt)


def is_interrupted_callback(error: BaseException) -> bool:
  """Whether ``error`` is the runtime error of a program whose host callback got a Ctrl-C."""
  if not isinstance(error, jax.errors.JaxRuntimeError):
    return False
  return str(error).rstrip().rstrip(':').endswith('KeyboardInterrupt')  # the callback's traceback ends so


def weakly_typed(x):
  """``x`` with a weak type, as a Python scalar turned array has (``jax.lax.fori_loop``'s index
  for Python int bounds): ``x * jnp.int8(1)`` is then ``int8``."""
  return _jax_lax._convert_element_type(x, weak_type=True)


# -- tracebacks that end in user code -------------------------------------------------
# JAX removes its own frames from the traceback of an error raised under one of its API
# boundaries (``JAX_TRACEBACK_FILTERING``); brainnx's entry points are such boundaries, and
# brainnx's files are excluded the same way, so a user's error shows the user's frames.

#: ``api_boundary(fun)``: ``fun``, with the tracebacks of errors raised under it filtered.
api_boundary = _traceback_util.api_boundary


def hide_frames_under(directory: str) -> None:
  """Leave the frames of files under ``directory`` out of filtered tracebacks, as JAX's own."""
  _traceback_util.register_exclusion(directory)
