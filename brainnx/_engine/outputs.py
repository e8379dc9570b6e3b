"""Graph nodes in a traced function's return value.

A returned node that the call already knew (an input, or reachable from one)
comes back as the same Python object. A node created inside the call is
split into its graph definition and array leaves, so the leaves can leave
the trace (stacked, under ``vmap``) and be merged into a fresh module.

Example:
  >>> from flax import nnx
  >>> from brainnx._engine.discovery import discover
  >>> from brainnx._engine.outputs import split_output
  >>> model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
  >>> disc = discover(lambda m: m, (model,), {})
  >>> spec, leaves = split_output((model, 1.0), disc)
  >>> spec.rebuild(leaves, disc)[0] is model
  True
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Sequence

import jax
import numpy as np
from flax import nnx

from brainnx import _compat
from brainnx._engine.discovery import Discovery, is_graph_node, is_reference

__all__ = ['Leaf', 'Known', 'KnownNode', 'New', 'Obj', 'OutSpec', 'Same', 'split_output']

# Output leaves that travel as arrays; anything else is returned as a static Python value.
_TRACEABLE = (jax.Array, np.ndarray, np.generic, int, float, complex, bool, _compat.Tracer, jax.ShapeDtypeStruct)


class Leaf(NamedTuple):
  """An array leaf: one output leaf of the traced function."""

  n_leaves = 1


class Known(NamedTuple):
  """A Variable the call already knew: returned as the same object."""

  index: int  # into the discovery's Variables
  n_leaves = 0


class KnownNode(NamedTuple):
  """A graph node the call already knew: returned as the same object."""

  index: int  # into the discovery's nodes
  n_leaves = 0


class Obj(NamedTuple):
  """A static Python value (or a node left attached inside), returned as it is."""

  value: Any
  n_leaves = 0


class New(NamedTuple):
  """A graph node created inside the call: rebuilt by ``nnx.merge`` from its state's leaves."""

  graphdef: Any
  state_def: Any
  n_leaves: int
  leaf_vars: tuple  # (path, Variable stand-in) for each of the ``n_leaves`` leaves


class Same(NamedTuple):
  """A node returned again: the object built for output position ``first``."""

  first: int
  n_leaves = 0


@dataclasses.dataclass(frozen=True, eq=False)
class OutSpec:
  """How to rebuild a return value from its array leaves: one slot per flattened position."""

  treedef: Any  # of the return value, graph nodes kept as leaves
  slots: tuple
  has_nodes: bool

  def rebuild(self, leaves: Sequence, disc: Discovery) -> Any:
    if not self.has_nodes:
      return jax.tree.unflatten(self.treedef, leaves)
    it = iter(leaves)
    out = []
    for slot in self.slots:
      kind = type(slot)
      if kind is Leaf:
        out.append(next(it))
      elif kind is Known:
        out.append(disc.variables[slot.index])
      elif kind is KnownNode:
        out.append(disc.node_refs[slot.index]())
      elif kind is Obj:
        out.append(slot.value)
      elif kind is Same:
        out.append(out[slot.first])
      else:
        state = jax.tree.unflatten(slot.state_def, [next(it) for _ in range(slot.n_leaves)])
        out.append(nnx.merge(slot.graphdef, state))
    return jax.tree.unflatten(self.treedef, out)

  def new_nodes(self) -> list:
    """The ``New`` slots, in output order."""
    return [s for s in self.slots if type(s) is New]


def _stand_in(v):
  """``v`` with shapes for values: filters can match it, and it holds no tracer."""
  shapes = lambda x: jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), x)  # noqa: E731
  return v.replace(shapes(v.get_value())) if isinstance(v, nnx.Variable) else shapes(v)


def split_output(out: Any, disc: Discovery, attached: Sequence = ()) -> tuple[OutSpec, list]:
  """``(spec, leaves)`` for a return value; ``attached`` are new nodes kept as is."""
  flat, treedef = jax.tree.flatten(out, is_leaf=is_reference)
  attached_ids = {id(x) for x in attached}
  slots, leaves, has_nodes = [], [], False
  seen: dict[int, int] = {}  # id of a node created inside -> its first output position
  for x in flat:
    if not is_reference(x):
      if isinstance(x, _TRACEABLE):
        slots.append(Leaf())
        leaves.append(x)
      else:  # a string or other Python object: static, it leaves the trace as it is
        slots.append(Obj(x))
        has_nodes = True
      continue
    has_nodes = True
    if not is_graph_node(x):  # a plain object holding graph nodes: returned as it is
      slots.append(Obj(x))
    elif isinstance(x, nnx.Variable) and disc.index_of(x) is not None:
      slots.append(Known(disc.index_of(x)))
    elif disc.node_index_of(x) is not None:
      slots.append(KnownNode(disc.node_index_of(x)))
    elif id(x) in attached_ids:
      slots.append(Obj(x))
    elif id(x) in seen:
      slots.append(Same(seen[id(x)]))
    else:
      seen[id(x)] = len(slots)
      graphdef, state = nnx.split(x)
      state_leaves, state_def = jax.tree.flatten(state)
      flat_state = nnx.to_flat_state(state) if isinstance(state, nnx.State) else [((), state)]
      leaf_vars = tuple(
        (path, _stand_in(v)) for path, v in flat_state for _ in jax.tree.leaves(v.get_value() if isinstance(v, nnx.Variable) else v)
      )
      slots.append(New(graphdef, state_def, len(state_leaves), leaf_vars))
      leaves.extend(state_leaves)
  return OutSpec(treedef, tuple(slots), has_nodes), leaves
