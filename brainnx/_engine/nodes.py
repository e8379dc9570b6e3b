"""What a value is, as discovery sees it: a graph node, a plain object holding them, a reference
argument, or a static value; and how a Variable's path reads in errors.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from brainnx._engine.nodes import holds_graph_node, is_graph_node
  >>> model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
  >>> is_graph_node(model), holds_graph_node({'m': [model]}), holds_graph_node(jnp.ones(2))
  (True, True, False)
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
import sysconfig
import types
from typing import Any, Hashable

import jax
import numpy as np
from flax import nnx

from brainnx import _compat
from brainnx._compat.slots import slot_names


# Objects that can never hold a Variable: skipped without a look inside.
ATOM_TYPES = (
  jax.Array, np.ndarray, np.generic, int, float, complex, bool, str, bytes,
  type(None), type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
  types.MethodType, functools.partial, np.dtype, range, type(Ellipsis),
)


# Array values held by graph nodes: state, as ``nnx.split`` sees them.
ARRAY_TYPES = (jax.Array, np.ndarray, _compat.Tracer)


# Packages whose objects are never entered as plain objects (their state is not the user's).
_LIBRARY_PACKAGES = frozenset({
  'jax', 'jaxlib', 'flax', 'numpy', 'optax', 'tqdm', 'chex', 'matplotlib', 'orbax', 'brainnx',
  'equinox', 'brainstate', 'ml_dtypes', 'IPython', 'ipykernel', 'pytest', '_pytest', 'hypothesis',
}) | (frozenset(sys.stdlib_module_names) - {'types', 'argparse'})  # SimpleNamespace, Namespace are plain


def _library_dirs() -> tuple[str, ...]:
  dirs = []
  for name in ('jax', 'jaxlib', 'flax', 'numpy', 'optax', 'tqdm', 'chex', 'matplotlib', 'typing_extensions'):
    spec = importlib.util.find_spec(name)
    if spec is not None and spec.submodule_search_locations:
      dirs.extend(os.path.join(p, '') for p in spec.submodule_search_locations)
    elif spec is not None and spec.origin:  # a single-file module
      dirs.append(spec.origin)
  here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  dirs.append(os.path.join(here, '_'))  # brainnx's own private modules (_compat, _engine/, _transforms/)
  dirs.append(os.path.join(here, '__init__'))
  return tuple(dirs)


# what is_library_file reads: the libraries' folders and files, and Python's standard library
# (the site-packages folder that may lie inside it excepted)
_LIBRARY_DIRS = _library_dirs()
_STDLIB = tuple({os.path.join(sysconfig.get_paths()[k], '') for k in ('stdlib', 'platstdlib')})
_INSTALLED = ('site-packages', 'dist-packages')


@functools.lru_cache(maxsize=4096)
def is_library_file(filename: str) -> bool:
  """Whether code from ``filename`` belongs to a library (JAX, flax, ..., brainnx's private
  modules, Python's standard library): its globals are its own, never a user's Variables, and
  its frames are not the user's.

  >>> import collections.abc
  >>> is_library_file(collections.abc.__file__), is_library_file('/home/me/train.py')
  (True, False)
  """
  if filename.startswith(_LIBRARY_DIRS) or filename.startswith('<frozen '):
    return True
  for stdlib in _STDLIB:
    if filename.startswith(stdlib):
      return not filename[len(stdlib):].startswith(_INSTALLED)
  return False


def is_graph_node(x: Any) -> bool:
  """True for a Variable or an NNX Pytree (Module, Rngs, Optimizer, List, ...)."""
  return isinstance(x, (nnx.Variable, nnx.Pytree))


_HEAP_TYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class made by a class statement or type(), not written in C


def _made_by_exec(cls: type) -> bool:
  """Whether ``cls`` claims the ``builtins`` module without being one of its C types: a class
  statement run by ``exec`` with globals that lack ``__name__`` (a user's tool, a notebook
  runner) gets that module name; it is user code all the same."""
  return cls.__module__ == 'builtins' and bool(cls.__flags__ & _HEAP_TYPE)


@functools.lru_cache(maxsize=1024)
def _is_plain_type(cls: type) -> bool:
  if cls.__module__.partition('.')[0] in _LIBRARY_PACKAGES and not _made_by_exec(cls):
    return False
  if issubclass(cls, (nnx.Pytree, nnx.Variable, BaseException)):
    return False
  return '__dict__' in dir(cls) or bool(slot_names(cls))


def is_plain_object(x: Any) -> bool:
  """A user object whose attributes (``vars()``, or its ``__slots__``) brainnx walks: not a
  graph node, type or function."""
  return not isinstance(x, ATOM_TYPES) and _is_plain_type(type(x)) and (
    hasattr(x, '__dict__') or bool(slot_names(type(x))))


def holds_graph_node(x: Any, _seen=None) -> bool:
  """Whether ``x`` is, or holds somewhere inside, a Variable or NNX Pytree (cycle-safe)."""
  if isinstance(x, ATOM_TYPES):
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
  """Passed by reference into a transform: a graph node, or a plain object holding one or
  not registered as a pytree (JAX could not take it as an argument: a ``Trainer`` whose list
  is still empty)."""
  return is_graph_node(x) or (is_plain_object(x) and (holds_graph_node(x) or _is_pytree_leaf(x)))


def _is_pytree_leaf(x: Any) -> bool:
  return jax.tree_util.treedef_is_leaf(jax.tree.structure(x))


def holds_array(x: Any) -> bool:
  """A list, tuple or dict with an array among its leaves (``foo.a = [x * 2 for x in foo.a]``):
  its arrays are state, as ``nnx.split`` takes them."""
  return isinstance(x, (list, tuple, dict)) and any(isinstance(leaf, ARRAY_TYPES) for leaf in jax.tree.leaves(x))


def is_int(x) -> bool:
  """A Python int that is not a bool (``True`` is an ``int`` to Python, never a count or an axis here)."""
  return isinstance(x, int) and not isinstance(x, bool)


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
