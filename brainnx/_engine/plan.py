"""A compiled call's plan: everything a warm call of a ``JittedFunction`` needs for one set
of reference arguments (the discovery and its guard, the compiled program, the values the last
call passed), the warm call itself, and the write-back of a compiled call's results.

The warm call is a closure over locals, specialised for the common argument shapes: every
attribute lookup there is paid on every call. A plan keeps the list of values its last call
passed (``_compat.KEPT_VALUES``); every route by which flax writes a Variable patches or
forgets those lists, and the plan's own write-back puts its written values back in.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> import brainnx as bnx
  >>> from brainnx._engine.plan import Plan
  >>> count = nnx.Variable(jnp.array(0))
  >>> def bump():
  ...   count[...] += 1
  >>> f = bnx.jit(bump)
  >>> f(); f()
  >>> plan, _, _ = f._plan_for((), {})  # the plan the warm calls use
  >>> isinstance(plan, Plan), plan.ran, plan.disc.paths, int(count[...])
  (True, True, (('count',),), 2)
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import threading
import weakref
from typing import Any, Callable, NamedTuple

import jax

from brainnx import _compat
from brainnx._engine.arguments import ArgKind, CallArgs
from brainnx._engine.call import check_values
from brainnx._engine.discovery import Discovery
from brainnx._engine.host_calls import raise_pending_interrupt
from brainnx._engine.nodes import holds_graph_node
from brainnx._engine.sentinels import MISS
from brainnx._engine.state import STATE_CHANGES, read_values, set_values, write_values
from brainnx._engine.stateful_function import StatefulFunction
from brainnx._engine.weak import weak_or_strong

FAST_DYN = (_compat.ArrayImpl, int, float, bool, complex)


class Packed:
  """Compiled output: its tree's static part carries the Trace that made it."""

  __slots__ = ('written', 'new', 'out', 'trace')

  def __init__(self, written, new, out, trace):
    self.written, self.new, self.out, self.trace = written, new, out, trace


jax.tree_util.register_pytree_node(
  Packed,
  lambda p: ((p.written, p.new, p.out), p.trace),
  lambda trace, children: Packed(*children, trace),
)


class Written(NamedTuple):
  """Compiled output of a call that writes Variables (a namedtuple: flattened in C++)."""

  written: dict  # discovery index -> new value
  out: Any


#: The plan of the call now entering ``jax.jit`` in this thread (a weak reference): ``_body``
#: reads it when JAX traces. Every plan of one compiled program has the same discovery and
#: call signature (the program is chosen by them), so any of them traces it the same way.
CURRENT_PLAN = threading.local()


class Plan:
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
    self.kept_lists = _compat.KEPT_VALUES  # held here: dropped plans may outlive the module at exit
    # the list this plan keeps goes with it (a plan pushed out of its cache, its function dropped)
    self.me = weakref.ref(self, lambda me, kept=self.kept_lists: kept.pop(me, None))
    hash(self.me)  # kept now: a weak reference hashes only while its object lives
    # a data attribute's array is written by plain setattr, which counts no value write
    self.keeps_values = not any(type(v) is _compat.DataAttribute for v in disc.variables)
    self.ran = False  # whether a call has run this plan (see JitOptions.compile_on_reuse)
    self.variables = disc.variables
    self.undonated = None  # set for default donation: () -> the program that donates nothing
    self.warm = warm_call(self)

  def forget_values(self) -> None:
    """Drop the value list this plan keeps (it left its function's cache)."""
    self.kept_lists.pop(self.me, None)

  def positions(self) -> dict:
    """``id(variable)`` -> its index in discovery order (see :meth:`Discovery.positions`)."""
    return self.disc.positions()

  def live_call(self) -> CallArgs:
    """The call with its reference arguments (alive while a call that passed them runs)."""
    return dataclasses.replace(self.call, refs=tuple(r() for r in self.ref_refs))

  def state(self, values: list | None = None) -> tuple:
    """``compiled``'s state arguments: ``(values,)``, or ``(donated values, the others)``."""
    if values is None:
      values = read_values(self.variables)
    if not self.donated:
      return (values,)
    return [values[i] for i in self.donated], [values[i] for i in self.kept]

  def program(self, values: list | None = None) -> tuple:
    """``(program, state arguments)`` for this call. A plan that donates by default (``jit``'s
    ``donate_states=None`` on an accelerator) donates only arrays nothing else references: when a
    user's ``old = v[...]`` (or another Variable, or anything) holds one, this call runs the
    program that donates nothing, so ``old`` still reads afterwards. ``values``: the Variables'
    values the call read (default: read now)."""
    state = self.state(values)
    if self.undonated is not None and max(map(sys.getrefcount, state[0])) > sole_reference_count():
      return self.undonated(), (self.full_state(state),)
    return self.compiled, state

  def full_state(self, state_args) -> list:
    """Every discovered Variable's value, in discovery order, from ``state()``'s arguments."""
    if len(state_args) == 1:  # a program that donates nothing (see program())
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
      if type(x) not in FAST_DYN and holds_graph_node(x):
        return None
    return dyn if self.disc.guard.ok() else None


