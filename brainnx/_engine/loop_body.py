"""A body traced once and evaluated inside a JAX construct: what loops and branches share.

A :class:`LoopBody` is ``f(*args)`` as a pure function of the Variables it
writes (carried from step to step, or from branch to branch) and of its
arguments' array leaves; the Variables it only reads enter as constants.
``scan``, ``for_loop``, the while loops, ``cond``/``switch``/``ifelse`` and
``map`` evaluate it inside ``jax.lax.scan``/``while_loop``/``switch`` and
write what it computed back with :meth:`LoopBody.write_back`.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from flax import nnx
  >>> from brainnx._engine.loop_body import LoopBody, dyn_leaves
  >>> total = nnx.Variable(jnp.zeros(()))
  >>> def step(x):
  ...   total[...] += x
  ...   return x * 2
  >>> body = LoopBody(step, (jnp.ones(()),), 'example')
  >>> written, out = jax.lax.fori_loop(0, 3, lambda i, c: (body.run(c[0], dyn_leaves((c[1][0],)))),
  ...                                  (body.initial_written(), [jnp.ones(())]))
  >>> body.write_back(written)
  >>> float(total[...]), float(out[0])
  (7.0, 8.0)
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from brainnx import _compat
from brainnx._engine.arguments import CallArgs
from brainnx._engine.caches import LRUCache
from brainnx._engine.discovery import Discovery, discover
from brainnx._engine.nodes import is_graph_node
from brainnx._engine.state import abstract_args, abstract_states, aval_key, finish_call, read_values, write_values
from brainnx._engine.tracing import Trace, trace_call, tracing_config


def is_key(x) -> bool:
  return hasattr(x, 'dtype') and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def strong_typed(x):
  """``x`` as a strongly typed array (loop carries must keep one type)."""
  if is_key(x) or not (hasattr(x, 'dtype') or isinstance(x, (int, float, bool, complex))):
    return x
  return jax.lax.convert_element_type(x, jnp.result_type(x))


def dyn_leaves(x) -> list:
  """The array leaves of ``x`` (graph nodes travel by reference, not as leaves)."""
  return [leaf for leaf in jax.tree.leaves(x, is_leaf=is_graph_node) if not is_graph_node(leaf)]


_BRANCHING = ('cond', 'switch', 'ifelse')  # constructs whose LoopBody is a branch, not a loop body


class LoopBody:
  """``f(*args)`` traced as a pure function of carried and constant values.

  ``written`` Variables (indices into the discovery) travel in the carry;
  the rest of the touched ones are read from their current values. A call
  with other abstract values (JAX promoting a weakly typed carry) traces
  again; a write that changes a carried Variable's shape or dtype is an
  error naming it.
  """

  def __init__(self, f: Callable, args: tuple, name: str, disc: Discovery | None = None, sliced: tuple = (),
               keep_new: bool = False, fixed: tuple = ()):
    self.f, self.name = f, name
    self.keep_new = keep_new  # Variables the body creates (Module.sow) come out stacked per step
    self.call = CallArgs.split(args, {})
    self.disc = disc if disc is not None else discover(f, args, {})
    self.values = read_values(self.disc.variables)
    self.sliced = tuple(sliced)  # Variables stacked on axis 0 that each step sees one slice of
    self.fixed = tuple(fixed)  # Variables every step sees at their pre-loop value (broadcast)
    self.per_step = self.sliced + self.fixed  # given to each step, not carried: see run_step
    self.restructured = frozenset()  # written Variables whose value may change structure (every branch agrees)
    self._dyn_def = jax.tree.structure(list(self.call.dyn))
    self._traces = LRUCache(32)  # the trace cache StatefulFunction and jit use, per abstract signature
    self.contents = self.disc.snapshot()
    avals = abstract_states(self.disc, self.values)
    for i in self.sliced:
      avals[i] = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype, weak_type=a.weak_type), avals[i])
    self.trace = self.last_trace = self._trace_for(avals, abstract_args(self.call.dyn))
    if name in _BRANCHING and (self.trace.attachments or self.trace.out_spec.new_nodes()):
      raise ValueError(
        f'{name}: a branch creates Variables or Modules, or binds a name or attribute to another '
        f'object; do that before calling {name} (or use brainnx.vmap_new_states outside it) and '
        'only update Variables inside'
      )
    # a body that binds existing objects (``global model; model = other``) creates nothing: the
    # binding is made once, after the loop, by :meth:`output`
    if (self.trace.attachments.stand_ins and not keep_new) or self.trace.out_spec.new_nodes():
      raise ValueError(
        f'{name}: the loop body creates Variables or Modules; create them before the loop '
        '(or use brainnx.vmap_new_states outside it) and only update them inside'
      )

  def _trace_for(self, state_avals, dyn_avals) -> Trace:
    key = (aval_key(state_avals), aval_key(dyn_avals), tracing_config())
    trace = self._traces.get(key)
    if trace is None:
      trace = trace_call(self.f, self.disc, self.call, state_avals, dyn_avals)
      self._traces.set(key, trace)
    return trace

  def output(self, leaves: Sequence, created: Sequence = ()) -> object:
    """The loop's result from its output leaves, after what the body attached (the values of the
    Variables it created: ``created``) or bound is attached."""
    return finish_call(self.disc, self.last_trace.attachments, list(created), self.trace.out_spec, list(leaves))[0]

  @property
  def written(self) -> tuple[int, ...]:
    """Written Variables that travel in the carry (sliced and fixed ones come out per step instead)."""
    return tuple(i for i in self.trace.written if i not in self.per_step)

  def initial_written(self) -> list:
    return [jax.tree.map(strong_typed, self.values[i]) for i in self.written]

  def run(self, carried: list, dyn_leaves: list) -> tuple[list, list]:
    """Evaluate: ``(new written values, output leaves)``, carried values keeping their types."""
    new, out_leaves, _, _ = self.run_step(carried, dyn_leaves, ())
    return new, out_leaves

  def run_step(self, carried: list, dyn_leaves: list, slices: Sequence) -> tuple[list, list, list, list]:
    """``run`` with this step's values of the ``per_step`` Variables (slices, then fixed values);
    also returns their new values and the values of Variables the step created."""
    pos = {i: k for k, i in enumerate(self.written)}
    at = {i: k for k, i in enumerate(self.per_step)}
    states = [carried[pos[i]] if i in pos else slices[at[i]] if i in at else x for i, x in enumerate(self.values)]
    dyn = jax.tree.unflatten(self._dyn_def, list(dyn_leaves))
    trace = self._trace_for(abstract_states(self.disc, states), abstract_args(dyn))
    if trace.written != self.trace.written:
      raise ValueError(f'{self.name}: the body writes other Variables when traced again with new input types')
    outs, created, out_leaves = trace.run([states[i] for i in trace.states], dyn_leaves)
    self.last_trace = trace
    new = dict(zip(trace.written, outs))
    carried_out = [new[i] if i in self.restructured else self._keep_type(new[i], c, i)
                   for c, i in zip(carried, self.written)]
    slices_out = [self._keep_type(new[i], s, i) if i in new else s for s, i in zip(slices, self.per_step)]
    return carried_out, out_leaves, slices_out, created

  def run_readonly(self, values: list, dyn_leaves: list) -> list:
    """Output leaves for the given value of every discovered Variable (a body that writes nothing)."""
    dyn = jax.tree.unflatten(self._dyn_def, list(dyn_leaves))
    trace = self._trace_for(abstract_states(self.disc, values), abstract_args(dyn))
    return trace.run([values[i] for i in trace.states], dyn_leaves)[2]

  def _keep_type(self, new, old, i):
    inside, kept = ('inside a branch', 'Variables a branch writes') if self.name in _BRANCHING else (
      'inside the loop', 'loop-carried Variables')
    if jax.tree.structure(new) != jax.tree.structure(old):
      raise ValueError(
        f'{self.name}: {self.disc.describe(i)} changes its value\'s structure {inside}, '
        f'from {jax.tree.structure(old)} to {jax.tree.structure(new)} (e.g. Module.sow appending '
        f'per step); {kept} must keep it: return per-step values as outputs instead, or sow outside'
      )

    def one(n, o):
      if jnp.shape(n) != jnp.shape(o):
        raise ValueError(
          f'{self.name}: {self.disc.describe(i)} changes shape {inside}, '
          f'from {jnp.shape(o)} to {jnp.shape(n)}; {kept} must keep their shape'
        )
      if is_key(n):
        return n
      if jnp.result_type(n) != jnp.result_type(o) and not jax.typeof(n).weak_type:
        raise ValueError(
          f'{self.name}: {self.disc.describe(i)} changes dtype {inside}, from '
          f'{jnp.result_type(o)} to {jnp.result_type(n)}; {kept} must keep their '
          'dtype: cast the new value back, e.g. `v[...] = new.astype(v.dtype)`'
        )
      return jax.lax.convert_element_type(n, jnp.result_type(o))

    return jax.tree.map(one, new, old)

  def write_back(self, final: list, indices: Sequence[int] | None = None) -> None:
    """Write the loop's final values: of the carried Variables, or of those at ``indices``
    (stacked and fixed ones, or every branch's writes)."""
    write_values(self.disc, self.written if indices is None else list(indices), list(final))


def in_python() -> bool:
  """Under ``jax.disable_jit()`` with concrete values, loops run as Python loops (inside an
  outer trace, e.g. ``jax.vmap``, they stay JAX loops, as ``jax.lax``'s do)."""
  return jax.config.jax_disable_jit and _compat.at_top_level()


def all_or_nothing(f, args, loop: Callable):
  """Run a Python loop; if a step fails, every Variable it reaches gets its pre-call value."""
  disc = discover(f, args, {})
  before, contents = read_values(disc.variables), disc.snapshot()
  try:
    return loop()
  except BaseException:
    write_values(disc, range(len(before)), before)
    disc.restore(contents)
    raise
