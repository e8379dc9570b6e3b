"""The one eager entry point: a transform called outside any trace runs as a cached program.

Inside a trace a transform runs its body directly. Outside, the call goes
through a ``brainnx.jit`` of the body, cached per owner (the transform
object, or the user function of a loop) and per static configuration in a
cache that holds owners weakly: dropping the function drops its programs.

Example:
  >>> import jax.numpy as jnp
  >>> from brainnx._engine.eager import run
  >>> def body(f, x, scale):
  ...   return f(x) * scale
  >>> double = lambda x: x * 2
  >>> run(body, (double,), (3.0,), (jnp.ones(2),)).tolist()
  [6.0, 6.0]
"""

from __future__ import annotations

import dataclasses
import types
import weakref
from typing import Any, Callable, Sequence

import jax

from brainnx import _compat
from brainnx._engine.arguments import StaticArgs
from brainnx._engine.caches import WeakCache
from brainnx._engine.jitted import JitOptions, JittedFunction, weak_or_strong

__all__ = ['eager', 'run']

_PROGRAMS = WeakCache(512)


def eager() -> bool:
  """True outside any trace and outside ``jax.disable_jit()``: the call runs compiled."""
  return _compat.at_top_level() and not jax.config.jax_disable_jit


@_compat.api_boundary
def run(
  body: Callable,
  owners: Sequence[Any],
  config: tuple,
  args: tuple,
  kwargs: dict | None = None,
  *,
  discover_from: Any = None,
  options: JitOptions = JitOptions(),
  statics: StaticArgs = StaticArgs(),
  compile_first: bool = False,
):
  """``body(*owners, *args, *config, **kwargs)``, compiled when called eagerly.

  ``owners`` (functions, transform objects, progress bars; ``None`` entries
  allowed) are held weakly by the cache; ``config`` is part of the key
  (unhashable parts, such as Variable instances given as filters, by
  identity). ``statics`` are the user's static arguments, kept static by the
  compiled program as by the traced one. Discovery starts from ``discover_from`` (default: the owners).
  The user's function runs once per abstract signature, as under ``jax.jit``:
  the first call traces it and evaluates the trace op by op (as JAX runs an
  untransformed function), the second compiles that same trace;
  ``compile_first`` compiles on the first call (``shard_map``, whose
  primitive JAX evaluates eagerly only without sharded closed-over inputs).
  """
  kwargs = kwargs or {}
  if not eager():
    return body(*owners, *args, *config, **kwargs)
  live = [x for o in owners if o is not None for x in _key_objects(o)]
  if statics == StaticArgs():
    statics = options.statics
  key = (body, tuple(o is None for o in owners), hashable(config), statics)
  jitted = _PROGRAMS.get(live, key)
  if jitted is None:
    # a one-off call never waits for XLA to compile the whole program
    options = dataclasses.replace(options, statics=statics, compile_on_reuse=not compile_first)
    jitted = _compile(body, owners, config, discover_from, options)
    _PROGRAMS.set(live, key, jitted)
  return jitted(*args, **kwargs)


class _ByIdentity:
  """A cache-key stand-in for an unhashable object (a Variable given as a filter): equal only
  to the same object while it lives."""

  __slots__ = ('ref', '_id')

  def __init__(self, obj):
    self.ref, self._id = weak_or_strong(obj), id(obj)

  def __hash__(self) -> int:
    return self._id

  def __eq__(self, other) -> bool:
    return isinstance(other, _ByIdentity) and self._id == other._id and self.ref() is not None and self.ref() is other.ref()


def hashable(config):
  """``config`` with its unhashable parts replaced: lists and dicts by tuples, other objects by identity."""
  if isinstance(config, (list, tuple)):
    return (type(config).__name__, *(hashable(x) for x in config))
  if isinstance(config, dict):
    return ('dict', *((hashable(k), hashable(v)) for k, v in config.items()))
  try:
    hash(config)
  except TypeError:
    return _ByIdentity(config)
  return config


def _compile(body, owners, config, discover_from, options) -> JittedFunction:
  refs = tuple(_ref(o) for o in owners)

  def traced(*args, **kwargs):
    return body(*(r() for r in refs), *args, *config, **kwargs)

  source = discover_from if discover_from is not None else _WeakOwners(refs)
  return JittedFunction(source, options, traced=traced, name=getattr(body, '__name__', None))


class _WeakOwners:
  """What discovery explores for a weakly held owner: its live objects, via ``__wrapped__``."""

  def __init__(self, refs):
    self._refs = refs

  def __call__(self, *args, **kwargs):  # never called: a discovery root only
    raise TypeError('not callable')

  @property
  def __wrapped__(self):
    return [o for o in (r() for r in self._refs) if o is not None]


def _key_objects(obj) -> tuple:
  """A bound method is made anew on every attribute access: key it by its function and self."""
  if isinstance(obj, types.MethodType):
    return (obj.__func__, obj.__self__)
  return (obj,)


def _ref(obj):
  if obj is None:
    return lambda: None
  if isinstance(obj, types.MethodType):
    return weakref.WeakMethod(obj)
  return weak_or_strong(obj)
