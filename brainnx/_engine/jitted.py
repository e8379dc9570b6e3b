"""``jit``: compile a stateful function; Python runs once per abstract signature.

Each call finds a *plan*: the discovered Variables and the compiled program
for this call's references (graph nodes passed as arguments) and static
arguments. A plan is reused while its guard holds (same objects under the
same names and attributes; flax Pytrees' attributes are compared only after
flax reports an attribute edit), so a warm call costs a few identity checks,
one value read per Variable, the ``jax.jit`` dispatch, and one write per
written Variable. The compiled program evaluates the
``StatefulFunction`` jaxpr; weak types are part of its signature, as in
``jax.jit``. A plan holds the objects passed by reference weakly:
dropping a model drops its plan.

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

import dataclasses
import functools
import threading
import weakref
from typing import Any, Callable, NamedTuple

import jax

from brainnx import _compat
from brainnx._engine.config import Config
from brainnx._engine.sentinels import MISS, NOT_GIVEN
from brainnx._engine.arguments import ArgKind, CallArgs, StaticArgs, normalize_argnums
from brainnx._engine.caches import LRUCache
from brainnx._engine.discovery import discover, Discovery
from brainnx._engine.nodes import holds_graph_node
from brainnx._engine.filters import to_filter
from brainnx._engine.outputs import Leaf, New
from brainnx._engine.sharding import Rules, arg_specs, constrain, layout_of, new_layout, place
from brainnx._engine.call import check_values
from brainnx._engine.state import STATE_CHANGES, read_values, set_values, write_values
from brainnx._engine.stateful_function import StatefulFunction
from brainnx._engine.tracing import Trace


_FAST_DYN = (_compat.ArrayImpl, int, float, bool, complex)
_compat.quiet_interrupted_callbacks()  # a Ctrl-C in a host callback is raised, not logged (see __call__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class JitOptions(Config):
  """``jit``'s config: how a ``JittedFunction`` compiles (static and donated arguments,
  shardings, ``jax.jit`` keywords)."""

  name: str = 'jit'
  statics: StaticArgs = StaticArgs()
  donate_argnums: tuple[int, ...] = ()
  donate_states: Any = None  # a filter, or True: every written Variable
  jax_kwargs: tuple[tuple[str, Any], ...] = ()
  in_shardings: Any = NOT_GIVEN  # of the user's positional arguments, as in jax.jit
  out_shardings: Any = NOT_GIVEN  # of the user's output, as in jax.jit
  state_shardings: Rules = Rules()
  # the eager entry's programs: a plan's first call evaluates its trace op by op, as JAX runs an
  # untransformed function, and the second compiles (a function called once never waits for XLA)
  compile_on_reuse: bool = False

  @property
  def sharded(self) -> bool:
    return bool(self.state_shardings) or self.in_shardings is not NOT_GIVEN or self.out_shardings is not NOT_GIVEN


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


class _Written(NamedTuple):
  """Compiled output of a call that writes Variables (a namedtuple: flattened in C++)."""

  written: dict  # discovery index -> new value
  out: Any


#: The plan of the call now entering ``jax.jit`` in this thread (a weak reference): ``_body``
#: reads it when JAX traces. Every plan of one compiled program has the same discovery and
#: call signature (the program is chosen by them), so any of them traces it the same way.
_CURRENT = threading.local()


class _Plan:
  """Everything a warm call needs, for one set of reference arguments."""

  def __init__(self, disc: Discovery, call: CallArgs, compiled, on_drop: Callable, donated: tuple = (),
               layout: tuple = (), stateful_fun: StatefulFunction | None = None):
    self.disc, self.compiled = disc, compiled
    self.stateful_fun = stateful_fun  # what the program traces (its jax.jit holds no user function)
    self.layout = layout  # per Variable: the Sharding it keeps (None: free), or () for none
    self.donated = donated  # discovery indices whose buffers the program may reuse
    self.kept = tuple(i for i in range(len(disc.variables)) if i not in set(donated))
    self.call = dataclasses.replace(call, refs=())  # held weakly below
    self.ref_refs = tuple(weak_or_strong(x, on_drop) for x in call.refs)
    self.me = weakref.ref(self)
    self.kept_lists = _compat.KEPT_VALUES  # held here: dropped plans may outlive the module at exit
    self._positions = None
    # a data attribute's array is written by plain setattr, which counts no value write
    self.keeps_values = not any(type(v) is _compat.DataAttribute for v in disc.variables)
    self.ran = False  # whether a call has run this plan (see JitOptions.compile_on_reuse)
    self.variables = disc.variables
    self.warm = _warm_call(self)

  def positions(self) -> dict:
    """``id(variable)`` -> its index in discovery order (made once, when a list is first kept)."""
    if self._positions is None:
      self._positions = {id(v): i for i, v in enumerate(self.variables)}
    return self._positions

  def live_call(self) -> CallArgs:
    """The call with its reference arguments (alive while a call that passed them runs)."""
    return dataclasses.replace(self.call, refs=tuple(r() for r in self.ref_refs))

  def state(self) -> tuple:
    """The program's state arguments: ``(values,)``, or ``(donated values, the others)``."""
    values = read_values(self.variables)
    if not self.donated:
      return (values,)
    return [values[i] for i in self.donated], [values[i] for i in self.kept]

  def full_state(self, state_args) -> list:
    """Every discovered Variable's value, in discovery order, from ``state()``'s arguments."""
    if not self.donated:
      return state_args[0]
    full = [None] * len(self.variables)
    for indices, values in zip((self.donated, self.kept), state_args):
      for i, x in zip(indices, values):
        full[i] = x
    return full

  def match(self, args: tuple, kwargs: dict):
    """The dynamic values for this call if the plan applies, else ``None``."""
    call = self.call
    if call.has_mixed or len(args) != call.n_args or tuple(kwargs) != call.kw_names:
      return None
    if kwargs:
      args = args + tuple(kwargs.values())
    for s, ref in zip(call.slots_of(ArgKind.REF), self.ref_refs):
      if args[s] is not ref():
        return None
    for s, value in call.statics:
      if args[s] is not value and not (type(args[s]) is type(value) and args[s] == value):
        return None
    dyn = tuple([args[s] for s in call.slots_of(ArgKind.DYN)])
    for x in dyn:
      if type(x) not in _FAST_DYN and holds_graph_node(x):
        return None
    return dyn if self.disc.guard.ok() else None


