"""``jit``: compile a stateful function; Python runs once per abstract signature.

Each call finds a *plan*: the discovered Variables and the compiled program
for this call's graph nodes and static arguments. A plan is reused while its
guard holds (same objects under the same names and attributes), so a warm
call costs one identity check per container, one value read per Variable,
the ``jax.jit`` dispatch, and one write per written Variable. The compiled
program evaluates the ``StatefulFunction`` jaxpr, so a weak-type-only change
re-lowers without running Python again.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> import brainnx as bnx
  >>> model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
  >>> calls = nnx.Variable(jnp.zeros((), jnp.int32))
  >>> @bnx.jit
  ... def forward(x):
  ...   calls[...] += 1
  ...   return model(x)
  >>> forward(jnp.ones(2)).shape, forward(jnp.ones(2)).shape, int(calls[...])
  ((2,), (2,), 2)
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from brainnx import _compat
from brainnx._arguments import CallArgs, contains_graph_node, normalize_static_argnums
from brainnx._discovery import Discovery, discover
from brainnx._tracing import LRUCache, StatefulFunction, Trace, adopt_new, write_values

__all__ = ['jit', 'JittedFunction']

_ARRAY_IMPL = type(jnp.zeros(()))
_FAST_DYN = (_ARRAY_IMPL, int, float, bool, complex)
_tls = threading.local()
_raw_value = _compat.raw_value


class _Packed:
  """Compiled output: its tree's static part carries the Trace that made it."""

  __slots__ = ('written', 'new', 'out', 'trace')

  def __init__(self, written, new, out, trace):
    self.written, self.new, self.out, self.trace = written, new, out, trace


jax.tree_util.register_pytree_node(
  _Packed,
  lambda p: ((p.written, p.new, p.out), p.trace),
  lambda trace, children: _Packed(*children, trace),
)


class _Plan:
  """Everything a warm call needs, for one set of graph-node arguments."""

  __slots__ = (
    'disc', 'call', 'compiled', 'variables', 'n_args', 'kw_names',
    'node_slots', 'node_objs', 'static_slots', 'static_vals', 'dyn_slots', 'fast', 'warm',
  )

  def __init__(self, disc: Discovery, call: CallArgs, compiled):
    self.disc, self.call, self.compiled = disc, call, compiled
    self.variables = disc.variables
    self.n_args, self.kw_names = call.n_args, call.kw_names
    kinds = call.kinds
    self.node_slots = tuple(s for s, k in enumerate(kinds) if k == 'node')
    self.node_objs = call.nodes if 'mixed' not in kinds else ()
    self.static_slots = tuple(s for s, _ in call.statics)
    self.static_vals = tuple(v for _, v in call.statics)
    self.dyn_slots = tuple(s for s, k in enumerate(kinds) if k == 'dyn')
    self.fast = 'mixed' not in kinds
    self.warm = _warm_call(self)

  def match(self, args: tuple, kwargs: dict):
    """The dynamic values for this call if the plan applies, else ``None``."""
    if not self.fast or len(args) != self.n_args or tuple(kwargs) != self.kw_names:
      return None
    if kwargs:
      args = args + tuple(kwargs.values())
    for s, obj in zip(self.node_slots, self.node_objs):
      if args[s] is not obj:
        return None
    for s, value in zip(self.static_slots, self.static_vals):
      if args[s] is not value and not (type(args[s]) is type(value) and args[s] == value):
        return None
    dyn = tuple([args[s] for s in self.dyn_slots])
    for x in dyn:
      if type(x) not in _FAST_DYN and contains_graph_node(x):
        return None
    return dyn if self.disc.guard.ok() else None


def _warm_call(plan: _Plan):
  """``warm(args, kwargs)``: the call if ``plan`` applies, else ``_MISS``.

  A closure over locals, specialised for the common shapes (dynamic
  positional arguments only; graph nodes then dynamic arguments), because
  every attribute lookup here is paid on every call.
  """
  guard, compiled, variables, n = plan.disc.guard.ok, plan.compiled, plan.variables, plan.n_args
  raw, tls, fast_dyn = _raw_value, _tls, _FAST_DYN

  if plan.fast and not plan.kw_names and not plan.static_slots:
    node_pairs = tuple(zip(plan.node_slots, plan.node_objs))
    dyn_slots = plan.dyn_slots
    simple = not node_pairs

    def warm(args, kwargs):
      if kwargs or len(args) != n:
        return _MISS
      for s, obj in node_pairs:
        if args[s] is not obj:
          return _MISS
      dyn = args if simple else tuple([args[s] for s in dyn_slots])
      for x in dyn:
        if type(x) not in fast_dyn and contains_graph_node(x):
          return _MISS
      if not guard():
        return _MISS
      tls.plan = plan
      return _complete(plan, compiled(list(map(raw, variables)), *dyn))

    return warm

  def warm_general(args, kwargs):
    dyn = plan.match(args, kwargs)
    if dyn is None:
      return _MISS
    tls.plan = plan
    return _complete(plan, compiled(list(map(raw, variables)), *dyn))

  return warm_general


