"""Batch axes of a mapped call, in named steps: each argument leaf's ``in_axes``, each
Variable's (``state_in_axes`` first, then the argument it came through, else broadcast), the
RNG streams split per element, and where each written Variable goes afterwards.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from brainnx._engine.arguments import CallArgs
  >>> from brainnx._engine.discovery import discover
  >>> from brainnx._transforms.mapping_config import vmap_config
  >>> from brainnx._transforms.vmap_axes import batch_layout
  >>> w = nnx.Param(jnp.ones((4, 2)))
  >>> f = lambda x: x * w[...]
  >>> args = (jnp.ones((4, 2)),)
  >>> config = vmap_config('vmap', state_in_axes={0: nnx.Param}, state_out_axes=None,
  ...                      unexpected_out_state_mapping='raise')
  >>> layout = batch_layout(config, discover(f, args, {}), CallArgs.split(args, {}), args, {})
  >>> layout.size, layout.state_axes
  (4, [0])
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from brainnx import _compat
from brainnx._engine.arguments import ArgKind, CallArgs
from brainnx._engine.discovery import Discovery
from brainnx._engine.errors import BatchAxisError, user_stacklevel
from brainnx._engine.filters import types_code
from brainnx._engine.nodes import is_graph_node, is_int, key_name
from brainnx._engine.roots import RootKind
from brainnx._engine.sentinels import ONCE
from brainnx._engine.state import read_values
from brainnx._transforms import vmap_checks
from brainnx._transforms.mapping_config import Policy, VmapConfig


def uncommitted(x):
  """``x``, or a copy on the default device, uncommitted, when ``x`` is committed to devices."""
  if isinstance(x, jax.Array) and x.committed and x.is_fully_addressable:
    return jnp.asarray(np.asarray(x))
  return x


def uncommit(variables) -> None:
  for v in variables:
    value = _compat.raw_value(v)
    moved = jax.tree.map(uncommitted, value)
    if any(a is not b for a, b in zip(jax.tree.leaves(moved), jax.tree.leaves(value))):
      _compat.set_raw_value(v, moved)


def _positional_axes(in_axes, n_args: int) -> list:
  if isinstance(in_axes, list):
    in_axes = tuple(in_axes)
  if isinstance(in_axes, tuple):
    if len(in_axes) != n_args:
      raise ValueError(
        f'vmap in_axes is a tuple of length {len(in_axes)} but the function got {n_args} '
        'positional arguments: give one entry per positional argument'
      )
    return list(in_axes)
  if in_axes is not None and not is_int(in_axes):
    raise TypeError(f'vmap in_axes must be an int, None or a tuple, got {in_axes!r}')
  return [in_axes] * n_args


def axis_at(spec, keys: tuple, where: str):
  """The int/None axis a (possibly nested) axis spec gives at ``keys``."""
  for key in keys:
    if spec is None or isinstance(spec, int):
      return spec
    if isinstance(spec, nnx.StateAxes):
      break
    if isinstance(spec, (list, tuple)) and isinstance(key, int) and key < len(spec):
      spec = spec[key]
    elif isinstance(spec, dict) and key in spec:
      spec = spec[key]
    else:
      raise ValueError(f'vmap in_axes for {where} has no entry for {key!r}')
  if isinstance(spec, nnx.StateAxes):
    raise vmap_checks.state_axes_at(spec, 'vmap out_axes' if where == 'out_axes' else f'vmap in_axes for {where}')
  if spec is not None and not is_int(spec):
    raise TypeError(f'vmap in_axes for {where} must give an int or None here, got {spec!r}')
  return spec


def _leaf_axes(spec, value, where: str) -> list:
  """One axis per leaf of ``value`` (graph nodes kept as leaves)."""
  leaves = jax.tree_util.tree_flatten_with_path(value, is_leaf=is_graph_node)[0]
  return [axis_at(spec, tuple(key_name(k) for k in path), where) for path, _ in leaves]


def _normalized(axis: int, ndim: int) -> int | None:
  return axis + ndim if -ndim <= axis < 0 else (axis if 0 <= axis < ndim else None)


@dataclasses.dataclass
class BatchLayout:
  """In-axes of every discovered Variable and dynamic argument, and the batch size."""

  state_axes: list
  split_streams: list  # (key index, count index)
  dyn_axes: tuple
  size: int
  stacks_broadcast: tuple = ()  # stacked Variables coming in whole: refused if the function reads them


def batch_layout(cfg: VmapConfig, disc: Discovery, call: CallArgs, args: tuple, kwargs: dict) -> BatchLayout:
  arg_axes = _positional_axes(cfg.in_axes, len(args))
  values = read_values(disc.variables)
  vmap_checks.check_rules_reach(cfg.name, cfg.state_in, list(zip(disc.paths, disc.variables)), 'the function reaches')

  def in_axis(path, var, root_index):
    hit, axis = cfg.state_in.axis_of(path, var)
    if hit:
      return True, axis, 'state_in_axes'
    root = disc.roots[root_index]
    if root.kind is RootKind.ARG:
      return False, axis_at(arg_axes[root.name], path[1:], f'argument {root.name}'), f'in_axes of argument {root.name}'
    if root.kind is RootKind.KWARG:
      return False, 0, f'keyword argument {root.name!r}'
    return False, None, 'broadcast'

  axes, sources, matched = [], [], []
  for i, (path, var) in enumerate(zip(disc.paths, disc.variables)):
    hit, axis, source = in_axis(path, var, disc.root_of[i])
    axes.append(axis)
    sources.append(source)
    matched.append(hit)
  for i, path, root in disc.aliases:  # one Variable, two ways in: they must agree
    _, axis, source = in_axis(path, disc.variables[i], root)
    if axis != axes[i]:
      raise BatchAxisError(
        f'{cfg.name}: {disc.describe(i)} is also reached as {path!r}, with another batch axis: '
        f'{axes[i]} ({sources[i]}) there, {axis} ({source}) here. One Variable has one batch '
        'axis: pass it once, give both arguments the same in_axes, or set its axis with state_in_axes'
      )

  check_node_aliases(cfg, args, kwargs, arg_axes)

  split, presplit = [], []
  for k, c in disc.streams:
    if matched[k]:
      continue
    key = values[k]
    if axes[k] is not None and getattr(key, 'ndim', 0) > 0:
      continue  # a stacked stream coming in through a mapped argument: used as given
    if getattr(key, 'ndim', 0) > 0:  # several keys, broadcast: refused below, naming the cause
      presplit.append(k)
      continue
    split.append((k, c))
    axes[k] = 0
    if not matched[c]:
      axes[c] = None

  sizes = []
  split_keys = {k for k, _ in split}
  for i, axis in enumerate(axes):
    if axis is None or i in split_keys:
      continue
    for leaf in jax.tree.leaves(values[i]):
      shape = jnp.shape(leaf)
      norm = _normalized(axis, len(shape))
      if norm is None and isinstance(disc.variables[i], (nnx.RngKey, nnx.RngCount)):
        stream = disc.variables[i].get_metadata().get('tag') or disc.paths[i][-2]
        raise ValueError(
          f'{cfg.name}: {disc.describe(i)} is mapped on axis {axis} ({sources[i]}) but the stream '
          f'holds one key (shape {tuple(shape)}), not one per element as nnx.split_rngs would leave it. '
          f'Drop the rule for it (the {stream!r} entry of your nnx.StateAxes, or of state_in_axes): '
          f'{cfg.name} splits {stream!r} per element by itself, one key each, as flax\'s '
          'nnx.split_rngs + nnx.vmap does'
        )
      if norm is None:
        raise ValueError(
          f'{cfg.name}: {disc.describe(i)} is mapped on axis {axis} ({sources[i]}) but its value '
          f'has shape {tuple(shape)}: map it on an axis it has, or broadcast it with '
          f'state_in_axes={{None: {types_code([disc.variables[i]])}}}'
        )
      axes[i] = norm
      sizes.append((shape[norm], disc.describe(i)))

  for i, (path, var) in enumerate(zip(disc.paths, disc.variables)):
    hit, out_axis = cfg.state_out.axis_of(path, var)
    if hit and out_axis is not None and axes[i] is not None and i not in split_keys:
      ndim = max((jnp.ndim(x) for x in jax.tree.leaves(values[i])), default=0)
      if _normalized(out_axis, ndim) != axes[i]:
        raise BatchAxisError(
          f'{cfg.name}: {disc.describe(i)} is mapped in on axis {axes[i]} ({sources[i]}) but '
          f'state_out_axes declares axis {out_axis}: use the same axis for both'
        )

  n_state = len(sizes)  # the entries before this are Variables'
  dyn_axes = []
  slot_axes = list(arg_axes) + [0] * len(kwargs)
  names = [f'argument {i}' for i in range(len(args))] + [f'keyword argument {k!r}' for k in kwargs]
  for slot, kind in enumerate(call.kinds):
    if kind not in (ArgKind.DYN, ArgKind.MIXED):
      continue
    value = (list(args) + list(kwargs.values()))[slot]
    leaf_axes = _leaf_axes(slot_axes[slot], value, names[slot])
    leaves = jax.tree.leaves(value, is_leaf=is_graph_node)
    for leaf, axis in zip(leaves, leaf_axes):
      if axis is None or is_graph_node(leaf):
        continue
      shape = jnp.shape(leaf)
      if not shape:
        raise ValueError(
          f'{cfg.name}: {names[slot]} is a scalar but in_axes maps it on axis {axis}; '
          'pass in_axes=None for it or give it a leading batch axis'
        )
      norm = _normalized(axis, len(shape))
      if norm is None:
        raise ValueError(f'{cfg.name}: {names[slot]} has shape {tuple(shape)}, no axis {axis} to map over')
      sizes.append((shape[norm], names[slot]))
    if kind is ArgKind.DYN:
      dyn_axes.append(slot_axes[slot])
    else:
      dyn_axes.extend(a for a, leaf in zip(leaf_axes, leaves) if not is_graph_node(leaf))

  if cfg.axis_size is not None:
    sizes.append((cfg.axis_size, 'axis_size'))
  distinct = sorted({s for s, _ in sizes})
  if not sizes:
    raise ValueError(
      f'{cfg.name}: nothing is mapped (no argument or Variable has a batch axis) and no '
      'axis_size was given: pass axis_size=N, or map an input'
    )
  if len(distinct) > 1:
    raise ValueError(_inconsistent_sizes(cfg, sizes, distinct, sources, slot_axes[:len(args)], names, n_state))
  stacks = vmap_checks.stacked_broadcasts(cfg, disc, axes, matched, distinct[0])
  # a stream a brainnx vmap stacked is a stack: refused where read, with the other stacks
  vmap_checks.check_presplit(cfg, disc, [k for k in presplit if k not in stacks])
  return BatchLayout(axes, split, tuple(dyn_axes), distinct[0], stacks)


def _inconsistent_sizes(cfg: VmapConfig, sizes: list, distinct: list, sources: list, positional_axes: list,
                        names: list, n_state: int) -> str:
  """The message for batch sizes that disagree: the sizes grouped (Variables counted, not listed
  one by one), and the likely fix. When the Variables agree on one size and only data
  arguments differ (an ensemble of 4 called on a batch of 16 with the default in_axes=0), the
  fix is those arguments' axes, not the Module's: the in_axes to write is spelt out."""
  groups: dict = {}
  for k, (size, where) in enumerate(sizes):
    groups.setdefault(size, ([], []))[k >= n_state].append(where)
  parts = []
  for size, (state, data) in groups.items():
    said = data + ([state[0]] if len(state) == 1 else [f'{len(state)} Variables (first: {state[0]})'] if state else [])
    parts.append(f'size {size}: ' + ', '.join(said))
  message = f'{cfg.name}: inconsistent batch sizes {distinct} ({"; ".join(parts)})'
  state_sizes = {size for size, _ in sizes[:n_state]}
  if len(state_sizes) == 1:
    (members,) = state_sizes
    odd = {where for size, where in sizes[n_state:] if size != members and where.startswith('argument ')}
    if odd and all(size == members or where in odd for size, where in sizes[n_state:]):
      axes = ['None' if names[i] in odd else repr(a) for i, a in enumerate(positional_axes)]
      return (f'{message}. The Variables are mapped with {members} members; '
              f'{", ".join(sorted(odd))} {"has" if len(odd) == 1 else "have"} another size. If '
              f'{"it is" if len(odd) == 1 else "they are"} data every member sees whole (a batch, '
              f'not one slice per member), broadcast {"it" if len(odd) == 1 else "them"}: '
              f'in_axes=({", ".join(axes)}{"," if len(axes) == 1 else ""})')
  if any(src.startswith('in_axes of argument') for src in sources):
    message += ('. A Module passed with an int in_axes is mapped whole: every Variable in it needs that '
                'batch axis. Pass in_axes=None for it to broadcast it, or map only some Variables with state_in_axes')
  return message


def check_node_aliases(cfg: VmapConfig, args: tuple, kwargs: dict, arg_axes: list) -> None:
  """One graph node (a Module, Rngs) passed through two arguments with different batch axes:
  ``BatchAxisError`` naming both paths, whether or not the function reads it (as ``nnx.vmap``'s
  "inconsistent aliasing"). Variables ``state_in_axes`` matches take its axis either way."""
  seen: dict[int, tuple] = {}
  slots = [(i, a, arg_axes[i], f'in_axes of argument {i}') for i, a in enumerate(args)]
  slots += [(k, a, 0, f'keyword argument {k!r}') for k, a in kwargs.items()]
  for name, value, spec, source in slots:
    leaves = jax.tree_util.tree_flatten_with_path(value, is_leaf=is_graph_node)[0]
    for key_path, node in leaves:
      if not is_graph_node(node) or isinstance(node, nnx.Variable):
        continue  # a bare Variable passed twice is the discovery's alias check
      head = (name,) + tuple(key_name(k) for k in key_path)
      for sub, var in nnx.iter_graph(node):
        if not isinstance(var, nnx.Variable):
          continue
        path = head + tuple(sub)
        if cfg.state_in.axis_of(path, var)[0]:
          continue
        axis = axis_at(spec, path[1:], f'argument {name}')
        ndim = max((jnp.ndim(x) for x in jax.tree.leaves(_compat.raw_value(var))), default=0)
        norm = _normalized(axis, ndim) if axis is not None else None
        first = seen.setdefault(id(var), (path, axis, norm, source))
        if first[2] != norm:
          raise BatchAxisError(
            f'{cfg.name}: one graph node is passed twice with different batch axes: its '
            f'{type(var).__name__} is reached as {first[0]!r} with axis {first[1]} ({first[3]}) and as '
            f'{path!r} with axis {axis} ({source}). One Variable has one batch axis: pass the node '
            'once, give both arguments the same in_axes, or set its axis with state_in_axes'
          )


def written_axis(cfg: VmapConfig, disc: Discovery, i: int, in_axis, batched: bool):
  """Where a written Variable's new value goes: an int axis, or ``ONCE``."""
  path, var = disc.paths[i], disc.variables[i]
  hit, out_axis = cfg.state_out.axis_of(path, var)
  if hit:
    if out_axis is None:
      if batched:
        raise BatchAxisError(
          f'{cfg.name}: {disc.describe(i)} is declared state_out_axes=None (one value for the '
          'whole batch) but its new value differs per batch element: declare a batch axis for it, '
          f'e.g. state_out_axes={{0: {types_code([var])}}}'
        )
      return ONCE
    return out_axis
  if in_axis is not None:
    return in_axis
  if not batched:
    return ONCE
  what = f'{cfg.name}: {disc.describe(i)} is broadcast into the mapped call (no batch axis) but its new value differs per batch element'
  hint = ''
  if isinstance(var, nnx.BatchStat):
    hint = (
      '. If it is a running statistic of a normalisation layer (nnx.BatchNorm) mapped over examples, '
      "give the layer axis_name=<the vmap's axis_name> (and the vmap that axis_name) so the "
      'statistics are averaged over the batch'
    )
  if cfg.policy is Policy.RAISE:
    raise BatchAxisError(
      f'{what}. Say where the batch axis goes: state_out_axes={{0: {types_code([var])}}} (or map it in '
      "with state_in_axes), or pass unexpected_out_state_mapping='warn' or 'ignore' to stack it "
      f'on axis 0{hint}'
    )
  if cfg.policy is Policy.WARN:
    warnings.warn(
      f'{what}: it is stacked on axis 0. Declare state_out_axes={{0: {types_code([var])}}} to say so '
      f'and silence this warning{hint}',
      UserWarning,
      stacklevel=user_stacklevel(),
    )
  return 0


def one_of_zeros(tree, axes):
  """A zero-size batch as a batch of one element of zeros, for ``pmap`` (which cannot map
  nothing), so values that do not depend on the batch can still be computed."""
  def grow(x, axis):
    if axis is None:
      return x
    shape = list(jnp.shape(x))
    shape[axis] = 1
    return jnp.zeros(shape, jnp.result_type(x))

  return [jax.tree.map(lambda x, a=a: grow(x, a), t) for t, a in zip(tree, axes)]
