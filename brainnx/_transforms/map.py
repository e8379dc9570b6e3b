"""``map``: a function over the leading axis, sequentially or in ``vmap`` chunks.

Example:
  >>> import jax.numpy as jnp
  >>> import brainnx as bnx
  >>> bnx.map(lambda row: row.sum(), jnp.arange(12.0).reshape(6, 2), batch_size=4).tolist()
  [1.0, 5.0, 9.0, 13.0, 17.0, 21.0]
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from brainnx._engine.config import Config
from brainnx._engine.discovery import discover
from brainnx._engine.eager import call
from brainnx._engine.filters import stacks_handled_by
from brainnx._engine.loop_body import LoopBody
from brainnx._engine.nodes import is_int
from brainnx._transforms.scan import (
  ScanConfig,
  check_loop_callable,
  for_body,
  leading_length,
  run_scan,
  scan,
  step_example,
)
from brainnx._transforms.vmap import vmap


@dataclasses.dataclass(frozen=True, kw_only=True)
class MapConfig(Config):
  """A ``map``'s settings: ``batch_size`` ``None`` for a sequential loop, else the chunk size."""

  name: str = 'map'
  batch_size: int | None = None


def map(f: Callable, *xs, batch_size: int | None = None) -> Any:  # noqa: A001 - brainstate's name
  """Apply ``f`` to every slice of ``xs`` along the leading axis; outputs stacked.

  Without ``batch_size`` this is a sequential loop (``f`` may write
  Variables). With ``batch_size`` it runs ``vmap(f)`` over chunks of that
  size (then the remainder), trading memory for speed; ``f`` may then only
  write RNG state (each element draws its own keys).

  Args:
    f: the function, called as ``f(*x)`` with one leading-axis slice of each
      of ``xs``.
    *xs: pytrees of arrays mapped over their leading axis; every leaf must
      have the same leading size.
    batch_size: ``None`` (default) for a sequential loop, or a positive int:
      the number of slices evaluated together by ``vmap``.

  Returns:
    ``f``'s outputs for every slice, stacked along a new leading axis (a
    pytree of the structure ``f`` returns).

  Raises:
    TypeError: if ``f`` is not callable.
    ValueError: if ``batch_size`` is not a positive int, if ``xs`` holds no
      arrays, a scalar, or leaves of different leading sizes, or if with
      ``batch_size`` ``f`` writes a Variable other than RNG state.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import brainnx as bnx
    >>> seen = nnx.Variable(jnp.array(0))
    >>> def f(x):
    ...   seen[...] += 1
    ...   return x * 2
    >>> bnx.map(f, jnp.arange(4)).tolist(), int(seen[...])
    ([0, 2, 4, 6], 4)
  """
  check_loop_callable(f, 'map')
  if batch_size is not None and (not is_int(batch_size) or batch_size <= 0):
    raise ValueError(f'map: batch_size must be a positive int, got {batch_size!r}')
  return call(_map_impl, MapConfig(batch_size=batch_size), (f,), xs)


def _map_impl(config: MapConfig, roots: tuple, *xs):
  (f,), batch_size = roots, config.batch_size
  if not jax.tree.leaves(xs):
    raise ValueError('map: no inputs to map over')
  n = leading_length(xs, None, 'map')
  if batch_size is None:
    with stacks_handled_by(f):  # map slices its inputs, never Variables: a stack read whole is meant
      return run_scan(ScanConfig(name='map'), for_body(f), None, None, xs)[1]
  example = (None, step_example(xs))
  body = LoopBody(lambda c, x: (c, f(*x)), example, 'map', discover(f, example, {}))
  written = [i for i in body.written if not isinstance(body.disc.variables[i], nnx.RngState)]
  if written:
    names = ', '.join(body.disc.describe(i) for i in written)
    raise ValueError(
      f'map: with batch_size, f runs under vmap and may not write {names}; '
      'drop batch_size for a sequential map, or return the values instead'
    )
  full, rest = divmod(n, batch_size)
  mapped = vmap(f)

  def chunk_step(c, chunk):
    return c, mapped(*chunk)

  outs = []
  with stacks_handled_by(f, chunk_step):  # as above
    if full:
      chunks = jax.tree.map(lambda x: x[: full * batch_size].reshape((full, batch_size) + x.shape[1:]), xs)
      _, ys = scan(chunk_step, None, chunks)
      outs.append(jax.tree.map(lambda y: y.reshape((full * batch_size,) + y.shape[2:]), ys))
    if rest:
      outs.append(mapped(*jax.tree.map(lambda x: x[full * batch_size :], xs)))
  if len(outs) == 1:
    return outs[0]
  return jax.tree.map(lambda a, b: jnp.concatenate([a, b]), *outs)
