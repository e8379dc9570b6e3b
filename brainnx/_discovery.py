"""From a callable and its arguments to the Variables it can touch.

Roots are the positional and keyword arguments, a bound method's ``self``,
``functools.partial`` arguments, default values, closure cells and the global
names the function's code loads (following helper functions the same way).
Each root is walked through NNX graph nodes (Modules, ``nnx.Pytree``s such as
``nnx.Rngs`` and ``nnx.Optimizer``, ``nnx.List``/``nnx.Dict``), ``nnx.State``,
dicts, lists, tuples and other pytrees. A Variable reached twice is one
Variable; its path is the first one found.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from brainnx._discovery import discover
  >>> counter = nnx.Variable(jnp.zeros(()))
  >>> def bump():
  ...   counter[...] += 1
  >>> discover(bump, (), {}).paths
  (('counter',),)
"""

from __future__ import annotations

import dataclasses
import dis
import functools
import inspect
import itertools
import operator
import types
from typing import Any, Callable, Hashable

import jax
import numpy as np
from flax import nnx

__all__ = ['Discovery', 'Guard', 'discover', 'is_graph_node', 'walk_new']

Path = tuple[Hashable, ...]

# Objects that can never hold a Variable: skipped without a look inside.
_ATOMS = (
  jax.Array, np.ndarray, np.generic, int, float, complex, bool, str, bytes,
  type(None), type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
  types.MethodType, functools.partial, np.dtype, range, type(Ellipsis),
)


def _library_dirs() -> tuple[str, ...]:
  import importlib.util
  import os

  dirs = []
  for name in ('jax', 'jaxlib', 'flax', 'numpy', 'optax', 'tqdm', 'chex', 'matplotlib'):
    spec = importlib.util.find_spec(name)
    if spec is not None and spec.submodule_search_locations:
      dirs.extend(os.path.join(p, '') for p in spec.submodule_search_locations)
  here = os.path.dirname(os.path.abspath(__file__))
  dirs.append(os.path.join(here, '_'))  # brainnx's own private modules
  dirs.append(os.path.join(here, '__init__'))
  return tuple(dirs)


# Functions defined in these files are not searched for captured Variables.
_LIBRARY_DIRS = _library_dirs()


def is_graph_node(x: Any) -> bool:
  """True for a Variable or an NNX Pytree (Module, Rngs, Optimizer, List, ...)."""
  return isinstance(x, (nnx.Variable, nnx.Pytree))


@dataclasses.dataclass(frozen=True)
class Root:
  """Where a walk started: ``name`` heads the paths below it."""

  name: Hashable
  kind: str  # 'arg' | 'kwarg' | 'self' | 'partial' | 'default' | 'closure' | 'global'


class Guard:
  """A cheap check that what a discovery saw is still what the function sees.

  It records the object behind every closure cell and global name that led
  to Variables, and the entries of every mutable container on the way (a
  Module's attribute dict, a dict, a list). ``ok()`` compares the entries in
  two C-level passes: the whole flattened list by equality (static
  attributes may be re-set to equal values), and the graph entries
  (Variables, Modules, containers holding them) by identity.
  """

  __slots__ = ('_cells', '_globals', '_views', '_values', '_graph_at', '_graph_values', 'ok')

  def __init__(self, cells, globals_, containers, masks):
    self._cells = tuple(cells)  # (cell, object)
    self._globals = tuple(globals_)  # (namespace, name, object)
    # live views: reading them costs no method call per container
    self._views = tuple(c.values() if isinstance(c, dict) else c for c in containers)
    self._values = list(_chain(self._views))
    at = [i for i, m in enumerate(_chain(masks)) if m]
    if len(at) == 1:
      (i,) = at
      self._graph_at = lambda values: (values[i],)
    else:
      self._graph_at = operator.itemgetter(*at) if at else (lambda values: ())
    self._graph_values = self._graph_at(self._values)

    self.ok = self._make_check()

  def _make_check(self):
    """``ok()`` as a closure over locals: this runs on every warm call."""
    cells, namespaces, views = self._cells, self._globals, self._views
    values, graph_at, graph_values = self._values, self._graph_at, self._graph_values
    chain, is_ = _chain, operator.is_

    def ok() -> bool:
      if cells:
        try:
          for cell, obj in cells:
            if cell.cell_contents is not obj:
              return False
        except ValueError:  # a cell was emptied
          return False
      for namespace, name, obj in namespaces:
        if namespace.get(name) is not obj:
          return False
      now = [*chain(views)]
      try:
        if now != values:
          return False
      except Exception:  # an array compared with an array: no single truth value
        return False
      return all(map(is_, graph_at(now), graph_values))

    return ok


_chain = itertools.chain.from_iterable
_cell_contents = operator.attrgetter('cell_contents')
_MISSING = object()


