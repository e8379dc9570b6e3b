"""flax's graph internals brainnx uses: a node's live attribute dict, split and merge against
known objects (``RefMap``, ``flatten(..., ref_index=)``, ``unflatten(..., index_ref=)``), the
graph registry, trace levels of Variables and Pytrees, arrays held as data attributes, filters.

Supported: flax 0.12.4 through 0.12.x. Version differences handled here: the graph module
(``flax.nnx.graphlib`` from 0.12.5, ``flax.nnx.graph`` before) and ``flatten``'s ``graph=``
keyword (from 0.12.5; before, every flatten walks the graph).
"""

from __future__ import annotations

import inspect
import operator
from typing import Any, Callable

from flax.nnx import filterlib as _filterlib
from flax.nnx import tracers as _nnx_tracers

try:
  from flax.nnx import graphlib  # flax >= 0.12.5
except ImportError:  # flax 0.12.4
  from flax.nnx import graph as graphlib

from brainnx._compat.slots import SlotAttributes, slot_names

_FLATTEN_TAKES_GRAPH = 'graph' in inspect.signature(graphlib.flatten).parameters

#: ``raw_value(variable)``: the stored value, without the copy ``get_value`` makes.
raw_value = operator.attrgetter('_raw_value')

#: ``metadata_of(variable)``: the Variable's live metadata dict (no copy).
metadata_of = operator.attrgetter('_var_metadata')

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


# -- flax's graph split and merge with known objects ------------------------------------
# What a call creates is split against the objects it already knew (so a new node holding a
# known one records a reference to it, not a copy) and merged per call against that call's
# objects: flax's own ``ref_index``/``index_ref`` mechanism of ``nnx.split``/``nnx.merge``.


def known_ref_map(objects) -> Any:
  """A flax ``RefMap`` giving ``objects[k]`` the graph index ``k`` (``None`` entries hold a
  place: their index is used by no object)."""
  ref_map = graphlib.RefMap()
  for k, obj in enumerate(objects):
    ref_map[object() if obj is None else obj] = k
  return ref_map


def graph_flatten(x, ref_map) -> tuple[Any, list, list]:
  """``(graphdef, paths, leaves)`` of ``x`` as ``nnx.split`` sees it; objects in ``ref_map``
  become references; leaves are Variables (or arrays held as attributes)."""
  extra = {'graph': True} if _FLATTEN_TAKES_GRAPH else {}
  graphdef, flat = graphlib.flatten(x, ref_index=ref_map, with_paths=True, **extra)
  return graphdef, list(flat.paths), list(flat.leaves)


def graph_unflatten(graphdef, values: list, index_ref) -> Any:
  """The object ``graphdef`` describes, with fresh Variables holding ``values`` (raw values,
  in ``graph_flatten``'s leaf order) and references resolved through ``index_ref``."""
  return graphlib.unflatten(graphdef, list(values), index_ref=index_ref)


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

  graphlib.register_graph_node_type(cls, refuse, None, None, None, None, None)


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


# -- filters -------------------------------------------------------------------

to_predicate = _filterlib.to_predicate
