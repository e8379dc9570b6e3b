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

import contextlib
import dataclasses
import functools
import gc
import threading
import weakref
from typing import Any

import jax

from brainnx import _compat
from brainnx._engine.arguments import ArgKind, CallArgs, StaticArgs, normalize_argnums
from brainnx._engine.caches import LRUCache
from brainnx._engine.call import check_values
from brainnx._engine.config import Config
from brainnx._engine.discovery import Discovery, discover
from brainnx._engine.filters import to_filter
from brainnx._engine.host_calls import calls_host, deferring_interrupts
from brainnx._engine.outputs import Leaf, New
from brainnx._engine.plan import CURRENT_PLAN, Packed, Plan, Written, complete_call
from brainnx._engine.roots import Root, RootKind
from brainnx._engine.sentinels import MISS, NOT_GIVEN
from brainnx._engine.sharding import Rules, arg_specs, constrain, layout_of, new_layout, place
from brainnx._engine.state import read_values
from brainnx._engine.stateful_function import StatefulFunction
from brainnx._engine.tracing import Trace

_compat.quiet_interrupted_callbacks()  # a Ctrl-C in a host callback is raised, not logged (see __call__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class JitOptions(Config):
  """``jit``'s config: how a ``JittedFunction`` compiles (static and donated arguments,
  shardings, ``jax.jit`` keywords)."""

  name: str = 'jit'
  statics: StaticArgs = StaticArgs()
  donate_argnums: tuple[int, ...] = ()
  donate_argnames: tuple[str, ...] = ()  # with donate_argnums, as jax.jit resolves them (see StaticArgs)
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


#: The backends on which ``jit`` with ``donate_states=None`` donates the Variables a call writes
#: (in the calls where nothing else references their arrays): there a step that donates nothing
#: allocates and fills fresh buffers for everything it writes. On CPU the default donates nothing.
DONATE_BY_DEFAULT = frozenset({'gpu', 'cuda', 'rocm', 'tpu'})


def _raise_interrupt(error: BaseException) -> None:
  """A Ctrl-C that stopped the program inside a host callback is raised as what it is."""
  if _compat.is_interrupted_callback(error):
    raise KeyboardInterrupt from None


def _always_miss(args, kwargs):
  return MISS


class JittedFunction:
  """The callable ``jit`` returns. See :func:`jit`.

  ``fun`` is the user's function; ``traced`` (default ``fun``) is what runs
  inside the trace (the eager entry passes a transform's body), and
  ``roots()`` (default: ``fun``) what discovery starts from at each cold
  call (the eager entry's live roots, held weakly).
  """

  def __init__(self, fun, options: JitOptions = JitOptions(), traced=None, name=None, roots=None):
    self.__wrapped__ = fun
    if callable(fun) and not isinstance(fun, (tuple, list)):
      functools.update_wrapper(self, fun, updated=())
    self._fun = fun
    self._roots = roots if roots is not None else (lambda: fun)
    self._options = options
    self._donated_args = StaticArgs(normalize_argnums(options.donate_argnums, 'donate_argnums'), options.donate_argnames)
    overlap = sorted(set(self._donated_args.argnums) & set(options.statics.argnums)) + sorted(
      set(options.donate_argnames) & set(options.statics.argnames))
    if overlap:
      raise ValueError(f'arguments {overlap} cannot be both static and donated')
    # wrappers of one function share its traces and programs, as jax.jit's do
    traces, self._compiled = (_shared_caches(fun, options) if traced is None else None) or (None, LRUCache(64))
    self.stateful_fun = StatefulFunction(traced or fun, name=name or getattr(fun, '__name__', None), cache=traces)
    self.stateful_fun.statics = options.statics
    self._plans = LRUCache(16, on_evict=Plan.forget_values)
    self._warm = _always_miss
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
    with gc_paused():
      return self._traced_call(args, kwargs)

  def _traced_call(self, args, kwargs):
    plan, dyn, disc, values = self._plan_and_values(args, kwargs)
    contents, signature = disc.snapshot(), disc.signature
    once = self._options.compile_on_reuse and not plan.ran and not self._options.sharded
    try:
      with _compat.created_variables(log=False):  # orphans of the trace go back to this level
        CURRENT_PLAN.plan = plan.me
        program, state = plan.program(values)
        run = program.__wrapped__ if once else program  # op by op: what jax.jit would compile
        result = run(*state, *dyn)
    except BaseException:
      disc.restore(contents)  # a failed compile or run keeps no attribute the trace added
      raise
    plan.ran = True
    if disc.signature != signature:  # the trace rebound a captured counter (see Discovery.refresh_captured)
      with self._lock:
        self._compiled.set((disc.signature,) + plan.compiled_key[1:], plan.compiled)
    return complete_call(plan, result)

  def _plan_for(self, args, kwargs) -> tuple[Plan, tuple, Discovery]:
    return self._plan_and_values(args, kwargs)[:3]

  def _plan_and_values(self, args, kwargs) -> tuple[Plan, tuple, Discovery, list | None]:
    """The plan for this call, its dynamic arguments, its discovery, and the Variables' values
    read before a new plan traced anything (``None`` for a cached plan: read them when calling)."""
    call = CallArgs.split(args, kwargs, self._options.statics)
    key = tuple(map(id, call.refs)) + (call.signature,)
    plan = self._plans.get(key)
    if plan is not None and plan.disc.guard.ok():
      if all(r() is x for r, x in zip(plan.ref_refs, call.refs)):
        self._warm = plan.warm
        return plan, call.dyn, plan.disc, None
    disc = discover(self._roots(), args, kwargs)
    values = read_values(disc.variables)  # what this (cold) call computes with
    check_values(disc, values)
    layout = layout_of(disc, self._options.state_shardings)
    if layout and _compat.at_top_level():
      place(disc, layout)
      values = read_values(disc.variables)  # laid out
    donated, effects, by_default = self._donated_states(disc, call)
    compiled = self._compiled_for(disc, call, donated, layout)
    if effects:  # a progress bar's Ctrl-C waits for the end of a donated program
      compiled = deferring_interrupts(compiled)
    plan = Plan(disc, call, compiled, _evictor(self, key), donated, layout, self.stateful_fun)
    if by_default:  # for the calls where another reference holds an array to donate
      plan.undonated = functools.partial(self._compiled_for, disc, call, (), layout)
    plan.compiled_key = (disc.signature, call.signature, donated, layout)
    self._plans.set(key, plan)
    self._warm = plan.warm
    return plan, call.dyn, disc, values

  def _donated_states(self, disc: Discovery, call: CallArgs) -> tuple[tuple, bool, bool]:
    """Indices of the Variables whose buffers are donated: written ones matching ``donate_states``;
    whether a program that donates has (never failing) host callbacks; and whether it donates by
    default (``donate_states=None`` on a backend in :data:`DONATE_BY_DEFAULT`: every written
    Variable, in the calls where nothing else references its array, see ``Plan.program``).

    Which Variables a call writes is read off its trace (cached: the compiled program's own
    trace reuses it, so Python still runs once).
    """
    spec = self._options.donate_states
    nodes = _donated_node_roots(call, self._donated_args)
    by_default = spec is None and not nodes and jax.default_backend() in DONATE_BY_DEFAULT
    if by_default:
      spec = True
    if (spec is None or spec is False) and not nodes:
      return (), False, False
    values = read_values(disc.variables)
    trace = self.stateful_fun.trace_for(disc, call, values, call.dyn)
    if calls_host(trace.closed):  # a callback may raise mid-program: donated buffers would be lost
      return (), False, False
    written = trace.written
    chosen = None if spec is None or spec is False else (lambda path, var: True) if spec is True else to_filter(spec)
    donated = tuple(sorted(
      i for i in written
      if (chosen is not None and chosen(disc.paths[i], disc.variables[i])) or disc.roots[disc.root_of[i]] in nodes
    ))
    return donated, bool(donated and trace.closed.effects), by_default and bool(donated)

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
      donate_argnums=(0,) * bool(donated) + _donated_positions(call, self._donated_args, n_state),
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
      out['out_shardings'] = Written(None, opts.out_shardings) if trace.written else opts.out_shardings
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
    return Packed(None, new, leaves, trace)

  def _drop_plan(self, key) -> None:
    plan = self._plans.get(key)
    self._plans.pop(key)
    if plan is not None:
      plan.kept_lists.pop(plan.me, None)
      if self._warm is plan.warm:
        self._warm = _always_miss

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
    CURRENT_PLAN.plan = plan.me
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
    self._warm = _always_miss
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
    return complete_call(plan, result)