@dataclasses.dataclass(eq=False)
class Discovery:
  """The Variables a call can touch, with their paths and how they were found."""

  variables: tuple[nnx.Variable, ...]
  paths: tuple[Path, ...]
  root_of: tuple[int, ...]  # per variable, index into ``roots``
  roots: tuple[Root, ...]
  nodes: tuple[Any, ...]  # Pytree graph nodes met on the way
  node_paths: tuple[Path, ...]
  streams: tuple[tuple[int, int], ...]  # (key index, count index) per RngStream
  guard: Guard
  signature: Hashable  # structure + static attributes, for sharing traces

  def __post_init__(self):
    self._index = {id(v): i for i, v in enumerate(self.variables)}
    self._node_index = {id(n): i for i, n in enumerate(self.nodes)}

  def index_of(self, variable) -> int | None:
    return self._index.get(id(variable))

  def node_index_of(self, node) -> int | None:
    return self._node_index.get(id(node))

  def describe(self, i: int) -> str:
    """``"Param at ('model', 'l1', 'kernel')"``: how errors name a Variable."""
    return f'{type(self.variables[i]).__name__} at {self.paths[i]!r}'


class _Walker:
  """Depth-first walk of graph nodes and containers, recording Variables."""

  def __init__(self, known_ids=None):
    self.variables, self.paths, self.root_of = [], [], []
    self.nodes, self.node_paths = [], []
    self.streams = []
    self.containers = []
    self.masks = []
    self.signature = []
    self._var_ids: dict[int, int] = {}
    self._seen: set[int] = set()
    self._relevant_containers: set[int] = set()
    self._known = known_ids  # when set: only report Variables not in it

  def walk(self, obj, path: Path, root: int) -> bool:
    """Walk ``obj``; True when it is or holds a graph node or Variable."""
    if isinstance(obj, _ATOMS):
      return False
    if isinstance(obj, nnx.Variable):
      return self._variable(obj, path, root)
    key = id(obj)
    if key in self._seen:
      return self._relevant_seen(obj)
    if isinstance(obj, nnx.Pytree):
      self._seen.add(key)
      return self._pytree(obj, path, root)
    if isinstance(obj, nnx.State):
      self._seen.add(key)
      return self._container(obj.raw_mapping, list(obj.raw_mapping.items()), path, root, True)
    if isinstance(obj, dict):
      self._seen.add(key)
      return self._container(obj, list(obj.items()), path, root, True)
    if isinstance(obj, list):
      self._seen.add(key)
      return self._container(obj, list(enumerate(obj)), path, root, True)
    if isinstance(obj, tuple):
      self._seen.add(key)
      names = getattr(obj, '_fields', None)
      items = list(zip(names, obj)) if names else list(enumerate(obj))
      return self._container(obj, items, path, root, False)
    return self._generic(obj, path, root)

  def _relevant_seen(self, obj) -> bool:
    return isinstance(obj, nnx.Pytree) or id(obj) in self._relevant_containers

  def _variable(self, var, path, root) -> bool:
    if id(var) in self._var_ids:
      return True
    if self._known is not None and id(var) in self._known:
      self._var_ids[id(var)] = -1
      return True
    if var.hijax or var.ref:
      raise TypeError(
        f'{type(var).__name__} at {path!r} was created with hijax=True or ref=True (flax\'s '
        'mutable-array Variables); brainnx transforms manage plain Variables only: create it '
        'with the defaults (hijax=False, ref=False)'
      )
    self._var_ids[id(var)] = len(self.variables)
    self.variables.append(var)
    self.paths.append(path)
    self.root_of.append(root)
    self.signature.append((path, type(var)))
    return True

  def _pytree(self, node, path, root) -> bool:
    self.nodes.append(node)
    self.node_paths.append(path)
    attrs = vars(node)
    int_keys = getattr(type(node), '_pytree__has_int_keys', False)
    statics, mask = [], []
    for name, value in list(attrs.items()):
      if name.startswith('_pytree__'):
        mask.append(False)
        continue
      child_key = int(name) if int_keys and name.isdigit() else name
      relevant = self.walk(value, path + (child_key,), root)
      mask.append(relevant)
      if not relevant:
        statics.append((name, _hashable(value)))
    self.containers.append(attrs)
    self.masks.append(mask)
    self.signature.append((path, type(node), tuple(statics)))
    if isinstance(node, nnx.RngStream):
      k, c = self._var_ids.get(id(node.key), -1), self._var_ids.get(id(node.count), -1)
      if k >= 0 and c >= 0:
        self.streams.append((k, c))
    return True

  def _container(self, container, items, path, root, mutable) -> bool:
    mask = [self.walk(v, path + (k,), root) for k, v in items]
    relevant = [k for (k, _), m in zip(items, mask) if m]
    if not relevant:
      return False
    self._relevant_containers.add(id(container))
    if mutable:
      self.containers.append(container)
      self.masks.append(mask)
    self.signature.append((path, type(container), tuple(relevant)))
    return True

  def _generic(self, obj, path, root) -> bool:
    try:
      children, _ = jax.tree_util.tree_flatten_with_path(obj, is_leaf=lambda y: y is not obj)
    except Exception:
      return False
    if len(children) == 1 and children[0][1] is obj:
      return False
    self._seen.add(id(obj))
    found = False
    for key_path, child in children:
      found |= self.walk(child, path + tuple(_key_name(k) for k in key_path), root)
    return found