class _Strong:
  """A strong stand-in for ``weakref.ref`` where an object cannot be weakly referenced."""

  __slots__ = ('obj',)

  def __init__(self, obj):
    self.obj = obj

  def __call__(self):
    return self.obj


def weak_or_strong(x, callback=None):
  """``weakref.ref(x, callback)``, or a strong stand-in when ``x`` cannot be weakly referenced."""
  try:
    return weakref.ref(x, callback)
  except TypeError:
    return _Strong(x)


def _warm_call(plan: _Plan):
  """``warm(args, kwargs)``: the call if ``plan`` applies, else ``MISS``.

  A closure over locals, specialised for the common shapes (dynamic
  positional arguments only; references then dynamic arguments), because
  every attribute lookup here is paid on every call.
  """
  guard, compiled, me, current = plan.disc.guard.ok, plan.compiled, plan.me, _CURRENT
  fast_dyn, kept, fresh, write, finish = _FAST_DYN, _compat.KEPT_VALUES, _fresh_values, _write, _finish
  call = plan.call
  n = call.n_args

  if not call.has_mixed and not call.kw_names and not call.statics and not plan.donated:
    ref_pairs = tuple(zip(call.slots_of(ArgKind.REF), plan.ref_refs))
    dyn_slots = call.slots_of(ArgKind.DYN)

    def warm(args, kwargs):
      if kwargs or len(args) != n:
        return MISS
      if ref_pairs:
        for s, ref in ref_pairs:
          if args[s] is not ref():
            return MISS
        args = tuple([args[s] for s in dyn_slots])
      for x in args:
        if type(x) not in fast_dyn and holds_graph_node(x):
          return MISS
      if not guard():
        return MISS
      # _complete, inlined: this is the whole cost of a warm call beyond JAX's
      entry = kept.get(me)
      values = fresh(plan) if entry is None else entry[1]
      current.plan = me
      result = compiled(values, *args)
      kind = type(result)
      if kind is _Written:
        write(plan, result.written)
        return result.out
      if kind is _Packed:
        return finish(plan, result)
      return result

    return warm

  def warm_general(args, kwargs):
    dyn = plan.match(args, kwargs)
    if dyn is None:
      return MISS
    current.plan = me
    return _complete(plan, compiled(*plan.state(), *dyn))

  return warm_general


