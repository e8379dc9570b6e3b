"""``checkpointed_scan`` and ``checkpointed_for_loop``: ``scan`` and ``for_loop`` with the same
values and gradients and reverse-mode memory that grows with the logarithm of the length.

Example:
  >>> import jax, jax.numpy as jnp
  >>> import brainnx as bnx
  >>> step = lambda c, x: (jnp.tanh(c + x), c)
  >>> carry, _ = bnx.checkpointed_scan(step, 0.0, jnp.ones(10), base=2)
  >>> bool(jnp.allclose(carry, bnx.scan(step, 0.0, jnp.ones(10))[0]))
  True
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from brainnx._engine.config import Config
from brainnx._engine.eager import call
from brainnx._engine.filters import AxisRules
from brainnx._engine.loop_body import all_or_nothing, dyn_leaves, in_python
from brainnx._engine.nodes import is_int
from brainnx._transforms import scan_state
from brainnx._transforms.progress import runner_for, split_pbar
from brainnx._transforms.scan import (
  check_loop_callable,
  for_body,
  leading_length,
  python_scan,
  rebuild_part,
  scan_parts,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointedConfig(Config):
  """A checkpointed loop's settings: ``base`` steps per checkpointed block, ``pbar`` an int
  update frequency (a :class:`ProgressBar` object is a root)."""

  name: str = 'checkpointed_scan'
  length: int | None = None
  base: int = 16
  pbar: int | None = None


def _check_base(base) -> int:
  if not is_int(base) or base < 2:
    raise ValueError(f'checkpointed loops need an int base >= 2, got {base!r}')
  return base


def _digits(length: int, base: int) -> list[tuple[int, int]]:
  """``length`` in base ``base``: ``[(depth, digit), ...]``, most significant first."""
  if length < 0:
    raise ValueError(f'checkpointed loops need a non-negative length, got {length}')
  digits, depth = [], 0
  while length:
    length, digit = divmod(length, base)
    digits.append((depth, digit))
    depth += 1
  return [(d, a) for d, a in reversed(digits) if a]


def _nested_scan(step, carry, length: int, base: int):
  """``lax.scan(step, carry, None, length)`` with reverse-mode memory O(base * log_base(length)).

  ``length`` is split into its digits in base ``base``; digit ``a`` at depth
  ``d`` runs ``a`` blocks of ``base**d`` steps, a block being ``base``
  checkpointed blocks of the depth below (the innermost level, ``base``
  plain steps, is not checkpointed). A backward pass then keeps one carry
  per step of each level and recomputes the rest. ``step`` reads its inputs
  itself (by the step counter in its carry), so no slice of them is kept.
  """

  def block(depth):
    if depth == 1:
      return lambda c, _: jax.lax.scan(step, c, None, length=base)
    below = jax.checkpoint(block(depth - 1), prevent_cse=False)
    return lambda c, _: jax.lax.scan(below, c, None, length=base)

  if length == 0:  # as jax.lax.scan: the carry as given, every output with a leading axis of 0
    return jax.lax.scan(step, carry, None, length=0)
  pieces = []
  for depth, count in _digits(length, base):
    body = step if depth == 0 else jax.checkpoint(block(depth), prevent_cse=False)
    carry, ys = jax.lax.scan(body, carry, None, length=count)
    pieces.append(jax.tree.map(lambda y: y.reshape((count * base**depth,) + y.shape[depth + 1 :]), ys))
  ys = pieces[0] if len(pieces) == 1 else jax.tree.map(lambda *p: jnp.concatenate(p), *pieces)
  return carry, ys


def checkpointed_scan(
  f: Callable, init: Any, xs: Any, length: int | None = None, base: int = 16, pbar=None
) -> tuple[Any, Any]:
  """``scan`` with the same values and gradients, and less reverse-mode memory.

  Reverse-mode memory grows like O(base * log_base(length)) steps instead of
  O(length): the steps are split into nested checkpointed blocks of
  ``base`` steps, and a backward pass recomputes the inner steps.

  Args:
    f: the body, ``f(carry, x) -> (carry, y)`` (see :func:`scan`).
    init: the initial carry (a pytree).
    xs: a pytree of arrays scanned over their leading axis.
    length: the number of steps; must agree with ``xs``'s leading size.
      Default ``None``: that size.
    base: the block size of each checkpointing level (an int >= 2). Default
      ``16``.
    pbar: a :class:`ProgressBar`, or an int update frequency. Default
      ``None``: no bar.

  Returns:
    ``(carry, ys)``, as :func:`scan`.

  Raises:
    TypeError: if ``f`` is not callable, or ``pbar`` is not ``None``, a
      ``ProgressBar`` or an int.
    ValueError: if ``base`` is not an int >= 2, the loop has zero steps, or
      for the problems :func:`scan` reports.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import brainnx as bnx
    >>> def total(w):
    ...   return bnx.checkpointed_scan(lambda c, x: (jnp.tanh(c * w + x), c), 0.0, jnp.ones(100), base=4)[0]
    >>> bool(jnp.allclose(jax.grad(total)(0.5), jax.grad(lambda w: bnx.scan(
    ...     lambda c, x: (jnp.tanh(c * w + x), c), 0.0, jnp.ones(100))[0])(0.5)))
    True
  """
  check_loop_callable(f, 'checkpointed_scan')
  base = _check_base(base)
  bar, rest = split_pbar(pbar)
  return call(_checkpointed_impl, CheckpointedConfig(length=length, base=base, pbar=rest), (f, bar), (init, xs))


def _checkpointed_impl(config: CheckpointedConfig, roots: tuple, init, xs):
  f, bar = roots
  return run_checkpointed(config, f, bar, init, xs)


def run_checkpointed(config: CheckpointedConfig, f: Callable, bar, init, xs):
  """``checkpointed_scan(f, init, xs)`` as ``config`` says, in the current trace."""
  name, base = config.name, config.base
  if scan_state.holds_nodes(xs):
    raise TypeError(
      f'{name}: xs holds a graph node (a Module or Rngs); scanning over stacked Variables is '
      'done by scan and for_loop: use one of them (under brainnx.remat for less memory)'
    )
  n = leading_length(xs, config.length, name)
  runner = runner_for(bar or config.pbar, n)
  if in_python() and n:
    return all_or_nothing(f, (init, xs), lambda: python_scan(f, init, xs, n, False, runner))
  body, n_carry, _ = scan_parts(f, init, xs, name, AxisRules(None, 'state_in_axes'), keep_new=False)

  xs_leaves = dyn_leaves(xs)

  def step(carry, _):
    written, leaves, (run_id, i) = carry
    # inputs are read by index from the (loop-constant) xs, so that the checkpointed
    # levels keep only carries as residuals, never slices of xs
    x_leaves = [  # a zero-length loop only traces its step: a slice of nothing is zeros
      jax.lax.dynamic_index_in_dim(x, i, keepdims=False) if n else jnp.zeros(jnp.shape(x)[1:], jnp.result_type(x))
      for x in xs_leaves
    ]
    written, out = body.run(written, leaves + x_leaves)
    if runner:
      runner.step(run_id, i, rebuild_part(body, out, 0), rebuild_part(body, out, 1))
    return (written, out[:n_carry], (run_id, i + 1)), out[n_carry:]

  run_id = runner.start() if runner else jnp.int32(0)
  init_carry = (body.initial_written(), dyn_leaves(init), (run_id, jnp.int32(0)))
  (written, leaves, _), ys = _nested_scan(step, init_carry, n, base)
  body.write_back(written)
  return body.output(list(leaves) + list(ys))


def checkpointed_for_loop(f: Callable, *xs, length: int | None = None, base: int = 16, pbar=None) -> Any:
  """``for_loop`` with the memory profile of :func:`checkpointed_scan`.

  Values and gradients are those of :func:`for_loop`; reverse-mode memory
  grows like O(base * log_base(length)) steps.

  Args:
    f: the body, called as ``f(*x)`` with one leading-axis slice of each of
      ``xs``.
    *xs: pytrees of arrays looped over their leading axis (same size).
    length: the number of steps; must agree with the leading sizes.
      Default ``None``: that size.
    base, pbar: as in :func:`checkpointed_scan`.

  Returns:
    ``f``'s outputs for every step, stacked along a new leading axis.

  Raises:
    TypeError: if ``f`` is not callable, or ``pbar`` is not ``None``, a
      ``ProgressBar`` or an int.
    ValueError: if ``base`` is not an int >= 2, the loop has zero steps, or
      for the problems :func:`for_loop` reports.

  Example:
    >>> import jax.numpy as jnp
    >>> import brainnx as bnx
    >>> bnx.checkpointed_for_loop(lambda x: x * 2, jnp.arange(5), base=2).tolist()
    [0, 2, 4, 6, 8]
  """
  check_loop_callable(f, 'checkpointed_for_loop')
  base = _check_base(base)
  bar, rest = split_pbar(pbar)
  config = CheckpointedConfig(name='checkpointed_for_loop', length=length, base=base, pbar=rest)
  return call(_checkpointed_for_impl, config, (f, bar), xs)


def _checkpointed_for_impl(config: CheckpointedConfig, roots: tuple, *xs):
  f, bar = roots
  return run_checkpointed(config, for_body(f), bar, None, xs)[1]
