"""``shard_map``: ``jax.shard_map`` for functions that read and write Variables.

Each device runs the function on its shard. Variables enter with the spec their rule in
``state_in_specs`` gives (replicated, ``P()``, where none matches), and those the function
writes leave with their ``state_out_specs`` spec (default: their input spec) and are written
back as global arrays.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jax.sharding import Mesh, PartitionSpec as P
  >>> from flax import nnx
  >>> import brainnx as bnx
  >>> mesh = Mesh(jax.devices()[:1], ('d',))
  >>> total = nnx.Variable(jnp.zeros(()))
  >>> def add(x):
  ...   total[...] += jax.lax.psum(x.sum(), 'd')
  ...   return x * 2
  >>> y = bnx.shard_map(add, mesh=mesh, in_specs=P('d'), out_specs=P('d'))(jnp.arange(4.0))
  >>> y.tolist(), float(total[...])
  ([0.0, 2.0, 4.0, 6.0], 6.0)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from brainnx._engine.arguments import ArgKind, CallArgs
from brainnx._engine.call import StatefulCall
from brainnx._engine.discovery import discover
from brainnx._engine.config import Config
from brainnx._engine.eager import call, eager
from brainnx._engine.sharding import Rules, arg_specs, check_divides, check_gathers, constrain, place
from brainnx._engine.errors import check_callable
from brainnx._engine.roots import RootKind


_REPLICATED = PartitionSpec()


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardMapConfig(Config):
  """``shard_map``'s settings: the mesh (``None``: the one set with ``jax.set_mesh``), the
  arguments' and output's specs, and the Variables' spec rules."""

  name: str = 'shard_map'
  mesh: Any = None
  in_specs: Any = None
  out_specs: Any = None
  state_in: Rules
  state_out: Rules
  axis_names: frozenset = frozenset()
  check_vma: bool = True


def shard_map(
  f: Callable,
  *,
  mesh: Any = None,
  in_specs: Any,
  out_specs: Any,
  state_in_specs: dict | None = None,
  state_out_specs: dict | None = None,
  axis_names: Any = frozenset(),
  check_vma: bool = True,
) -> Callable:
  """``jax.shard_map`` for a function that reads and writes Variables.

  ``in_specs`` has one ``PartitionSpec`` per positional argument (or one for all), as in
  ``jax.shard_map``; a graph node passed as an argument gets ``None`` (or ``P()``) there,
  since its Variables follow ``state_in_specs``, or flax's ``nnx.StateSharding`` (or an
  ``nnx.State`` of specs), which lays out that node's Variables as ``nnx.shard_map`` does,
  paths relative to the node. Collectives over the mesh axes work inside.
  Variables the function writes are written back after the call.

  Args:
    f: the per-shard function.
    mesh: a ``jax.sharding.Mesh``. Default ``None``: the mesh set with ``jax.set_mesh``.
    in_specs: specs of the positional arguments (a graph node's: ``None`` or an
      ``nnx.StateSharding``).
    out_specs: specs of the output (a prefix of its tree), as in ``jax.shard_map``.
    state_in_specs: ``{PartitionSpec: filter}``: how matched Variables are split over the
      mesh (first match wins). Default ``None``: every Variable replicated (``P()``).
    state_out_specs: ``{PartitionSpec: filter}``: how written Variables are put back
      together. Default ``None``: each with its input spec.
    axis_names: mesh axes the function is manual over, as in ``jax.shard_map``.
      Default: all of them.
    check_vma: as in ``jax.shard_map``. Default ``True``.

  Returns:
    A function with ``f``'s signature returning the global output.

  Raises:
    TypeError: if ``f`` is not callable, ``mesh`` is not a Mesh, a state spec dict is malformed, or a dynamic
      argument is passed by keyword.
    ValueError: if no mesh is given or set, a spec does not divide a Variable's shape (naming
      the Variable), ``in_specs`` has the wrong length or gives a graph node a spec (an
      ``nnx.StateSharding`` matching none of a node's Variables, or given to an array), or ``f``
      creates Variables or returns graph nodes.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import Mesh, PartitionSpec as P
    >>> import brainnx as bnx
    >>> mesh = Mesh(jax.devices()[:1], ('d',))
    >>> bnx.shard_map(lambda x: x + 1, mesh=mesh, in_specs=P('d'), out_specs=P('d'))(jnp.zeros(2)).tolist()
    [1.0, 1.0]
  """
  check_callable(f, 'shard_map')
  if mesh is not None and not isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
    raise TypeError(f'shard_map: mesh must be a jax.sharding.Mesh (or None for the mesh set with jax.set_mesh), got {mesh!r}')
  config = ShardMapConfig(
    mesh=mesh, in_specs=_hashable(_flax_specs(in_specs)), out_specs=_hashable(out_specs),
    state_in=Rules.parse(state_in_specs, 'state_in_specs'), state_out=Rules.parse(state_out_specs, 'state_out_specs'),
    axis_names=frozenset(axis_names), check_vma=check_vma,
  )

  @functools.wraps(f)
  def sharded(*args, **kwargs):
    if eager():
      _lay_out_read(f, args, kwargs, mesh, config.in_specs, config.state_in)
    return call(_shard_map_impl, config, (f,), args, kwargs, compile_first=True)

  return sharded


