"""The base of every transform's configuration.

Each transform parses its keywords once, when it is built, into a frozen
subclass of :class:`Config` (``ScanConfig``, ``GradConfig``, ``VmapConfig``,
``JitOptions``, ...). Its ``name`` is the transform's public name, which
its errors use; the whole config is part of the key under which the eager
entry caches the compiled program.

Example:
  >>> import dataclasses
  >>> from brainnx._engine.config import Config
  >>> @dataclasses.dataclass(frozen=True, kw_only=True)
  ... class ScaleConfig(Config):
  ...   name: str = 'scale'
  ...   factor: float = 1.0
  >>> ScaleConfig(factor=2.0)
  ScaleConfig(name='scale', factor=2.0)
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  """What a transform was configured with, parsed once; ``name`` is its public name (errors say it)."""

  name: str
