"""Roots reached through a callable: a bound method's ``self``, ``functools.partial``
arguments, default values, closure cells and the global names its code loads (following
helper functions the same way).

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from brainnx._engine.discovery import discover
  >>> scale = nnx.Param(jnp.ones(()))
  >>> def f(x, bias=nnx.Variable(jnp.zeros(()))):
  ...   return x * scale[...] + bias[...]
  >>> [(root.name, root.kind.value) for root in discover(f, (1.0,), {}).roots]
  [(0, 'argument'), ('scale', 'global'), ('bias', 'default value')]
"""

from __future__ import annotations

import dataclasses
import dis
import enum
import functools
import inspect
import types
from typing import Hashable

from flax import nnx

from brainnx._engine.nodes import holds_graph_node, is_library_file, is_plain_object, static_key
from brainnx._engine.sentinels import MISSING


class RootKind(enum.Enum):
  """How a discovery root was reached."""

  ARG = 'argument'
  KWARG = 'keyword argument'
  SELF = 'self'
  PARTIAL = 'partial argument'
  DEFAULT = 'default value'
  CLOSURE = 'closure'
  GLOBAL = 'global'
  SELECTED = 'selected'  # a Variable a transform is given (grad's grad_states), read or not


@dataclasses.dataclass(frozen=True)
class Root:
  """Where a walk started: ``name`` heads the paths below it."""

  name: Hashable
  kind: RootKind


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


class RootFinder:
  """Collects roots from arguments and from what a callable captures.

  Every closure cell and global name the code reads is guarded, whether or
  not it led to a Variable; values that hold no graph node also enter the
  signature, so rebinding one (``M = None`` to a module, ``scale = 2.0`` to
  ``3.0``) gives a new trace instead of a stale one.
  """

  def __init__(self, walker):
    self.walker = walker
    self.roots: list[Root] = []
    self.cells: list = []
    self.globals: list = []
    self.captured: list = []  # (name, static key) of captured values holding no graph node
    self.plain: list = []  # (source, position in captured) of those values
    self._explored: set[int] = set()
    self._guarded_globals: set = set()  # (id(namespace), name) already guarded
    self._shallow = False  # exploring methods of classes met as data: only state-holding names count
    self._classes_done: set = set()

  def add(self, name, kind: RootKind, obj) -> bool:
    if is_callable_to_explore(obj):
      self.explore(obj)
      return True
    self.roots.append(Root(name, kind))
    found = self.walker.walk(obj, (name,), len(self.roots) - 1)
    if isinstance(obj, (list, tuple, dict)):  # functions held in a container (a list of branches)
      for item in obj.values() if isinstance(obj, dict) else obj:
        if is_callable_to_explore(item):
          self.explore(item)
    return found

  def _captured(self, name, kind: RootKind, obj, source: tuple) -> None:
    if self._shallow:  # a method's names: guarded and walked only where they lead to state
      if holds_graph_node(obj) or is_callable_to_explore(obj):
        self.add(name, kind, obj)
      return
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
    elif isinstance(fn, dict):
      for f in fn.values():
        self.explore(f)
    elif isinstance(fn, nnx.Variable):  # selected by identity: a swap out of the graph must show
      self.add('selected', RootKind.SELECTED, fn)
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
      init = user_constructor(fn)
      if init is not None:
        self.explore(init)
    elif hasattr(fn, '__wrapped__'):  # a transform object: what it runs, and what else it reads
      self.explore(getattr(fn, '__discovery_roots__', fn.__wrapped__))

  def _function(self, fn: types.FunctionType) -> None:
    if hasattr(fn, '__wrapped__'):
      self.explore(fn.__wrapped__)
    code = fn.__code__
    library = is_library_file(code.co_filename)
    for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
      try:
        obj = cell.cell_contents
      except ValueError:
        continue
      if self._shallow and not holds_graph_node(obj) and not is_callable_to_explore(obj):
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
      obj = namespace.get(name, MISSING)
      if obj is MISSING or (self._shallow and not holds_graph_node(obj) and not is_callable_to_explore(obj)):
        continue  # a builtin, or a method's plain global
      if (id(namespace), name) not in self._guarded_globals:
        self._guarded_globals.add((id(namespace), name))
        self.globals.append((namespace, name, obj))
      self._captured(name, RootKind.GLOBAL, obj, ('global', namespace, name))
    for i, default in enumerate(fn.__defaults__ or ()):
      names = code.co_varnames[: code.co_argcount]
      self.add(names[len(names) - len(fn.__defaults__) + i], RootKind.DEFAULT, default)
    for k, default in (fn.__kwdefaults__ or {}).items():
      self.add(k, RootKind.DEFAULT, default)


  def explore_classes(self, classes: dict) -> None:
    """Explore the methods of the user classes of the graph nodes and plain objects met
    (``classes``, which grows as they are walked): a Module's method may read a global Variable
    however the Module is called. Only names that hold state are guarded from there."""
    shallow, self._shallow = self._shallow, True
    try:
      while todo := [c for c in classes if c not in self._classes_done]:
        for cls in todo:
          self._classes_done.add(cls)
          for fn in user_methods(cls):
            self.explore(fn)
    finally:
      self._shallow = shallow


@functools.lru_cache(maxsize=1024)
def user_methods(cls: type) -> tuple:
  """The functions written in user code that ``cls`` and its bases define (methods, static and
  class methods, property accessors)."""
  found: dict = {}
  for klass in cls.__mro__:  # each level's own (a base's method a subclass overrides may run through super())
    if klass is object:
      continue
    for name in dir(klass):
      attr = inspect.getattr_static(klass, name, None)
      if isinstance(attr, (staticmethod, classmethod)):
        attr = attr.__func__
      for fn in (attr.fget, attr.fset) if isinstance(attr, property) else (attr,):
        if isinstance(fn, types.FunctionType) and not is_library_file(fn.__code__.co_filename):
          found[fn] = None
  return tuple(found)


def user_constructor(cls: type):
  """``cls.__init__`` when it is written in user code (it may close over an ``nnx.Rngs``), else None."""
  init = getattr(cls, '__init__', None)
  if isinstance(init, types.FunctionType) and not is_library_file(init.__code__.co_filename):
    return init
  return None


def is_callable_to_explore(obj) -> bool:
  if isinstance(obj, (types.FunctionType, functools.partial, types.MethodType)):
    return True
  if isinstance(obj, type):
    return user_constructor(obj) is not None
  if isinstance(obj, nnx.Pytree) or is_plain_object(obj):
    return False
  return callable(obj) and hasattr(obj, '__wrapped__')
