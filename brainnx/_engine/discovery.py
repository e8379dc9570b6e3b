"""From a callable and its arguments to the Variables it can touch.

Roots are the positional and keyword arguments, a bound method's ``self``,
``functools.partial`` arguments, default values, closure cells and the global
names the function's code loads (following helper functions the same way).
Each root is walked through NNX graph nodes (Modules, ``nnx.Pytree``s such as
``nnx.Rngs`` and ``nnx.Optimizer``, ``nnx.List``/``nnx.Dict``), ``nnx.State``,
dicts, lists, tuples, other pytrees, and the attributes of plain Python
objects (a ``Trainer`` or a dataclass holding a model). A Variable reached
twice is one Variable; its path is the first one found.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from brainnx._engine.discovery import discover
  >>> counter = nnx.Variable(jnp.zeros(()))
  >>> def bump():
  ...   counter[...] += 1
  >>> discover(bump, (), {}).paths
  (('counter',),)
"""

from __future__ import annotations

import dataclasses
import operator
import weakref
from typing import Any, Hashable

import jax
from flax import nnx

from brainnx import _compat
from brainnx._engine.guard import DATA, GRAPH, STATIC, Guard
from brainnx._engine.nodes import (ARRAY_TYPES, ATOM_TYPES, describe, holds_array, holds_graph_node, is_plain_object,
                                   is_reference, key_name, static_key)
from brainnx._engine.roots import Root, RootFinder, RootKind
from brainnx._engine.sentinels import MISSING


Path = tuple[Hashable, ...]


