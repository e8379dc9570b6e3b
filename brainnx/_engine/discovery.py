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
import dis
import enum
import functools
import importlib.util
import inspect
import itertools
import operator
import os
import sys
import types
import weakref
from typing import Any, Callable, Hashable

import jax
import numpy as np
from flax import nnx

from brainnx import _compat

__all__ = [
  'MISSING', 'Discovery', 'Guard', 'describe', 'discover', 'holds_graph_node', 'is_graph_node', 'is_plain_object',
  'is_reference',
  'key_name', 'static_key',
]

Path = tuple[Hashable, ...]

# Objects that can never hold a Variable: skipped without a look inside.
_ATOMS = (
  jax.Array, np.ndarray, np.generic, int, float, complex, bool, str, bytes,
  type(None), type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
  types.MethodType, functools.partial, np.dtype, range, type(Ellipsis),
)

# Array values held by graph nodes: state, as ``nnx.split`` sees them.
_ARRAYS = (jax.Array, np.ndarray, _compat.Tracer)

# Packages whose objects are never entered as plain objects (their state is not the user's).
_LIBRARY_PACKAGES = frozenset({
  'jax', 'jaxlib', 'flax', 'numpy', 'optax', 'tqdm', 'chex', 'matplotlib', 'orbax', 'brainnx',
  'equinox', 'brainstate', 'ml_dtypes', 'IPython', 'ipykernel', 'pytest', '_pytest', 'hypothesis',
}) | (frozenset(sys.stdlib_module_names) - {'types', 'argparse'})  # SimpleNamespace, Namespace are plain


def _library_dirs() -> tuple[str, ...]:
  dirs = []
  for name in ('jax', 'jaxlib', 'flax', 'numpy', 'optax', 'tqdm', 'chex', 'matplotlib'):
    spec = importlib.util.find_spec(name)
    if spec is not None and spec.submodule_search_locations:
      dirs.extend(os.path.join(p, '') for p in spec.submodule_search_locations)
  here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  dirs.append(os.path.join(here, '_'))  # brainnx's own private modules (_compat, _engine/, _transforms/)
  dirs.append(os.path.join(here, '__init__'))
  return tuple(dirs)


# Functions defined in these files are not searched for captured Variables.
LIBRARY_DIRS = _library_dirs()


def is_graph_node(x: Any) -> bool:
  """True for a Variable or an NNX Pytree (Module, Rngs, Optimizer, List, ...)."""
  return isinstance(x, (nnx.Variable, nnx.Pytree))


@functools.lru_cache(maxsize=1024)
def _is_plain_type(cls: type) -> bool:
  if cls.__module__.partition('.')[0] in _LIBRARY_PACKAGES:
    return False
  if issubclass(cls, (nnx.Pytree, nnx.Variable, BaseException)):
    return False
  return '__dict__' in dir(cls) or bool(_compat.slot_names(cls))


def is_plain_object(x: Any) -> bool:
  """A user object whose attributes (``vars()``, or its ``__slots__``) brainnx walks: not a
  graph node, type or function."""
  return not isinstance(x, _ATOMS) and _is_plain_type(type(x)) and (
    hasattr(x, '__dict__') or bool(_compat.slot_names(type(x))))


def holds_graph_node(x: Any, _seen=None) -> bool:
  """Whether ``x`` is, or holds somewhere inside, a Variable or NNX Pytree (cycle-safe)."""
  if isinstance(x, _ATOMS):
    return False
  if is_graph_node(x):
    return True
  seen = set() if _seen is None else _seen
  if id(x) in seen:
    return False
  seen.add(id(x))
  if isinstance(x, (tuple, list)):
    return any(holds_graph_node(v, seen) for v in x)
  if isinstance(x, dict):
    return any(holds_graph_node(v, seen) for v in x.values())
  if is_plain_object(x):
    return any(holds_graph_node(v, seen) for v in _compat.attributes(x).values())
  leaves = jax.tree.leaves(x, is_leaf=lambda y: y is not x and (is_graph_node(y) or is_plain_object(y)))
  return any(y is not x and holds_graph_node(y, seen) for y in leaves)


