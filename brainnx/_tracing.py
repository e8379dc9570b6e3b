"""Trace a stateful function once per abstract signature; replay the jaxpr.

The Variables a call can reach (see ``_discovery``) get tracers swapped in for
the duration of the trace; reads are the jaxpr inputs some equation or output
uses, writes are Variables whose value afterwards is not the tracer that went
in. Everything is restored in a ``finally``.

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

import collections
import contextlib
import dataclasses
import functools
import threading
from typing import Any, Callable, Hashable, Sequence

import jax
import jax.extend
import numpy as np

from brainnx import _compat
from brainnx._arguments import CallArgs, normalize_static_argnums
from brainnx._discovery import Discovery, discover, walk_new
from brainnx._outputs import OutSpec, split_output

__all__ = ['StatefulFunction', 'make_jaxpr', 'Trace', 'swapped', 'write_values', 'park_new', 'adopt_new', 'TRACE_LOCK']

#: Held while Variables hold tracers, so that two threads never swap the same ones at once.
TRACE_LOCK = threading.RLock()


# -- a small LRU cache ------------------------------------------------------------


class LRUCache:
  """Thread-safe least-recently-used mapping with hit/miss counters."""

  def __init__(self, maxsize: int = 128):
    self.maxsize = maxsize
    self._data: collections.OrderedDict = collections.OrderedDict()
    self._lock = threading.Lock()
    self.hits = self.misses = 0

  def get(self, key, default=None):
    with self._lock:
      if key in self._data:
        self._data.move_to_end(key)
        self.hits += 1
        return self._data[key]
      self.misses += 1
      return default

  def set(self, key, value) -> None:
    with self._lock:
      self._data[key] = value
      self._data.move_to_end(key)
      while len(self._data) > self.maxsize:
        self._data.popitem(last=False)

  def clear(self) -> None:
    with self._lock:
      self._data.clear()
      self.hits = self.misses = 0

  def __len__(self) -> int:
    return len(self._data)

  def stats(self) -> dict:
    total = self.hits + self.misses
    return {
      'size': len(self._data),
      'maxsize': self.maxsize,
      'hits': self.hits,
      'misses': self.misses,
      'hit_rate': 100.0 * self.hits / total if total else 0.0,
    }


# -- swapping values into Variables ---------------------------------------------------


@contextlib.contextmanager
def swapped(disc: Discovery, values: Sequence, *, keep_structure_on_error: bool = False):
  """Let every discovered Variable hold ``values[i]`` (writable here) inside the block.

  On exit every Variable gets its pre-call value and trace level back, and
  every graph node its trace level. If the block raises, attributes that
  the block added to or replaced in discovered Modules are rolled back too.
  """
  variables, nodes = disc.variables, disc.nodes
  with TRACE_LOCK:
    old_values = [_compat.raw_value(v) for v in variables]
    old_levels = [_compat.get_node_trace_state(x) for x in variables]
    old_node_levels = [_compat.get_node_trace_state(n) for n in nodes]
    old_attrs = [dict(vars(n)) for n in nodes]
    level = _compat.new_trace_state()
    try:
      for v, x in zip(variables, values):
        _compat.set_raw_value(v, x)
        _compat.set_node_trace_state(v, level)
      for n in nodes:
        _compat.set_node_trace_state(n, level)
      yield
    except BaseException:
      if not keep_structure_on_error:
        for n, attrs in zip(nodes, old_attrs):
          current = vars(n)
          current.clear()
          current.update(attrs)
      raise
    finally:
      for v, x, lv in zip(variables, old_values, old_levels):
        _compat.set_raw_value(v, x)
        _compat.set_node_trace_state(v, lv)
      for n, lv in zip(nodes, old_node_levels):
        _compat.set_node_trace_state(n, lv)


def write_values(disc: Discovery, indices: Sequence[int], values: Sequence) -> None:
  """Write results back, refusing to leave a tracer where it cannot live.

  A tracer may only be stored in a Variable whose trace level is the current
  one (inside an enclosing brainnx transform). Inside a raw ``jax.jit`` or
  ``jax.vmap`` the write is refused before any Variable changes.
  """
  variables = disc.variables
  for i, x in zip(indices, values):
    if _holds_tracer(x) and not _compat.can_update(variables[i]):
      raise RuntimeError(
        f'{disc.describe(i)} was written inside a JAX transform that brainnx does not '
        'manage (a raw jax.jit, jax.vmap, jax.lax.scan, ...): its new value is a tracer '
        'that would leak out of that transform. Use the brainnx version of the outer '
        'transform (brainnx.jit, brainnx.vmap, brainnx.scan, ...), or return the value '
        'instead of writing it.'
      )
  for i, x in zip(indices, values):
    _compat.set_raw_value(variables[i], x)


def _holds_tracer(x) -> bool:
  return any(isinstance(leaf, _compat.Tracer) for leaf in jax.tree.leaves(x))


def park_new(new_vars: Sequence) -> None:
  """Replace the traced values of Variables created inside a trace by their shapes.

  Called inside the trace once their values are collected as outputs, so that
  no tracer outlives its trace; :func:`adopt_new` gives the final values.
  """
  for v in new_vars:
    _compat.set_raw_value(v, jax.tree.map(abstract, _compat.raw_value(v)))


def adopt_new(new_vars: Sequence, new_nodes: Sequence, values: Sequence) -> None:
  """Give Variables created inside a call their final values and this trace level."""
  level = _compat.new_trace_state()
  for v, x in zip(new_vars, values):
    _compat.set_raw_value(v, x)
    _compat.set_node_trace_state(v, level)
  for n in new_nodes:
    _compat.set_node_trace_state(n, level)


# -- one trace ---------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class Trace:
  """A traced call: its jaxpr and what it does to Variables.

  ``closed`` takes the touched states' leaves (in ``states`` order) then the
  dynamic argument leaves; it returns the written states' leaves (or every
  touched state's, when traced with ``return_only_write=False``), then the
  leaves of Variables created inside, then the output leaves.
  """

  closed: Any
  states: tuple[int, ...]  # touched discovery indices, in first-touch order
  read: frozenset
  written: tuple[int, ...]  # discovery indices, in ``states`` order
  state_defs: tuple  # treedef of each touched state's value
  only_write: bool
  new_vars: tuple
  new_nodes: tuple
  new_defs: tuple
  out_spec: OutSpec
  out_shapes: Any
  cacheable: bool

  def run(self, state_values: Sequence, dyn_leaves: Sequence):
    """Evaluate the jaxpr: ``(written or all state values, new var values, out leaves)``."""
    flat = []
    for x in state_values:
      flat.extend(jax.tree.leaves(x))
    outs = jax.core.eval_jaxpr(self.closed.jaxpr, self.closed.consts, *flat, *dyn_leaves)
    it = iter(outs)
    out_states = self.written if self.only_write else self.states
    by_index = {i: d for i, d in zip(self.states, self.state_defs)}
    states = [_take(by_index[i], it) for i in out_states]
    new = [_take(d, it) for d in self.new_defs]
    return states, new, list(it)


def _take(treedef, it):
  return jax.tree.unflatten(treedef, [next(it) for _ in range(treedef.num_leaves)])


def abstract(x):
  """A ``ShapeDtypeStruct`` for an array-like (weak types dropped)."""
  if isinstance(x, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)
  if hasattr(x, 'shape') and hasattr(x, 'dtype'):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)
  return jax.ShapeDtypeStruct(np.shape(x), jax.dtypes.result_type(x))


def abstract_key(values) -> Hashable:
  leaves, treedef = jax.tree.flatten(values)
  return treedef, tuple((tuple(a.shape), a.dtype) for a in map(abstract, leaves))


def trace_call(
  fun: Callable,
  disc: Discovery,
  call: CallArgs,
  state_values: Sequence,
  dyn: Sequence,
  *,
  only_write: bool = True,
  keep_structure: bool = True,
) -> Trace:
  """Trace ``fun`` on abstract versions of ``state_values`` and ``dyn``.

  With ``keep_structure`` Variables the function creates and attaches to
  discovered Modules stay attached (holding tracers until the caller gives
  them values with :func:`adopt_new`); otherwise such attributes are removed.
  """
  side = {}

  @functools.wraps(fun)
  def flat_fun(states_in, dyn_in):
    with swapped(disc, states_in):
      args, kwargs = call.rebuild(dyn_in, call.nodes)
      out = fun(*args, **kwargs)
      new_values = [_compat.raw_value(v) for v in disc.variables]
      new_vars, new_nodes = walk_new(disc.nodes, disc)
      spec, out_leaves = split_output(out, disc, new_nodes)
      new_var_values = [_compat.raw_value(v) for v in new_vars]
      park_new(new_vars)
    written = [i for i, (a, b) in enumerate(zip(new_values, states_in)) if a is not b]
    side.update(written=written, new_vars=new_vars, new_nodes=new_nodes, spec=spec)
    side['new_defs'] = tuple(jax.tree.structure(x) for x in new_var_values)
    return [new_values[i] for i in written], new_var_values, out_leaves

  state_avals = [jax.tree.map(abstract, x) for x in state_values]
  dyn_avals = [jax.tree.map(abstract, x) for x in dyn]
  closed, shapes = jax.make_jaxpr(flat_fun, return_shape=True)(state_avals, dyn_avals)
  if not keep_structure:
    for v in side['new_vars']:
      _compat.set_raw_value(v, None)
    drop_new_attributes(disc, side['new_vars'], side['new_nodes'])
  return _finish_trace(closed, shapes, side, disc, state_values, only_write)


def drop_new_attributes(disc: Discovery, new_vars, new_nodes) -> None:
  """Detach Variables and nodes a call created from the discovered Modules."""
  new_ids = {id(x) for x in (*new_vars, *new_nodes)}
  for n in disc.nodes:
    attrs = vars(n)
    for name in [k for k, v in attrs.items() if id(v) in new_ids]:
      del attrs[name]


def _finish_trace(closed, shapes, side, disc, state_values, only_write) -> Trace:
  jaxpr = closed.jaxpr
  leaf_counts = [len(jax.tree.leaves(x)) for x in state_values]
  starts = np.cumsum([0] + leaf_counts)
  n_state_leaves = int(starts[-1])
  state_invars = jaxpr.invars[:n_state_leaves]
  dyn_invars = jaxpr.invars[n_state_leaves:]
  written = side['written']
  written_set = set(written)

  first_use: dict = {}
  for k, eqn in enumerate(jaxpr.eqns):
    for a in eqn.invars:
      if isinstance(a, jax.extend.core.Var):
        first_use.setdefault(a, k)
  n_eqns = len(jaxpr.eqns)
  n_written_leaves = sum(leaf_counts[i] for i in written)
  produced = {}
  for k, eqn in enumerate(jaxpr.eqns):
    for o in eqn.outvars:
      produced[o] = k
  for a in jaxpr.outvars:
    if isinstance(a, jax.extend.core.Var):
      first_use.setdefault(a, n_eqns)

  touch, read = {}, set()
  for i in range(len(disc.variables)):
    leaves = state_invars[starts[i] : starts[i + 1]]
    uses = [first_use[a] for a in leaves if a in first_use]
    if uses:
      read.add(i)
      touch[i] = min(uses)
  out_it = 0
  written_outvars = {}
  for i in written:
    outs = jaxpr.outvars[out_it : out_it + leaf_counts[i]]
    out_it += leaf_counts[i]
    written_outvars[i] = outs
    # a value produced by equation k was written after k ran
    at = min((produced.get(o, n_eqns) + 0.5 if isinstance(o, jax.extend.core.Var) else n_eqns for o in outs), default=n_eqns)
    touch[i] = min(touch.get(i, at), at)
  states = tuple(sorted(touch, key=lambda i: (touch[i], i)))

  new_invars = [a for i in states for a in state_invars[starts[i] : starts[i + 1]]] + list(dyn_invars)
  rest = jaxpr.outvars[n_written_leaves:]
  if only_write:
    state_outs = [a for i in states if i in written_set for a in written_outvars[i]]
  else:
    state_outs = [
      a
      for i in states
      for a in (written_outvars[i] if i in written_set else state_invars[starts[i] : starts[i + 1]])
    ]
  new_outvars = state_outs + list(rest)
  info = jaxpr.debug_info
  if info is not None:
    arg_names = tuple(disc.describe(i) for i in states for _ in range(leaf_counts[i]))
    arg_names += tuple(f'arg{k}' for k in range(len(dyn_invars)))
    info = info._replace(arg_names=arg_names, result_paths=tuple(f'out{k}' for k in range(len(new_outvars))))
  new_jaxpr = jaxpr.replace(invars=new_invars, outvars=new_outvars, debug_info=info)
  new_closed = jax.extend.core.ClosedJaxpr(new_jaxpr, closed.consts)
  cacheable = not any(isinstance(c, _compat.Tracer) for c in closed.consts)
  return Trace(
    closed=new_closed,
    states=states,
    read=frozenset(read),
    written=tuple(i for i in states if i in written_set),
    state_defs=tuple(jax.tree.structure(state_values[i]) for i in states),
    only_write=only_write,
    new_vars=tuple(side['new_vars']),
    new_nodes=tuple(side['new_nodes']),
    new_defs=side['new_defs'],
    out_spec=side['spec'],
    out_shapes=side['spec'].rebuild(list(shapes[2]), disc),
    cacheable=cacheable,
  )


# -- the public StatefulFunction ------------------------------------------------------


class StatefulFunction:
  """A function whose Variables are found by tracing, with a cached jaxpr per signature.

  Args:
    fun: the function. It may read and write any Variable reachable from its
      arguments, ``self``, ``functools.partial`` arguments, closure cells and
      the globals its code loads.
    static_argnums, static_argnames: arguments compared by value (hashable)
      and baked into the trace.
    name: a label for error messages and ``repr``.
    return_only_write: the jaxpr returns only written states' values (else
      every touched state's).

  The jaxpr's inputs are ``get_states()`` values then the dynamic argument
  leaves; its outputs are the (written) state values then the output leaves.
  Traces are kept in a thread-safe LRU cache (128 entries).

  States are ordered by first touch, read off the jaxpr: the first equation
  that uses a state's incoming value or produces its new value. States
  touched at the same point (say, assigned an argument as is) keep their
  discovery order.

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
  ):
    if not callable(fun):
      raise TypeError(f'StatefulFunction needs a callable, got {type(fun).__name__}')
    self.fun = fun
    self.static_argnums = normalize_static_argnums(static_argnums)
    self.static_argnames = (static_argnames,) if isinstance(static_argnames, str) else tuple(static_argnames)
    self.name = name or getattr(fun, '__name__', type(fun).__name__)
    self.return_only_write = return_only_write
    self._cache = LRUCache(cache_size)

  def __repr__(self) -> str:
    return f'StatefulFunction({self.name})'

  # -- tracing ----------------------------------------------------------------

  def _prepare(self, args, kwargs):
    call = CallArgs.split(args, kwargs, self.static_argnums, self.static_argnames)
    disc = discover(self.fun, args, kwargs)
    return call, disc

  def trace_for(self, disc: Discovery, call: CallArgs, state_values, dyn, *, keep_structure=True) -> Trace:
    """The (cached) trace of this call; ``state_values`` are per discovered Variable."""
    key = (disc.signature, call.signature, abstract_key(list(state_values)), abstract_key(list(dyn)))
    found = self._cache.get(key)
    if found is not None:
      return found
    trace = trace_call(
      self.fun, disc, call, state_values, dyn, only_write=self.return_only_write, keep_structure=keep_structure
    )
    if trace.cacheable:
      self._cache.set(key, trace)
    return trace

  def _trace(self, args, kwargs, keep_structure=False):
    call, disc = self._prepare(args, kwargs)
    values = [_compat.raw_value(v) for v in disc.variables]
    return call, disc, self.trace_for(disc, call, values, call.dyn, keep_structure=keep_structure)

  def make_jaxpr(self, *args, **kwargs) -> 'StatefulFunction':
    """Trace for these arguments (arrays or ``jax.ShapeDtypeStruct``s); returns ``self``."""
    self._trace(args, kwargs)
    return self

  def get_jaxpr(self, *args, **kwargs):
    """The ``ClosedJaxpr`` for these arguments."""
    return self._trace(args, kwargs)[2].closed

  def get_states(self, *args, **kwargs) -> tuple:
    """Variables the call reads or writes, in first-touch order."""
    _, disc, trace = self._trace(args, kwargs)
    return tuple(disc.variables[i] for i in trace.states)

  def get_read_states(self, *args, **kwargs) -> tuple:
    """Variables whose incoming value the call uses."""
    _, disc, trace = self._trace(args, kwargs)
    return tuple(disc.variables[i] for i in trace.states if i in trace.read)

  def get_write_states(self, *args, **kwargs) -> tuple:
    """Variables the call gives a new value."""
    _, disc, trace = self._trace(args, kwargs)
    return tuple(disc.variables[i] for i in trace.written)

  def get_out_shapes(self, *args, **kwargs):
    """The return value's structure with ``jax.ShapeDtypeStruct`` leaves."""
    return self._trace(args, kwargs)[2].out_shapes

  def jaxpr_call(self, state_vals: Sequence, *args, **kwargs):
    """Evaluate the cached jaxpr purely: ``(new_state_vals, out)``.

    ``state_vals`` are values for ``get_states(*args, **kwargs)``, in that
    order; the result holds a new value for each of them (the input value
    for states the call only reads). No Variable is changed.
    """
    call, disc, trace = self._trace(args, kwargs)
    state_vals = list(state_vals)
    if len(state_vals) != len(trace.states):
      raise ValueError(
        f'{self.name}.jaxpr_call: expected {len(trace.states)} state values '
        f'(one per get_states() entry), got {len(state_vals)}'
      )
    outs, _, out_leaves = trace.run(state_vals, jax.tree.leaves(call.dyn))
    by_index = dict(zip(trace.written if trace.only_write else trace.states, outs))
    new_vals = [by_index.get(i, x) for i, x in zip(trace.states, state_vals)]
    return new_vals, trace.out_spec.rebuild(out_leaves, disc)

  def __call__(self, *args, **kwargs):
    """Run the traced computation on current values and write the results back."""
    call, disc = self._prepare(args, kwargs)
    values = [_compat.raw_value(v) for v in disc.variables]
    trace = self.trace_for(disc, call, values, call.dyn, keep_structure=True)
    outs, new, out_leaves = trace.run([values[i] for i in trace.states], jax.tree.leaves(call.dyn))
    if trace.closed.effects:  # let a failing host callback raise before anything is written
      jax.block_until_ready((outs, new, out_leaves))
    written = trace.written if trace.only_write else trace.states
    write_values(disc, written, outs)
    adopt_new(trace.new_vars, trace.new_nodes, new)
    return trace.out_spec.rebuild(out_leaves, disc)

  def clear_cache(self) -> None:
    """Forget every cached trace."""
    self._cache.clear()

  def get_cache_stats(self) -> dict:
    """``{'jaxpr_cache': {'size', 'maxsize', 'hits', 'misses', 'hit_rate'}}``."""
    return {'jaxpr_cache': self._cache.stats()}


def make_jaxpr(
  fun: Callable,
  static_argnums: int | Sequence[int] = (),
  static_argnames: str | Sequence[str] = (),
  return_shape: bool = False,
  return_only_write: bool = False,
):
  """``make_jaxpr(f)(*args) -> (ClosedJaxpr, states[, out_shapes])``.

  Like ``jax.make_jaxpr``, with the Variables ``f`` touches as the leading
  inputs (and, by default, leading outputs).

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
      return trace.closed, states, trace.out_shapes
    return trace.closed, states

  return make_jaxpr_f
