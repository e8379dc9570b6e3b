"""Shardings for Variables and arguments: the rules behind ``jit(state_shardings=...)``,
``jit(in_shardings=...)`` on the user's own arguments, and ``shard_map``'s state specs.

A rule set is a dict ``{sharding_or_PartitionSpec: filter}``; the first rule whose filter
matches a Variable gives its layout. A bare ``PartitionSpec`` refers to the mesh set with
``jax.set_mesh`` (or the mesh a transform is given).

Example:
  >>> import jax.numpy as jnp
  >>> from jax.sharding import PartitionSpec as P
  >>> from flax import nnx
  >>> from brainnx._engine.discovery import discover
  >>> from brainnx._engine.sharding import Rules
  >>> w = nnx.Param(jnp.zeros((8, 2)))
  >>> rules = Rules.parse({P('x'): nnx.Param}, 'state_shardings')
  >>> rules.specs(discover(lambda: w, (), {}), default=None)
  (P('x',),)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, Sharding

from brainnx import _compat
from brainnx._engine.arguments import ArgKind, CallArgs
from brainnx._engine.discovery import Discovery
from brainnx._engine.filters import to_filter


_SPEC_TYPES = (Sharding, PartitionSpec)


@dataclasses.dataclass(frozen=True)
class Rules:
  """``{layout: filter}`` as a hashable tuple of ``(layout, filter)``, first match wins."""

  items: tuple[tuple[Any, Any], ...] = ()
  what: str = 'state_shardings'

  @classmethod
  def parse(cls, mapping: Any, what: str) -> 'Rules':
    if mapping is None:
      return cls((), what)
    if not isinstance(mapping, dict):
      raise TypeError(
        f'{what} must be a dict {{sharding_or_PartitionSpec: filter}}, got {type(mapping).__name__}'
      )
    items = []
    for layout, spec in mapping.items():
      if not isinstance(layout, _SPEC_TYPES):
        raise TypeError(
          f'{what}: the keys are shardings or PartitionSpecs (the values are filters); '
          f'got key {layout!r} of type {type(layout).__name__}'
        )
      to_filter(spec)  # a bad filter fails here, naming itself
      items.append((layout, tuple(spec) if isinstance(spec, list) else spec))
    return cls(tuple(items), what)

  def __bool__(self) -> bool:
    return bool(self.items)

  def specs(self, disc: Discovery, default: Any) -> tuple:
    """The layout of each discovered Variable (``default`` where no rule matches)."""
    predicates = [(layout, to_filter(spec)) for layout, spec in self.items]
    out = []
    for path, var in zip(disc.paths, disc.variables):
      out.append(next((layout for layout, match in predicates if match(path, var)), default))
    return tuple(out)


def resolve(layout: Any, what: str, mesh: Any = None) -> Sharding | None:
  """A ``Sharding`` for ``layout``: a bare ``PartitionSpec`` uses ``mesh`` or the mesh in context."""
  if layout is None or isinstance(layout, Sharding):
    return layout
  mesh = mesh if mesh is not None else jax.sharding.get_mesh()
  if mesh.empty:
    raise ValueError(
      f'{what}: {layout!r} is a PartitionSpec, which needs a mesh: call inside '
      '`with jax.set_mesh(mesh):` or give a NamedSharding(mesh, spec)'
    )
  return NamedSharding(mesh, layout)


def _leaves(value) -> list:
  return jax.tree.leaves(value)


def check_divides(disc: Discovery, i: int, spec: PartitionSpec, mesh_shape: dict, what: str) -> None:
  """``ValueError`` naming Variable ``i`` if ``spec`` does not fit its shape on the mesh."""
  for leaf in _leaves(_compat.raw_value(disc.variables[i])):
    _check_shape(f'{what}: {disc.describe(i)}', tuple(getattr(leaf, 'shape', ())), spec, mesh_shape)


def check_gathers(disc: Discovery, i: int, value, spec: PartitionSpec, mesh_shape: dict, what: str) -> None:
  """``ValueError`` naming Variable ``i`` if ``spec`` cannot put its per-shard ``value`` back
  together (a mesh axis the mesh lacks, more dimensions than the value has): the shards are
  concatenated, so any size fits."""
  for leaf in _leaves(value):
    _check_shape(f'{what}: {disc.describe(i)}', tuple(getattr(leaf, 'shape', ())), spec, mesh_shape, divides=False)


def _shown(spec: PartitionSpec) -> str:
  """``P('x', None)``, as jax 0.9 and later print a spec (earlier: ``PartitionSpec('x', None)``)."""
  return 'P(' + ', '.join(map(repr, spec)) + (',)' if len(spec) == 1 else ')')


def _check_shape(who: str, shape: tuple, spec: PartitionSpec, mesh_shape: dict, divides: bool = True) -> None:
  """``ValueError`` starting with ``who`` (``'what: the Variable'``) if ``spec`` does not fit."""
  for dim, axes in enumerate(spec):
    names = () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
    unknown = [a for a in names if a not in mesh_shape]
    if unknown:
      raise ValueError(
        f'{who}: its spec {_shown(spec)} names mesh axis {unknown[0]!r}, which the mesh does not '
        f'have (its axes: {tuple(mesh_shape)})'
      )
  if len(spec) > len(shape):
    raise ValueError(f'{who} has shape {shape}, but its spec {_shown(spec)} names {len(spec)} dimension(s)')
  if not divides:
    return
  for dim, axes in enumerate(spec):
    names = () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
    size = math.prod(mesh_shape[a] for a in names)
    if shape[dim] % size:
      raise ValueError(
        f'{who} has shape {shape}; dimension {dim} (size {shape[dim]}) '
        f'does not divide into {size} shards of mesh axes {names} (spec {_shown(spec)})'
      )


def layout_of(disc: Discovery, rules: Rules) -> tuple:
  """Each Variable's ``Sharding`` under ``rules`` (``None``: no rule), checked against its shape
  (a spec naming an axis the mesh lacks fails here, naming the Variable, not in JAX)."""
  if not rules:
    return ()
  shardings = []
  for i, layout in enumerate(rules.specs(disc, None)):
    if isinstance(layout, PartitionSpec):
      mesh = _context_mesh(layout, rules.what)
      check_divides(disc, i, layout, dict(mesh.shape), rules.what)
      shardings.append(NamedSharding(mesh, layout))
      continue
    if isinstance(layout, NamedSharding):
      check_divides(disc, i, layout.spec, dict(layout.mesh.shape), rules.what)
    shardings.append(layout)
  return tuple(shardings)


def new_layout(rules: Rules, path: tuple, var: Any, shape: tuple) -> Sharding | None:
  """The ``Sharding`` of a Variable created inside a call (``var`` may be a stand-in holding
  shapes), checked against ``shape``; ``None`` where no rule matches."""
  layout = next((lay for lay, spec in rules.items if to_filter(spec)(path, var)), None)
  if layout is None:
    return None
  if isinstance(layout, PartitionSpec):
    mesh = _context_mesh(layout, rules.what)
    spec = layout
  else:
    mesh, spec = getattr(layout, 'mesh', None), getattr(layout, 'spec', None)
  if spec is not None and mesh is not None:
    what = f'{rules.what}: {type(var).__name__} at {tuple(path)!r} (created inside the call)'
    _check_shape(what, shape, spec, dict(mesh.shape))
  return layout if isinstance(layout, Sharding) else NamedSharding(mesh, spec)


def _context_mesh(spec: PartitionSpec, what: str):
  mesh = jax.sharding.get_mesh() if _compat.at_top_level() else jax.sharding.get_abstract_mesh()
  if mesh.empty:
    raise ValueError(
      f'{what}: {spec!r} is a PartitionSpec, which needs a mesh: call inside '
      '`with jax.set_mesh(mesh):` or give a NamedSharding(mesh, spec)'
    )
  return mesh


def place(disc: Discovery, layout: Sequence) -> None:
  """Move each concrete Variable value that is not laid out as ``layout`` says (once)."""
  for var, sharding in zip(disc.variables, layout):
    if sharding is None:
      continue
    value = _compat.raw_value(var)
    leaves = _leaves(value)
    if any(isinstance(x, _compat.Tracer) or not isinstance(x, jax.Array) for x in leaves):
      continue
    if all(x.sharding.is_equivalent_to(sharding, x.ndim) for x in leaves):
      continue
    _compat.set_raw_value(var, jax.tree.map(lambda x: lay_out(x, sharding), value))


def lay_out(x: jax.Array, sharding: Sharding) -> jax.Array:
  """``x`` as a ``sharding``-laid-out array; across processes (``jax.distributed``) each
  process supplies its own devices' shards of ``x``, which every process holds whole."""
  if sharding.is_fully_addressable or not x.is_fully_addressable:
    return jax.device_put(x, sharding)
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):  # keys travel as their data
    return jax.random.wrap_key_data(lay_out(jax.random.key_data(x), sharding), impl=jax.random.key_impl(x))
  # Slice on the host: indexing a jax.Array under `jax.set_mesh` would give a global array.
  host = np.asarray(x)
  return jax.make_array_from_callback(x.shape, sharding, lambda index: host[index])


