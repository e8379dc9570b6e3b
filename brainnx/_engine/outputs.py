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
from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx

from brainnx import _compat
from brainnx._engine.discovery import Discovery, is_graph_node, is_reference

__all__ = ['OutSpec', 'split_output']

# Output leaves that travel as arrays; anything else is returned as a static Python value.
_TRACEABLE = (jax.Array, np.ndarray, np.generic, int, float, complex, bool, _compat.Tracer, jax.ShapeDtypeStruct)


@dataclasses.dataclass(frozen=True, eq=False)
class OutSpec:
  """How to rebuild a return value from its array leaves."""

  treedef: Any  # of the return value, graph nodes kept as leaves
  # per leaf: ('leaf',) | ('var', i) | ('node', i) | ('obj', x) | ('new', graphdef, treedef, n, leaf_vars)
  # where ``leaf_vars`` gives ``(path, Variable)`` for each of a new node's ``n`` leaves
  slots: tuple[tuple, ...]
  has_nodes: bool

  def rebuild(self, leaves: Sequence, disc: Discovery) -> Any:
    if not self.has_nodes:
      return jax.tree.unflatten(self.treedef, leaves)
    it = iter(leaves)
    out = []
    for slot in self.slots:
      kind = slot[0]
      if kind == 'leaf':
        out.append(next(it))
      elif kind == 'var':
        out.append(disc.variables[slot[1]])
      elif kind == 'node':
        out.append(disc.node_refs[slot[1]]())
      elif kind == 'obj':
        out.append(slot[1])
      else:
        _, graphdef, state_def, n, _ = slot
        state = jax.tree.unflatten(state_def, [next(it) for _ in range(n)])
        out.append(nnx.merge(graphdef, state))
    return jax.tree.unflatten(self.treedef, out)


def _stand_in(v):
  """``v`` with shapes for values: filters can match it, and it holds no tracer."""
  shapes = lambda x: jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), x)  # noqa: E731
  return v.replace(shapes(v.get_value())) if isinstance(v, nnx.Variable) else shapes(v)


def split_output(out: Any, disc: Discovery, attached: Sequence = ()) -> tuple[OutSpec, list]:
  """``(spec, leaves)`` for a return value; ``attached`` are new nodes kept as is."""
  flat, treedef = jax.tree.flatten(out, is_leaf=is_reference)
  attached_ids = {id(x) for x in attached}
  slots, leaves, has_nodes = [], [], False
  for x in flat:
    if not is_reference(x):
      if isinstance(x, _TRACEABLE):
        slots.append(('leaf',))
        leaves.append(x)
      else:  # a string or other Python object: static, it leaves the trace as it is
        slots.append(('obj', x))
        has_nodes = True
      continue
    has_nodes = True
    if not is_graph_node(x):  # a plain object holding graph nodes: returned as it is
      slots.append(('obj', x))
    elif isinstance(x, nnx.Variable) and disc.index_of(x) is not None:
      slots.append(('var', disc.index_of(x)))
    elif disc.node_index_of(x) is not None:
      slots.append(('node', disc.node_index_of(x)))
    elif id(x) in attached_ids:
      slots.append(('obj', x))
    else:
      graphdef, state = nnx.split(x)
      state_leaves, state_def = jax.tree.flatten(state)
      flat_state = nnx.to_flat_state(state) if isinstance(state, nnx.State) else [((), state)]
      leaf_vars = tuple(
        (path, _stand_in(v)) for path, v in flat_state for _ in jax.tree.leaves(v.get_value() if isinstance(v, nnx.Variable) else v)
      )
      slots.append(('new', graphdef, state_def, len(state_leaves), leaf_vars))
      leaves.extend(state_leaves)
  return OutSpec(treedef, tuple(slots), has_nodes), leaves