@dataclasses.dataclass(eq=False)
class Discovery:
  """The Variables a call can touch, with their paths and how they were found.

  ``containers`` are the mutable containers met on the way (attribute dicts
  of Modules and plain objects, dicts, lists): a call may add Variables to
  them, and a failed call has its changes to them rolled back.
  """

  variables: list  # nnx.Variables (and DataAttributes); a list: :meth:`follow` swaps entries in place
  paths: tuple[Path, ...]
  root_of: tuple[int, ...]  # per variable, index into ``roots``
  roots: tuple[Root, ...]
  node_refs: tuple[Any, ...]  # weak references to the Pytree graph nodes met on the way
  containers: tuple[Any, ...]
  streams: tuple[tuple[int, int], ...]  # (key index, count index) per RngStream
  aliases: tuple[tuple[int, Path, int], ...]  # (index, other path, its root) of shared Variables
  guard: Guard
  signature: Hashable  # structure + static attributes + captured names, for sharing traces
  plain: tuple = ()  # (source, position in the signature's captured part) of captured plain values
  container_paths: tuple = ()  # per container: the path it was reached at
  plain_objects: tuple = ()  # (signature position, attribute dict, its keys, its mask) per plain object
  names: tuple = ()  # the captured names the code loads: ('cell', cell, name) or ('global', namespace, name)
  shared: frozenset = frozenset()  # indices of the Variables reached at more than one place

  def __post_init__(self):
    self._index = {id(v): i for i, v in enumerate(self.variables)}
    self._node_index = {id(r()): i for i, r in enumerate(self.node_refs)}

  @property
  def nodes(self) -> tuple:
    """The graph nodes (held weakly, so a cached discovery does not keep a dropped model
    alive; they are alive while a call that reaches them runs)."""
    return tuple(r() for r in self.node_refs)

  def positions(self) -> dict:
    """``id(variable)`` -> its index, for the value lists warm calls keep (:meth:`follow`
    updates it and forgets every kept list)."""
    return self._index

  def index_of(self, variable) -> int | None:
    return self._index.get(id(variable))

  def node_index_of(self, node) -> int | None:
    return self._node_index.get(id(node))

  def describe(self, i: int) -> str:
    """How errors name the ``i``-th Variable (see :func:`describe`)."""
    return describe(self.paths[i], self.variables[i])

  def refresh_captured(self) -> bool:
    """Take in the plain values (no graph node inside) the captured names, and the static
    attributes of plain objects, hold now.

    Called after a traced call: a function that rebinds a captured counter while it is
    traced (``global n; n += 1``, ``self.steps += 1`` on a ``Trainer``) must not look changed
    to its next call, which would trace it again; only a value changed from outside does.
    Returns whether any changed.
    """
    structure, captured = self.signature
    captured = list(captured)
    changed = False
    for source, at in self.plain:
      obj = _source_value(source)
      if obj is MISSING:
        continue
      key = (captured[at][0], static_key(obj))
      if key != captured[at]:
        captured[at] = key
        self.guard.rebind(source, obj)
        changed = True
    statics_changed = False
    structure = list(structure)
    for at, container, keys, mask in self.plain_objects:
      if tuple(container) != keys:
        continue
      path, owner, relevant, statics = structure[at]
      now = tuple((k, static_key(v)) for (k, v), m in zip(container.items(), mask) if not m)
      if now != statics:
        structure[at] = (path, owner, relevant, now)
        statics_changed = True
    if statics_changed and self.guard.take_plain_statics():
      changed = True
    else:
      structure = self.signature[0]
    if changed:
      self.signature = (tuple(structure), tuple(captured))
    return changed

  def snapshot(self) -> list:
    """The contents of every container (and, last, the objects behind the captured names), for
    :meth:`restore` after a failed call."""
    return [dict(c) if isinstance(c, dict) else list(c) for c in self.containers] + [
      tuple(_source_value(source) for source in self.names)
    ]

  def unchanged_since(self, saved: list) -> bool:
    """Whether every container holds the very entries of :meth:`snapshot`'s ``saved``, and every
    captured name the same object."""
    if any(_source_value(source) is not obj for source, obj in zip(self.names, saved[-1])):
      return False
    for container, before in zip(self.containers, saved):
      if len(container) != len(before):
        return False
      now, then = (container.values(), before.values()) if isinstance(container, dict) else (container, before)
      if not all(map(operator.is_, now, then)):
        return False
    return True

  def follow(self, replaced: list) -> None:
    """Take in ``(index, new Variable)`` pairs a call put where known Variables of the same type
    and metadata were (``self.h = nnx.Intermediate(x)`` on every call), so the next call finds
    its plan instead of discovering the graph again; anything else that changed leaves the
    guard to see it: a Variable known already (``self.held = self.w``), or one put where a shared
    Variable was (its other places still hold the old one)."""
    if any(i in self.shared or id(new) in self._index for i, new in replaced):
      return
    try:
      if any(type(new) is not type(self.variables[i]) or
             _compat.metadata_of(new) != _compat.metadata_of(self.variables[i]) for i, new in replaced):
        return
    except Exception:  # metadata holding arrays: no single truth value
      return
    pairs = []
    for i, new in replaced:
      old = self.variables[i]
      pairs.append((old, new))
      del self._index[id(old)]
      self.variables[i] = new
      self._index[id(new)] = i
    _compat.values_written()  # kept value lists name the old Variables: forget them all
    self.guard.follow(pairs)

  def container_name(self, c: int) -> str:
    """How messages name the ``c``-th container (by the path it was reached at)."""
    path = self.container_paths[c] if c < len(self.container_paths) else None
    return f'the container at {tuple(path)!r}' if path is not None else 'a container the call reaches'

  def changes_since(self, saved: list) -> list:
    """The entries that add, replace or remove state since :meth:`snapshot`'s ``saved`` (what
    :meth:`restore` would undo): ``(container index, key, new entry or MISSING)``, or
    ``(container index, None, new items)`` for a list."""
    data = {}  # id(container) -> keys of its arrays that are known state (written, not attached)
    for v in self.variables:
      if isinstance(v, _compat.DataAttribute):
        data.setdefault(id(v.container), set()).add(v.key)
    changes = []
    for c, (container, before) in enumerate(zip(self.containers, saved)):
      keys = data.get(id(container), ())
      if isinstance(container, list):
        if _list_changed(container, before, keys):
          changes.append((c, None, list(container)))
        continue
      for key, value in _dict_changes(container, before, keys).items():
        changes.append((c, key, value))
    return changes

  def rebound_since(self, saved: list) -> list:
    """``(name index, object)`` of the captured names rebound to state (a graph node, or an
    object holding one) since :meth:`snapshot`'s ``saved``: lazy initialisation of a global."""
    return [(k, now) for k, (source, before) in enumerate(zip(self.names, saved[-1]))
            if (now := _source_value(source)) is not before and holds_graph_node(now)]

  def rebind(self, k: int, obj) -> None:
    """Bind the ``k``-th captured name to ``obj``."""
    source = self.names[k]
    if source[0] == 'cell':
      source[1].cell_contents = obj
    else:
      source[1][source[2]] = obj

  def restore(self, saved: list) -> None:
    """Undo the changes made since :meth:`snapshot` that add, replace or remove state (graph
    nodes, arrays); other Python side effects in the same containers stay."""
    for k, (source, before) in enumerate(zip(self.names, saved[-1])):
      now = _source_value(source)
      if now is not before and (holds_graph_node(now) or holds_graph_node(before)) and before is not MISSING:
        self.rebind(k, before)
    for container, before in zip(self.containers, saved):
      if isinstance(container, list):
        if _list_changed(container, before):
          container[:] = before
        continue
      undo = {key: before.get(key, MISSING) for key in _dict_changes(container, before)}
      if undo:
        _compat.restore_entries(container, undo, MISSING)