def constrain(value: Any, sharding: Sharding | None) -> Any:
  """``value`` laid out as ``sharding`` inside a trace (``reshard`` on an explicit mesh)."""
  if sharding is None:
    return value
  mesh = getattr(sharding, 'mesh', None)
  if mesh is not None and mesh.are_all_axes_explicit:
    return jax.sharding.reshard(value, sharding)
  return jax.lax.with_sharding_constraint(value, sharding)


def arg_specs(call: CallArgs, specs: Any, what: str, *, default: Any = None, keywords: Any = None) -> tuple:
  """One spec per dynamic entry of ``call`` from a spec per (non-static) positional argument.

  ``specs`` is one spec for every argument, or a tuple/list with one per positional argument
  that is not static, as ``jax.jit``'s ``in_shardings``. A graph node passed by reference has
  no spec of its own (its Variables follow the state rules): its entry must be ``None`` or
  ``default``. Dynamic keyword arguments get ``keywords``.
  """
  positional = [s for s in range(call.n_args) if call.kinds[s] is not ArgKind.STATIC]
  if isinstance(specs, (tuple, list)) and not isinstance(specs, PartitionSpec):
    if len(specs) != len(positional):
      raise ValueError(
        f'{what} has {len(specs)} entries for {len(positional)} positional argument(s) '
        '(one per argument that is not static, as in jax.jit)'
      )
    per_slot = dict(zip(positional, specs))
  else:
    per_slot = {s: specs for s in positional}
  per_arg = isinstance(specs, (tuple, list))
  mixed = {slot: mask for slot, _, mask in call.mixed}
  out = []
  for slot, kind in enumerate(call.kinds):
    spec = per_slot.get(slot, keywords)
    if kind is ArgKind.DYN:
      out.append(spec)
    elif kind is ArgKind.REF:
      if per_arg and slot in per_slot and spec is not None and spec != default:
        raise ValueError(
          f'{what}[{positional.index(slot)}] is {spec!r}, but that argument is a graph node '
          'passed by reference: lay its Variables out with the state rules '
          '(state_shardings / state_in_specs) and give None here'
        )
    elif kind is ArgKind.MIXED:
      if spec is not None and not isinstance(spec, _SPEC_TYPES):
        raise ValueError(
          f'{what}: argument {slot} holds Variables or graph nodes, so its entry must be one '
          f'sharding or spec for all its arrays (or None), not {spec!r}'
        )
      out.extend(spec for is_ref in mixed[slot] if not is_ref)
  return tuple(out)
