"""Graph nodes in a traced function's return value.

A returned node that the call already knew (an input, or reachable from one)
comes back as the same Python object. A node created inside the call is
split, as ``nnx.split`` does, against the objects the call knew: its graph
definition holds references to them (a new ``Pair(backbone, head)`` refers
to the ``backbone`` argument) and its Variables' values leave the trace as
leaves (stacked, under ``vmap``). Each call merges the definition anew
against its own objects, sharing kept with what the call attached.

Example:
  >>> from flax import nnx
  >>> from brainnx._engine.discovery import discover
  >>> from brainnx._engine.outputs import split_output
  >>> from brainnx._engine.structure import GraphSplit
  >>> model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
  >>> disc = discover(lambda m: m, (model,), {})
  >>> spec, leaves = split_output((model, 1.0), disc, GraphSplit(disc))
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
from brainnx._engine.discovery import Discovery
from brainnx._engine.nodes import holds_graph_node, is_graph_node, is_plain_object
from brainnx._engine.structure import GraphSplit, KnownRefs


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
  """A static Python value, returned as it is."""

  value: Any
  n_leaves = 0


class New(NamedTuple):
  """A graph node created inside the call (or a created one returned again): merged per call
  from its graph definition, its references resolved to that call's objects."""

  graphdef: Any
  n_leaves: int  # array leaves, all Variables' values flattened
  leaf_vars: tuple  # (path, Variable stand-in) for each of the ``n_leaves`` leaves
  value_defs: tuple  # tree structure of each Variable's value (a dict, a tuple of sown values)


@dataclasses.dataclass(frozen=True, eq=False)
class OutSpec:
  """How to rebuild a return value from its array leaves: one slot per flattened position."""

  treedef: Any  # of the return value, graph nodes kept as leaves
  slots: tuple
  has_nodes: bool

  def rebuild(self, leaves: Sequence, disc: Discovery, index_ref: dict | None = None) -> Any:
    """The return value from its leaves; ``index_ref`` (shared with what the call attached)
    resolves references of created nodes."""
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
      else:
        if index_ref is None:
          index_ref = KnownRefs(disc)
        values = [jax.tree.unflatten(d, [next(it) for _ in range(d.num_leaves)]) for d in slot.value_defs]
        out.append(_compat.graph_unflatten(slot.graphdef, values, index_ref))
    return jax.tree.unflatten(self.treedef, out)

  def new_nodes(self) -> list:
    """The ``New`` slots, in output order."""
    return [s for s in self.slots if type(s) is New]


def _opaque(x) -> bool:
  """A plain object that is not a registered pytree: JAX cannot take it apart."""
  if not is_plain_object(x):
    return False
  children = jax.tree.leaves(x, is_leaf=lambda y: y is not x)
  return len(children) == 1 and children[0] is x


def _holds_traced(x, depth: int = 3) -> bool:
  if isinstance(x, _compat.Tracer) or is_graph_node(x):
    return True
  if depth == 0:
    return False
  if isinstance(x, (list, tuple)):
    return any(_holds_traced(v, depth - 1) for v in x)
  if isinstance(x, dict):
    return any(_holds_traced(v, depth - 1) for v in x.values())
  if is_plain_object(x):
    return any(_holds_traced(v, depth - 1) for v in _compat.attributes(x).values())
  return False


def is_output_leaf(x) -> bool:
  """How a return value is taken apart: graph nodes and opaque objects are its leaves."""
  return is_graph_node(x) or _opaque(x)


def split_output(out: Any, disc: Discovery, graph: GraphSplit, name: str = 'the call') -> tuple[OutSpec, list]:
  """``(spec, leaves)`` for a return value; created nodes are split with ``graph`` (shared with
  what the call attached)."""
  flat, treedef = jax.tree.flatten(out, is_leaf=is_output_leaf)
  slots, leaves, has_nodes = [], [], False
  for x in flat:
    if not is_graph_node(x):
      if isinstance(x, _TRACEABLE):
        slots.append(Leaf())
        leaves.append(x)
        continue
      if _opaque(x) and (holds_graph_node(x) or _holds_traced(x)):
        raise TypeError(
          f'{name} returns a {type(x).__name__} holding arrays or graph nodes, which is not a '
          'valid JAX type (jax.jit refuses it too): register it as a pytree '
          '(flax.struct.dataclass, jax.tree_util.register_dataclass), make it an nnx.Pytree, '
          'or return its contents'
        )
      slots.append(Obj(x))  # a string or other Python object: static, it leaves the trace as it is
      has_nodes = True
      continue
    has_nodes = True
    if isinstance(x, nnx.Variable) and disc.index_of(x) is not None:
      slots.append(Known(disc.index_of(x)))
    elif disc.node_index_of(x) is not None:
      slots.append(KnownNode(disc.node_index_of(x)))
    else:
      recipe, values, stand_ins, _, paths = graph.split(x, f'the {type(x).__name__} {name} returns')
      # a Variable may hold a pytree ({'k': x, 'j': y}, the tuple ``sow`` builds): its leaves
      # travel one by one, and each names the Variable that holds it
      value_defs, leaf_vars = [], []
      for value, path, var in zip(values, paths, stand_ins):
        flat_value, value_def = jax.tree.flatten(value)
        value_defs.append(value_def)
        leaf_vars.extend([(path, var)] * len(flat_value))
        leaves.extend(flat_value)
      slots.append(New(recipe.graphdef, len(leaf_vars), tuple(leaf_vars), tuple(value_defs)))
  return OutSpec(treedef, tuple(slots), has_nodes), leaves
