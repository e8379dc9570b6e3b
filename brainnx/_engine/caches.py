"""Bounded caches: an LRU for traces and plans, and a cache whose keys hold objects weakly.

Example:
  >>> from brainnx._engine.caches import WeakCache
  >>> class Fn:
  ...   pass
  >>> cache, fn = WeakCache(), Fn()
  >>> cache.set((fn,), 'config', 'compiled')
  >>> cache.get((fn,), 'config'), len(cache)
  ('compiled', 1)
  >>> del fn
  >>> len(cache)                   # the entry went with the object
  0
"""

from __future__ import annotations

import collections
import threading
import weakref
from typing import Any, Hashable, Sequence


class LRUCache:
  """Thread-safe least-recently-used mapping with hit/miss counters."""

  def __init__(self, maxsize: int = 128, on_evict=None):
    self.maxsize = maxsize
    self.on_evict = on_evict  # called with each value pushed out or replaced (outside the lock)
    self._data: collections.OrderedDict = collections.OrderedDict()
    self._lock = threading.Lock()
    self.hits = self.misses = 0

  def get(self, key, default=None):
    with self._lock:
      if key in self._data:
        self._data.move_to_end(key)
        self.hits += 1
        return self._data[key]
      self.misses += 1
      return default

  def set(self, key, value) -> None:
    with self._lock:
      old = self._data.get(key)
      self._data[key] = value
      self._data.move_to_end(key)
      gone = [old] if old is not None and old is not value else []
      while len(self._data) > self.maxsize:
        gone.append(self._data.popitem(last=False)[1])
    if self.on_evict is not None:
      for old in gone:
        self.on_evict(old)

  def pop(self, key) -> None:
    with self._lock:
      self._data.pop(key, None)

  def clear(self) -> None:
    with self._lock:
      self._data.clear()
      self.hits = self.misses = 0

  def __len__(self) -> int:
    return len(self._data)

  def stats(self) -> dict:
    total = self.hits + self.misses
    return {
      'size': len(self._data),
      'maxsize': self.maxsize,
      'hits': self.hits,
      'misses': self.misses,
      'hit_rate': 100.0 * self.hits / total if total else 0.0,
    }


class WeakCache:
  """A bounded mapping from ``(objects, extra)`` to values that holds ``objects`` weakly.

  ``objects`` are user functions, modules or progress bars; ``extra`` is a
  hashable remainder of the key. An entry is dropped as soon as one of its
  objects is collected, so a cached value must not hold them strongly.
  Objects that cannot be weakly referenced make the entry uncacheable
  (``set`` does nothing).
  """

  def __init__(self, maxsize: int = 256):
    self.maxsize = maxsize
    self._data: collections.OrderedDict = collections.OrderedDict()
    self._lock = threading.RLock()  # reentrant: a collection may run ``drop`` while it is held

  def get(self, objects: Sequence[Any], extra: Hashable = None):
    key = (tuple(map(id, objects)), extra)
    with self._lock:
      entry = self._data.get(key)
      if entry is None:
        return None
      refs, value = entry
      if any(r() is not o for r, o in zip(refs, objects)):  # an id reused by a new object
        return None
      self._data.move_to_end(key)
      return value

  def set(self, objects: Sequence[Any], extra: Hashable, value) -> None:
    key = (tuple(map(id, objects)), extra)
    this = weakref.ref(self)

    def drop(_, key=key):
      cache = this()
      if cache is not None:
        with cache._lock:
          cache._data.pop(key, None)

    try:
      refs = tuple(weakref.ref(o, drop) for o in objects)
    except TypeError:
      return
    with self._lock:
      self._data[key] = (refs, value)
      while len(self._data) > self.maxsize:
        self._data.popitem(last=False)

  def __len__(self) -> int:
    return len(self._data)
