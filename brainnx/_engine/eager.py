"""The one eager entry point: a transform called outside any trace runs as a cached program.

Every transform is a public function that parses its keywords once into a
frozen :class:`Config` (which carries the transform's public name for its
errors), then calls :func:`call` with its implementation, that config, the
objects discovery starts from (``roots``: the user's functions, a progress
bar) and the call's arguments. Inside a trace the implementation runs
directly; outside, it runs through a ``brainnx.jit`` of itself, cached per
root and per config in a cache that holds roots weakly: dropping the
function drops its programs. Transform objects (``vmap``'s and ``grad``'s)
keep their one program on themselves instead (:func:`program`).

Example:
  >>> import dataclasses
  >>> import jax.numpy as jnp
  >>> from brainnx._engine.config import Config
  >>> from brainnx._engine.eager import call
  >>> @dataclasses.dataclass(frozen=True, kw_only=True)
  ... class ScaleConfig(Config):
  ...   scale: float
  >>> def scale_impl(config, roots, x):
  ...   (f,) = roots
  ...   return f(x) * config.scale
  >>> double = lambda x: x * 2
  >>> call(scale_impl, ScaleConfig(name='scale', scale=3.0), (double,), (jnp.ones(2),)).tolist()
  [6.0, 6.0]
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Callable, Sequence

import jax

from brainnx import _compat
from brainnx._engine.caches import WeakCache
from brainnx._engine.config import Config
from brainnx._engine.jitted import JitOptions, JittedFunction
from brainnx._engine.weak import weak_or_strong, weak_ref

_PROGRAMS = WeakCache(512)


def eager() -> bool:
  """True outside any trace and outside ``jax.disable_jit()``: the call runs compiled."""
  return _compat.at_top_level() and not jax.config.jax_disable_jit


@_compat.api_boundary
def call(
  impl: Callable,
  config: Config,
  roots: Sequence[Any],
  args: tuple,
  kwargs: dict | None = None,
  *,
  options: JitOptions = JitOptions(),
  compile_first: bool = False,
):
  """``impl(config, roots, *args, **kwargs)``, compiled when called eagerly.

  ``roots`` (functions, transform objects, progress bars; ``None`` entries
  allowed) are held weakly by the cache and are where discovery starts;
  ``config`` is part of the key
  (unhashable parts, such as Variable instances given as filters, by
  identity). ``options.statics`` are the user's static arguments, kept
  static by the compiled program as by the traced one. The user's function
  runs once per abstract signature, as under ``jax.jit``: the first call
  traces it and evaluates the trace op by op (as JAX runs an untransformed
  function), the second compiles that same trace; ``compile_first``
  compiles on the first call (``shard_map``, whose primitive JAX evaluates
  eagerly only without sharded closed-over inputs).
  """
  kwargs = kwargs or {}
  if not eager():
    return impl(config, tuple(roots), *args, **kwargs)
  live = [x for o in roots if o is not None for x in _key_objects(o)]
  key = (impl, tuple(o is None for o in roots), hashable(config), options.statics)
  jitted = _PROGRAMS.get(live, key)
  if jitted is None:
    jitted = program(impl, config, roots, options=options, compile_first=compile_first)
    _PROGRAMS.set(live, key, jitted)
  return jitted(*args, **kwargs)


def program(impl: Callable, config: Config, roots: Sequence[Any], *, discover_from: Any = None,
            options: JitOptions = JitOptions(), compile_first: bool = False) -> JittedFunction:
  """The compiled program of ``impl(config, roots, ...)``, holding ``roots`` weakly: what
  :func:`call` caches, and what a transform object keeps on itself. Discovery starts from the
  live roots, or from ``discover_from`` (held as given) when the call reads more than they
  reach (``grad``'s ``grad_states``)."""
  # a one-off call never waits for XLA to compile the whole program
  options = dataclasses.replace(options, compile_on_reuse=not compile_first)
  refs = tuple(weak_ref(o) for o in roots)

  def traced(*args, **kwargs):
    return impl(config, tuple(r() for r in refs), *args, **kwargs)

  if discover_from is not None:
    live = lambda: discover_from  # noqa: E731 - held as given
  else:
    live = lambda: [o for o in (r() for r in refs) if o is not None]  # noqa: E731
  return JittedFunction(None, options, traced=traced, name=getattr(impl, '__name__', None), roots=live)


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
  try:
    hash(config)
    return config
  except TypeError:
    pass
  if dataclasses.is_dataclass(config) and not isinstance(config, type):
    return (type(config), *(hashable(getattr(config, f.name)) for f in dataclasses.fields(config)))
  if isinstance(config, dict):
    return ('dict', *((hashable(k), hashable(v)) for k, v in config.items()))
  return _ByIdentity(config)


def _key_objects(obj) -> tuple:
  """A bound method is made anew on every attribute access: key it by its function and self."""
  if isinstance(obj, types.MethodType):
    return (obj.__func__, obj.__self__)
  return (obj,)