def _donated_node_roots(call: CallArgs, donated: StaticArgs) -> frozenset:
  """The discovery roots of the graph-node arguments ``donate_argnums`` / ``donate_argnames``
  select: their written Variables are donated, as ``donate_states`` donates (flax's meaning)."""
  roots = set()
  for slot, kind in enumerate(call.kinds):
    if kind in (ArgKind.REF, ArgKind.MIXED) and donated.is_static(slot, call.n_args, call.kw_names):
      positional = slot < call.n_args
      name = slot if positional else call.kw_names[slot - call.n_args]
      roots.add(Root(name, RootKind.ARG if positional else RootKind.KWARG))
  return frozenset(roots)


def _donated_positions(call: CallArgs, donated: StaticArgs, n_state: int = 1) -> tuple[int, ...]:
  """Positions in ``(*state, *dyn)`` of the donated dynamic arguments."""
  positions, k = [], 0
  for slot, kind in enumerate(call.kinds):
    if kind is ArgKind.DYN:
      if donated.is_static(slot, call.n_args, call.kw_names):
        positions.append(n_state + k)
      k += 1
    elif kind is ArgKind.MIXED:
      k += sum(1 for s, _, mask in call.mixed if s == slot for m in mask if not m)
  return tuple(positions)


def _body(n_state: int, rules: Rules, *args):
  plan: Plan = CURRENT_PLAN.plan()
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
    return Packed(written, new, out_leaves, trace)
  out = trace.out_spec.rebuild(out_leaves, plan.disc)
  return Written(written, out) if written else out  # a call that writes nothing returns its output as is


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
  """Whether the compiled output is a ``Packed`` (rebuilt in Python) rather than the user's tree."""
  return bool(trace.attachments or trace.out_spec.has_nodes or trace.waits)


@contextlib.contextmanager
def gc_paused():
  """Python's cyclic garbage collector paused for the block (if it was running): a cold call
  keeps most of what it allocates (the jaxpr, the lowered module), and full collections over a
  growing heap took about a fifth of a first call of a 500-layer model
  (``benchmarks/first_call.py``). Reference counting still frees the rest as it goes."""
  if not gc.isenabled():
    yield
    return
  gc.disable()
  try:
    yield
  finally:
    gc.enable()
