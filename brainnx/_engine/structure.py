"""What a call does to the object graph, recorded once and rebuilt on every call.

A traced call may attach new state to the objects it reaches (``self.h =
nnx.Intermediate(x)``, ``m.head = nnx.Linear(...)``, ``self.sow(...)``) and
return new graph nodes that hold old ones (``Pair(backbone, head)``). Both are
recorded against the call's discovery, the way ``nnx.split`` records a graph:
objects the call already knew become references to their discovery index,
new ones become a graph definition plus the values of their Variables. The
trace itself leaves nothing attached. After every call, ``state.finish_call``
merges the definitions against *that* call's objects (``nnx.merge`` with its
known objects as references): each call gets fresh Variables of its own,
attached where the function put them, and sharing between what it attached
and what it returned is kept.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from brainnx._engine.discovery import discover
  >>> from brainnx._engine.structure import GraphSplit, KnownRefs
  >>> m = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
  >>> disc = discover(lambda m: m, (m,), {})
  >>> before = disc.snapshot()
  >>> m.extra = nnx.Param(jnp.ones(2))
  >>> graph = GraphSplit(disc)
  >>> attached, values = graph.attachments(disc.changes_since(before))
  >>> disc.restore(before); hasattr(m, 'extra')
  False
  >>> _ = attached.apply(disc, [values[0] * 3], KnownRefs(disc))
  >>> m.extra[...].tolist()
  [3.0, 3.0]
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Sequence

import jax
import numpy as np
from flax import nnx

from brainnx import _compat
from brainnx._engine.discovery import Discovery
from brainnx._engine.nodes import holds_array, holds_graph_node, is_graph_node
from brainnx._engine.sentinels import MISSING


_ARRAYS = (jax.Array, np.ndarray, _compat.Tracer)


class Fresh(NamedTuple):
  """A value built anew per call from a graph definition (references resolve to known objects)."""

  graphdef: Any
  n_leaves: int


class Static(NamedTuple):
  """A plain Python value the call put in a container (flax's own bookkeeping, a list's ints)."""

  value: Any


class Gone(NamedTuple):
  """An entry the call removed."""


def stand_in(v):
  """``v`` with shapes for values: what filters see of a created Variable (holds no tracer)."""
  shapes = lambda x: jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), x)  # noqa: E731
  if isinstance(v, nnx.Variable):
    return v.replace(shapes(v.get_raw_value()))
  return _compat.DataAttribute({'value': shapes(v)}, 'value')


def known_objects(disc: Discovery) -> list:
  """The objects a call knew, by graph index: its Variables, then its graph nodes."""
  return [v if isinstance(v, nnx.Variable) else None for v in disc.variables] + list(disc.nodes)


class KnownRefs(dict):
  """``index_ref`` for one call: graph index → that call's object (known ones looked up on use)."""

  def __init__(self, disc: Discovery):
    super().__init__()
    self._disc, self._n_vars = disc, len(disc.variables)

  def __missing__(self, k):
    if not isinstance(k, int) or k < 0:
      raise KeyError(k)
    if k < self._n_vars:
      obj = self._disc.variables[k]
    elif k - self._n_vars < len(self._disc.node_refs):
      obj = self._disc.node_refs[k - self._n_vars]()
    else:
      raise KeyError(k)
    self[k] = obj
    return obj


@dataclasses.dataclass(frozen=True, eq=False)
class Attachments:
  """Entries a call put into (or removed from) the containers it reached.

  ``edits`` holds ``(container index, key, recipe)``, and for a list
  ``(container index, None, recipes of its items)``. The created
  Variables' values leave the trace as leaves, one per Variable (or array
  attribute), in edit order; ``stand_ins`` and ``defs`` describe them.
  """

  edits: tuple = ()
  bindings: tuple = ()  # (captured name index, recipe): a global or closure name the call bound
  stand_ins: tuple = ()  # per leaf: a Variable (or DataAttribute) holding shapes
  var_index: tuple = ()  # per leaf: the graph index of its Variable (None: an array attribute)
  defs: tuple = ()  # per leaf: the tree structure of its value

  def __bool__(self) -> bool:
    return bool(self.edits or self.bindings)

  def apply(self, disc: Discovery, values: Sequence, index_ref: dict, attach: bool = True) -> list:
    """Build this call's objects (into ``index_ref``) and, with ``attach``, put them in ``disc``'s
    containers; returns the Variable holding each leaf (``None`` for an array attribute)."""
    it = iter(values)
    built = []
    for c, key, recipe in self.edits:
      if key is None:
        built.append((c, None, [_build(r, it, index_ref) for r in recipe]))
      else:
        built.append((c, key, _build(recipe, it, index_ref)))
    bound = [(k, _build(recipe, it, index_ref)) for k, recipe in self.bindings]
    if attach:
      replaced = [] if not bound else None  # known Variables replaced in place, one for one
      for c, key, value in built:
        container = disc.containers[c]
        if key is None:
          container[:] = value
          replaced = None
          continue
        old = container.get(key, MISSING)
        i = disc.index_of(old) if isinstance(old, nnx.Variable) and isinstance(value, nnx.Variable) else None
        if i is None:  # an entry added, or something other than a Variable replaced
          replaced = None
        elif replaced is not None:
          replaced.append((i, value))
        _compat.restore_entries(container, {key: value}, MISSING)
      for k, value in bound:
        disc.rebind(k, value)
      if replaced:
        disc.follow(replaced)
    return [None if k is None else index_ref[k] for k in self.var_index]


