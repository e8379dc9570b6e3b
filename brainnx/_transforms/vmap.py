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
import functools
import weakref
from typing import Any, Callable, Hashable

import jax
import jax.numpy as jnp

from brainnx import _compat
from brainnx._engine.call import Record, StatefulCall
from brainnx._engine.discovery import discover
from brainnx._engine.eager import eager, program
from brainnx._engine.errors import check_callable
from brainnx._engine.filters import AxisRules, members_metadata
from brainnx._engine.jitted import JitOptions
from brainnx._engine.nodes import is_int
from brainnx._engine.rng import advanced_count, split_per_element
from brainnx._engine.sentinels import ONCE
from brainnx._engine.state import finish_call
from brainnx._transforms import vmap_checks
from brainnx._transforms.mapping_config import Mapper, VmapConfig, partition_name, vmap_config
from brainnx._transforms.vmap_axes import BatchLayout, batch_layout, one_of_zeros, uncommit, uncommitted, written_axis
from brainnx._transforms.vmap_outputs import (
  Decisions,
  check_out_rules,
  check_unbatched_outputs,
  created_axis,
  mark_created_stacked,
  out_leaf_axes,
  place_batched,
  warn_identical_members,
)


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
    except _compat.DEVICE_MISMATCH_ERRORS as e:
      if self.config.mapper is not Mapper.PMAP or not _compat.is_device_mismatch(e):
        raise
    # jax.pmap takes inputs committed to other devices (a counter a 2-device pmap wrote, now read
    # by a 4-device one), where the compiled program around it cannot: move them, as pmap would
    uncommit(discover(self.config.fn, args, kwargs).variables)
    args, kwargs = jax.tree.map(uncommitted, (args, kwargs))
    return self._program(*args, **kwargs)

  def __get__(self, obj, objtype=None):
    """Decorating a method: ``self`` is bound as the first argument, as for a function."""
    return self if obj is None else functools.partial(self, obj)

  def __repr__(self) -> str:
    return f'brainnx.{self.config.name}({getattr(self.config.fn, "__name__", self.config.fn)!r})'


def _mapped_impl(config: VmapConfig, roots: tuple, *args, **kwargs):
  return mapped_call(config, args, kwargs)


# -- axes of arguments ---------------------------------------------------------------


# -- the mapped call ----------------------------------------------------------------


def mapped_call(cfg: VmapConfig, args: tuple, kwargs: dict):
  """One mapped call inside the current trace (see module docstring)."""
  stateful = StatefulCall.enter(cfg.fn, args, kwargs, name=cfg.name, statics=cfg.statics, creates='keep')
  disc, values = stateful.disc, stateful.values
  layout = batch_layout(cfg, disc, stateful.call, args, kwargs)
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
    state_in = [x if i in split else one_of_zeros([x], [a])[0] for i, (x, a) in enumerate(zip(state_in, layout.state_axes))]
    dyn_in = tuple(one_of_zeros(list(dyn_in), list(layout.dyn_axes)))
    layout = dataclasses.replace(layout, size=1)
  mapped_vars = [(disc.variables[i], axis, max((jnp.ndim(x) for x in jax.tree.leaves(values[i])), default=0))
                 for i, axis in enumerate(layout.state_axes) if axis is not None and i not in stream_vars]
  decisions = Record(cfg.name)  # set by the first trace of ``body``; pmap traces twice
  # jax.pmap's cache keeps ``body`` alive (in C++): it reaches the call, and through it the
  # Variables, only while the call runs
  call_ref = weakref.ref(stateful)

  def body(states, dyn):
    trace = _compat.current_trace()
    stateful = call_ref()
    disc = stateful.disc
    with members_metadata(mapped_vars):  # one member's sharding metadata: the mapped axis left out
      step = stateful.step(states, dyn)
    out_spec, out_leaves = step.split_out(disc)
    written = [i for i in step.written if i not in stream_vars]
    if not decisions.is_set:  # pmap: decisions come from the abstract vmap pass
      batched = lambda x: any(_compat.is_batched_here(leaf, trace) for leaf in jax.tree.leaves(x))  # noqa: E731
      out_axes = out_leaf_axes(cfg, out_spec)
      check_unbatched_outputs(cfg, out_spec, out_leaves, out_axes, batched)
      warn_identical_members(cfg, out_spec, out_leaves, out_axes, batched)
      decisions.set(Decisions(
        attachments=step.attachments,
        out_spec=out_spec,
        written=written,
        placement=[written_axis(cfg, disc, i, layout.state_axes[i], batched(step.values[i])) for i in written],
        new_placement=[created_axis(cfg, v, batched(x)) for v, x in zip(step.new_vars, step.new_values)],
        out_axes=out_axes,
      ))
    return [step.values[i] for i in written], step.new_values, out_leaves

  with stateful.rolling_back():
    if layout.stacks_broadcast:  # refused where read: a stack the function only reaches may stay
      read = vmap_checks.read_inputs(lambda: jax.make_jaxpr(_vmap_of(cfg, layout, body))(state_in, dyn_in), state_in)
      disc.restore(stateful.contents)
      vmap_checks.check_stacked_broadcast(
        cfg, disc, [i for i in layout.stacks_broadcast if read is None or i in read], layout.size)
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
    check_out_rules(cfg, disc, decided)
    def place(value, axis):
      if pad and axis is not ONCE:  # the padded element goes: back to no elements
        value = jax.tree.map(lambda x: x[:0], value)
      return place_batched(value, axis, unstacked=empty and not pad)

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
  mark_created_stacked(cfg, decided, result, size, attached)
  return result


def _vmap_of(cfg: VmapConfig, layout: BatchLayout, body, out_axes=0):
  return jax.vmap(
    body,
    in_axes=(layout.state_axes, layout.dyn_axes),
    out_axes=out_axes,
    axis_name=cfg.axis_name,
    axis_size=layout.size,
    spmd_axis_name=cfg.spmd_axis_name,
  )


def _pmap_of(cfg: VmapConfig, layout: BatchLayout, body):
  return jax.pmap(
    body,
    axis_name=cfg.axis_name,
    in_axes=(layout.state_axes, layout.dyn_axes),
    out_axes=0,
    axis_size=layout.size,
    **dict(cfg.pmap_kwargs),
  )


def mapped(name: str, fn: Callable | None, config: VmapConfig):
  """A ``MappedFunction`` of ``fn`` with ``config``, or a decorator when ``fn`` is None."""
  if fn is None:
    return lambda f: mapped(name, f, config)
  check_callable(fn, name)
  size = config.axis_size
  if size is not None and not is_int(size):
    raise TypeError(f'{name}: axis_size must be an int, got axis_size={size!r} ({type(size).__name__})')
  if size is not None and size < 0:
    raise ValueError(f'{name}: axis_size must be non-negative, got axis_size={size!r}')
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
    partition_name=partition_name(transform_metadata, 'vmap'),
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
    partition_name=partition_name(transform_metadata, 'vmap_new_states'),
    state_to_exclude=AxisRules(state_to_exclude, 'state_to_exclude', 'vmap_new_states') if state_to_exclude is not None else None,
  )
  return mapped('vmap_new_states', fun, config)
