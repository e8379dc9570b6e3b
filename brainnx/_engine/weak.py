"""Weak references as the caches need them: to any object (a strong stand-in where one cannot be
weakly referenced), and to a callable (a bound method by its function and ``self``, which
are what lives; a bound method object itself is made anew on every attribute access).

Example:
  >>> from brainnx._engine.weak import weak_ref
  >>> class Model:
  ...   def apply(self, x):
  ...     return x
  >>> model = Model()
  >>> ref = weak_ref(model.apply)
  >>> ref()(3), weak_ref(None)(), weak_ref(3)()
  (3, None, 3)
  >>> del model
  >>> ref() is None
  True
"""

from __future__ import annotations

import types
import weakref


class _Strong:
  """A strong stand-in for ``weakref.ref`` where an object cannot be weakly referenced."""

  __slots__ = ('obj',)

  def __init__(self, obj):
    self.obj = obj

  def __call__(self):
    return self.obj


def weak_or_strong(x, callback=None):
  """``weakref.ref(x, callback)``, or a strong stand-in when ``x`` cannot be weakly referenced."""
  try:
    return weakref.ref(x, callback)
  except TypeError:
    return _Strong(x)


def weak_ref(obj):
  """A weak reference to ``obj``: ``None`` gives ``None`` back, a bound method is held by its
  function and ``self`` (``weakref.WeakMethod``), any other object by :func:`weak_or_strong`."""
  if obj is None:
    return lambda: None
  if isinstance(obj, types.MethodType):
    return weakref.WeakMethod(obj)
  return weak_or_strong(obj)