NO_ATTACHMENTS = Attachments()


def _build(recipe, leaves, index_ref):
  kind = type(recipe)
  if kind is Fresh:
    return _compat.graph_unflatten(recipe.graphdef, [next(leaves) for _ in range(recipe.n_leaves)], index_ref)
  if kind is Static:
    return recipe.value
  return MISSING


class GraphSplit:
  """Splits what one traced call created against the objects its discovery knows; one per
  trace, shared by what the call attached and what it returned (so sharing is kept)."""

  def __init__(self, disc: Discovery):
    self.disc = disc
    self._ref_map = None

  @property
  def ref_map(self):
    if self._ref_map is None:
      self._ref_map = _compat.known_ref_map(known_objects(self.disc))
    return self._ref_map

  def split(self, x, where: str) -> tuple[Fresh, list, list, list, list]:
    """``(recipe, values, stand-ins, Variable graph indices, paths)`` of one new value."""
    graphdef, paths, leaves = _compat.graph_flatten(x, self.ref_map)
    values, stand_ins, var_index = [], [], []
    for path, leaf in zip(paths, leaves):
      if isinstance(leaf, nnx.Variable):
        values.append(leaf.get_raw_value())
        var_index.append(self.ref_map[leaf])
      elif isinstance(leaf, _ARRAYS):
        values.append(leaf)
        var_index.append(None)
      else:
        raise TypeError(
          f'{where} holds a {type(leaf).__name__} at {tuple(path)!r} that is neither an array nor an '
          'NNX graph node: brainnx rebuilds what a call creates as nnx.merge does; hold it in an '
          'nnx.Module, an nnx.Pytree or a registered pytree'
        )
      stand_ins.append(stand_in(leaf))
    return Fresh(graphdef, len(values)), values, stand_ins, var_index, [tuple(p) for p in paths]

  def entry(self, value, where: str, acc: list):
    """The recipe of one container entry; its leaves go to ``acc``."""
    if value is MISSING:
      return Gone()
    if is_graph_node(value) or isinstance(value, _ARRAYS) or holds_graph_node(value) or holds_array(value):
      recipe, values, stand_ins, var_index, _ = self.split(value, where)
      acc.append((values, stand_ins, var_index))
      return recipe
    return Static(value)

  def attachments(self, changes: Sequence, rebound: Sequence = ()) -> tuple[Attachments, list]:
    """The recipe of ``disc.changes_since(...)``'s changes and ``disc.rebound_since(...)``'s
    bindings, and the values of their leaves."""
    acc: list = []
    edits = []
    for c, key, value in changes:
      where = f'what the call attached to {self.disc.container_name(c)}'
      if key is None:
        edits.append((c, None, tuple(self.entry(v, where, acc) for v in value)))
      else:
        edits.append((c, key, self.entry(value, f'{where}[{key!r}]', acc)))
    bindings = tuple((k, self.entry(obj, f'what the call bound to {self.disc.names[k][2]!r}', acc)) for k, obj in rebound)
    values = [v for vals, _, _ in acc for v in vals]
    return Attachments(
      edits=tuple(edits),
      bindings=bindings,
      stand_ins=tuple(s for _, ss, _ in acc for s in ss),
      var_index=tuple(k for _, _, ks in acc for k in ks),
      defs=tuple(jax.tree.structure(v) for v in values),
    ), values