def _fresh_values(plan: _Plan) -> list:
  """The Variables' values as a warm call reads them when it kept none: kept for the next call
  if no value was written meanwhile (see ``_compat.KEPT_VALUES``)."""
  changes, writes = STATE_CHANGES, _compat.VALUE_WRITES
  mark, begun = writes[0], changes[1]
  if not changes[0]:
    values = list(map(_compat.raw_value, plan.variables))
    if changes[1] == begun and not changes[0]:  # no other thread's trace or write-back meanwhile
      with _compat.KEPT_LOCK:
        if writes[0] == mark and plan.keeps_values:
          _compat.KEPT_VALUES[plan.me] = (plan.positions(), values)
      return values
  return read_values(plan.variables)


def _raise_interrupt(error: BaseException) -> None:
  """A Ctrl-C that stopped the program inside a host callback is raised as what it is."""
  if _compat.is_interrupted_callback(error):
    raise KeyboardInterrupt from None


def _cold(args, kwargs):
  return MISS


class JittedFunction:
  """The callable ``jit`` returns. See :func:`jit`.

  ``fun`` is what discovery starts from; ``traced`` (default ``fun``) is
  what runs inside the trace (the transforms pass their own body).
  """

  def __init__(self, fun, options: JitOptions = JitOptions(), traced=None, name=None):
    self.__wrapped__ = fun
    if callable(fun) and not isinstance(fun, (tuple, list)):
      functools.update_wrapper(self, fun, updated=())
    self._fun = fun
    self._options = options
    self._donate_argnums = normalize_argnums(options.donate_argnums, 'donate_argnums')
    overlap = set(self._donate_argnums) & set(options.statics.argnums)
    if overlap:
      raise ValueError(f'arguments {sorted(overlap)} cannot be both static and donated')
    # wrappers of one function share its traces and programs, as jax.jit's do
    traces, self._compiled = (_shared_caches(fun, options) if traced is None else None) or (None, LRUCache(64))
    self.stateful_fun = StatefulFunction(traced or fun, name=name or getattr(fun, '__name__', None), cache=traces)
    self.stateful_fun.statics = options.statics
    self._plans = LRUCache(16)
    self._warm = _cold
    self._lock = threading.Lock()

  # -- calling ----------------------------------------------------------------

  def __call__(self, *args, **kwargs):
    try:
      out = self._warm(args, kwargs)
      if out is not MISS:
        return out
      return self._cold_call(args, kwargs)
    except jax.errors.JaxRuntimeError as e:  # costs nothing until raised
      _raise_interrupt(e)
      raise

  @_compat.api_boundary
  def _cold_call(self, args, kwargs):
    plan, dyn, disc = self._plan_for(args, kwargs)
    contents, signature = disc.snapshot(), disc.signature
    once = self._options.compile_on_reuse and not plan.ran and not self._options.sharded
    try:
      with _compat.created_variables(log=False):  # orphans of the trace go back to this level
        _CURRENT.plan = plan.me
        run = plan.compiled.__wrapped__ if once else plan.compiled  # op by op: what jax.jit would compile
        result = run(*plan.state(), *dyn)
    except BaseException:
      disc.restore(contents)  # a failed compile or run keeps no attribute the trace added
      raise
    plan.ran = True
    if disc.signature != signature:  # the trace rebound a captured counter (see Discovery.refresh_captured)
      with self._lock:
        self._compiled.set((disc.signature,) + plan.compiled_key[1:], plan.compiled)
    return _complete(plan, result)

  def _plan_for(self, args, kwargs) -> tuple[_Plan, tuple, Discovery]:
    call = CallArgs.split(args, kwargs, self._options.statics)
    key = tuple(map(id, call.refs)) + (call.signature,)
    plan = self._plans.get(key)
    if plan is not None and plan.disc.guard.ok():
      if all(r() is x for r, x in zip(plan.ref_refs, call.refs)):
        self._warm = plan.warm
        return plan, call.dyn, plan.disc
    disc = discover(self._fun, args, kwargs)
    check_values(disc, read_values(disc.variables))
    layout = layout_of(disc, self._options.state_shardings)
    if layout and _compat.at_top_level():
      place(disc, layout)
    donated = self._donated_states(disc, call)
    compiled = self._compiled_for(disc, call, donated, layout)
    plan = _Plan(disc, call, compiled, _evictor(self, key), donated, layout, self.stateful_fun)
    plan.compiled_key = (disc.signature, call.signature, donated, layout)
    self._plans.set(key, plan)
    self._warm = plan.warm
    return plan, call.dyn, disc

  def _donated_states(self, disc: Discovery, call: CallArgs) -> tuple:
    """Indices of the Variables whose buffers are donated: written ones matching ``donate_states``.

    Which Variables a call writes is read off its trace (cached: the compiled program's own
    trace reuses it, so Python still runs once).
    """
    spec = self._options.donate_states
    if spec is None or spec is False:
      return ()
    values = read_values(disc.variables)
    trace = self.stateful_fun.trace_for(disc, call, values, call.dyn)
    if calls_host(trace.closed):  # a callback may raise mid-program: donated buffers would be lost
      return ()
    written = trace.written
    predicate = (lambda path, var: True) if spec is True else to_filter(spec)
    return tuple(sorted(i for i in written if predicate(disc.paths[i], disc.variables[i])))

  def _compiled_for(self, disc: Discovery, call: CallArgs, donated: tuple = (), layout: tuple = ()):
    key = (disc.signature, call.signature, donated, layout)
    with self._lock:
      compiled = self._compiled.get(key)
    if compiled is not None:
      return compiled
    n_state = 2 if donated else 1
    shardings = self._shardings(disc, call, donated, layout) if self._options.sharded else {}
    compiled = jax.jit(
      functools.partial(_body, n_state, self._options.state_shardings),
      donate_argnums=(0,) * bool(donated) + _donated_positions(call, self._donate_argnums, n_state),
      **shardings,
      **dict(self._options.jax_kwargs),
    )
    with self._lock:
      self._compiled.set(key, compiled)
    return compiled

  def _shardings(self, disc: Discovery, call: CallArgs, donated: tuple, layout: tuple) -> dict:
    """``jax.jit``'s ``in_shardings``/``out_shardings`` for ``(*state, *dynamic args)``."""
    opts = self._options
    per_var = list(layout) if layout else [None] * len(disc.variables)
    if donated:
      kept = [i for i in range(len(per_var)) if i not in set(donated)]
      state = ([per_var[i] for i in donated], [per_var[i] for i in kept])
    else:
      state = (per_var,)
    user_in = None if opts.in_shardings is NOT_GIVEN else opts.in_shardings
    out = {'in_shardings': state + arg_specs(call, user_in, 'in_shardings')}
    if opts.out_shardings is not NOT_GIVEN:
      values = read_values(disc.variables)
      trace = self.stateful_fun.trace_for(disc, call, values, call.dyn)
      if _packs(trace):
        raise ValueError(
          'jit: out_shardings lays out array outputs, but this function returns graph nodes, '
          'Variables created inside, or non-array values (or has side effects such as '
          'jax.debug.print): lay Variables out with state_shardings or flax sharding '
          'metadata, and return arrays'
        )
      # None: the written Variables, laid out in _body
      out['out_shardings'] = _Written(None, opts.out_shardings) if trace.written else opts.out_shardings
    elif opts.state_shardings:
      new = self._new_shardings(disc, call)
      if new is not None:
        out['out_shardings'] = new
    return out

  def _new_shardings(self, disc: Discovery, call: CallArgs):
    """``out_shardings`` laying out the Variables the call creates (``None``: it creates none).

    Given to ``jax.jit`` as well as constrained in ``_body``: on a mesh with explicit axes
    and no ``jax.set_mesh``, only an output sharding puts the program on the mesh.
    """
    values = [_compat.raw_value(v) for v in disc.variables]
    trace = self.stateful_fun.trace_for(disc, call, values, call.dyn)
    if not trace.cacheable or not _packs(trace):
      return None
    new, leaves = _new_layouts(self._options.state_shardings, trace)
    if not any(s is not None for s in new + leaves):
      return None
    return _Packed(None, new, leaves, trace)

  def _drop_plan(self, key) -> None:
    plan = self._plans.get(key)
    self._plans.pop(key)
    if plan is not None:
      plan.kept_lists.pop(plan.me, None)
      if self._warm is plan.warm:
        self._warm = _cold

  def cache_sizes(self) -> dict:
    """Sizes of the plan, compiled-program and trace caches (all bounded)."""
    return {
      'plans': len(self._plans),
      'compiled': len(self._compiled),
      'traces': len(self.stateful_fun._cache),
    }

  def trace(self, *args, **kwargs) -> 'Traced':
    """The traced program for these arguments (``jax.jit(...).trace``); ``.lower()`` gives
    :meth:`lower`'s result, ``.jaxpr`` the program."""
    plan, dyn, _ = self._plan_for(args, kwargs)
    _CURRENT.plan = plan.me
    return Traced(self, plan.compiled.trace(*plan.state(), *dyn))

  def lower(self, *args, **kwargs) -> 'Lowered':
    """The lowered program for these arguments; ``.compile()`` gives a callable that takes
    the same arguments as the function and writes Variables back."""
    return self.trace(*args, **kwargs).lower()

  def clear_cache(self) -> None:
    """Forget plans, compiled programs and traces (the next call retraces)."""
    with self._lock:
      self._compiled.clear()
    self._plans.clear()
    _compat.KEPT_VALUES.clear()  # other functions' lists too: they are read again next call
    self._warm = _cold
    self.stateful_fun.clear_cache()

  def __repr__(self) -> str:
    return f'brainnx.jit({getattr(self._fun, "__name__", self._fun)!r})'

  def __get__(self, obj, objtype=None):
    if obj is None:
      return self
    return functools.partial(self, obj)


