"""Per-element RNG streams for mapped calls.

An ``nnx.RngStream`` is a key Variable and a count Variable; a draw is
``fold_in(key, count)`` followed by ``count += 1``. For a mapped call brainnx
draws once from the stream, splits that key into one key per batch element,
lets every element use its own key (with the stream's count), and afterwards
leaves the key as it was and the count advanced by exactly one.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from brainnx._engine.rng import split_per_element
  >>> keys = split_per_element(jax.random.key(0), jnp.uint32(0), 4)
  >>> keys.shape
  (4,)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def split_per_element(key: jax.Array, count: jax.Array, size: int) -> jax.Array:
  """``size`` independent keys from one draw of the stream, stacked on axis 0.

  Works for a stream of any key shape (a stack of streams splits each one).
  """
  base = jax.random.fold_in(key, count) if key.ndim == 0 else _fold_many(key, count)
  if base.ndim == 0:
    return jax.random.split(base, size)
  flat = base.reshape(-1)
  keys = jax.vmap(lambda k: jax.random.split(k, size))(flat)  # (n, size)
  return jnp.moveaxis(keys, 1, 0).reshape((size,) + base.shape)


def _fold_many(key, count):
  count = jnp.broadcast_to(count, key.shape)
  flat = jax.vmap(jax.random.fold_in)(key.reshape(-1), count.reshape(-1))
  return flat.reshape(key.shape)


def advanced_count(count: jax.Array) -> jax.Array:
  """The count of a stream after one draw."""
  return count + jnp.ones_like(count)