@functools.lru_cache(maxsize=1)
def sole_reference_count() -> int:
  """What ``sys.getrefcount`` reports, in :meth:`Plan.program`'s check, for an array that only its
  Variable references: the Variable, the list of those to donate and the call's own argument
  (measured on this interpreter with lists in the same places)."""
  owner = [object()]
  state = ([owner[0]],)
  return max(map(sys.getrefcount, state[0]))


def warm_call(plan: Plan):
  """``warm(args, kwargs)``: the call if ``plan`` applies, else ``MISS``.

  A closure over locals, specialised for the common shapes (dynamic
  positional arguments only; references then dynamic arguments), because
  every attribute lookup here is paid on every call.
  """
  guard, compiled, me, current = plan.disc.guard.ok, plan.compiled, plan.me, CURRENT_PLAN
  fast_dyn, kept, fresh, write, finish = FAST_DYN, _compat.KEPT_VALUES, fresh_values, write_results, finish_packed
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
      # complete_call, inlined: this is the whole cost of a warm call beyond JAX's
      entry = kept.get(me)
      values = fresh(plan) if entry is None else entry[1]
      current.plan = me
      try:
        result = compiled(values, *args)
      except TypeError:
        explain_bad_values(plan)
        raise
      kind = type(result)
      if kind is Written:
        write(plan, result.written)
        return result.out
      if kind is Packed:
        return finish(plan, result)
      return result

    return warm

  def warm_general(args, kwargs):
    dyn = plan.match(args, kwargs)
    if dyn is None:
      return MISS
    current.plan = me
    program, state = plan.program()
    try:
      result = program(*state, *dyn)
    except TypeError:
      explain_bad_values(plan)
      raise
    return complete_call(plan, result)

  return warm_general


def explain_bad_values(plan: Plan) -> None:
  """After JAX refused a warm call's arguments: the ``TypeError`` naming a Variable that holds
  something other than arrays (set since the last call), if one does; JAX's own otherwise."""
  try:
    check_values(plan.disc, read_values(plan.variables))
  except TypeError as named:
    raise named from None


def fresh_values(plan: Plan) -> list:
  """The Variables' values as a warm call reads them when it kept none: kept for the next call
  if no value was written meanwhile (see ``_compat.KEPT_VALUES``)."""
  changes, writes = STATE_CHANGES, _compat.VALUE_WRITES
  mark, begun = writes.n, changes.begun
  if not changes.under_way:
    values = list(map(_compat.raw_value, plan.variables))
    if changes.begun == begun and not changes.under_way:  # no other thread's trace or write-back meanwhile
      # KEPT_LOCK is TRACE_LOCK: a trace in another thread holds it; then keep nothing, never wait
      if _compat.KEPT_LOCK.acquire(blocking=False):
        try:
          if writes.n == mark and plan.keeps_values:
            _compat.KEPT_VALUES[plan.me] = (plan.positions(), values)
        finally:
          _compat.KEPT_LOCK.release()
      return values
  return read_values(plan.variables)


def complete_call(plan: Plan, result):
  """Write a compiled call's results back; return its output."""
  kind = type(result)
  if kind is Written:
    write_results(plan, result.written)
    return result.out
  if kind is Packed:
    return finish_packed(plan, result)
  return result


def write_results(plan: Plan, written: dict) -> None:
  values = written.values()
  if type(next(iter(values))) is _compat.ArrayImpl:  # concrete: we run eagerly, the write is ours
    with _compat.KEPT_LOCK:  # TRACE_LOCK too: no other write lands between ours and the patch
      entry = _compat.KEPT_VALUES.get(plan.me)
      set_values(list(map(plan.variables.__getitem__, written)), values)  # forgets every kept list
      if entry is not None:  # ours was the only write: keep ours, updated
        kept = entry[1]
        for i, x in zip(written, values):
          kept[i] = x
        _compat.KEPT_VALUES[plan.me] = entry
  else:
    write_values(plan.disc, tuple(written), tuple(values))


def finish_packed(plan: Plan, packed: Packed):
  if packed.trace.waits:
    # A host callback may fail while the program runs asynchronously; wait for it,
    # so that a failure raises here, before any Variable is written.
    jax.block_until_ready((packed.written, packed.new, packed.out))
  if packed.written:
    write_results(plan, packed.written)
  out = packed.trace.finish(plan.disc, packed.new, packed.out)
  if packed.trace.closed.effects:
    raise_pending_interrupt()  # a Ctrl-C a progress bar held back until the results were written
  return out
