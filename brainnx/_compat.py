"""The one place that touches private JAX and Flax APIs.

Everything here is a thin, named wrapper so that a version bump of jax or
flax touches this file only. ``tests/test_compat.py`` fails if any other
module imports ``jax._src`` or a private flax module.
"""

from __future__ import annotations

import operator

from flax.nnx import filterlib as _filterlib
from flax.nnx import tracers as _nnx_tracers
from jax._src import core as _jax_core
from jax._src.interpreters import batching as _batching

__all__ = [
    'current_trace',
    'is_batched_here',
    'raw_value',
    'set_raw_value',
  'set_raw_values',
    'set_node_trace_state',
    'get_node_trace_state',
    'new_trace_state',
  'can_update',
  'at_top_level',
    'to_predicate',
    'Tracer',
]

Tracer = _jax_core.Tracer

# -- Variable values ---------------------------------------------------------

#: ``raw_value(variable)``: the stored value, without the copy ``get_value`` makes.
raw_value = operator.attrgetter('_raw_value')


def set_raw_value(variable, value) -> None:
  """Store ``value`` in ``variable`` without flax's trace-level check.

  brainnx only calls this after it has decided itself that the write is legal
  (eager write-back of a compiled result, or restoring a pre-call value).
  """
  object.__setattr__(variable, '_raw_value', value)


def set_raw_values(variables, values) -> None:
  """``set_raw_value`` for many Variables at once (the jit write-back loop)."""
  store = object.__setattr__
  for variable, value in zip(variables, values):
    store(variable, '_raw_value', value)


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


# -- filters -------------------------------------------------------------------

to_predicate = _filterlib.to_predicate