def _list_changed(container: list, before: list, data_keys=()) -> bool:
  """Whether a list gained, lost or swapped state (graph nodes, arrays) since ``before``; a new
  array at a position in ``data_keys`` (known state, written back) is no change."""
  if len(container) == len(before) and all(
    a is b or (k in data_keys and isinstance(a, ARRAY_TYPES)) for k, (a, b) in enumerate(zip(container, before))
  ):
    return False
  olds, news = {id(x): x for x in before}, {id(x): x for x in container}
  changed = [x for k, x in olds.items() if k not in news] + [x for k, x in news.items() if k not in olds]
  return any(map(_is_state, changed))


def _dict_changes(container: dict, before: dict, data_keys=()) -> dict:
  """``{key: new entry or MISSING}`` of a dict's entries that add, replace or remove state (a new
  array under a key in ``data_keys``, known state written back, is none); a flax node's own
  bookkeeping (``nnx.List``'s length, its node names) goes with its state."""
  changed = {}
  for key in container.keys() | before.keys():
    old, new = before.get(key, MISSING), container.get(key, MISSING)
    if old is not new and (_is_state(old) or _is_state(new)):
      if key in data_keys and isinstance(new, ARRAY_TYPES):
        continue
      changed[key] = new
  if changed and _compat.is_node_attributes(container):
    changed = {k: container.get(k, MISSING) for k in container.keys() | before.keys()
               if before.get(k, MISSING) is not container.get(k, MISSING)}
  return changed


def _source_value(source: tuple):
  if source[0] == 'cell':
    try:
      return source[1].cell_contents
    except ValueError:
      return MISSING
  return source[1].get(source[2], MISSING)


def _is_state(x) -> bool:
  """A container entry a call may not leave changed on error: a graph node, an array, or a
  list, tuple or dict holding arrays (``foo.a = [x * 2 for x in foo.a]``)."""
  return isinstance(x, ARRAY_TYPES) or holds_graph_node(x) or holds_array(x)


