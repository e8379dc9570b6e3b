"""What a mapping transform (``vmap``, ``vmap_new_states``, ``pmap``) is configured with.

Example:
  >>> from flax import nnx
  >>> from brainnx._transforms.mapping_config import vmap_config
  >>> config = vmap_config('vmap', in_axes=0, state_in_axes={0: nnx.Param}, state_out_axes=None,
  ...                      unexpected_out_state_mapping='raise')
  >>> config.name, config.policy.value
  ('vmap', 'raise')
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Callable, Hashable

from flax import nnx

from brainnx._engine.arguments import StaticArgs
from brainnx._engine.config import Config
from brainnx._engine.filters import AxisRules
from brainnx._transforms import vmap_checks


class Mapper(enum.Enum):
  """Which JAX mapping runs the batch."""

  VMAP = 'vmap'
  PMAP = 'pmap'


class Policy(enum.Enum):
  """``unexpected_out_state_mapping``: what happens to a broadcast Variable written per element."""

  RAISE = 'raise'
  WARN = 'warn'
  IGNORE = 'ignore'

  @classmethod
  def of(cls, value: str) -> 'Policy':
    try:
      return cls(value)
    except ValueError:
      raise ValueError(
        f'unexpected_out_state_mapping must be one of {tuple(p.value for p in cls)}, got {value!r}'
      ) from None


@dataclasses.dataclass(frozen=True)
class VmapConfig(Config):
  """Everything a mapping transform (``vmap``, ``vmap_new_states``, ``pmap``) was configured
  with; ``name`` is its mapper's (``vmap`` or ``pmap``), which errors use."""

  fn: Callable | None
  in_axes: Any = 0
  out_axes: Any = 0
  axis_name: Hashable | None = None
  axis_size: int | None = None
  spmd_axis_name: Any = None
  state_in: AxisRules = dataclasses.field(default_factory=lambda: AxisRules(None, 'state_in_axes'))
  state_out: AxisRules = dataclasses.field(default_factory=lambda: AxisRules(None, 'state_out_axes'))
  policy: Policy = Policy.RAISE
  new_states: bool = False  # vmap_new_states: Variables created inside come out batched
  state_tag: str | None = None
  state_to_exclude: AxisRules | None = None
  mapper: Mapper = Mapper.VMAP
  pmap_kwargs: tuple = ()
  statics: StaticArgs = StaticArgs()  # pmap's static_broadcasted_argnums
  donate_argnums: tuple = ()  # pmap's donate_argnums
  partition_name: Hashable | None = None  # the mesh axis of the stacked axis in sharding metadata


def partition_name(transform_metadata, name: str):
  """The mesh axis ``transform_metadata`` (flax's ``{nnx.PARTITION_NAME: axis}``) gives the
  stacked axis; ``None`` without it."""
  if transform_metadata is None:
    return None
  if not isinstance(transform_metadata, dict) or set(transform_metadata) - {nnx.PARTITION_NAME}:
    raise TypeError(
      f'{name}: transform_metadata must be a dict {{nnx.PARTITION_NAME: mesh axis or None}} (the only '
      f'key brainnx reads), got {transform_metadata!r}'
    )
  return transform_metadata.get(nnx.PARTITION_NAME)


def vmap_config(name: str, *, state_in_axes, state_out_axes, unexpected_out_state_mapping, **fields) -> VmapConfig:
  """A ``VmapConfig`` from mapping transform ``name``'s public keywords (rules and policy
  normalised; an ``nnx.StateAxes`` in ``in_axes`` becomes the ``state_in_axes`` entries it means)."""
  fields['in_axes'], from_in_axes = vmap_checks.split_state_axes(fields.get('in_axes', 0))
  return VmapConfig(
    name=fields.get('mapper', Mapper.VMAP).value,
    fn=None,
    state_in=from_in_axes + AxisRules(state_in_axes, 'state_in_axes', name),
    state_out=AxisRules(state_out_axes, 'state_out_axes', name),
    policy=Policy.of(unexpected_out_state_mapping),
    **fields,
  )