def _lay_out_read(f, args, kwargs, mesh, in_specs, state_in: Rules) -> None:
  """Called outside any trace: move every Variable to the layout its ``state_in_specs`` spec
  gives (``P()``: replicated over the mesh), as ``nnx.shard_map`` leaves the state it reads.
  Written Variables come back laid out by their ``state_out_specs`` anyway."""
  mesh = mesh if mesh is not None else jax.sharding.get_mesh()
  if mesh.empty or not isinstance(mesh, jax.sharding.Mesh):
    return  # the call itself says what is missing
  disc = discover(f, tuple(args), kwargs)
  by_slot = _node_shardings(in_specs, CallArgs.split(args, kwargs))[1] if _names_nodes(in_specs) else {}
  specs = _state_specs(disc, state_in, by_slot)
  for i, spec in enumerate(specs):
    check_divides(disc, i, spec, dict(mesh.shape), 'shard_map: state_in_specs')
  place(disc, [NamedSharding(mesh, spec) for spec in specs])


def _flax_specs(specs):
  """flax's ``nnx.State`` of specs as the ``nnx.StateSharding`` that ``nnx.shard_map`` builds of it."""
  if isinstance(specs, (tuple, list)):
    return type(specs)(_flax_specs(s) for s in specs)
  return nnx.StateSharding(specs) if isinstance(specs, nnx.State) else specs


def _names_nodes(in_specs) -> bool:
  """Whether ``in_specs`` holds an ``nnx.StateSharding`` (is one, or has one as an entry)."""
  entries = in_specs if isinstance(in_specs, tuple) else (in_specs,)
  return any(isinstance(s, nnx.StateSharding) for s in entries)


def _node_shardings(in_specs, arguments: CallArgs) -> tuple[Any, dict]:
  """``in_specs`` with each ``nnx.StateSharding`` entry replaced by ``None``, and the
  ``{argument position: StateSharding}`` that lays out that graph node's Variables."""
  if not _names_nodes(in_specs):
    return in_specs, {}
  positional = [s for s in range(arguments.n_args) if arguments.kinds[s] is not ArgKind.STATIC]
  if isinstance(in_specs, nnx.StateSharding):  # one entry for every argument, as a prefix
    in_specs = (in_specs,) * len(positional)
  if len(in_specs) != len(positional):
    return in_specs, {}  # arg_specs names the length
  by_slot = {}
  for n, (slot, spec) in enumerate(zip(positional, in_specs)):
    if isinstance(spec, nnx.StateSharding):
      if arguments.kinds[slot] is not ArgKind.REF:
        raise ValueError(
          f'shard_map: in_specs[{n}] is an nnx.StateSharding, which lays out a graph node\'s '
          'Variables, but that argument is not a graph node: give it a PartitionSpec'
        )
      by_slot[slot] = spec
  return tuple(None if isinstance(s, nnx.StateSharding) else s for s in in_specs), by_slot