class _Walker:
  """Depth-first walk of graph nodes and containers, recording Variables."""

  def __init__(self):
    self.variables, self.paths, self.root_of = [], [], []
    self.nodes = []
    self.streams = []
    self.aliases = []  # (index, path, root): a Variable reached again from another root
    self.shared: set[int] = set()  # indices of Variables reached more than once, from any root
    self.containers = []  # guarded: they hold graph nodes
    self.counted = []  # per guarded container: a flax Pytree's attributes (edits counted)
    self.watched = []  # every mutable container met
    self.watched_paths = []
    self.metadata = []  # (Variable, a copy of its metadata), for the guard
    self.owners: tuple[set[int], set[int]] = (set(), set())  # ids of the guarded Pytrees, Variables
    self.plain_objects = []
    self.classes: dict = {}  # the types of the graph nodes and plain objects met, in order
    self.masks = []
    self.stateless = []  # (container, what is state in it): containers holding no state yet
    self.track_stateless = True  # False under an argument holding no graph node (array data)
    self.signature = []
    self._var_ids: dict[int, int] = {}
    self._seen: set[int] = set()
    self._relevant: set[int] = set()

  def walk(self, obj, path: Path, root: int) -> bool:
    """Walk ``obj``; True when it is or holds a graph node or Variable."""
    if isinstance(obj, ATOM_TYPES):
      return False
    if isinstance(obj, nnx.Variable):
      return self._variable(obj, path, root)
    key = id(obj)
    if key in self._seen:
      return key in self._relevant
    self._seen.add(key)
    if isinstance(obj, nnx.Pytree):
      self.classes[type(obj)] = None
      found = self._pytree(obj, path, root)
    elif isinstance(obj, nnx.State):
      found = self._items(obj.raw_mapping, list(obj.raw_mapping.items()), path, root, mutable=True)
    elif isinstance(obj, dict):
      found = self._items(obj, list(obj.items()), path, root, mutable=True)
    elif isinstance(obj, list):
      found = self._items(obj, list(enumerate(obj)), path, root, mutable=True)
    elif isinstance(obj, tuple):
      names = getattr(obj, '_fields', None)
      items = list(zip(names, obj)) if names else list(enumerate(obj))
      found = self._items(obj, items, path, root, mutable=False)
    elif is_plain_object(obj):
      self.classes[type(obj)] = None
      attrs = _compat.attributes(obj)
      found = self._items(attrs, list(attrs.items()), path, root, mutable=True, owner=type(obj))
    else:
      found = self._generic(obj, path, root)
    if found:
      self._relevant.add(key)
    return found

  def _data(self, container, key, path, root) -> int:
    """Register the array at ``container[key]`` (a data attribute) as state; its mask code."""
    self._record(_compat.DataAttribute(container, key), path, root)
    return DATA

  def _record(self, var, path, root) -> None:
    self._var_ids[id(var)] = len(self.variables)
    self.variables.append(var)
    self.paths.append(path)
    self.root_of.append(root)
    self.signature.append((path, type(var)))

  def _variable(self, var, path, root) -> bool:
    if id(var) in self._var_ids:
      i = self._var_ids[id(var)]
      if i >= 0 and root != self.root_of[i]:
        self.aliases.append((i, path, root))
      self.shared.add(i)
      return True
    if var.hijax or var.ref:
      raise TypeError(
        f'{describe(path, var)} was created with hijax=True or ref=True (flax\'s '
        'mutable-array Variables); brainnx transforms manage plain Variables only: create it '
        'with the defaults (hijax=False, ref=False)'
      )
    self._record(var, path, root)
    metadata = _compat.metadata_of(var)
    self.metadata.append((var, dict(metadata)))
    self.owners[1].add(id(var))
    self.signature.append(tuple((k, static_key(v)) for k, v in metadata.items()))
    return True

  def _pytree(self, node, path, root) -> bool:
    self.nodes.append(node)
    attrs = _compat.attributes(node)
    int_keys = _compat.pytree_has_int_keys(type(node))
    items = list(attrs.items())
    keyed = [(int(n) if int_keys and n.isdigit() else n, n, v) for n, v in items if not _compat.is_internal_attribute(n)]
    codes, statics = {}, []
    for child_key, name, value in sorted(keyed, key=lambda t: (type(t[0]).__name__, t[0])):  # nnx's order
      if isinstance(value, ARRAY_TYPES):  # an array attribute is state in nnx.split, as a Variable is
        codes[name] = self._data(attrs, name, path + (child_key,), root)
      elif isinstance(value, (list, dict)) and not isinstance(value, nnx.Pytree):
        codes[name] = GRAPH if self._data_container(value, path + (child_key,), root) else STATIC
      else:
        codes[name] = GRAPH if self.walk(value, path + (child_key,), root) else STATIC
      if codes[name] == STATIC:
        statics.append((name, static_key(value)))
    # flax's own bookkeeping (the node's trace state, which every nnx transform that merges the
    # node replaces) is not compared
    mask = [codes.get(name, DATA if _compat.is_internal_attribute(name) else STATIC) for name, _ in items]
    self.containers.append(attrs)
    self.counted.append(True)
    self.owners[0].add(id(node))
    self.watched.append(attrs)
    self.watched_paths.append(path)
    self.masks.append(mask)
    self.signature.append((path, type(node), tuple(statics)))
    if isinstance(node, nnx.RngStream):
      k, c = self._var_ids.get(id(node.key), -1), self._var_ids.get(id(node.count), -1)
      if k >= 0 and c >= 0:
        self.streams.append((k, c))
    return True

  def _items(self, container, items, path, root, *, mutable: bool, owner: type | None = None) -> bool:
    """A dict, list, tuple or plain object's attributes. Mutable ones are watched for Variables
    a call adds (even while they hold none); those holding graph nodes are also guarded."""
    mask = [self.walk(v, path + (k,), root) for k, v in items]
    relevant = tuple(k for (k, _), m in zip(items, mask) if m)
    if mutable:
      self.watched.append(container)
      self.watched_paths.append(path)
    if not relevant:
      if mutable and self.track_stateless and type(container) in (dict, list):
        self.stateless.append((container, holds_graph_node))  # an array here is data
      return False
    if mutable:
      self.containers.append(container)
      self.counted.append(False)
      self.masks.append(mask)
    if owner is not None:  # a plain object: its other attributes are static, like a Module's
      statics = tuple((k, static_key(v)) for (k, v), m in zip(items, mask) if not m)
      self.plain_objects.append((len(self.signature), container, tuple(k for k, _ in items), tuple(mask)))
      self.signature.append((path, owner, relevant, statics))
    else:
      self.signature.append((path, type(container), relevant))
    return True

  def _data_container(self, container, path, root) -> bool:
    """A list or dict held as a node's attribute: its arrays are data, like attributes."""
    key = id(container)
    if key in self._seen:
      return key in self._relevant
    self._seen.add(key)
    items = list(container.items()) if isinstance(container, dict) else list(enumerate(container))
    self.watched.append(container)
    self.watched_paths.append(path)
    mask = []
    for k, v in items:
      if isinstance(v, ARRAY_TYPES):
        mask.append(self._data(container, k, path + (k,), root))
      else:
        mask.append(GRAPH if self.walk(v, path + (k,), root) else STATIC)
    if not any(mask):
      if self.track_stateless:
        self.stateless.append((container, _is_state))  # a node's arrays are state
      return False
    self._relevant.add(key)
    self.containers.append(container)
    self.counted.append(False)
    self.masks.append(mask)
    self.signature.append((path, type(container), tuple(k for (k, _), m in zip(items, mask) if m)))
    return True

  def _generic(self, obj, path, root) -> bool:
    try:
      children, _ = jax.tree_util.tree_flatten_with_path(obj, is_leaf=lambda y: y is not obj)
    except Exception:
      return False
    if len(children) == 1 and children[0][1] is obj:
      return False
    found = False
    for key_path, child in children:
      found |= self.walk(child, path + tuple(key_name(k) for k in key_path), root)
    return found


