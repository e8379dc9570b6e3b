"""The state step: run a user function against Variables, and read and write their values.

:func:`state_step` is the one place a user function runs against the
Variables it reaches: swap values into them, call, collect what it wrote and
the Variables it created, restore. Values are read and written here under
one rule: no brainnx call sees another thread's tracers or half of its
write-back (:func:`read_values`, :func:`set_values`).

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from brainnx._engine.arguments import CallArgs
  >>> from brainnx._engine.discovery import discover
  >>> from brainnx._engine.state import state_step
  >>> count = nnx.Variable(jnp.array(0))
  >>> def f():
  ...   count[...] += 1
  >>> step = state_step(f, discover(f, (), {}), CallArgs.split((), {}), [jnp.array(5)], ())
  >>> step.written, int(step.values[0]), int(count[...])
  ((0,), 6, 0)
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Hashable, NamedTuple, Sequence

import jax
import numpy as np

from brainnx import _compat
from brainnx._engine.arguments import CallArgs
from brainnx._engine.discovery import Discovery
from brainnx._engine.filters import note_whole_stacks
from brainnx._engine.outputs import OutSpec, split_output
from brainnx._engine.structure import NO_ATTACHMENTS, Attachments, GraphSplit, KnownRefs


#: Held while Variables hold tracers and while values are written back, so that no brainnx
#: call in one thread sees another thread's tracers (warm reads take it only when
#: ``STATE_CHANGES`` says a change is under way: see :func:`read_values`); flax's writes from
#: other threads wait for it.
TRACE_LOCK = _compat.TRACE_LOCK
STATE_CHANGES = _compat.STATE_CHANGES


def read_values(variables: Sequence) -> list:
  """Every Variable's value: never another thread's tracer, nor half of its write-back."""
  changes, begun = STATE_CHANGES, STATE_CHANGES.begun
  if not changes.under_way:
    values = list(map(_compat.raw_value, variables))
    if changes.begun == begun:
      return values
  with TRACE_LOCK:
    return list(map(_compat.raw_value, variables))


def set_values(variables: Sequence, values) -> None:
  """Store concrete ``values`` in ``variables`` as one change (see ``STATE_CHANGES``)."""
  with TRACE_LOCK:
    STATE_CHANGES.under_way += 1  # inline: a write-back of a warm call takes this path
    STATE_CHANGES.begun += 1
    try:
      _compat.set_raw_values(variables, values)
    finally:
      STATE_CHANGES.under_way -= 1


# -- the state step -----------------------------------------------------------------


@contextlib.contextmanager
def swapped(disc: Discovery, values: Sequence):
  """Let every discovered Variable hold ``values[i]`` (writable here) inside the block, which
  receives the containers' contents as they were before it (``disc.snapshot()``).

  On exit every Variable gets its pre-call value and trace level back, and
  every graph node its trace level; entries the block added to, replaced in
  or removed from the discovered containers (Module and plain-object
  attributes, dicts, lists) are rolled back: what a call attaches is
  recorded inside the block and rebuilt per call (:mod:`structure`).
  """
  variables, nodes = disc.variables, disc.nodes
  with TRACE_LOCK:
    old_values = [_compat.raw_value(v) for v in variables]
    old_levels = [_compat.get_node_trace_state(x) for x in variables]
    old_node_levels = [_compat.get_node_trace_state(n) for n in nodes]
    contents = disc.snapshot()
    level = _compat.new_trace_state()
    STATE_CHANGES.under_way += 1  # inline: a write-back of a warm call takes this path
    STATE_CHANGES.begun += 1
    try:
      _compat.set_raw_values(variables, values)  # one counted write for the whole swap
      for v in variables:
        _compat.set_node_trace_state(v, level)
      for n in nodes:
        _compat.set_node_trace_state(n, level)
      yield contents
    finally:
      disc.restore(contents)
      _compat.set_raw_values(variables, old_values)
      for v, lv in zip(variables, old_levels):
        _compat.set_node_trace_state(v, lv)
      for n, lv in zip(nodes, old_node_levels):
        _compat.set_node_trace_state(n, lv)
      STATE_CHANGES.under_way -= 1


@dataclasses.dataclass(frozen=True, eq=False)
class StepResult:
  """What one call did to the state, read inside the trace that ran it.

  ``values`` holds every discovered Variable's value after the call (tracers
  of the enclosing trace); ``written`` the indices of those that changed.
  ``attachments`` records what the call attached to (or removed from) the
  containers it reached, against its discovery; ``new_values`` are the
  values of the Variables it attached (:func:`finish_call` builds them per
  call). ``graph`` splits what it created, shared with its output.
  """

  out: Any
  values: list
  written: tuple[int, ...]
  attachments: Attachments
  new_values: list
  graph: GraphSplit

  @property
  def new_vars(self) -> tuple:
    """Stand-ins (shapes, no tracers) of the Variables the call attached: what filters see."""
    return self.attachments.stand_ins

  def written_values(self) -> list:
    return [self.values[i] for i in self.written]

  def split_out(self, disc: Discovery, name: str = 'the call') -> tuple[OutSpec, list]:
    """The return value as a rebuild spec and its array leaves (computed once)."""
    split = getattr(self, '_split', None)
    if split is None:
      split = split_output(self.out, disc, self.graph, name)
      object.__setattr__(self, '_split', split)
    return split

  def shape(self) -> 'StepShape':
    """The part of the result without tracers, safe to keep once the trace ends."""
    written_defs = tuple(jax.tree.structure(self.values[i]) for i in self.written)
    return StepShape(self.written, written_defs, self.attachments)


class StepShape(NamedTuple):
  """What a step did, without its traced values."""

  written: tuple[int, ...]
  written_defs: tuple  # tree structure of each written value (a write may change it: ``sow``)
  attachments: Attachments


def _is_container_value(x) -> bool:
  return isinstance(x, (dict, list))


def state_step(fun: Callable, disc: Discovery, call: CallArgs, state_values: Sequence, dyn: Sequence) -> StepResult:
  """Swap ``state_values`` in, call ``fun`` on ``call`` with ``dyn``, collect, restore.

  This is the one place a transform runs a user function against the
  Variables; ``jit``, ``grad``, the mapped body and the loop bodies all
  call it inside their own trace. A write is a new value, or an edit
  inside a dict or list value (``v['k'] = x``, what ``sow`` does to
  ``nnx.capture``'s buffers).
  """
  inside = [(i, jax.tree.structure(x), jax.tree.leaves(x)) for i, x in enumerate(state_values) if _is_container_value(x)]
  with swapped(disc, state_values) as before:
    edits = _compat.PYTREE_EDITS.n
    args, kwargs = call.rebuild(dyn, call.refs)
    try:
      out = fun(*args, **kwargs)
    except (TypeError, ValueError) as error:  # a shape error may come from a stack used whole
      note_whole_stacks(error, disc)
      raise
    now = [_compat.raw_value(v) for v in disc.variables]
    graph = GraphSplit(disc)
    if _compat.PYTREE_EDITS.n == edits and disc.unchanged_since(before):
      attachments, new_values = NO_ATTACHMENTS, []  # nothing was attached anywhere
    else:
      attachments, new_values = graph.attachments(disc.changes_since(before), disc.rebound_since(before))
  written = {i for i, (a, b) in enumerate(zip(now, state_values)) if a is not b}
  for i, structure, leaves in inside:
    if i not in written and (jax.tree.structure(now[i]) != structure or any(
        a is not b for a, b in zip(jax.tree.leaves(now[i]), leaves))):
      written.add(i)
  return StepResult(out, now, tuple(sorted(written)), attachments, new_values, graph)


def finish_call(disc: Discovery, attachments: Attachments, new_values: Sequence, out_spec: OutSpec,
                out_leaves: Sequence, *, attach: bool = True) -> tuple[Any, list]:
  """``(output, attached Variables)``: what a call attached built and attached anew for this
  call's objects, and its output rebuilt, sharing one set of references (``nnx.merge``)."""
  index_ref = KnownRefs(disc) if attachments or out_spec.has_nodes else None
  attached = attachments.apply(disc, new_values, index_ref, attach=attach) if attachments else []
  return out_spec.rebuild(out_leaves, disc, index_ref), attached


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
  set_values([variables[i] for i in indices], values)


def _holds_tracer(x) -> bool:
  return any(isinstance(leaf, _compat.Tracer) for leaf in jax.tree.leaves(x))


# -- abstract values ---------------------------------------------------------------

_ARRAY_LIKE = (jax.Array, np.ndarray, np.generic, int, float, complex, bool, jax.ShapeDtypeStruct)


def abstract(x) -> jax.ShapeDtypeStruct:
  """A ``ShapeDtypeStruct`` for an array-like, keeping JAX's weak type (Python scalars)."""
  if isinstance(x, jax.ShapeDtypeStruct):
    return x
  aval = jax.typeof(x)
  sharding = getattr(aval, 'sharding', None)
  extra = {}
  # on a mesh with explicit or manual axes the sharding is part of the type; on Auto axes only
  # (jax.pmap's own mesh, a jit's output) it changes nothing a trace produces
  if sharding is not None and not sharding.mesh.empty and any(
      t != jax.sharding.AxisType.Auto for t in sharding.mesh.axis_types):
    extra['sharding'] = sharding
  return _compat.shape_dtype_struct(aval, manual=_compat.manual_axes(aval), **extra)  # manual: inside shard_map


def abstract_tree(value, where: Callable[[], str]):
  for leaf in jax.tree.leaves(value):
    if not isinstance(leaf, _ARRAY_LIKE) and not isinstance(leaf, _compat.Tracer):
      raise TypeError(
        f'{where()} holds a {type(leaf).__name__} ({leaf!r:.60}), not an array: brainnx traces '
        'Variable values and dynamic arguments as JAX arrays. Store arrays in Variables; pass '
        'other values as static arguments (static_argnums/static_argnames) or module attributes'
      )
  return jax.tree.map(abstract, value)


def abstract_states(disc: Discovery, values: Sequence) -> list:
  """Abstract values of every discovered Variable; a non-array value → ``TypeError`` naming it."""
  return [abstract_tree(x, lambda i=i: disc.describe(i)) for i, x in enumerate(values)]


def abstract_args(dyn: Sequence) -> list:
  """Abstract values of a call's dynamic arguments."""
  return [abstract_tree(x, lambda k=k: f'dynamic argument {k}') for k, x in enumerate(dyn)]


def aval_key(avals) -> Hashable:
  leaves, treedef = jax.tree.flatten(avals)
  manual = _compat.aval_manual_key
  return treedef, tuple((a.shape, a.dtype, a.weak_type, a.sharding, manual(a)) for a in leaves)
