"""State-aware ``vmap`` and ``vmap_new_states``.

A mapped call discovers the Variables ``fn`` can reach, gives each an in-axis
(``state_in_axes`` first, then the ``in_axes`` of the argument it came
through, else broadcast), splits every unmatched RNG stream into one key per
element, runs ``jax.vmap`` with the values swapped in, and writes results
back by the out-axis rules of the reference (``docs/api/mapping.md``). Outside any trace the whole thing
runs through ``brainnx.jit``, so warm eager calls replay a compiled program.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> import brainnx as bnx
  >>> scale = nnx.Param(jnp.arange(3.0))       # one scale per element
  >>> calls = nnx.Variable(jnp.array(0))
  >>> @bnx.vmap(state_in_axes={0: nnx.Param})
  ... def f(x):
  ...   calls[...] += 1                          # unbatched: written once
  ...   return x * scale[...]
  >>> f(jnp.ones(3)), int(calls[...])
  (Array([0., 1., 2.], dtype=float32), 1)
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import sys
import warnings
from typing import Any, Callable, Hashable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from brainnx import _compat
from brainnx._engine.arguments import ArgKind, CallArgs, StaticArgs
from brainnx._engine.discovery import Discovery
from brainnx._engine.nodes import is_graph_node, key_name, LIBRARY_DIRS
from brainnx._engine.roots import RootKind
from brainnx._engine.discovery import discover
from brainnx._engine.eager import eager, program
from brainnx._engine.config import Config
from brainnx._engine.errors import BatchAxisError
from brainnx._engine.filters import AxisRules, mark_stacked, types_code
from brainnx._engine.jitted import JitOptions
from brainnx._engine.outputs import Leaf, New, OutSpec
from brainnx._engine.sentinels import ONCE
from brainnx._engine.rng import advanced_count, split_per_element
from brainnx._engine.call import Record, StatefulCall
from brainnx._engine.state import finish_call, read_values
from brainnx._engine.structure import Attachments
from brainnx._engine.errors import check_callable
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


class MappedFunction:
  """The callable ``vmap`` / ``pmap`` / ``vmap_new_states`` return; it keeps its compiled
  program (made at the first eager call) on itself."""

  def __init__(self, config: VmapConfig):
    self.config = config
    functools.update_wrapper(self, config.fn, updated=())
    self.__wrapped__ = config.fn
    self._program = None

  def __call__(self, *args, **kwargs):
    if not eager():
      return mapped_call(self.config, args, kwargs)
    if self._program is None:
      options = JitOptions(statics=self.config.statics, donate_argnums=self.config.donate_argnums)
      self._program = program(_mapped_impl, self.config, (self,), options=options)
    try:
      return self._program(*args, **kwargs)
    except ValueError as e:
      if self.config.mapper is not Mapper.PMAP or 'incompatible devices' not in str(e):
        raise
    # jax.pmap takes inputs committed to other devices (a counter a 2-device pmap wrote, now read
    # by a 4-device one), where the compiled program around it cannot: move them, as pmap would
    _uncommit(discover(self.config.fn, args, kwargs).variables)
    args, kwargs = jax.tree.map(_uncommitted, (args, kwargs))
    return self._program(*args, **kwargs)

  def __get__(self, obj, objtype=None):
    """Decorating a method: ``self`` is bound as the first argument, as for a function."""
    return self if obj is None else functools.partial(self, obj)

  def __repr__(self) -> str:
    return f'brainnx.{self.config.name}({getattr(self.config.fn, "__name__", self.config.fn)!r})'


def _mapped_impl(config: VmapConfig, roots: tuple, *args, **kwargs):
  return mapped_call(config, args, kwargs)


# -- axes of arguments ---------------------------------------------------------------


def _uncommitted(x):
  """``x``, or a copy on the default device, uncommitted, when ``x`` is committed to devices."""
  if isinstance(x, jax.Array) and x.committed and x.is_fully_addressable:
    return jnp.asarray(np.asarray(x))
  return x


def _uncommit(variables) -> None:
  for v in variables:
    value = _compat.raw_value(v)
    moved = jax.tree.map(_uncommitted, value)
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
  if in_axes is not None and (not isinstance(in_axes, int) or isinstance(in_axes, bool)):
    raise TypeError(f'vmap in_axes must be an int, None or a tuple, got {in_axes!r}')
  return [in_axes] * n_args


def _axis_at(spec, keys: tuple, where: str):
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
  if spec is not None and (not isinstance(spec, int) or isinstance(spec, bool)):
    raise TypeError(f'vmap in_axes for {where} must give an int or None here, got {spec!r}')
  return spec


def _leaf_axes(spec, value, where: str) -> list:
  """One axis per leaf of ``value`` (graph nodes kept as leaves)."""
  leaves = jax.tree_util.tree_flatten_with_path(value, is_leaf=is_graph_node)[0]
  return [_axis_at(spec, tuple(key_name(k) for k in path), where) for path, _ in leaves]


def _normalized(axis: int, ndim: int) -> int | None:
  return axis + ndim if -ndim <= axis < 0 else (axis if 0 <= axis < ndim else None)


# -- the mapped call ----------------------------------------------------------------


@dataclasses.dataclass
class _Layout:
  """In-axes of every discovered Variable and dynamic argument, and the batch size."""

  state_axes: list
  split_streams: list  # (key index, count index)
  dyn_axes: tuple
  size: int


def _layout(cfg: VmapConfig, disc: Discovery, call: CallArgs, args: tuple, kwargs: dict) -> _Layout:
  arg_axes = _positional_axes(cfg.in_axes, len(args))
  values = read_values(disc.variables)
  vmap_checks.check_rules_reach(cfg.name, cfg.state_in, list(zip(disc.paths, disc.variables)), 'the function reaches')

  def in_axis(path, var, root_index):
    hit, axis = cfg.state_in.axis_of(path, var)
    if hit:
      return True, axis, 'state_in_axes'
    root = disc.roots[root_index]
    if root.kind is RootKind.ARG:
      return False, _axis_at(arg_axes[root.name], path[1:], f'argument {root.name}'), f'in_axes of argument {root.name}'
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

  _check_node_aliases(cfg, args, kwargs, arg_axes)

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
    listing = ', '.join(f'{where}: {s}' for s, where in sizes)
    hint = ''
    if any(src.startswith('in_axes of argument') for src in sources):
      hint = (
        '. A Module passed with an int in_axes is mapped whole: every Variable in it needs that '
        'batch axis. Pass in_axes=None for it to broadcast it, or map only some Variables with state_in_axes'
      )
    raise ValueError(f'{cfg.name}: inconsistent batch sizes {distinct} ({listing}){hint}')
  vmap_checks.check_stacked_broadcast(cfg, disc, axes, matched, distinct[0], presplit)
  return _Layout(axes, split, tuple(dyn_axes), distinct[0])


def _check_node_aliases(cfg: VmapConfig, args: tuple, kwargs: dict, arg_axes: list) -> None:
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
        axis = _axis_at(spec, path[1:], f'argument {name}')
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


def _decide(cfg: VmapConfig, disc: Discovery, i: int, in_axis, batched: bool):
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
      stacklevel=_user_stacklevel(),
    )
  return 0


def _user_stacklevel() -> int:
  """The ``warnings.warn`` stacklevel of the first frame outside brainnx, jax and flax."""
  frame, level = sys._getframe(1), 1
  while frame is not None and frame.f_code.co_filename.startswith(LIBRARY_DIRS):
    frame, level = frame.f_back, level + 1
  return level


def _place(value, axis, unstacked: bool = False):
  """Move the batch axis (0) of every leaf to ``axis``, or keep one copy (``ONCE``).

  ``unstacked``: the mapping already gave values placed ``ONCE`` without a batch axis (an
  empty batch, mapped with ``out_axes=None`` for them: there is no element 0 to take).
  """
  if axis is ONCE:
    return value if unstacked else jax.tree.map(lambda x: x[0], value)
  if axis == 0:
    return value
  return jax.tree.map(lambda x: jnp.moveaxis(x, 0, axis), value)


def _one_of_zeros(tree, axes):
  """A zero-size batch as a batch of one element of zeros, for ``pmap`` (which cannot map
  nothing), so values that do not depend on the batch can still be computed."""
  def grow(x, axis):
    if axis is None:
      return x
    shape = list(jnp.shape(x))
    shape[axis] = 1
    return jnp.zeros(shape, jnp.result_type(x))

  return [jax.tree.map(lambda x, a=a: grow(x, a), t) for t, a in zip(tree, axes)]


def _out_leaf_axes(cfg: VmapConfig, spec) -> list:
  """The out-axis of every output leaf; a Module created inside takes ``out_axes``, except
  Variables of it that ``state_out_axes`` places (``None``: one shared copy)."""
  markers = jax.tree.unflatten(spec.treedef, list(range(spec.treedef.num_leaves)))
  flat = jax.tree_util.tree_flatten_with_path(markers)[0]
  axes = []
  for (path, _), slot in zip(flat, spec.slots):
    axis = _axis_at(cfg.out_axes, tuple(key_name(k) for k in path), 'out_axes')
    if type(slot) is Leaf:
      axes.append(axis)
    elif type(slot) is New:
      for var_path, var in slot.leaf_vars:
        hit, declared = cfg.state_out.axis_of(var_path, var)
        axes.append(declared if hit else axis)
  return axes


def _check_unbatched_outputs(cfg: VmapConfig, spec, leaves: list, axes: list, batched) -> None:
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


def _warn_identical_members(cfg: VmapConfig, spec, leaves: list, axes: list, batched) -> None:
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
          f'{cfg.name}: no Param of the {slot.graphdef.type.__name__ if hasattr(slot.graphdef, "type") else "Module"} '
          f'created inside depends on the batch, so all members are identical (first: '
          f'{type(var).__name__} at {tuple(path)!r}). Its nnx.Rngs was probably created inside the '
          'mapped function: create it outside (rngs = nnx.Rngs(0); vmap(lambda: Model(rngs=rngs), '
          'axis_size=n)()), or keep one shared copy with state_out_axes={None: nnx.Param}',
          UserWarning,
          stacklevel=_user_stacklevel(),
        )


@dataclasses.dataclass
class _Decisions:
  """What the mapped body found out about one call, decided on its first trace."""

  attachments: Attachments  # what the call attached (one stand-in per created leaf)
  out_spec: OutSpec
  written: list  # discovery indices written (RNG streams excluded)
  placement: list  # per written Variable: an int axis or ONCE
  new_placement: list  # per new Variable
  out_axes: list  # per output leaf


def mapped_call(cfg: VmapConfig, args: tuple, kwargs: dict):
  """One mapped call inside the current trace (see module docstring)."""
  stateful = StatefulCall.enter(cfg.fn, args, kwargs, name=cfg.name, statics=cfg.statics, creates='keep')
  disc, values = stateful.disc, stateful.values
  layout = _layout(cfg, disc, stateful.call, args, kwargs)
  size = layout.size
  dyn_in = stateful.call.dyn
  # jax caches pmapped functions by identity, keeping ``body`` alive: it must not hold tracers
  stateful.call = dataclasses.replace(stateful.call, dyn=())
  state_in = list(values)
  pad = layout.size == 0 and cfg.mapper is Mapper.PMAP  # pmap runs an empty batch as one element
  for k, c in layout.split_streams:
    state_in[k] = split_per_element(values[k], values[c], max(layout.size, 1) if pad else layout.size)
  stream_vars = {i for pair in layout.split_streams for i in pair}
  if cfg.mapper is Mapper.PMAP:
    devices = dict(cfg.pmap_kwargs).get('devices') or jax.local_devices(backend=dict(cfg.pmap_kwargs).get('backend'))
    if layout.size > len(devices):
      raise ValueError(
        f'pmap: the batch has {layout.size} elements but there are only {len(devices)} devices: '
        'pmap maps one element per device; use vmap, or shard_map/jit with shardings, or split the batch'
      )
  empty = layout.size == 0
  if pad:
    split = {k for k, _ in layout.split_streams}
    state_in = [x if i in split else _one_of_zeros([x], [a])[0] for i, (x, a) in enumerate(zip(state_in, layout.state_axes))]
    dyn_in = tuple(_one_of_zeros(list(dyn_in), list(layout.dyn_axes)))
    layout = dataclasses.replace(layout, size=1)
  decisions = Record(cfg.name)  # set by the first trace of ``body``; pmap traces twice

  def body(states, dyn):
    trace = _compat.current_trace()
    step = stateful.step(states, dyn)
    out_spec, out_leaves = step.split_out(disc)
    written = [i for i in step.written if i not in stream_vars]
    if not decisions.is_set:  # pmap: decisions come from the abstract vmap pass
      batched = lambda x: any(_compat.is_batched_here(leaf, trace) for leaf in jax.tree.leaves(x))  # noqa: E731
      out_axes = _out_leaf_axes(cfg, out_spec)
      _check_unbatched_outputs(cfg, out_spec, out_leaves, out_axes, batched)
      _warn_identical_members(cfg, out_spec, out_leaves, out_axes, batched)
      decisions.set(_Decisions(
        attachments=step.attachments,
        out_spec=out_spec,
        written=written,
        placement=[_decide(cfg, disc, i, layout.state_axes[i], batched(step.values[i])) for i in written],
        new_placement=[_new_var_axis(cfg, v, batched(x)) for v, x in zip(step.new_vars, step.new_values)],
        out_axes=out_axes,
      ))
    return [step.values[i] for i in written], step.new_values, out_leaves

  with stateful.rolling_back():
    if cfg.mapper is Mapper.PMAP:
      jax.eval_shape(_vmap_of(cfg, layout, body), state_in, dyn_in)
      disc.restore(stateful.contents)
      run_mapped = _pmap_of(cfg, layout, body)
    elif empty:
      # an empty batch computes what does not depend on it, as jax.vmap does: the first trace
      # decides what is batched, and the unbatched values leave with out_axes=None
      jax.eval_shape(_vmap_of(cfg, layout, body), state_in, dyn_in)
      disc.restore(stateful.contents)
      d = decisions.get()
      run_mapped = _vmap_of(cfg, layout, body, out_axes=(
        [None if a is ONCE else 0 for a in d.placement],
        [None if a is ONCE else 0 for a in d.new_placement],
        [None if a is None else 0 for a in d.out_axes],
      ))
    else:
      run_mapped = _vmap_of(cfg, layout, body)
    try:
      written_vals, new_vals, out_leaves = run_mapped(state_in, dyn_in)
    except ValueError as e:
      vmap_checks.raise_clearer(cfg.name, e)
      raise
    decided = decisions.get()
    _check_out_rules(cfg, disc, decided)
    def place(value, axis):
      if pad and axis is not ONCE:  # the padded element goes: back to no elements
        value = jax.tree.map(lambda x: x[:0], value)
      return _place(value, axis, unstacked=empty and not pad)

    written_now = [place(v, a) for v, a in zip(written_vals, decided.placement)]
    new_now = [place(v, a) for v, a in zip(new_vals, decided.new_placement)]
    leaves = [place(x, ONCE if a is None else a) for x, a in zip(out_leaves, decided.out_axes)]
    streams = [c for _, c in layout.split_streams]
    stateful.write_back(written_now + [advanced_count(values[c]) for c in streams], indices=decided.written + streams)
  result, attached = finish_call(disc, decided.attachments, new_now, decided.out_spec, leaves)
  if cfg.new_states and cfg.state_tag is not None:
    for v, axis in zip(attached, decided.new_placement):
      if v is not None and axis is not ONCE:
        v.set_metadata(tag=cfg.state_tag)
  _mark_stacked(cfg, decided, result, size, attached)
  return result


def _check_out_rules(cfg: VmapConfig, disc: Discovery, decided: '_Decisions') -> None:
  """Every ``state_out_axes`` entry must match a Variable reached, created or returned."""
  named = list(zip(disc.paths, disc.variables)) + [((), v) for v in decided.attachments.stand_ins]
  for slot in decided.out_spec.new_nodes():
    named.extend(slot.leaf_vars)
  vmap_checks.check_rules_reach(cfg.name, cfg.state_out, named, 'the function reaches or creates')


def _mark_stacked(cfg: VmapConfig, decided: '_Decisions', result, size: int, attached: list) -> None:
  """Record the batch axis on every Variable this call built stacked: those of Modules created
  inside and returned, and those created inside that come out batched (``vmap_new_states``)."""
  vmap_checks.mark_results(decided.out_spec, result, decided.out_axes, size, cfg.partition_name)
  if not cfg.new_states:  # a sown Intermediate under plain vmap stays as flax would give it
    return
  for v, axis in zip(attached, decided.new_placement):
    if v is not None and axis is not ONCE:
      mark_stacked(v, axis, size, cfg.partition_name)


def _new_var_axis(cfg: VmapConfig, variable, batched: bool):
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


def _vmap_of(cfg: VmapConfig, layout: _Layout, body, out_axes=0):
  return jax.vmap(
    body,
    in_axes=(layout.state_axes, layout.dyn_axes),
    out_axes=out_axes,
    axis_name=cfg.axis_name,
    axis_size=layout.size,
    spmd_axis_name=cfg.spmd_axis_name,
  )


def _pmap_of(cfg: VmapConfig, layout: _Layout, body):
  return jax.pmap(
    body,
    axis_name=cfg.axis_name,
    in_axes=(layout.state_axes, layout.dyn_axes),
    out_axes=0,
    axis_size=layout.size,
    **dict(cfg.pmap_kwargs),
  )


def _partition_name(transform_metadata, name: str):
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


def mapped(name: str, fn: Callable | None, config: VmapConfig):
  """A ``MappedFunction`` of ``fn`` with ``config``, or a decorator when ``fn`` is None."""
  if fn is None:
    return lambda f: mapped(name, f, config)
  check_callable(fn, name)
  size = config.axis_size
  if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 0):
    raise ValueError(f'{name}: axis_size must be a non-negative int, got axis_size={size!r}')
  return MappedFunction(dataclasses.replace(config, fn=fn))


def vmap(
  fn: Callable | None = None,
  *,
  in_axes: Any = 0,
  out_axes: Any = 0,
  axis_name: Hashable | None = None,
  axis_size: int | None = None,
  spmd_axis_name: Any = None,
  state_in_axes: Any = None,
  state_out_axes: Any = None,
  unexpected_out_state_mapping: str = 'raise',
  transform_metadata: dict | None = None,
) -> Callable:
  """Vectorizing map over arguments *and* the Variables ``fn`` reaches.

  Works as ``vmap(f)``, ``@vmap`` and ``@vmap(in_axes=...)``.
  ``state_in_axes`` / ``state_out_axes`` give batch axes to Variables by NNX
  filter (``nnx.Param``, a tag, ``nnx.PathContains``, ``nnx.All/Any/Not``, a
  predicate, a Variable instance or a list of them): a filter alone means
  ``{0: filter}``; a dict ``{axis: filter}`` (axis int or ``None``) is read
  in order, first match wins. Other Variables take the ``in_axes`` of the
  argument they came through (a Module passed with ``in_axes=0`` is mapped
  whole), else they are broadcast. Every ``nnx.Rngs`` stream not matched by
  ``state_in_axes`` gives each element its own key and advances once.

  A written Variable goes out on its ``state_out_axes`` axis, else its
  in-axis; a broadcast Variable whose new value is the same for all
  elements is written once; one that differs per element follows
  ``unexpected_out_state_mapping``: ``'raise'`` (``BatchAxisError``),
  ``'warn'`` or ``'ignore'`` (stacked on axis 0).

  Args:
    fn: the function to map. Default ``None``: return a decorator.
    in_axes: the batch axis of each positional argument: an int, ``None``
      (broadcast), or a tuple with one entry per positional argument (each
      an int, ``None`` or a pytree prefix of them). Keyword arguments are
      mapped on axis 0. Default ``0``.
    out_axes: the batch axis of the outputs (an int, ``None`` for an output
      that is the same for every element, or a pytree prefix). Default ``0``.
    axis_name: a name for the mapped axis, for collectives such as
      ``jax.lax.pmean(x, axis_name)``. Default ``None``.
    axis_size: the batch size, needed when nothing mapped gives it (a
      non-negative int). Default ``None``.
    spmd_axis_name: passed to ``jax.vmap``. Default ``None``.
    state_in_axes: batch axes of Variables going in: a filter (``{0:
      filter}``) or a dict ``{axis: filter}``. Default ``None``: no rules.
    state_out_axes: batch axes of written Variables going out, in the same
      form. Default ``None``: no rules.
    unexpected_out_state_mapping: what happens to a broadcast Variable
      written with a per-element value: ``'raise'`` (default), ``'warn'`` or
      ``'ignore'``.
    transform_metadata: ``{nnx.PARTITION_NAME: axis}``, as ``nnx.vmap``
      takes it: the mesh axis that sharding metadata (``out_sharding``) of
      Variables created stacked gives the new axis. Default ``None``: the
      axis is inserted as ``None`` (not sharded), so the metadata keeps the
      array's rank either way.

  Returns:
    The mapped function (reading and writing Variables as described), or,
    when ``fn`` is ``None``, a decorator that makes one.

  Raises:
    TypeError: if ``fn`` is not callable, or if ``state_in_axes`` /
      ``state_out_axes`` hold something that is not a filter or an axis key
      that is not an int or ``None``; when called, if ``in_axes`` is not an
      int, ``None`` or a tuple.
    ValueError: if ``axis_size`` is not a non-negative int or
      ``unexpected_out_state_mapping`` is not one of the three policies;
      when called, if a tuple ``in_axes`` does not have one entry per
      positional argument, an input has no axis to map over, the batch sizes
      disagree or none is given, or an output with ``out_axes=None``
      depends on the batch.
    BatchAxisError: when called, if a Variable's batch axis cannot be
      decided or contradicts itself: a broadcast Variable written with a
      per-element value under ``'raise'``, a ``state_out_axes=None``
      Variable that depends on the batch, one Variable reached with two
      batch axes, or an in-axis that disagrees with ``state_out_axes``.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import brainnx as bnx
    >>> rngs = nnx.Rngs(0)
    >>> make = bnx.vmap(lambda: nnx.Linear(2, 3, rngs=rngs), axis_size=4)
    >>> ensemble = make()
    >>> ensemble.kernel.shape
    (4, 2, 3)
  """
  config = vmap_config(
    'vmap',
    in_axes=in_axes,
    out_axes=out_axes,
    axis_name=axis_name,
    axis_size=axis_size,
    spmd_axis_name=spmd_axis_name,
    state_in_axes=state_in_axes,
    state_out_axes=state_out_axes,
    unexpected_out_state_mapping=unexpected_out_state_mapping,
    partition_name=_partition_name(transform_metadata, 'vmap'),
  )
  return mapped('vmap', fn, config)


def vmap_new_states(
  fun: Callable | None = None,
  *,
  in_axes: Any = 0,
  out_axes: Any = 0,
  axis_name: Hashable | None = None,
  axis_size: int | None = None,
  spmd_axis_name: Any = None,
  state_tag: str | None = None,
  state_to_exclude: Any = None,
  state_in_axes: Any = None,
  state_out_axes: Any = None,
  unexpected_out_state_mapping: str = 'raise',
  transform_metadata: dict | None = None,
) -> Callable:
  """``vmap`` whose Variables created inside ``fun`` come out stacked on axis 0.

  Works as ``vmap_new_states(f)``, ``@vmap_new_states`` and
  ``@vmap_new_states(state_tag=...)``. New Variables, including ones
  attached to existing Modules, get the batch axis (and the tag
  ``state_tag`` when given). Those matching ``state_to_exclude`` are kept
  as one value and must not depend on the batch. Existing Variables follow
  :func:`vmap`'s rules.

  Args:
    fun: the function to map. Default ``None``: return a decorator.
    in_axes: the batch axis of each positional argument, as in
      :func:`vmap`. Default ``0``.
    out_axes: the batch axis of the outputs, as in :func:`vmap`. Default ``0``.
    axis_name: a name for the mapped axis, for collectives. Default ``None``.
    axis_size: the batch size, needed when nothing mapped gives it (a
      positive int). Default ``None``.
    spmd_axis_name: passed to ``jax.vmap``. Default ``None``.
    state_tag: a tag set on every batched Variable created inside (its
      ``.tag`` metadata). Default ``None``: no tag.
    state_to_exclude: a filter of created Variables kept as one unbatched
      value. Default ``None``: none excluded.
    state_in_axes: batch axes of existing Variables going in, by filter (see
      :func:`vmap`). Default ``None``.
    state_out_axes: batch axes of written or created Variables going out, by
      filter; it takes precedence over the default axis 0. Default ``None``.
    unexpected_out_state_mapping: for existing broadcast Variables written
      with a per-element value: ``'raise'`` (default), ``'warn'`` or
      ``'ignore'``.
    transform_metadata: ``{nnx.PARTITION_NAME: axis}`` (see :func:`vmap`).

  Returns:
    The mapped function, or, when ``fun`` is ``None``, a decorator that
    makes one.

  Raises:
    TypeError: if ``fun`` is not callable, or a rule (``state_in_axes``,
      ``state_out_axes``, ``state_to_exclude``) is not a filter.
    ValueError: if ``axis_size`` is not a positive int, or
      ``unexpected_out_state_mapping`` is not one of the three policies;
      when called, for the input problems :func:`vmap` reports.
    BatchAxisError: when called, if a created Variable matching
      ``state_to_exclude`` or declared ``state_out_axes=None`` differs per
      batch element, or for the Variable problems :func:`vmap` reports.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import brainnx as bnx
    >>> cell = nnx.Dict(w=nnx.Param(jnp.ones(2)))
    >>> @bnx.vmap_new_states(state_tag='hidden')
    ... def init(x):
    ...   cell['h'] = nnx.Variable(x * cell['w'][...])
    >>> init(jnp.ones((5, 2)))
    >>> cell['h'].shape, cell['h'].tag
    ((5, 2), 'hidden')
  """
  if isinstance(axis_size, int) and axis_size <= 0:
    raise ValueError(f'vmap_new_states: axis_size must be positive, got {axis_size}')
  config = vmap_config(
    'vmap_new_states',
    in_axes=in_axes,
    out_axes=out_axes,
    axis_name=axis_name,
    axis_size=axis_size,
    spmd_axis_name=spmd_axis_name,
    state_in_axes=state_in_axes,
    state_out_axes=state_out_axes,
    unexpected_out_state_mapping=unexpected_out_state_mapping,
    new_states=True,
    state_tag=state_tag,
    partition_name=_partition_name(transform_metadata, 'vmap_new_states'),
    state_to_exclude=AxisRules(state_to_exclude, 'state_to_exclude', 'vmap_new_states') if state_to_exclude is not None else None,
  )
  return mapped('vmap_new_states', fun, config)
