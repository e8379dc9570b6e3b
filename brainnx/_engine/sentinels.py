"""The engine's sentinel values: each one object, compared with ``is``, whose repr says what it means.

Example:
  >>> from brainnx._engine.sentinels import MISSING
  >>> {}.get('key', MISSING) is MISSING, MISSING
  (True, MISSING)
"""

from __future__ import annotations


class Sentinel:
  """A named marker that no user value can equal."""

  __slots__ = ('_name',)

  def __init__(self, name: str):
    self._name = name

  def __repr__(self) -> str:
    return self._name


#: An absent entry: a container key, global name or closure value that was not there.
MISSING = Sentinel('MISSING')
#: A :class:`~brainnx._engine.call.Record` that no trace has set yet.
UNSET = Sentinel('UNSET')
#: A warm call whose cached plan does not apply: the call goes the cold way.
MISS = Sentinel('MISS')
#: ``in_shardings``/``out_shardings`` left to ``jax.jit``.
NOT_GIVEN = Sentinel('NOT_GIVEN')
#: Where a value the same for every batch element goes: written once, unbatched.
ONCE = Sentinel('ONCE')
