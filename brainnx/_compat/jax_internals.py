"""JAX's private APIs brainnx uses: tracers and the current trace, the batch tracer of
``vmap``, an inlined ``jit`` call of a jaxpr, jaxpr debug names, device-mismatch errors, the
weak-type conversion, host-callback interrupts and traceback filtering.

Supported: jax 0.8.1 through 0.10.x. Version differences handled here: the context mesh of a
``jit`` call (``jax._src.pjit.get_ctx_mesh`` from 0.10, ``jax._src.mesh.get_concrete_mesh``
before), the abstract value's manual axes (``manual_axis_type`` from 0.10, ``vma`` before).
"""

from __future__ import annotations

import logging

import jax
from jax._src import array as _jax_array
from jax._src import core as _jax_core
from jax._src import pjit as _jax_pjit
from jax._src import stages as _jax_stages
from jax._src import traceback_util as _traceback_util
from jax._src.interpreters import batching as _batching
from jax._src.lax import lax as _jax_lax

Tracer = _jax_core.Tracer

#: The concrete array type a compiled call returns (a class lookup: no backend starts).
ArrayImpl = _jax_array.ArrayImpl

if hasattr(_jax_pjit, 'get_ctx_mesh'):  # jax >= 0.10
  _ctx_mesh = _jax_pjit.get_ctx_mesh
else:  # jax 0.8, 0.9
  from jax._src import mesh as _jax_mesh

  def _ctx_mesh(_):
    return _jax_mesh.get_concrete_mesh()


def manual_axes(aval):
  """The manual (``shard_map``) axes part of an abstract value's type, or ``None``: jax 0.10's
  ``manual_axis_type``, earlier releases' ``vma``."""
  manual = getattr(aval, 'manual_axis_type', None)
  if manual is not None:
    return manual if (manual.varying or manual.unreduced or manual.reduced) else None
  vma = getattr(aval, 'vma', None)
  return vma or None


def shape_dtype_struct(aval, **extra) -> jax.ShapeDtypeStruct:
  """A ``ShapeDtypeStruct`` of ``aval`` with its weak type and, where given, its manual axes
  (``manual=``) under the name this jax spells them."""
  manual = extra.pop('manual', None)
  if manual is not None:
    extra['manual_axis_type' if hasattr(aval, 'manual_axis_type') else 'vma'] = manual
  return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type, **extra)


def aval_manual_key(a):
  """What an abstract value's manual axes add to a cache key."""
  return getattr(a, 'manual_axis_type', None) if hasattr(a, 'manual_axis_type') else getattr(a, 'vma', None)


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
    ctx_mesh=_ctx_mesh(False),
    name='brainnx_call',
    keep_unused=False,
    inline=True,
    compiler_options_kvs=(),
  )


def host_callback_target(eqn):
  """The Python function a host-callback equation (``io_callback``, ``pure_callback``,
  ``jax.debug.callback``) calls, or ``None`` where it cannot be found. ``io_callback`` and
  ``pure_callback`` keep it as ``callback_func`` of their flat wrapper; ``jax.debug.callback``'s
  flat wrapper is a closure over it (jax 0.8.1 through 0.10.x)."""
  flat = eqn.params.get('callback')
  target = getattr(flat, 'callback_func', None)
  if target is not None:
    return target
  for cell in getattr(flat, '__closure__', None) or ():
    try:
      value = cell.cell_contents
    except ValueError:  # an empty cell
      continue
    if callable(value) and not isinstance(value, type):
      return value
  return None


def with_debug_names(debug_info, arg_names: tuple, result_paths: tuple):
  """A jaxpr's ``debug_info`` with its argument and result names replaced (or None)."""
  if debug_info is None:
    return None
  return debug_info._replace(arg_names=arg_names, result_paths=result_paths)


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
