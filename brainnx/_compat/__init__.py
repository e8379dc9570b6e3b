"""The one place that touches private JAX and Flax APIs, one room per surface:

- ``jax_internals``: JAX's tracers, traces, jaxpr calls, errors and traceback filtering;
- ``flax_graph``: flax's graph internals (attribute dicts, split/merge against known objects,
  the registry, trace levels, data attributes, filters);
- ``flax_hooks``: what brainnx installs into flax's classes on import (value-write counting,
  the trace lock, the edit log, the creation log) and the counters and locks they keep;
- ``slots``: a live attribute dict for objects with ``__slots__`` (pure Python).

Each room says which versions it supports and handles each version difference once.
Everything else imports the names below from here; ``tests/test_compat.py`` fails if any other
module imports ``jax._src`` or a private flax module, reads a private attribute of a Variable or
Pytree, or writes into an object's ``vars()``. Nothing here imports the rest of brainnx, and
importing it does not start a JAX backend.
"""

from brainnx._compat.flax_graph import (
  DataAttribute, attributes, can_update, get_node_trace_state, graph_flatten, graph_unflatten, is_internal_attribute,
  is_node_attributes, known_ref_map, metadata_of, new_trace_state, pytree_has_int_keys, raw_value, refuse_nnx_flatten,
  set_node_trace_state, to_predicate,
)
from brainnx._compat.flax_hooks import (
  EDIT_LOG, KEPT_LOCK, KEPT_VALUES, PYTREE_EDITS, STATE_CHANGES, TRACE_LOCK, VALUE_WRITES, EditCount, StateChanges,
  created_variables, outer_level, restore_entries, set_raw_value, set_raw_values, values_written,
)
from brainnx._compat.jax_internals import (
  DEVICE_MISMATCH_ERRORS, ArrayImpl, Tracer, api_boundary, aval_manual_key, at_top_level, call_jaxpr, current_trace,
  hide_frames_under, host_callback_target, is_batched_here, is_device_mismatch, is_interrupted_callback, manual_axes,
  quiet_interrupted_callbacks, shape_dtype_struct, weakly_typed, with_debug_names,
)
