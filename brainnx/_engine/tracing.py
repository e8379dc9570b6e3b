"""Traces of stateful functions: one jaxpr per abstract signature, and how to replay it.

:func:`trace_call` runs the engine's stateful call under ``jax.make_jaxpr``;
reads are the jaxpr inputs some equation or output uses, writes are
Variables whose value afterwards is not the one that went in. A
:class:`Trace` replays the jaxpr on values. ``StatefulFunction``
(``brainnx._engine.stateful_function``) caches traces per signature.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from flax import nnx
  >>> from brainnx._engine.arguments import CallArgs
  >>> from brainnx._engine.discovery import discover
  >>> from brainnx._engine.tracing import trace_call
  >>> w = nnx.Param(jnp.ones(2))
  >>> f = lambda x: x * w[...]
  >>> trace = trace_call(f, discover(f, (), {}), CallArgs.split((jnp.ones(2),), {}), [jax.ShapeDtypeStruct((2,), jnp.float32)], [jax.ShapeDtypeStruct((2,), jnp.float32)])
  >>> trace.states, sorted(trace.read), trace.written
  ((0,), [0], ())
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Hashable, NamedTuple, Sequence

import jax
import jax.extend
import numpy as np

from brainnx import _compat
from brainnx._engine.arguments import CallArgs
from brainnx._engine.call import StatefulCall, StepInfo
from brainnx._engine.discovery import Discovery
from brainnx._engine.host_calls import calls_host
from brainnx._engine.outputs import OutSpec
from brainnx._engine.state import abstract_tree, finish_call
from brainnx._engine.structure import Attachments


class TraceKey(NamedTuple):
  """What a cached trace depends on."""

  discovery: Hashable  # structure, static attributes and captured names
  call: Hashable  # argument kinds and static values
  states: Hashable  # abstract values of the discovered Variables
  args: Hashable  # abstract values of the dynamic arguments
  config: Hashable = ()  # the JAX configuration a trace depends on (see ``tracing_config``)


def tracing_config() -> tuple:
  """The JAX settings that change what tracing produces, as ``jax.jit`` keys its cache on them
  (``jax.enable_x64`` turns ``jnp.array(1.0)`` into float64)."""
  config = jax.config
  return (config.jax_enable_x64, config.jax_default_matmul_precision, config.jax_numpy_rank_promotion,
          config.jax_numpy_dtype_promotion)


# -- one trace ---------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class Trace:
  """A traced call: its jaxpr and what it does to Variables.

  ``closed`` takes the touched states' leaves (in ``states`` order) then the
  dynamic argument leaves; it returns the written states' leaves (or every
  touched state's, when traced with ``only_write=False``), then the
  leaves of Variables created inside, then the output leaves.
  """

  closed: Any
  states: tuple[int, ...]  # touched discovery indices, in first-touch order
  read: frozenset
  written: tuple[int, ...]  # discovery indices, in ``states`` order
  state_avals: tuple  # abstract value of each touched state
  out_defs: tuple  # tree structure of each returned state value (written or all, in ``states`` order)
  only_write: bool
  attachments: Attachments  # what the call attaches, rebuilt per call (see ``structure``)
  out_spec: OutSpec
  out_leaf_shapes: tuple  # ShapeDtypeStruct per output leaf
  cacheable: bool

  @functools.cached_property
  def waits(self) -> bool:
    """Whether a call must wait for the program's end before writing anything back: it has
    side effects, or a host callback that may fail (a ``jax.pure_callback`` has no effect,
    and on an accelerator the call returns before the program fails)."""
    return bool(self.closed.effects) or calls_host(self.closed)

  @property
  def new_vars(self) -> tuple:
    """Stand-ins (shapes) of the Variables the call attaches, one per created leaf."""
    return self.attachments.stand_ins

  @property
  def new_defs(self) -> tuple:
    return self.attachments.defs

  def finish(self, disc: Discovery, new_values, out_leaves, *, attach: bool = True) -> Any:
    """What the call attached built and attached for ``disc``'s objects; the output rebuilt."""
    return finish_call(disc, self.attachments, new_values, self.out_spec, list(out_leaves), attach=attach)[0]

  def out_shapes(self, disc: Discovery) -> Any:
    """The output with ``ShapeDtypeStruct`` leaves (Modules created inside rebuilt anew each time)."""
    new = [jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), _compat.raw_value(v))
           for v in self.attachments.stand_ins]
    return self.finish(disc, new, self.out_leaf_shapes, attach=False)

  def run(self, state_values: Sequence, dyn_leaves: Sequence):
    """Evaluate the jaxpr: ``(written or all state values, new var values, out leaves)``."""
    flat = []
    for x in state_values:
      flat.extend(jax.tree.leaves(x))
    outs = _compat.call_jaxpr(self.closed, *flat, *dyn_leaves)
    it = iter(outs)
    states = [_take(d, it) for d in self.out_defs]
    new = [_take(d, it) for d in self.new_defs]
    return states, new, list(it)

  def check_states(self, disc: Discovery, values: Sequence, where: str) -> None:
    """``ValueError`` naming the first value that does not fit its touched state."""
    if len(values) != len(self.states):
      raise ValueError(
        f'{where}: expected {len(self.states)} state values (one per get_states() entry), got {len(values)}'
      )
    for i, value, expected in zip(self.states, values, self.state_avals):
      got = abstract_tree(value, lambda i=i: f'the value given for {disc.describe(i)}')
      if jax.tree.structure(got) != jax.tree.structure(expected) or any(
        (g.shape, g.dtype) != (e.shape, e.dtype) for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected))
      ):
        raise ValueError(
          f'{where}: the value given for {disc.describe(i)} is {_show(got)}, but the trace '
          f'expects {_show(expected)}'
        )


