"""The one stateful call every transform makes.

A transform turns ``fun(*args, **kwargs)``, which reads and writes Variables,
into a pure function for one JAX primitive (``jax.make_jaxpr``,
``jax.checkpoint``, ``jax.vmap``, ``jax.shard_map``, ``jax.grad``, ...), then
writes what it computed back::

    call = StatefulCall.enter(fun, args, kwargs, name='remat')
    with call.rolling_back():
      written, new, leaves = jax.checkpoint(call.pure)(call.values, call.call.dyn)
      call.write_back(written, new)
    return call.output(leaves)

:meth:`StatefulCall.enter` discovers the Variables, reads their values
(never another thread's tracers), and refuses leaked tracers by name.
:meth:`StatefulCall.pure` runs the engine's state step inside the
primitive's trace and keeps what the trace learned (written Variables,
created ones, the output's structure) in a write-once :class:`Record`: a
primitive that traces twice (``pmap``, ``jax.checkpoint`` under ``grad``)
must learn the same thing twice. :meth:`StatefulCall.write_back` writes all
or nothing; :meth:`StatefulCall.rolling_back` undoes, on error, every
container change and every Variable value the call made.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from flax import nnx
  >>> from brainnx._engine.call import StatefulCall
  >>> count = nnx.Variable(jnp.array(0))
  >>> def f(x):
  ...   count[...] += 1
  ...   return x * 2
  >>> call = StatefulCall.enter(f, (jnp.ones(2),), {}, name='example')
  >>> with call.rolling_back():
  ...   written, new, leaves = jax.jit(call.pure)(call.values, call.call.dyn)
  ...   call.write_back(written, new)
  >>> call.output(leaves).tolist(), int(count[...])
  ([2.0, 2.0], 1)
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Sequence

import jax

from brainnx import _compat
from brainnx._engine.arguments import CallArgs, StaticArgs
from brainnx._engine.discovery import Discovery, discover
from brainnx._engine.outputs import OutSpec
from brainnx._engine.sentinels import UNSET
from brainnx._engine.state import (
  StepResult, abstract, abstract_tree, finish_call, read_values, state_step, write_values,
)
from brainnx._engine.structure import Attachments


class Record:
  """A value a trace learns, kept once (the ``linear_util.Store`` idea).

  ``set`` stores the first value; a later ``set`` (the same function traced
  again by a primitive) must agree with it on ``agree(first, later)``, or
  the trace is an error naming ``what``.
  """

  __slots__ = ('_value', 'what')

  def __init__(self, what: str):
    self._value, self.what = UNSET, what

  def set(self, value, agree: Callable[[Any, Any], bool] = lambda a, b: True) -> None:
    if self._value is UNSET:
      self._value = value
    elif not agree(self._value, value):
      raise RuntimeError(f'{self.what}: the function did something else when traced again (it wrote other Variables)')

  @property
  def is_set(self) -> bool:
    return self._value is not UNSET

  def get(self):
    if self._value is UNSET:
      raise RuntimeError(f'{self.what}: the function was never traced')
    return self._value


@dataclasses.dataclass(frozen=True, eq=False)
class StepInfo:
  """What a traced call did, without its traced values (safe to keep after the trace)."""

  written: tuple[int, ...]
  written_defs: tuple  # tree structure of each written value (a write may change it: ``sow``)
  attachments: Attachments  # what the call attached, rebuilt per call
  out_spec: OutSpec

  @property
  def new_vars(self) -> tuple:
    """Stand-ins of the Variables the call attaches (what filters see)."""
    return self.attachments.stand_ins

  @classmethod
  def of(cls, step: StepResult, spec: OutSpec) -> 'StepInfo':
    shape = step.shape()
    return cls(shape.written, shape.written_defs, shape.attachments, spec)


def _same_writes(a: StepInfo, b: StepInfo) -> bool:
  return a.written == b.written


def check_values(disc: Discovery, values: Sequence) -> None:
  """Every Variable holds arrays (``TypeError`` naming it); at top level none holds a tracer,
  which only a JAX transform brainnx did not manage can have left (``RuntimeError`` naming it)."""
  top = None
  for i, value in enumerate(values):
    if type(value) is _compat.ArrayImpl:  # the common case, and neither error: one type check
      continue
    abstract_tree(value, lambda i=i: disc.describe(i))  # the TypeError, naming the Variable
    if top is None:
      top = _compat.at_top_level()
    if top and any(isinstance(x, _compat.Tracer) for x in jax.tree.leaves(value)):
      raise RuntimeError(
        f'{disc.describe(i)} holds a leaked tracer (a value left behind by a JAX '
        'transform that brainnx did not manage). Reset it, e.g. `var[...] = jnp.zeros(shape)`, '
        'and write Variables inside brainnx transforms only.'
      )


def settle_creations(log: Sequence) -> None:
  """Variables created during a step leave it without tracers, usable where the outermost
  brainnx call began (what the call attached or returned is rebuilt afresh, see
  :mod:`structure`): ones kept where brainnx cannot see them hold their abstract value
  (``ShapeDtypeStruct``) and accept ``set_value`` afterwards. This runs inside the step's
  trace, before it ends, so that no tracer outlives it."""
  level = _compat.outer_level()
  for v in log:
    value = _compat.raw_value(v)
    if any(isinstance(x, _compat.Tracer) for x in jax.tree.leaves(value)):
      _compat.set_raw_value(v, jax.tree.map(abstract, value))
    _compat.set_node_trace_state(v, level)


class StatefulCall:
  """One call of ``fun`` against the Variables it reaches (see the module docstring).

  ``creates`` says what happens to Variables the function creates and
  attaches to something it can reach: ``'refuse'`` (an error naming the
  transform), ``'keep'`` (:meth:`output` builds them for this call's objects
  and attaches them) or ``'detach'`` (a trace only: nothing is attached).
  """

  def __init__(self, fun: Callable, disc: Discovery, call: CallArgs, *, name: str, creates: str = 'refuse',
               values: Sequence | None = None):
    self.fun, self.disc, self.call, self.name, self.creates = fun, disc, call, name, creates
    self.values = list(values) if values is not None else None
    self.contents = disc.snapshot()
    self.info = Record(name)
    self.new_values: list = []

  @classmethod
  def enter(cls, fun: Callable, args: tuple, kwargs: dict, *, name: str, statics: StaticArgs = StaticArgs(),
            creates: str = 'refuse', disc: Discovery | None = None) -> 'StatefulCall':
    """Discover, read every Variable's value and check it, for a call about to run."""
    call = CallArgs.split(tuple(args), kwargs, statics)
    disc = disc if disc is not None else discover(fun, tuple(args), kwargs)
    values = read_values(disc.variables)
    check_values(disc, values)
    return cls(fun, disc, call, name=name, creates=creates, values=values)

  # -- inside the primitive's trace --------------------------------------------

  def step(self, state_values: Sequence, dyn: Sequence, call: CallArgs | None = None) -> StepResult:
    """The engine's state step on these values; what it learns goes to :attr:`info`."""
    with _compat.created_variables() as log:
      step = None
      try:
        step = state_step(self.fun, self.disc, call or self.call, state_values, dyn)
        if step.new_vars and self.creates == 'refuse':  # binding existing objects creates nothing
          raise ValueError(
            f'{self.name}: the function creates Variables ({_created(step)}); create them before the '
            f'{self.name} call and only update them inside'
          )
        self.info.set(StepInfo.of(step, step.split_out(self.disc, self.name)[0]), _same_writes)
      finally:
        settle_creations(log)
    return step

  def pure(self, state_values: Sequence, dyn: Sequence) -> tuple[list, list, list]:
    """``(written values, created Variables' values, output leaves)``: the function for a JAX primitive."""
    step = self.step(state_values, dyn)
    return step.written_values(), step.new_values, step.split_out(self.disc, self.name)[1]

  # -- after the primitive ------------------------------------------------------

  @property
  def written(self) -> tuple[int, ...]:
    return self.info.get().written

  def write_back(self, written_values: Sequence, new_values: Sequence = (), indices: Sequence[int] | None = None) -> None:
    """Write the new values of the written Variables (``indices``, default :attr:`written`);
    ``new_values`` are those of the Variables the call attaches (:meth:`output` builds them)."""
    info = self.info.get()
    indices = info.written if indices is None else tuple(indices)
    if _compat.at_top_level():  # computed op by op (vjp, disable_jit): on an accelerator a value
      jax.block_until_ready((written_values, new_values))  # a failed host callback made raises here
    write_values(self.disc, indices, list(written_values))
    self.new_values = list(new_values)

  def output(self, leaves: Sequence) -> Any:
    """The function's return value rebuilt from its leaves, after what the call attached is
    built for this call's objects and attached (one merge: sharing between them is kept)."""
    info = self.info.get()
    out, _ = finish_call(
      self.disc, info.attachments, self.new_values, info.out_spec, list(leaves)
    )
    self.new_values = []
    return out

  @contextlib.contextmanager
  def rolling_back(self):
    """On error inside the block: every container change this call made is undone.

    Variable values need no undoing here: a trace gives every Variable its value back
    (:func:`swapped`), and :meth:`write_back`, the block's last step, checks every value
    before it writes any (``write_values``), so an error leaves them as they were.
    """
    try:
      with _compat.created_variables(log=False):  # this call's level: where orphans of its trace go
        yield self
    except BaseException:
      self.disc.restore(self.contents)
      raise
    finally:
      # JAX may keep the traced function (and so this object) alive in its caches
      # (``jax.pmap``'s): the values and arguments, perhaps an enclosing trace's tracers, must not stay.
      self.values = None
      self.call = dataclasses.replace(self.call, dyn=())


def _created(step: StepResult) -> str:
  kinds = sorted({type(v).__name__ for v in step.new_vars} or {'Modules'})
  return ', '.join(kinds[:3]) + (', ...' if len(kinds) > 3 else '')