_MISS = object()


def _cold(args, kwargs):
  return _MISS


class JittedFunction:
  """The callable ``jit`` returns. See :func:`jit`."""

  def __init__(self, fun, static_argnums, static_argnames, donate_argnums, jit_kwargs, traced=None):
    self.__wrapped__ = fun
    functools.update_wrapper(self, fun, updated=())
    self._fun = fun
    self._static_argnums = normalize_static_argnums(static_argnums)
    self._static_argnames = (static_argnames,) if isinstance(static_argnames, str) else tuple(static_argnames)
    self._donate_argnums = normalize_static_argnums(donate_argnums, 'donate_argnums')
    overlap = set(self._donate_argnums) & set(self._static_argnums)
    if overlap:
      raise ValueError(f'arguments {sorted(overlap)} cannot be both static and donated')
    self._jit_kwargs = jit_kwargs
    self.stateful_fun = StatefulFunction(
      traced or fun, self._static_argnums, self._static_argnames, name=getattr(fun, '__name__', None)
    )
    self._compiled = LRUCache(64)
    self._plans = LRUCache(16)
    self._warm = _cold
    self._lock = threading.Lock()

  # -- calling ----------------------------------------------------------------

  def __call__(self, *args, **kwargs):
    out = self._warm(args, kwargs)
    if out is not _MISS:
      return out
    return _run(*self._plan_for(args, kwargs))

  def _plan_for(self, args, kwargs) -> tuple[_Plan, tuple]:
    call = CallArgs.split(args, kwargs, self._static_argnums, self._static_argnames)
    key = tuple(map(id, call.nodes)) + (call.signature,)
    plan = self._plans.get(key)
    if plan is not None and plan.disc.guard.ok():
      plan_call = plan.call
      if all(a is b for a, b in zip(plan_call.nodes, call.nodes)):
        self._warm = plan.warm
        return plan, call.dyn
    disc = discover(self._fun, args, kwargs)
    _check_no_leaked_tracers(disc)
    compiled = self._compiled_for(disc, call)
    plan = _Plan(disc, call, compiled)
    self._plans.set(key, plan)
    self._warm = plan.warm
    return plan, call.dyn

  def _compiled_for(self, disc: Discovery, call: CallArgs):
    key = (disc.signature, call.signature)
    with self._lock:
      compiled = self._compiled.get(key)
      if compiled is None:
        compiled = jax.jit(
          functools.partial(_body, self.stateful_fun),
          donate_argnums=_donated_positions(call, self._donate_argnums),
          **self._jit_kwargs,
        )
        self._compiled.set(key, compiled)
    return compiled

  def cache_sizes(self) -> dict:
    """Sizes of the plan, compiled-program and trace caches (all bounded)."""
    return {
      'plans': len(self._plans),
      'compiled': len(self._compiled),
      'traces': len(self.stateful_fun._cache),
    }

  def lower(self, *args, **kwargs):
    """``jax.stages.Lowered`` for these arguments (states become leading inputs)."""
    plan, dyn = self._plan_for(args, kwargs)
    _tls.plan = plan
    state = list(map(_compat.raw_value, plan.variables))
    return plan.compiled.lower(state, *dyn)

  def clear_cache(self) -> None:
    """Forget plans, compiled programs and traces (the next call retraces)."""
    with self._lock:
      self._compiled.clear()
    self._plans.clear()
    self._warm = _cold
    self.stateful_fun.clear_cache()

  def __repr__(self) -> str:
    return f'brainnx.jit({getattr(self._fun, "__name__", self._fun)!r})'

  def __get__(self, obj, objtype=None):
    if obj is None:
      return self
    return functools.partial(self, obj)


