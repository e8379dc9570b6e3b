"""State-aware ``pmap``: ``vmap``'s Variable semantics, one batch element per device.

Inside ``jax.pmap`` a value carries no mark of whether it differs across
devices, so a mapped call first traces ``fn`` under an abstract ``vmap``
(no computation) to decide where every written Variable goes, then runs it
under ``jax.pmap`` with those decisions. ``fn``'s Python therefore runs twice
per trace.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from flax import nnx
  >>> import brainnx as bnx
  >>> n = jax.local_device_count()
  >>> total = nnx.Variable(jnp.zeros(()))
  >>> @bnx.pmap(axis_name='d')
  ... def add(x):
  ...   total[...] += jax.lax.psum(x, 'd')   # same on every device: written once
  ...   return x * 2
  >>> add(jnp.ones(n)).shape == (n,), float(total[...]) == n
  (True, True)
"""

from __future__ import annotations

from typing import Any, Callable, Hashable

from brainnx._engine.arguments import StaticArgs, normalize_argnums
from brainnx._transforms.mapping_config import Mapper, vmap_config
from brainnx._transforms.vmap import mapped


def pmap(
  fn: Callable | None = None,
  axis_name: Hashable | None = None,
  *,
  in_axes: Any = 0,
  out_axes: Any = 0,
  static_broadcasted_argnums: int | tuple[int, ...] = (),
  devices=None,
  backend: str | None = None,
  axis_size: int | None = None,
  donate_argnums: int | tuple[int, ...] = (),
  state_in_axes: Any = None,
  state_out_axes: Any = None,
  unexpected_out_state_mapping: str = 'raise',
) -> Callable:
  """Parallel map over devices with ``vmap``'s Variable rules (see :func:`vmap`).

  Works as ``pmap(f)``, ``@pmap`` and ``@pmap(axis_name=...)``. One batch
  element runs per device; Variables get batch axes exactly as under
  :func:`vmap`. ``static_broadcasted_argnums`` are hashable arguments baked
  into the trace; ``donate_argnums`` donates those arguments' buffers to the
  compiled call.

  For new code on several devices prefer :func:`jit` with ``state_shardings`` and
  :func:`vmap` with ``spmd_axis_name`` (a sharded ensemble), or :func:`shard_map`: they
  work on meshes of any shape and across hosts under ``jax.distributed``.

  Args:
    fn: the function to map. Default ``None``: return a decorator.
    axis_name: a name for the mapped axis, for collectives such as
      ``jax.lax.psum(x, axis_name)``. Default ``None``.
    in_axes: the batch axis of each positional argument (an int, ``None``
      for broadcast, or a tuple/pytree of them), as in ``jax.pmap``.
      Default ``0``.
    out_axes: the batch axis of the outputs, as in ``jax.pmap``. Default ``0``.
    static_broadcasted_argnums: positions of hashable arguments baked into
      the trace. Default ``()``.
    devices: the devices to run on, as in ``jax.pmap``. Default ``None``:
      the local devices of ``backend``.
    backend: the XLA backend, as in ``jax.pmap``. Default ``None``.
    axis_size: the batch size, needed when nothing mapped gives it (a
      non-negative int). Default ``None``.
    donate_argnums: positions of arguments whose buffers the compiled call
      may reuse. Default ``()``.
    state_in_axes: batch axes of Variables going in, by filter (see
      :func:`vmap`). Default ``None``: by the argument they come through.
    state_out_axes: batch axes of written Variables going out, by filter.
      Default ``None``: their in-axis.
    unexpected_out_state_mapping: what happens to a broadcast Variable
      written with a per-element value: ``'raise'`` (default), ``'warn'`` or
      ``'ignore'`` (both stack it on axis 0).

  Returns:
    The mapped function (reading and writing Variables as ``fn`` does), or,
    when ``fn`` is ``None``, a decorator that makes one.

  Raises:
    TypeError: if ``fn`` is not callable, if an argnum is not an int, or if
      ``state_in_axes``/``state_out_axes`` hold something that is not a
      filter or an axis key that is not an int or ``None``.
    ValueError: if ``axis_size`` is not a non-negative int, an argnum is
      negative, or ``unexpected_out_state_mapping`` is not one of the three
      policies; when called, if the batch is larger than the number of
      devices, or the batch sizes disagree or none is given.
    BatchAxisError: when called, if a Variable's batch axis cannot be
      decided or contradicts itself (see :class:`BatchAxisError`).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> import brainnx as bnx
    >>> n = jax.local_device_count()
    >>> rngs = nnx.Rngs(0)
    >>> draws = bnx.pmap(lambda: rngs.normal(()), axis_size=n)()   # one key per device
    >>> draws.shape == (n,), int(rngs.default.count[...])
    (True, 1)
  """
  statics = normalize_argnums(static_broadcasted_argnums, 'static_broadcasted_argnums')
  config = vmap_config(
    'pmap',
    in_axes=in_axes,
    out_axes=out_axes,
    axis_name=axis_name,
    axis_size=axis_size,
    state_in_axes=state_in_axes,
    state_out_axes=state_out_axes,
    unexpected_out_state_mapping=unexpected_out_state_mapping,
    mapper=Mapper.PMAP,
    pmap_kwargs=tuple((k, v) for k, v in (('devices', devices), ('backend', backend)) if v is not None),
    statics=StaticArgs(argnums=statics),
    donate_argnums=normalize_argnums(donate_argnums, 'donate_argnums'),
  )
  return mapped('pmap', fn, config)
