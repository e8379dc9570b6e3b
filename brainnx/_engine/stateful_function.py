"""Trace a stateful function once per abstract signature; replay the jaxpr.

The one state step of every transform is :func:`state_step`: swap values
into the discovered Variables, call the function, collect what it wrote and
the Variables it created, restore. :func:`trace_call` runs it under
``jax.make_jaxpr``; reads are the jaxpr inputs some equation or output uses,
writes are Variables whose value afterwards is not the one that went in.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> import brainnx as bnx
  >>> count = nnx.Variable(jnp.zeros((), jnp.int32))
  >>> scale = nnx.Param(jnp.full((3,), 2.0))
  >>> def f(x):
  ...   count[...] += 1
  ...   return x * scale[...]
  >>> sf = bnx.StatefulFunction(f).make_jaxpr(jnp.ones(3))
  >>> [type(v).__name__ for v in sf.get_states(jnp.ones(3))]
  ['Variable', 'Param']
  >>> sf.get_write_states(jnp.ones(3)) == (count,)
  True
  >>> sf(jnp.ones(3)), count[...]
  (Array([2., 2., 2.], dtype=float32), Array(1, dtype=int32))
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.extend

from brainnx import _compat
from brainnx._engine.arguments import CallArgs, StaticArgs
from brainnx._engine.caches import LRUCache
from brainnx._engine.call import check_values
from brainnx._engine.discovery import Discovery, discover
from brainnx._engine.errors import check_callable
from brainnx._engine.state import abstract_args, abstract_states, aval_key, read_values, write_values
from brainnx._engine.tracing import Trace, TraceKey, trace_call, tracing_config


# -- the public StatefulFunction ------------------------------------------------------


class StatefulFunction:
  """A function whose Variables are found by tracing, with a cached jaxpr per signature.

  The jaxpr's inputs are ``get_states()`` values then the dynamic argument
  leaves; its outputs are the (written) state values then the output leaves.
  Traces are kept in a thread-safe LRU cache (128 entries by default).

  States are ordered by first touch, read off the jaxpr: the first equation
  that uses a state's incoming value or produces its new value. States
  touched at the same point (say, assigned an argument as is) keep their
  discovery order.

  The getters. Every method taking ``*args, **kwargs`` (the call's
  positional and keyword arguments: arrays, ``jax.ShapeDtypeStruct``s,
  graph nodes, static values) traces ``fun`` for those arguments unless a
  trace for their abstract signature is cached, and raises ``TypeError``
  if a static argument is not hashable, or a dynamic argument or a
  Variable the call uses holds something other than arrays.

  Args:
    fun: the function. It may read and write any Variable reachable from its
      arguments, ``self``, ``functools.partial`` arguments, closure cells and
      the globals its code loads.
    static_argnums: an int or ints: positions of arguments compared by
      value (hashable) and baked into the trace. Default ``()``.
    static_argnames: a name or names of such arguments. Default ``()``.
    name: a label for error messages and ``repr``. Default ``None``:
      ``fun.__name__``.
    return_only_write: the jaxpr returns only written states' values (else
      every touched state's). Default ``True``.
    cache_size: the number of traces kept (keyword only). Default ``128``.
    cache: a trace cache to share (keyword only; ``jit`` shares one among the wrappers of a
      function); ``cache_size`` is then unused.

  Raises:
    TypeError: if ``fun`` is not callable or an argnum is not an int.
    ValueError: if an argnum is negative, ``static_argnums`` is beyond
      ``fun``'s positional parameters, or a ``static_argnames`` entry is not
      one of its parameters.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import brainnx as bnx
    >>> w, seen = nnx.Param(jnp.ones(2)), nnx.Variable(jnp.array(0))
    >>> def f(x):
    ...   seen[...] += 1
    ...   return x @ w[...]
    >>> sf = bnx.StatefulFunction(f)
    >>> new_vals, out = sf.jaxpr_call([seen[...], w[...]], jnp.ones(2))
    >>> [int(new_vals[0]), float(out)], int(seen[...])   # jaxpr_call writes nothing
    ([1, 2.0], 0)
  """

  def __init__(
    self,
    fun: Callable,
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
    name: str | None = None,
    return_only_write: bool = True,
    *,
    cache_size: int = 128,
    cache: LRUCache | None = None,
  ) -> None:
    check_callable(fun, 'StatefulFunction')
    self.fun = fun
    self.statics = StaticArgs.resolve(fun, static_argnums, static_argnames, what='StatefulFunction')
    self.name = name or getattr(fun, '__name__', type(fun).__name__)
    self.return_only_write = return_only_write
    self._cache = cache if cache is not None else LRUCache(cache_size)

  def __repr__(self) -> str:
    return f'StatefulFunction({self.name})'

  # -- tracing ----------------------------------------------------------------

  def _prepare(self, args, kwargs):
    call = CallArgs.split(args, kwargs, self.statics)
    disc = discover(self.fun, args, kwargs)
    return call, disc

  def trace_for(self, disc: Discovery, call: CallArgs, state_values, dyn) -> Trace:
    """The (cached) trace of this call; ``state_values`` are per discovered Variable."""
    state_avals, dyn_avals = abstract_states(disc, state_values), abstract_args(dyn)
    key = TraceKey(disc.signature, call.signature, aval_key(state_avals), aval_key(dyn_avals), tracing_config())
    found = self._cache.get(key)
    if found is not None:
      return found
    trace = trace_call(
      self.fun, disc, call, state_avals, dyn_avals, only_write=self.return_only_write
    )
    if trace.cacheable:
      self._cache.set(key, trace)
      if disc.refresh_captured():  # the trace rebound a captured counter: the next call is the same
        self._cache.set(TraceKey(disc.signature, *key[1:]), trace)
    return trace

  @_compat.api_boundary  # the public methods trace here: an error in user code shows the user's frames
  def _trace(self, args, kwargs):
    call, disc = self._prepare(args, kwargs)
    values = read_values(disc.variables)
    check_values(disc, values)
    return call, disc, self.trace_for(disc, call, values, call.dyn)

  def make_jaxpr(self, *args, **kwargs) -> 'StatefulFunction':
    """Trace for these arguments (arrays or ``jax.ShapeDtypeStruct``s); returns ``self``.

    The trace is cached, so later calls with the same abstract signature
    reuse it. No Variable is changed.

    Args:
      *args, **kwargs: the call's arguments (see "The getters" in the class docstring).

    Returns:
      ``self``, for chaining (``sf.make_jaxpr(x).get_states(x)``).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> import brainnx as bnx
      >>> w = nnx.Param(jnp.ones(3))
      >>> sf = bnx.StatefulFunction(lambda x: x * w[...])
      >>> sf.make_jaxpr(jax.ShapeDtypeStruct((3,), jnp.float32)) is sf
      True
      >>> sf.get_cache_stats()['jaxpr_cache']['size']
      1
    """
    self._trace(args, kwargs)
    return self

  def get_jaxpr(self, *args, **kwargs) -> jax.extend.core.ClosedJaxpr:
    """The ``ClosedJaxpr`` for these arguments.

    Its inputs are the :meth:`get_states` values then the dynamic argument
    leaves; its outputs the written (or, with ``return_only_write=False``,
    all touched) state values then the output leaves.

    Args:
      *args, **kwargs: the call's arguments (see "The getters" in the class docstring).

    Returns:
      The cached ``jax.extend.core.ClosedJaxpr`` of the call.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import brainnx as bnx
      >>> w = nnx.Param(jnp.ones(3))
      >>> jaxpr = bnx.StatefulFunction(lambda x: x * w[...]).get_jaxpr(jnp.ones(3))
      >>> len(jaxpr.jaxpr.invars), len(jaxpr.jaxpr.outvars)   # (w, x) -> (out,)
      (2, 1)
    """
    return self._trace(args, kwargs)[2].closed

  def get_states(self, *args, **kwargs) -> tuple:
    """Variables the call reads or writes, in first-touch order.

    Args:
      *args, **kwargs: the call's arguments (see "The getters" in the class docstring).

    Returns:
      A tuple of the touched Variable objects, in the order of the jaxpr's
      state inputs.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import brainnx as bnx
      >>> out, scale = nnx.Variable(jnp.zeros(())), nnx.Param(jnp.array(2.0))
      >>> def f(x):
      ...   out[...] = x * scale[...]
      >>> bnx.StatefulFunction(f).get_states(1.0) == (scale, out)
      True
    """
    _, disc, trace = self._trace(args, kwargs)
    return tuple(disc.variables[i] for i in trace.states)

  def get_read_states(self, *args, **kwargs) -> tuple:
    """Variables whose incoming value the call uses.

    Args:
      *args, **kwargs: the call's arguments (see "The getters" in the class docstring).

    Returns:
      A tuple of those Variables, in first-touch order.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import brainnx as bnx
      >>> out, scale = nnx.Variable(jnp.zeros(())), nnx.Param(jnp.array(2.0))
      >>> def f(x):
      ...   out[...] = x * scale[...]      # out is written, not read
      >>> bnx.StatefulFunction(f).get_read_states(1.0) == (scale,)
      True
    """
    _, disc, trace = self._trace(args, kwargs)
    return tuple(disc.variables[i] for i in trace.states if i in trace.read)

  def get_write_states(self, *args, **kwargs) -> tuple:
    """Variables the call gives a new value.

    Args:
      *args, **kwargs: the call's arguments (see "The getters" in the class docstring).

    Returns:
      A tuple of those Variables, in first-touch order.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import brainnx as bnx
      >>> out, scale = nnx.Variable(jnp.zeros(())), nnx.Param(jnp.array(2.0))
      >>> def f(x):
      ...   out[...] = x * scale[...]
      >>> bnx.StatefulFunction(f).get_write_states(1.0) == (out,)
      True
    """
    _, disc, trace = self._trace(args, kwargs)
    return tuple(disc.variables[i] for i in trace.written)

  def get_out_shapes(self, *args, **kwargs) -> Any:
    """The return value's structure with ``jax.ShapeDtypeStruct`` leaves.

    Args:
      *args, **kwargs: the call's arguments (see "The getters" in the class docstring).

    Returns:
      A pytree of the structure ``fun`` returns, each array leaf replaced
      by its ``jax.ShapeDtypeStruct``.

    Example:
      >>> import jax.numpy as jnp
      >>> import brainnx as bnx
      >>> bnx.StatefulFunction(lambda x: {'sum': x.sum()}).get_out_shapes(jnp.ones((2, 3)))
      {'sum': ShapeDtypeStruct(shape=(), dtype=float32)}
    """
    _, disc, trace = self._trace(args, kwargs)
    return trace.out_shapes(disc)

  def jaxpr_call(self, state_vals: Sequence, *args, **kwargs) -> tuple[list, Any]:
    """Evaluate the cached jaxpr purely: ``(new_state_vals, out)``.

    ``state_vals`` are values for ``get_states(*args, **kwargs)``, in that
    order; the result holds a new value for each of them (the input value
    for states the call only reads). No Variable is changed.

    Args:
      state_vals: one value per :meth:`get_states` entry, in that order,
        each with that Variable's shape and dtype.
      *args: the call's positional arguments (arrays, graph nodes, static
        values).
      **kwargs: the call's keyword arguments.

    Returns:
      ``(new_state_vals, out)``: a list with the new value of each state
      (in :meth:`get_states` order) and the function's output.

    Raises:
      ValueError: if ``state_vals`` does not have one value per state, or
        a value's structure, shape or dtype differs from its state's.
      TypeError: if a state value, a dynamic argument or a Variable the
        call uses holds something other than arrays, or a static argument
        is not hashable.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import brainnx as bnx
      >>> count = nnx.Variable(jnp.array(0))
      >>> def f(x):
      ...   count[...] += 1
      ...   return x + count[...]
      >>> new_vals, out = bnx.StatefulFunction(f).jaxpr_call([jnp.array(10)], 1)
      >>> int(new_vals[0]), int(out), int(count[...])
      (11, 12, 0)
    """
    call, disc, trace = self._trace(args, kwargs)
    state_vals = list(state_vals)
    trace.check_states(disc, state_vals, f'{self.name}.jaxpr_call')
    outs, new, out_leaves = trace.run(state_vals, jax.tree.leaves(call.dyn))
    by_index = dict(zip(trace.written if trace.only_write else trace.states, outs))
    new_vals = [by_index.get(i, x) for i, x in zip(trace.states, state_vals)]
    return new_vals, trace.finish(disc, new, out_leaves, attach=False)

  def __call__(self, *args, **kwargs) -> Any:
    """Run the traced computation on current values and write the results back.

    The cached jaxpr (traced now if needed) is evaluated on the Variables'
    current values; written Variables get their new values, and Variables
    the function creates and attaches to a reachable container are kept.
    If evaluation fails, nothing is written.

    Args:
      *args: the call's positional arguments (arrays, graph nodes, static
        values).
      **kwargs: the call's keyword arguments.

    Returns:
      The function's output.

    Raises:
      TypeError: if a static argument is not hashable, or a dynamic
        argument or a Variable the call uses holds something other than
        arrays.
      RuntimeError: if the call runs inside a JAX transform brainnx does
        not manage (a raw ``jax.jit``, ``jax.vmap``, ...) and would leave a
        tracer in a Variable.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import brainnx as bnx
      >>> count = nnx.Variable(jnp.array(0))
      >>> def f(x):
      ...   count[...] += 1
      ...   return x + count[...]
      >>> sf = bnx.StatefulFunction(f)
      >>> int(sf(1)), int(sf(1)), int(count[...])
      (2, 3, 2)
    """
    call, disc = self._prepare(args, kwargs)
    values = read_values(disc.variables)
    check_values(disc, values)
    contents = disc.snapshot()
    try:
      trace = self.trace_for(disc, call, values, call.dyn)
      outs, new, out_leaves = trace.run([values[i] for i in trace.states], jax.tree.leaves(call.dyn))
      if trace.waits:  # let a failing host callback raise before anything is written
        jax.block_until_ready((outs, new, out_leaves))
    except BaseException:
      disc.restore(contents)
      raise
    written = trace.written if trace.only_write else trace.states
    write_values(disc, written, outs)
    return trace.finish(disc, new, out_leaves)

  def clear_cache(self) -> None:
    """Forget every cached trace.

    The next call with any arguments traces ``fun`` again.

    Returns:
      ``None``.

    Example:
      >>> import jax.numpy as jnp
      >>> import brainnx as bnx
      >>> sf = bnx.StatefulFunction(lambda x: x * 2).make_jaxpr(jnp.ones(2))
      >>> sf.clear_cache()
      >>> sf.get_cache_stats()['jaxpr_cache']['size']
      0
    """
    self._cache.clear()

  def get_cache_stats(self) -> dict:
    """``{'jaxpr_cache': {'size', 'maxsize', 'hits', 'misses', 'hit_rate'}}``.

    Returns:
      A dict with one entry, ``'jaxpr_cache'``: the number of cached traces
      (``size``), the cache bound (``maxsize``), lookups that found a trace
      (``hits``) or did not (``misses``), and ``hit_rate`` in percent.

    Example:
      >>> import jax.numpy as jnp
      >>> import brainnx as bnx
      >>> sf = bnx.StatefulFunction(lambda x: x * 2)
      >>> _ = sf.get_jaxpr(jnp.ones(2)), sf.get_jaxpr(jnp.zeros(2))   # same signature
      >>> stats = sf.get_cache_stats()['jaxpr_cache']
      >>> stats['size'], stats['hits'], stats['misses'], stats['maxsize']
      (1, 1, 1, 128)
    """
    return {'jaxpr_cache': self._cache.stats()}


def make_jaxpr(
  fun: Callable,
  static_argnums: int | Sequence[int] = (),
  static_argnames: str | Sequence[str] = (),
  return_shape: bool = False,
  return_only_write: bool = False,
) -> Callable[..., tuple]:
  """``make_jaxpr(f)(*args) -> (ClosedJaxpr, states[, out_shapes])``.

  Like ``jax.make_jaxpr``, with the Variables ``f`` touches as the leading
  inputs (and, by default, leading outputs). No Variable is changed.

  Args:
    fun: the function; it may read and write the Variables it reaches (see
      :class:`StatefulFunction`).
    static_argnums: an int or ints: positions of hashable arguments baked
      into the trace. Default ``()``.
    static_argnames: a name or names of such arguments. Default ``()``.
    return_shape: also return the output's structure with
      ``jax.ShapeDtypeStruct`` leaves. Default ``False``.
    return_only_write: the jaxpr's leading outputs are only the written
      states' values. Default ``False``: every touched state's value.

  Returns:
    A function taking ``fun``'s arguments (arrays or
    ``jax.ShapeDtypeStruct``s) and returning ``(closed_jaxpr, states)``, or
    ``(closed_jaxpr, states, out_shapes)`` with ``return_shape``;
    ``states`` is the tuple of touched Variables, in the jaxpr's input order.

  Raises:
    TypeError: if ``fun`` is not callable or an argnum is not an int; when
      the returned function is called, if a static argument is not hashable
      or a dynamic argument or Variable holds something other than arrays.
    ValueError: if an argnum is negative, ``static_argnums`` is beyond
      ``fun``'s positional parameters, or a ``static_argnames`` entry is not
      one of its parameters.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import brainnx as bnx
    >>> w = nnx.Param(jnp.ones(2))
    >>> jaxpr, states = bnx.make_jaxpr(lambda x: x @ w[...])(jnp.ones(2))
    >>> states == (w,), len(jaxpr.jaxpr.invars), len(jaxpr.jaxpr.outvars)
    (True, 2, 2)
  """
  sf = StatefulFunction(fun, static_argnums, static_argnames, return_only_write=return_only_write)

  def make_jaxpr_f(*args, **kwargs):
    _, disc, trace = sf._trace(args, kwargs)
    states = tuple(disc.variables[i] for i in trace.states)
    if return_shape:
      return trace.closed, states, trace.out_shapes(disc)
    return trace.closed, states

  return make_jaxpr_f