def is_reference(x: Any) -> bool:
  """Passed by reference into a transform: a graph node, or a plain object holding one."""
  return is_graph_node(x) or (is_plain_object(x) and holds_graph_node(x))


def describe(path, variable) -> str:
  """``"Param at ('model', 'l1', 'kernel')"``: how every error names a Variable."""
  return f'{type(variable).__name__} at {tuple(path)!r}'


def key_name(key) -> Hashable:
  """The plain key of a ``jax.tree_util`` path entry (dict key, index or attribute)."""
  for attr in ('key', 'idx', 'name'):
    if hasattr(key, attr):
      return getattr(key, attr)
  return str(key)


def static_key(value) -> Hashable:
  """A cache key for a value compared statically: by type and value (``1``, ``1.0``, ``True``
  differ), or by identity when it is unhashable."""
  try:
    hash(value)
  except TypeError:
    return ('<unhashable>', type(value), id(value))
  return (type(value), value)


class RootKind(enum.Enum):
  """How a discovery root was reached."""

  ARG = 'argument'
  KWARG = 'keyword argument'
  SELF = 'self'
  PARTIAL = 'partial argument'
  DEFAULT = 'default value'
  CLOSURE = 'closure'
  GLOBAL = 'global'


@dataclasses.dataclass(frozen=True)
class Root:
  """Where a walk started: ``name`` heads the paths below it."""

  name: Hashable
  kind: RootKind