def _state_specs(disc, state_in: Rules, by_slot: dict) -> tuple:
  """Each Variable's input spec: its argument's ``nnx.StateSharding`` (paths relative to the
  argument, as flax reads them), else the first ``state_in_specs`` rule matching it."""
  specs = list(state_in.specs(disc, _REPLICATED))
  for i, (path, var, r) in enumerate(zip(disc.paths, disc.variables, disc.root_of)):
    root = disc.roots[r]
    if root.kind is RootKind.ARG and root.name in by_slot:
      try:
        specs[i] = by_slot[root.name].map_prefix(path[1:], var)
      except ValueError:
        raise ValueError(
          f'shard_map: the nnx.StateSharding of argument {root.name} has no entry matching '
          f'{disc.describe(i)} (its path in that argument: {path[1:]})'
        ) from None
  return tuple(specs)


def _hashable(specs):
  return tuple(_hashable(s) for s in specs) if isinstance(specs, list) else specs


def _shard_map_impl(config: ShardMapConfig, roots: tuple, *args, **kwargs):
  (f,), mesh, in_specs, out_specs = roots, config.mesh, config.in_specs, config.out_specs
  state_in, state_out = config.state_in, config.state_out
  arguments = CallArgs.split(args, kwargs)
  if any(k is not ArgKind.STATIC and k is not ArgKind.REF for k in arguments.kinds[arguments.n_args:]):
    raise TypeError(
      'shard_map: in_specs refer to positional arguments; pass array arguments positionally '
      '(graph nodes may be passed by keyword)'
    )
  mesh = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
  if mesh.empty:
    raise ValueError('shard_map: no mesh: pass mesh=... or call inside `with jax.set_mesh(mesh):`')
  stateful = StatefulCall.enter(f, args, kwargs, name='shard_map')
  disc = stateful.disc
  in_specs, by_slot = _node_shardings(in_specs, arguments)
  specs_in = _state_specs(disc, state_in, by_slot)
  specs_out = tuple(o if o is not None else i for o, i in zip(state_out.specs(disc, None), specs_in))
  mesh_shape = dict(mesh.shape)
  for i, spec_in in enumerate(specs_in):
    check_divides(disc, i, spec_in, mesh_shape, 'shard_map: state_in_specs')
  dyn_specs = arg_specs(arguments, in_specs, 'shard_map: in_specs', default=_REPLICATED)
  # The Variables' out specs, filled in by the trace: ``state_out_specs`` applies to the written
  # ones only, and jax.shard_map reads its out_specs once the function has returned (they are
  # a prefix of its output).
  var_out_specs: list = []

  def per_shard(state_values, dyn):
    step = stateful.step(state_values, dyn)
    spec, leaves = step.split_out(disc)
    if spec.has_nodes:
      raise ValueError('shard_map: the function returns graph nodes or non-array values; return arrays')
    for i in step.written:  # per-shard values, put back together along the spec's axes
      check_gathers(disc, i, step.values[i], specs_out[i], mesh_shape, 'shard_map: state_out_specs')
    written = set(step.written)
    var_out_specs[:] = [specs_out[i] if i in written else specs_in[i] for i in range(len(specs_in))]
    return list(step.values), jax.tree.unflatten(spec.treedef, leaves)

  per_shard.__name__ = per_shard.__qualname__ = getattr(f, '__name__', 'shard_map')  # JAX's messages name it

  # On an explicit mesh a value's layout is part of its type: lay each Variable out as its spec says.
  values = [
    constrain(x, NamedSharding(mesh, spec)) if mesh.are_all_axes_explicit else x
    for x, spec in zip(stateful.values, specs_in)
  ]
  with stateful.rolling_back():
    now, out = jax.shard_map(
      per_shard, mesh=mesh, in_specs=(list(specs_in), dyn_specs), out_specs=(var_out_specs, out_specs),
      axis_names=config.axis_names, check_vma=config.check_vma,
    )(values, tuple(arguments.dyn))
    stateful.write_back([now[i] for i in stateful.written])
  return stateful.output(jax.tree.leaves(out))  # with what the function bound, as every transform