# -- roots reached through a callable ----------------------------------------------


def discover(roots: Any, args: tuple, kwargs: dict) -> Discovery:
  """Every Variable a call of ``roots`` with ``(*args, **kwargs)`` can reach, in discovery order.

  ``roots`` is the function called, or a sequence of what the call runs and reads (the branches
  of a ``switch``, a transform object and the Modules it differentiates). Arguments come first
  (positional by index, then keywords by name), then what the roots capture. Raises
  ``TypeError`` naming a Variable created with ``hijax=True`` or ``ref=True``.
  """
  walker = _Walker()
  finder = RootFinder(walker)
  for i, a in enumerate(args):
    finder.roots.append(Root(i, RootKind.ARG))
    walker.track_stateless = is_reference(a) or holds_graph_node(a)
    walker.walk(a, (i,), len(finder.roots) - 1)
  for k, a in kwargs.items():
    finder.roots.append(Root(k, RootKind.KWARG))
    walker.track_stateless = is_reference(a) or holds_graph_node(a)
    walker.walk(a, (k,), len(finder.roots) - 1)
  walker.track_stateless = True
  finder.explore(roots)
  finder.explore_classes(walker.classes)
  return Discovery(
    variables=list(walker.variables),
    paths=tuple(walker.paths),
    root_of=tuple(walker.root_of),
    roots=tuple(finder.roots),
    node_refs=tuple(map(weakref.ref, walker.nodes)),
    containers=tuple(walker.watched),
    streams=tuple(walker.streams),
    aliases=tuple(walker.aliases),
    shared=frozenset(walker.shared),
    guard=Guard([c[:2] for c in finder.cells], finder.globals, walker.containers, walker.masks, walker.counted,
                walker.metadata, walker.owners, walker.stateless),
    signature=(tuple(walker.signature), tuple(finder.captured)),
    plain=tuple(finder.plain),
    container_paths=tuple(walker.watched_paths),
    plain_objects=tuple(walker.plain_objects),
    names=tuple(('cell', cell, name) for cell, _, name in finder.cells) + tuple(
      ('global', ns, name) for ns, name, _ in finder.globals),
  )