#: Per user function (held weakly) and options: its traces and compiled programs, shared by every
#: ``jit`` wrapper of it, so ``bnx.jit(f)(x)`` with a new wrapper each time traces once, as
#: ``jax.jit(f)(x)`` does. The compiled programs find what to trace through the calling plan,
#: so nothing here holds the function strongly.
_SHARED: 'weakref.WeakKeyDictionary' = weakref.WeakKeyDictionary()
_SHARED_LOCK = threading.Lock()


def _shared_caches(fun, options: JitOptions):
  """``(traces, compiled programs)`` shared by ``fun``'s wrappers with equal ``options``, or
  ``None`` where ``fun`` cannot be held weakly or the options are unhashable."""
  try:
    hash(options)
  except TypeError:
    return None
  key = options
  try:
    with _SHARED_LOCK:
      per_options = _SHARED.setdefault(fun, {})
      if key not in per_options:
        per_options[key] = (LRUCache(128), LRUCache(64))
      return per_options[key]
  except TypeError:  # not weakly referenceable, or unhashable
    return None


def _evictor(jitted: JittedFunction, key):
  """A weakref callback dropping the plan ``key`` once one of its reference arguments dies."""
  owner = weakref.ref(jitted)

  def drop(_):
    j = owner()
    if j is not None:
      j._drop_plan(key)

  return drop