def _key_name(key) -> Hashable:
  for attr in ('key', 'idx', 'name'):
    if hasattr(key, attr):
      return getattr(key, attr)
  return str(key)


def _hashable(value) -> Hashable:
  try:
    hash(value)
    return value
  except TypeError:
    return ('<unhashable>', type(value), id(value))


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
  """Collects roots from arguments and from what a callable captures."""

  def __init__(self, walker: _Walker):
    self.walker = walker
    self.roots: list[Root] = []
    self.cells: list = []
    self.globals: list = []
    self._explored: set[int] = set()

  def add(self, name, kind, obj) -> bool:
    if _is_callable_to_explore(obj):
      self.explore(obj)
      return True
    self.roots.append(Root(name, kind))
    index = len(self.roots) - 1
    return self.walker.walk(obj, (name,), index)

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
        self.add(names[i] if i < len(names) else f'partial{i}', 'partial', a)
      for k, a in fn.keywords.items():
        self.add(k, 'partial', a)
      self.explore(fn.func)
    elif isinstance(fn, types.MethodType):
      self.add('self', 'self', fn.__self__)
      self.explore(fn.__func__)
    elif isinstance(fn, nnx.Pytree):
      self.add('self', 'self', fn)
    elif isinstance(fn, types.FunctionType):
      self._function(fn)
    elif hasattr(fn, '__wrapped__'):
      self.explore(fn.__wrapped__)

  def _function(self, fn: types.FunctionType) -> None:
    if hasattr(fn, '__wrapped__'):
      self.explore(fn.__wrapped__)
    code = fn.__code__
    for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
      try:
        obj = cell.cell_contents
      except ValueError:
        continue
      if self.add(name, 'closure', obj):
        self.cells.append((cell, obj))
    if code.co_filename.startswith(_LIBRARY_DIRS):
      return  # a library's closures may wrap user code; its globals are its own
    namespace = fn.__globals__
    for name in _loaded_globals(code):
      obj = namespace.get(name, _MISSING)
      if obj is _MISSING:
        continue
      if self.add(name, 'global', obj):
        self.globals.append((namespace, name, obj))
    for i, default in enumerate(fn.__defaults__ or ()):
      names = code.co_varnames[: code.co_argcount]
      self.add(names[len(names) - len(fn.__defaults__) + i], 'default', default)
    for k, default in (fn.__kwdefaults__ or {}).items():
      self.add(k, 'default', default)


def _is_callable_to_explore(obj) -> bool:
  if isinstance(obj, (types.FunctionType, functools.partial)):
    return True
  if isinstance(obj, types.MethodType):
    return True
  if isinstance(obj, nnx.Pytree):
    return False
  return callable(obj) and hasattr(obj, '__wrapped__') and not isinstance(obj, type)


def discover(fun: Callable, args: tuple, kwargs: dict) -> Discovery:
  """Every Variable ``fun(*args, **kwargs)`` can reach, in discovery order.

  Arguments come first (positional by index, then keywords by name), then
  what ``fun`` captures. Raises ``ValueError`` naming a Variable that holds a
  leaked tracer.
  """
  walker = _Walker()
  roots = _Roots(walker)
  for i, a in enumerate(args):
    roots.roots.append(Root(i, 'arg'))
    walker.walk(a, (i,), len(roots.roots) - 1)
  for k, a in kwargs.items():
    roots.roots.append(Root(k, 'kwarg'))
    walker.walk(a, (k,), len(roots.roots) - 1)
  roots.explore(fun)
  return Discovery(
    variables=tuple(walker.variables),
    paths=tuple(walker.paths),
    root_of=tuple(walker.root_of),
    roots=tuple(roots.roots),
    nodes=tuple(walker.nodes),
    node_paths=tuple(walker.node_paths),
    streams=tuple(walker.streams),
    guard=Guard(roots.cells, roots.globals, walker.containers, walker.masks),
    signature=tuple(walker.signature),
  )


def walk_new(objects, known: Discovery):
  """Variables and Pytree nodes reachable from ``objects`` that ``known`` lacks.

  Used after a traced call to find Variables the function created and
  attached to existing graph nodes.
  """
  walker = _Walker(known_ids={id(v) for v in known.variables})
  for i, obj in enumerate(objects):
    walker.walk(obj, (i,), 0)
  known_nodes = {id(n) for n in known.nodes}
  new_nodes = [n for n in walker.nodes if id(n) not in known_nodes]
  return tuple(walker.variables), tuple(new_nodes)