class Guard:
  """A cheap check that what a discovery saw is still what the function sees.

  It records the object behind every closure cell and global name the
  function (and the helpers it calls) loads, and the entries of every
  mutable container on the way (a Module's attribute dict, a plain
  object's, a dict, a list). ``ok()`` compares the names by identity and
  the entries in two C-level passes: the whole flattened list by equality
  (static attributes may be re-set to equal values), and the graph entries
  (Variables, Modules, containers holding them) by identity. Data-attribute
  arrays are state, like a Variable's value: not compared at all.

  The attribute dicts of flax Pytrees (Modules, ``nnx.List``, ``Rngs``, ...) and
  the Variables' metadata (which a function may read: ``v.get_metadata()``) are
  compared only when flax has changed some Pytree's attributes or Variable's
  metadata since the last passing check (``_compat.PYTREE_EDITS``); plain objects, dicts and lists, which
  nothing counts, are compared on every call. So a warm call over a deep model
  costs a few identity checks, not one comparison per attribute.
  """

  __slots__ = ('_cells', '_globals', '_all', '_uncounted', '_counted', '_metadata', '_owners', '_seen', 'ok')

  def __init__(self, cells, globals_, containers, masks, counted, metadata=(), owners=None):
    self._cells = list(cells)  # [cell, object]
    self._globals = list(globals_)  # [namespace, name, object]
    self._metadata = list(metadata)  # [Variable, a copy of its metadata]
    # ids of the Pytrees and of the Variables whose edits matter here (None: any edit does)
    self._owners = None if owners is None else (set(owners[0]), set(owners[1]))
    self._all = _entry_check(containers, masks)
    self._uncounted = _entry_check(
      [c for c, n in zip(containers, counted) if not n], [m for m, n in zip(masks, counted) if not n]
    )
    self._counted = _entry_check([c for c, n in zip(containers, counted) if n], [m for m, n in zip(masks, counted) if n])
    self._seen = [-1]  # the edit count at the last passing full check; -1: none yet
    self.ok = self._make_check()

  def _make_check(self):
    """``ok()`` as a closure over locals: this runs on every warm call (a few names: plain
    loops beat C-level ``map`` here, whose set-up costs more than the comparisons)."""
    cells, namespaces, metadata = self._cells, self._globals, self._metadata
    check_all, check_uncounted, seen, edits = self._all, self._uncounted, self._seen, _compat.PYTREE_EDITS
    metadata_of, log = _compat.metadata_of, _compat.EDIT_LOG
    nodes, variables = self._owners if self._owners is not None else (None, None)
    everything = (True, True)

    def edited_here(since: int) -> tuple[bool, bool]:
      """Whether the edits after count ``since`` touched (the guarded Pytrees, the guarded
      Variables' metadata): both, when an edit's object is unknown or the log no longer reaches
      back that far. Edits of other objects touch neither."""
      if nodes is None or since < 0:
        return everything
      touched_nodes = touched_variables = False
      try:
        for count, owner in reversed(log):
          if count <= since:
            return touched_nodes, touched_variables
          if owner is None:
            return everything
          if owner in nodes:
            touched_nodes = True
          elif owner in variables:
            touched_variables = True
      except RuntimeError:  # another thread edited while we read
        return everything
      return everything  # the log no longer reaches back to the last check

    def ok() -> bool:
      if cells:
        try:
          for cell, obj in cells:
            if cell.cell_contents is not obj:
              return False
        except ValueError:  # a cell was emptied
          return False
      for namespace, name, obj in namespaces:
        if namespace.get(name, _MISSING) is not obj:
          return False
      if edits[0] == seen[0]:
        return check_uncounted is None or check_uncounted()
      mark = edits[0]  # read before the check: an edit during it moves the count past mark
      touched_nodes, touched_variables = edited_here(seen[0])
      check = check_all if touched_nodes else check_uncounted
      if check is not None and not check():
        return False
      if touched_variables:
        try:
          if any(metadata_of(v) != saved for v, saved in metadata):
            return False
        except Exception:  # metadata holding arrays: no single truth value
          return False
      seen[0] = mark
      return True

    return ok

  def take_plain_statics(self) -> bool:
    """Expect the static attributes plain objects, dicts and lists hold now (a trace's own
    counter, ``self.steps += 1``), if no flax Pytree's attributes changed; whether it did."""
    if self._counted is not None and not self._counted():
      return False
    for check in (self._all, self._uncounted):
      if check is not None:
        check.resave()
    return True

  def follow(self, replaced: list) -> None:
    """Expect the containers as they are now, with ``(old, new)`` Variables swapped (see
    :meth:`Discovery.follow`)."""
    for check in (self._all, self._uncounted, self._counted):
      if check is not None:
        check.resave(graph=True)
    swap = {id(old): new for old, new in replaced}
    if self._owners is not None:
      self._owners[1].update(id(new) for _, new in replaced)
    self._metadata[:] = [(swap[id(v)], dict(_compat.metadata_of(swap[id(v)]))) if id(v) in swap else (v, m)
                         for v, m in self._metadata]

  def rebind(self, source: tuple, obj) -> None:
    """Expect ``obj`` behind a captured name from now on: ``source`` is ``('cell', cell)`` or
    ``('global', namespace, name)`` (a plain value the traced call itself rebound)."""
    if source[0] == 'cell':
      self._cells[:] = [(c, obj if c is source[1] else o) for c, o in self._cells]
    else:
      self._globals[:] = [(ns, n, obj if (ns is source[1] and n == source[2]) else o) for ns, n, o in self._globals]


def _entry_check(containers, masks) -> Callable[[], bool] | None:
  """``check()``: whether ``containers`` hold the entries they hold now (see :class:`Guard`);
  ``None`` when there are none."""
  if not containers:
    return None
  views = tuple(c.values() if isinstance(c, dict) else c for c in containers)
  codes = list(_chain(masks))
  values = list(_chain(views))
  size = len(values)
  if DATA in codes:
    static_at = _picker([i for i, c in enumerate(codes) if c == STATIC])
  else:  # the common case: the whole list, compared in one C call
    static_at = _whole
  graph_at = _picker([i for i, c in enumerate(codes) if c == GRAPH])
  saved = [static_at(values), graph_at(values)]
  chain, is_ = _chain, operator.is_

  def check() -> bool:
    now = [*chain(views)]
    if len(now) != size:
      return False
    try:
      if static_at(now) != saved[0]:
        return False
    except Exception:  # an array compared with an array: no single truth value
      return False
    return all(map(is_, graph_at(now), saved[1]))

  def resave(graph: bool = False) -> None:
    """Expect the static entries the containers hold now (and, with ``graph``, their graph
    entries; else only if those are unchanged)."""
    now = [*chain(views)]
    if len(now) == size and (graph or all(map(is_, graph_at(now), saved[1]))):
      saved[:] = [static_at(now), graph_at(now)]

  check.resave = resave
  return check


