"""A live attribute dict for objects without a ``__dict__`` (a ``@dataclass(slots=True)``
holding a model): what discovery walks and the guard compares, as it does a ``vars()``.

Example:
  >>> import dataclasses
  >>> from brainnx._compat.slots import SlotAttributes, slot_names
  >>> @dataclasses.dataclass(slots=True)
  ... class Trainer:
  ...   steps: int
  >>> trainer = Trainer(3)
  >>> attrs = SlotAttributes(trainer, slot_names(Trainer))
  >>> attrs['steps'] = 4
  >>> trainer.steps, list(attrs.values())
  (4, [4])
"""

from __future__ import annotations


class _LiveValues:
  """The current values of an object's slot attributes, read on every iteration."""

  __slots__ = ('obj', 'names')

  def __init__(self, obj, names):
    self.obj, self.names = obj, names

  def __iter__(self):
    return (getattr(self.obj, n, None) for n in self.names)

  def __len__(self) -> int:
    return len(self.names)


class SlotAttributes(dict):
  """A live dict over an object's ``__slots__`` attributes (a ``@dataclass(slots=True)``): reads
  see the object's current attributes; writes and removals go to the object."""

  def __init__(self, obj, names):
    super().__init__((n, getattr(obj, n)) for n in names if hasattr(obj, n))
    self._obj = obj

  def _sync(self) -> None:
    for name in list(dict.keys(self)):
      dict.__setitem__(self, name, getattr(self._obj, name, None))

  def __getitem__(self, name):
    return getattr(self._obj, name)

  def get(self, name, default=None):
    return getattr(self._obj, name, default) if name in dict.keys(self) else default

  def __setitem__(self, name, value) -> None:
    setattr(self._obj, name, value)
    dict.__setitem__(self, name, value)

  def pop(self, name, *default):
    if hasattr(self._obj, name):
      delattr(self._obj, name)
    return dict.pop(self, name, *default)

  def values(self):
    return _LiveValues(self._obj, tuple(dict.keys(self)))

  def items(self):
    self._sync()
    return dict.items(self)

  def __iter__(self):
    return iter(dict.keys(self))

  def copy(self) -> dict:
    self._sync()
    return dict(dict.items(self))


def slot_names(cls: type) -> tuple[str, ...]:
  """The ``__slots__`` attribute names of a class and its bases (none: it has a ``__dict__``)."""
  names = []
  for base in cls.__mro__:
    slots = getattr(base, '__slots__', ())  # a base's own, or one it inherits (listed once)
    for name in (slots,) if isinstance(slots, str) else slots:
      if name not in ('__dict__', '__weakref__') and name not in names:
        names.append(name)
  return tuple(names)