def _show(avals) -> str:
  return ', '.join(f'{a.dtype}{list(a.shape)}' for a in jax.tree.leaves(avals)) or 'an empty tree'


def _take(treedef, it):
  return jax.tree.unflatten(treedef, [next(it) for _ in range(treedef.num_leaves)])


def trace_call(
  fun: Callable,
  disc: Discovery,
  call: CallArgs,
  state_avals: Sequence,
  dyn_avals: Sequence,
  *,
  only_write: bool = True,
  name: str | None = None,
) -> Trace:
  """Trace ``fun`` on the abstract values of the Variables and dynamic arguments.

  Nothing the function attaches stays attached: the trace records it
  (``Trace.attachments``) and :meth:`Trace.finish` builds it per call.
  """
  stateful = StatefulCall(fun, disc, call, name=name or getattr(fun, '__name__', 'trace'), creates='keep')
  pure = functools.wraps(fun)(lambda states_in, dyn_in: stateful.pure(states_in, dyn_in))
  with _compat.created_variables(log=False):  # this level: where Variables the trace orphans go
    closed, shapes = jax.make_jaxpr(pure, return_shape=True)(list(state_avals), list(dyn_avals))
  return _finish_trace(closed, shapes, stateful.info.get(), disc, state_avals, only_write)


def ignored_inputs(eqn) -> frozenset:
  """Positions of ``eqn``'s inputs that the program it calls never uses: a brainnx ``jit``
  called inside a trace passes every Variable it discovered, and only what it touches counts
  as read."""
  inner = eqn.params.get('jaxpr')
  if not isinstance(inner, jax.extend.core.ClosedJaxpr) or len(inner.jaxpr.invars) != len(eqn.invars):
    return frozenset()
  used = used_vars(inner.jaxpr)
  return frozenset(k for k, v in enumerate(inner.jaxpr.invars) if v not in used)


def used_vars(jaxpr) -> set:
  """The variables ``jaxpr``'s equations and outputs use (see :func:`ignored_inputs`)."""
  used = set()
  for eqn in jaxpr.eqns:
    ignored = ignored_inputs(eqn)
    used.update(a for k, a in enumerate(eqn.invars) if k not in ignored and isinstance(a, jax.extend.core.Var))
  used.update(a for a in jaxpr.outvars if isinstance(a, jax.extend.core.Var))
  return used


def _finish_trace(closed, shapes, step: StepInfo, disc, state_avals, only_write) -> Trace:
  jaxpr = closed.jaxpr
  leaf_counts = [len(jax.tree.leaves(x)) for x in state_avals]
  starts = np.cumsum([0] + leaf_counts)
  n_state_leaves = int(starts[-1])
  state_invars = jaxpr.invars[:n_state_leaves]
  dyn_invars = jaxpr.invars[n_state_leaves:]
  written = step.written
  written_set = set(written)

  first_use: dict = {}
  for k, eqn in enumerate(jaxpr.eqns):
    for a in eqn.invars:
      if isinstance(a, jax.extend.core.Var):
        first_use.setdefault(a, k)
  n_eqns = len(jaxpr.eqns)
  n_written_leaves = sum(d.num_leaves for d in step.written_defs)
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
  written_def = dict(zip(written, step.written_defs))
  for i in written:
    n_out = written_def[i].num_leaves
    outs = jaxpr.outvars[out_it : out_it + n_out]
    out_it += n_out
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
  arg_names = tuple(disc.describe(i) for i in states for _ in range(leaf_counts[i]))
  arg_names += tuple(f'arg{k}' for k in range(len(dyn_invars)))
  info = _compat.with_debug_names(jaxpr.debug_info, arg_names, tuple(f'out{k}' for k in range(len(new_outvars))))
  new_jaxpr = jaxpr.replace(invars=new_invars, outvars=new_outvars, debug_info=info)
  new_closed = jax.extend.core.ClosedJaxpr(new_jaxpr, closed.consts)
  cacheable = not any(isinstance(c, _compat.Tracer) for c in closed.consts)
  return Trace(
    closed=new_closed,
    states=states,
    read=frozenset(read),
    written=tuple(i for i in states if i in written_set),
    state_avals=tuple(state_avals[i] for i in states),
    out_defs=tuple(
      written_def[i] if i in written_set else jax.tree.structure(state_avals[i])
      for i in states
      if i in written_set or not only_write
    ),
    only_write=only_write,
    attachments=step.attachments,
    out_spec=step.out_spec,
    out_leaf_shapes=tuple(shapes[2]),
    cacheable=cacheable,
  )