# What a guarded container entry is: compared by equality, by identity, or not at all (its
# value is state that calls write: a data-attribute array).
STATIC, GRAPH, DATA = 0, 1, 2


def _whole(values: list) -> list:
  return values


def _picker(positions: list):
  """``pick(values) -> tuple`` of the entries at ``positions`` (C-level for two or more)."""
  if not positions:
    return lambda values: ()
  if len(positions) == 1:
    (i,) = positions
    return lambda values: (values[i],)
  return operator.itemgetter(*positions)


_chain = itertools.chain.from_iterable


class _Missing:
  """An absent container entry (a key a call added was not there before)."""

  def __repr__(self) -> str:
    return 'MISSING'


MISSING = _MISSING = _Missing()


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

  def __post_init__(self):
    self._index = {id(v): i for i, v in enumerate(self.variables)}
    self._node_index = {id(r()): i for i, r in enumerate(self.node_refs)}

  @property
  def nodes(self) -> tuple:
    """The graph nodes (held weakly, so a cached discovery does not keep a dropped model
    alive; they are alive while a call that reaches them runs)."""
    return tuple(r() for r in self.node_refs)

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
      if obj is _MISSING:
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
    guard to see it."""
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
      if now is not before and (holds_graph_node(now) or holds_graph_node(before)) and before is not _MISSING:
        self.rebind(k, before)
    for container, before in zip(self.containers, saved):
      if isinstance(container, list):
        if _list_changed(container, before):
          container[:] = before
        continue
      undo = {key: before.get(key, _MISSING) for key in _dict_changes(container, before)}
      if undo:
        _compat.restore_entries(container, undo, _MISSING)


def _list_changed(container: list, before: list, data_keys=()) -> bool:
  """Whether a list gained, lost or swapped state (graph nodes, arrays) since ``before``; a new
  array at a position in ``data_keys`` (known state, written back) is no change."""
  if len(container) == len(before) and all(
    a is b or (k in data_keys and isinstance(a, _ARRAYS)) for k, (a, b) in enumerate(zip(container, before))
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
    old, new = before.get(key, _MISSING), container.get(key, _MISSING)
    if old is not new and (_is_state(old) or _is_state(new)):
      if key in data_keys and isinstance(new, _ARRAYS):
        continue
      changed[key] = new
  if changed and _compat.is_node_attributes(container):
    changed = {k: container.get(k, _MISSING) for k in container.keys() | before.keys()
               if before.get(k, _MISSING) is not container.get(k, _MISSING)}
  return changed


def _source_value(source: tuple):
  if source[0] == 'cell':
    try:
      return source[1].cell_contents
    except ValueError:
      return _MISSING
  return source[1].get(source[2], _MISSING)


def _is_state(x) -> bool:
  """A container entry a call may not leave changed on error: a graph node or an array."""
  return isinstance(x, _ARRAYS) or holds_graph_node(x)


class _Walker:
  """Depth-first walk of graph nodes and containers, recording Variables."""

  def __init__(self):
    self.variables, self.paths, self.root_of = [], [], []
    self.nodes = []
    self.streams = []
    self.aliases = []  # (index, path, root): a Variable reached again from another root
    self.containers = []  # guarded: they hold graph nodes
    self.counted = []  # per guarded container: a flax Pytree's attributes (edits counted)
    self.watched = []  # every mutable container met
    self.watched_paths = []
    self.metadata = []  # (Variable, a copy of its metadata), for the guard
    self.owners: tuple[set[int], set[int]] = (set(), set())  # ids of the guarded Pytrees, Variables
    self.plain_objects = []
    self.masks = []
    self.signature = []
    self._var_ids: dict[int, int] = {}
    self._seen: set[int] = set()
    self._relevant: set[int] = set()

  def walk(self, obj, path: Path, root: int) -> bool:
    """Walk ``obj``; True when it is or holds a graph node or Variable."""
    if isinstance(obj, _ATOMS):
      return False
    if isinstance(obj, nnx.Variable):
      return self._variable(obj, path, root)
    key = id(obj)
    if key in self._seen:
      return key in self._relevant
    self._seen.add(key)
    if isinstance(obj, nnx.Pytree):
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
      if isinstance(value, _ARRAYS):  # an array attribute is state in nnx.split, as a Variable is
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
      if isinstance(v, _ARRAYS):
        mask.append(self._data(container, k, path + (k,), root))
      else:
        mask.append(GRAPH if self.walk(v, path + (k,), root) else STATIC)
    if not any(mask):
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


@functools.lru_cache(maxsize=4096)
def _loaded_globals(code: types.CodeType) -> tuple[str, ...]:
  """Names a code object (and the code nested in it) loads as globals."""
  names: list[str] = []
  for ins in dis.get_instructions(code):
    if ins.opname in ('LOAD_GLOBAL', 'LOAD_NAME') and ins.argval not in names:
      names.append(ins.argval)
  for const in code.co_consts:
    if isinstance(const, types.CodeType):
      names.extend(n for n in _loaded_globals(const) if n not in names)
  return tuple(names)


def _param_names(fn) -> list[str]:
  try:
    return list(inspect.signature(fn).parameters)
  except (TypeError, ValueError):
    return []


class _Roots:
  """Collects roots from arguments and from what a callable captures.

  Every closure cell and global name the code reads is guarded, whether or
  not it led to a Variable; values that hold no graph node also enter the
  signature, so rebinding one (``M = None`` to a module, ``scale = 2.0`` to
  ``3.0``) gives a new trace instead of a stale one.
  """

  def __init__(self, walker: _Walker):
    self.walker = walker
    self.roots: list[Root] = []
    self.cells: list = []
    self.globals: list = []
    self.captured: list = []  # (name, static key) of captured values holding no graph node
    self.plain: list = []  # (source, position in captured) of those values
    self._explored: set[int] = set()

  def add(self, name, kind: RootKind, obj) -> bool:
    if _is_callable_to_explore(obj):
      self.explore(obj)
      return True
    self.roots.append(Root(name, kind))
    found = self.walker.walk(obj, (name,), len(self.roots) - 1)
    if isinstance(obj, (list, tuple, dict)):  # functions held in a container (a list of branches)
      for item in obj.values() if isinstance(obj, dict) else obj:
        if _is_callable_to_explore(item):
          self.explore(item)
    return found

  def _captured(self, name, kind: RootKind, obj, source: tuple) -> None:
    if not self.add(name, kind, obj) and not isinstance(obj, types.ModuleType):
      if not callable(obj):
        self.plain.append((source, len(self.captured)))
      self.captured.append((name, static_key(obj)))

  def explore(self, fn) -> None:
    if id(fn) in self._explored:
      return
    self._explored.add(id(fn))
    if isinstance(fn, (tuple, list)):  # several functions sharing one discovery
      for f in fn:
        self.explore(f)
    elif isinstance(fn, functools.partial):
      names = _param_names(fn.func)
      for i, a in enumerate(fn.args):
        self.add(names[i] if i < len(names) else f'partial{i}', RootKind.PARTIAL, a)
      for k, a in fn.keywords.items():
        self.add(k, RootKind.PARTIAL, a)
      self.explore(fn.func)
    elif isinstance(fn, types.MethodType):
      self.add('self', RootKind.SELF, fn.__self__)
      self.explore(fn.__func__)
    elif isinstance(fn, nnx.Pytree) or is_plain_object(fn):
      self.add('self', RootKind.SELF, fn)
      call = getattr(type(fn), '__call__', None)
      if isinstance(call, types.FunctionType):
        self.explore(call)
    elif isinstance(fn, types.FunctionType):
      self._function(fn)
    elif isinstance(fn, type):  # a class called as the function: its constructor runs
      init = _user_constructor(fn)
      if init is not None:
        self.explore(init)
    elif hasattr(fn, '__wrapped__'):
      self.explore(fn.__wrapped__)

  def _function(self, fn: types.FunctionType) -> None:
    if hasattr(fn, '__wrapped__'):
      self.explore(fn.__wrapped__)
    code = fn.__code__
    library = code.co_filename.startswith(LIBRARY_DIRS)
    for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
      try:
        obj = cell.cell_contents
      except ValueError:
        continue
      self.cells.append((cell, obj, name))
      if library:  # a library's closures may wrap user code; only what leads to Variables counts
        self.add(name, RootKind.CLOSURE, obj)
      else:
        self._captured(name, RootKind.CLOSURE, obj, ('cell', cell))
    if library:
      return  # a library's globals are its own
    namespace = fn.__globals__
    for name in _loaded_globals(code):
      obj = namespace.get(name, _MISSING)
      if obj is _MISSING:
        continue  # a builtin
      self.globals.append((namespace, name, obj))
      self._captured(name, RootKind.GLOBAL, obj, ('global', namespace, name))
    for i, default in enumerate(fn.__defaults__ or ()):
      names = code.co_varnames[: code.co_argcount]
      self.add(names[len(names) - len(fn.__defaults__) + i], RootKind.DEFAULT, default)
    for k, default in (fn.__kwdefaults__ or {}).items():
      self.add(k, RootKind.DEFAULT, default)


def _user_constructor(cls: type):
  """``cls.__init__`` when it is written in user code (it may close over an ``nnx.Rngs``), else None."""
  init = getattr(cls, '__init__', None)
  if isinstance(init, types.FunctionType) and not init.__code__.co_filename.startswith(LIBRARY_DIRS):
    return init
  return None


def _is_callable_to_explore(obj) -> bool:
  if isinstance(obj, (types.FunctionType, functools.partial, types.MethodType)):
    return True
  if isinstance(obj, type):
    return _user_constructor(obj) is not None
  if isinstance(obj, nnx.Pytree) or is_plain_object(obj):
    return False
  return callable(obj) and hasattr(obj, '__wrapped__')


def discover(fun: Callable, args: tuple, kwargs: dict) -> Discovery:
  """Every Variable ``fun(*args, **kwargs)`` can reach, in discovery order.

  Arguments come first (positional by index, then keywords by name), then
  what ``fun`` captures. Raises ``TypeError`` naming a Variable created
  with ``hijax=True`` or ``ref=True``.
  """
  walker = _Walker()
  roots = _Roots(walker)
  for i, a in enumerate(args):
    roots.roots.append(Root(i, RootKind.ARG))
    walker.walk(a, (i,), len(roots.roots) - 1)
  for k, a in kwargs.items():
    roots.roots.append(Root(k, RootKind.KWARG))
    walker.walk(a, (k,), len(roots.roots) - 1)
  roots.explore(fun)
  return Discovery(
    variables=list(walker.variables),
    paths=tuple(walker.paths),
    root_of=tuple(walker.root_of),
    roots=tuple(roots.roots),
    node_refs=tuple(map(weakref.ref, walker.nodes)),
    containers=tuple(walker.watched),
    streams=tuple(walker.streams),
    aliases=tuple(walker.aliases),
    guard=Guard([c[:2] for c in roots.cells], roots.globals, walker.containers, walker.masks, walker.counted,
                walker.metadata, walker.owners),
    signature=(tuple(walker.signature), tuple(roots.captured)),
    plain=tuple(roots.plain),
    container_paths=tuple(walker.watched_paths),
    plain_objects=tuple(walker.plain_objects),
    names=tuple(('cell', cell, name) for cell, _, name in roots.cells) + tuple(
      ('global', ns, name) for ns, name, _ in roots.globals),
  )