def _donated_positions(call: CallArgs, donate_argnums) -> tuple[int, ...]:
  positions, k = [], 0
  for slot, kind in enumerate(call.kinds):
    if kind == 'dyn':
      if slot in donate_argnums:
        positions.append(1 + k)
      k += 1
    elif kind == 'mixed':
      k += sum(1 for s, _, mask in call.mixed if s == slot for m in mask if not m)
  return tuple(positions)


def _body(sf: StatefulFunction, state: list, *dyn):
  plan: _Plan = _tls.plan
  trace: Trace = sf.trace_for(plan.disc, plan.call, state, dyn)
  written, new, out_leaves = trace.run([state[i] for i in trace.states], jax.tree.leaves(dyn))
  # A dict keyed by Variable index carries the written set in the output's
  # (C++-native) tree structure, so a cache hit needs no Python unflatten.
  written = dict(zip(trace.written, written))
  if trace.new_vars or trace.out_spec.has_nodes or trace.closed.effects:
    return _Packed(written, new, out_leaves, trace)
  return written, trace.out_spec.rebuild(out_leaves, plan.disc)


def _run(plan: _Plan, dyn: tuple):
  _tls.plan = plan
  return _complete(plan, plan.compiled(list(map(_raw_value, plan.variables)), *dyn))


def _complete(plan: _Plan, result):
  """Write a compiled call's results back; return its output."""
  if type(result) is tuple:
    written, out = result
    if written:
      _write(plan, written)
    return out
  return _finish(plan, result)


def _write(plan: _Plan, written: dict) -> None:
  values = written.values()
  if type(next(iter(values))) is _ARRAY_IMPL:  # concrete: we run eagerly, the write is ours
    _compat.set_raw_values(map(plan.variables.__getitem__, written), values)
  else:
    write_values(plan.disc, tuple(written), tuple(values))


def _finish(plan: _Plan, packed: _Packed):
  if packed.trace.closed.effects:
    # A host callback may fail while the program runs asynchronously; wait for it,
    # so that a failure raises here, before any Variable is written.
    jax.block_until_ready((packed.written, packed.new, packed.out))
  if packed.written:
    _write(plan, packed.written)
  trace = packed.trace
  adopt_new(trace.new_vars, trace.new_nodes, packed.new)
  return trace.out_spec.rebuild(packed.out, plan.disc)


def _check_no_leaked_tracers(disc: Discovery) -> None:
  if not _compat.at_top_level():
    return
  for i, v in enumerate(disc.variables):
    if any(isinstance(x, _compat.Tracer) for x in jax.tree.leaves(_compat.raw_value(v))):
      raise RuntimeError(
        f'{disc.describe(i)} holds a leaked tracer (a value left behind by a JAX '
        'transform that brainnx did not manage). Reset it, e.g. `var[...] = jnp.zeros(shape)`, '
        'and write Variables inside brainnx transforms only.'
      )


def jit(
  fun: Callable | None = None,
  *,
  static_argnums: int | Sequence[int] = (),
  static_argnames: str | Sequence[str] = (),
  donate_argnums: int | Sequence[int] = (),
  **jax_jit_kwargs: Any,
):
  """Compile ``fun``, reading and writing the Variables it can reach.

  Works as ``jit(f)``, ``@jit`` and ``@jit(static_argnums=...)``. Variables
  come from arguments, ``self``, ``functools.partial``s, closures and globals;
  writes are visible afterwards on the same Variable objects. Graph nodes
  passed as arguments travel by reference. Static arguments are compared by
  value and must be hashable. Other keyword arguments go to ``jax.jit``.

  The returned function has ``.lower(*args)``, ``.clear_cache()`` and
  ``.stateful_fun`` (the underlying :class:`StatefulFunction`).

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import brainnx as bnx
    >>> rngs = nnx.Rngs(0)
    >>> draw = bnx.jit(lambda: rngs.normal(()))
    >>> bool(draw() != draw())
    True
  """
  if fun is None:
    return functools.partial(
      jit,
      static_argnums=static_argnums,
      static_argnames=static_argnames,
      donate_argnums=donate_argnums,
      **jax_jit_kwargs,
    )
  if not callable(fun):
    raise TypeError(f'jit needs a callable, got {type(fun).__name__}')
  return JittedFunction(fun, static_argnums, static_argnames, donate_argnums, jax_jit_kwargs)