class _Stage:
  """One of ``jax.jit``'s stages of a brainnx call; its other attributes are JAX's."""

  def __init__(self, jitted: JittedFunction, stage):
    self._jitted, self._stage = jitted, stage

  def __getattr__(self, name):
    return getattr(self._stage, name)


class Traced(_Stage):
  """``jax.stages.Traced`` of a brainnx call; ``lower()`` keeps brainnx's calling convention."""

  def lower(self, *args, **kwargs) -> 'Lowered':
    return Lowered(self._jitted, self._stage.lower(*args, **kwargs))


class Lowered(_Stage):
  """``jax.stages.Lowered`` of a brainnx call; ``compile()`` keeps brainnx's calling convention."""

  def compile(self, *args, **kwargs) -> 'Compiled':
    return Compiled(self._jitted, self._stage.compile(*args, **kwargs))


class Compiled(_Stage):
  """A compiled brainnx call: ``compiled(*args, **kwargs)`` reads and writes Variables as the
  jitted function does; ``memory_analysis()``, ``cost_analysis()``, ``as_text()`` are JAX's."""

  def __call__(self, *args, **kwargs):
    plan, dyn, _ = self._jitted._plan_for(args, kwargs)
    try:
      result = self._stage(*plan.state(), *dyn)  # a Compiled takes no static arguments
    except jax.errors.JaxRuntimeError as e:
      _raise_interrupt(e)
      raise
    return _complete(plan, result)


def calls_host(jaxpr) -> bool:
  """Whether a (closed) jaxpr, or one nested in it, calls back to the host (``jax.pure_callback``,
  ``io_callback``, ``jax.debug.callback``): such a program can fail after it consumed its inputs."""
  inner = getattr(jaxpr, 'jaxpr', jaxpr)
  for eqn in getattr(inner, 'eqns', ()):
    if 'callback' in eqn.primitive.name:
      return True
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        if hasattr(sub, 'eqns') or hasattr(getattr(sub, 'jaxpr', None), 'eqns'):
          if calls_host(sub):
            return True
  return False


