"""Where a mapped call's results go: each written or created Variable's and each output leaf's
batch axis (or one copy, ``ONCE``), with the checks and warnings about outputs that do or do
not differ per element, and the stacked axis recorded on Variables built stacked.

Example:
  >>> import jax.numpy as jnp
  >>> from brainnx._engine.sentinels import ONCE
  >>> from brainnx._transforms.vmap_outputs import place_batched
  >>> batched = jnp.arange(6.0).reshape(3, 2)
  >>> place_batched(batched, 1).shape, place_batched(batched, ONCE).tolist()
  ((2, 3), [0.0, 1.0])
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
from flax import nnx

from brainnx._engine.discovery import Discovery
from brainnx._engine.errors import BatchAxisError, user_stacklevel
from brainnx._engine.filters import mark_stacked, types_code
from brainnx._engine.nodes import key_name
from brainnx._engine.outputs import Leaf, New, OutSpec
from brainnx._engine.sentinels import ONCE
from brainnx._engine.structure import Attachments
from brainnx._transforms import vmap_checks
from brainnx._transforms.mapping_config import Policy, VmapConfig
from brainnx._transforms.vmap_axes import axis_at


def place_batched(value, axis, unstacked: bool = False):
  """Move the batch axis (0) of every leaf to ``axis``, or keep one copy (``ONCE``).

  ``unstacked``: the mapping already gave values placed ``ONCE`` without a batch axis (an
  empty batch, mapped with ``out_axes=None`` for them: there is no element 0 to take).
  """
  if axis is ONCE:
    return value if unstacked else jax.tree.map(lambda x: x[0], value)
  if axis == 0:
    return value
  return jax.tree.map(lambda x: jnp.moveaxis(x, 0, axis), value)


def out_leaf_axes(cfg: VmapConfig, spec) -> list:
  """The out-axis of every output leaf; a Module created inside takes ``out_axes``, except
  Variables of it that ``state_out_axes`` places (``None``: one shared copy)."""
  markers = jax.tree.unflatten(spec.treedef, list(range(spec.treedef.num_leaves)))
  flat = jax.tree_util.tree_flatten_with_path(markers)[0]
  axes = []
  for (path, _), slot in zip(flat, spec.slots):
    axis = axis_at(cfg.out_axes, tuple(key_name(k) for k in path), 'out_axes')
    if type(slot) is Leaf:
      axes.append(axis)
    elif type(slot) is New:
      for var_path, var in slot.leaf_vars:
        hit, declared = cfg.state_out.axis_of(var_path, var)
        axes.append(declared if hit else axis)
  return axes


def check_unbatched_outputs(cfg: VmapConfig, spec, leaves: list, axes: list, batched) -> None:
  """An output placed unbatched (``out_axes=None``, or ``state_out_axes=None`` for a Variable of
  a Module created inside) that depends on the batch: ``BatchAxisError`` naming the Variable, or
  ``ValueError`` for a plain output."""
  it = iter(zip(leaves, axes))
  for slot in spec.slots:
    if type(slot) is Leaf:
      leaf, axis = next(it)
      if axis is None and batched(leaf):
        raise ValueError(f'{cfg.name}: an output has out_axes=None but depends on the batch')
    elif type(slot) is New:
      for var_path, var in slot.leaf_vars:
        leaf, axis = next(it)
        if axis is None and batched(leaf):
          declared, rule = cfg.state_out.axis_of(var_path, var)
          how = 'state_out_axes=None (one shared copy)' if declared else 'out_axes=None'
          raise BatchAxisError(
            f'{cfg.name}: {type(var).__name__} at {tuple(var_path)!r} of the {_created_type(slot.graphdef)} created '
            f'inside is declared {how} but its value differs per batch element: give it a batch axis, '
            f'e.g. state_out_axes={{0: {types_code([var])}}}, or make it independent of the batch'
          )


def _created_type(graphdef) -> str:
  """The class name of the node a graphdef describes (its root node), else ``'Module'``."""
  nodes = getattr(graphdef, 'nodes', None)
  root_type = getattr(nodes[0], 'type', None) if nodes else None
  return root_type.__name__ if isinstance(root_type, type) else 'Module'


def warn_identical_members(cfg: VmapConfig, spec, leaves: list, axes: list, batched) -> None:
  """Warn when no Param of a Module created inside depends on the batch: every member of the
  stack would be the same (an ``nnx.Rngs`` made inside the mapped function)."""
  it = iter(zip(leaves, axes))
  for slot in spec.slots:
    if type(slot) is Leaf:
      next(it)
    elif type(slot) is New:
      params = []
      for (path, var), (leaf, axis) in zip(slot.leaf_vars, [next(it) for _ in slot.leaf_vars]):
        if isinstance(var, nnx.Param) and axis is not None:
          params.append((path, var, batched(leaf), jnp.ndim(leaf) >= 2))
      # a kernel (2-D or more, randomly initialised in flax) the same for every member is the
      # sign; a constant scale or zero bias alone (nnx.BatchNorm) is not
      if params and not any(p[2] for p in params) and any(p[3] for p in params):
        path, var, _, _ = next(p for p in params if p[3])
        warnings.warn(
          f'{cfg.name}: no Param of the {_created_type(slot.graphdef)} '
          f'created inside depends on the batch, so all members are identical (first: '
          f'{type(var).__name__} at {tuple(path)!r}). Its nnx.Rngs was probably created inside the '
          'mapped function: create it outside (rngs = nnx.Rngs(0); vmap(lambda: Model(rngs=rngs), '
          'axis_size=n)()), or keep one shared copy with state_out_axes={None: nnx.Param}',
          UserWarning,
          stacklevel=user_stacklevel(),
        )


def check_out_rules(cfg: VmapConfig, disc: Discovery, decided: 'Decisions') -> None:
  """Every ``state_out_axes`` entry must match a Variable reached, created or returned."""
  named = list(zip(disc.paths, disc.variables)) + [((), v) for v in decided.attachments.stand_ins]
  for slot in decided.out_spec.new_nodes():
    named.extend(slot.leaf_vars)
  vmap_checks.check_rules_reach(cfg.name, cfg.state_out, named, 'the function reaches or creates')


def mark_created_stacked(cfg: VmapConfig, decided: 'Decisions', result, size: int, attached: list) -> None:
  """Record the batch axis on every Variable this call built stacked: those of Modules created
  inside and returned, and those created inside that come out batched (``vmap_new_states``)."""
  vmap_checks.mark_results(decided.out_spec, result, decided.out_axes, size, cfg.partition_name)
  if not cfg.new_states:  # a sown Intermediate under plain vmap stays as flax would give it
    return
  for v, axis in zip(attached, decided.new_placement):
    if v is not None and axis is not ONCE:
      mark_stacked(v, axis, size, cfg.partition_name)


def created_axis(cfg: VmapConfig, variable, batched: bool):
  """Where a Variable created inside the call goes: ``state_out_axes`` first, as for others."""
  hit, axis = cfg.state_out.axis_of((), variable)
  if hit:
    if axis is None and batched:
      raise BatchAxisError(
        f'{cfg.name}: a {type(variable).__name__} created inside the mapped function is declared '
        'state_out_axes=None (one shared copy) but differs per batch element'
      )
    return ONCE if axis is None else axis
  if not cfg.new_states:
    if batched and cfg.policy is Policy.RAISE:
      raise BatchAxisError(
        f'{cfg.name}: a {type(variable).__name__} created inside the mapped function differs per '
        'batch element: create it with brainnx.vmap_new_states to get it stacked'
      )
    return 0 if batched else ONCE
  exclude = cfg.state_to_exclude
  if exclude is not None and exclude.axis_of((), variable)[0]:
    if batched:
      raise BatchAxisError(
        f'vmap_new_states: {type(variable).__name__} matches state_to_exclude (replicated) but its '
        'value differs per batch element: it must not depend on the batch'
      )
    return ONCE
  return 0


@dataclasses.dataclass
class Decisions:
  """What the mapped body found out about one call, decided on its first trace."""

  attachments: Attachments  # what the call attached (one stand-in per created leaf)
  out_spec: OutSpec
  written: list  # discovery indices written (RNG streams excluded)
  placement: list  # per written Variable: an int axis or ONCE
  new_placement: list  # per new Variable
  out_axes: list  # per output leaf