def _donated_positions(call: CallArgs, donate_argnums, n_state: int = 1) -> tuple[int, ...]:
  """Positions in ``(*state, *dyn)`` of the donated dynamic arguments."""
  positions, k = [], 0
  for slot, kind in enumerate(call.kinds):
    if kind is ArgKind.DYN:
      if slot in donate_argnums:
        positions.append(n_state + k)
      k += 1
    elif kind is ArgKind.MIXED:
      k += sum(1 for s, _, mask in call.mixed if s == slot for m in mask if not m)
  return tuple(positions)


def _body(n_state: int, rules: Rules, *args):
  plan: _Plan = _CURRENT.plan()
  sf = plan.stateful_fun
  state, dyn = plan.full_state(args[:n_state]), args[n_state:]
  trace: Trace = sf.trace_for(plan.disc, plan.live_call(), state, dyn)
  written, new, out_leaves = trace.run([state[i] for i in trace.states], jax.tree.leaves(dyn))
  # A dict keyed by Variable index carries the written set in the output's
  # (C++-native) tree structure, so a cache hit needs no Python unflatten.
  if plan.layout:
    written = [constrain(x, plan.layout[i]) for i, x in zip(trace.written, written)]
  written = dict(zip(trace.written, written))
  if rules and (trace.attachments or trace.out_spec.has_nodes):
    new, out_leaves = _lay_out_new(rules, trace, new, out_leaves)
  if _packs(trace):
    return _Packed(written, new, out_leaves, trace)
  out = trace.out_spec.rebuild(out_leaves, plan.disc)
  return _Written(written, out) if written else out  # a call that writes nothing returns its output as is


def _new_layouts(rules: Rules, trace: Trace) -> tuple[list, list]:
  """``state_shardings`` for Variables created inside the call: one entry per new Variable
  attached to a known node (matched with an empty path: no root names it) and one per output
  leaf (``None`` but for the leaves of a returned new node, matched with their path in it)."""
  new = [new_layout(rules, (), v, _shape_of(_compat.raw_value(v))) for v in trace.new_vars]
  leaves = []
  for slot in trace.out_spec.slots:
    if type(slot) is Leaf:
      leaves.append(None)
    elif type(slot) is New:
      leaves.extend(new_layout(rules, path, var, _shape_of(var.get_value())) for path, var in slot.leaf_vars)
  return new, leaves


def _lay_out_new(rules: Rules, trace: Trace, new: list, out_leaves: list) -> tuple[list, list]:
  new_s, leaf_s = _new_layouts(rules, trace)
  new = [x if s is None else jax.tree.map(lambda leaf, s=s: constrain(leaf, s), x) for x, s in zip(new, new_s)]
  return new, [constrain(x, s) for x, s in zip(out_leaves, leaf_s)]


def _shape_of(x) -> tuple:
  leaves = jax.tree.leaves(x)
  return tuple(getattr(leaves[0], 'shape', ())) if leaves else ()


def _packs(trace: Trace) -> bool:
  """Whether the compiled output is a ``_Packed`` (rebuilt in Python) rather than the user's tree."""
  return bool(trace.attachments or trace.out_spec.has_nodes or trace.closed.effects)


def _complete(plan: _Plan, result):
  """Write a compiled call's results back; return its output."""
  kind = type(result)
  if kind is _Written:
    _write(plan, result.written)
    return result.out
  if kind is _Packed:
    return _finish(plan, result)
  return result


def _write(plan: _Plan, written: dict) -> None:
  values = written.values()
  if type(next(iter(values))) is _compat.ArrayImpl:  # concrete: we run eagerly, the write is ours
    with _compat.KEPT_LOCK:
      mark, entry = _compat.VALUE_WRITES[0], _compat.KEPT_VALUES.get(plan.me)
    set_values(list(map(plan.variables.__getitem__, written)), values)  # forgets every kept list
    if entry is not None:
      with _compat.KEPT_LOCK:
        if _compat.VALUE_WRITES[0] == mark + 1:  # ours was the only write: keep ours, updated
          kept = entry[1]
          for i, x in zip(written, values):
            kept[i] = x
          _compat.KEPT_VALUES[plan.me] = entry
  else:
    write_values(plan.disc, tuple(written), tuple(values))


def _finish(plan: _Plan, packed: _Packed):
  if packed.trace.closed.effects:
    # A host callback may fail while the program runs asynchronously; wait for it,
    # so that a failure raises here, before any Variable is written.
    jax.block_until_ready((packed.written, packed.new, packed.out))
  if packed.written:
    _write(plan, packed.written)
  return packed.trace.finish(plan.disc, packed.new, packed.out)
