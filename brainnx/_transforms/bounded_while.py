"""``bounded_while_loop``: a while loop with a step limit that reverse-mode differentiates.

``jax.lax.while_loop`` has no reverse-mode derivative, because the number of steps is not
known when the program is built. Bounding it by ``max_steps`` makes it a fixed program: the
steps run inside nested ``jax.lax.scan``s of ``base`` slots each, every slot guarded by the
condition (a slot whose condition is false passes its value through), and every level but the
innermost wrapped in ``jax.checkpoint``. A backward pass then keeps ``base`` values per level,
about ``base * log_base(max_steps)`` in all, instead of one per step.

Example:
  >>> import jax, jax.numpy as jnp
  >>> import brainnx as bnx
  >>> halve = lambda x: bnx.bounded_while_loop(lambda c: c > 1.0, lambda c: c / 2, x, max_steps=100)
  >>> float(halve(20.0)), float(jax.grad(halve)(20.0))  # 20 -> 10 -> 5 -> 2.5 -> 1.25 -> 0.625
  (0.625, 0.03125)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

from brainnx._engine.config import Config
from brainnx._engine.eager import call
from brainnx._engine.loop_body import all_or_nothing, dyn_leaves, in_python
from brainnx._engine.nodes import is_int
from brainnx._transforms.progress import runner_for, split_pbar
from brainnx._transforms.scan import check_loop_callable
from brainnx._transforms.while_loops import while_parts

_NAME = 'bounded_while_loop'


@dataclasses.dataclass(frozen=True, kw_only=True)
class BoundedWhileConfig(Config):
  """A ``bounded_while_loop``'s settings: at most ``max_steps`` steps, ``base`` slots per nesting
  level, ``pbar`` an int update frequency (a :class:`ProgressBar` object is a root)."""

  name: str = _NAME
  max_steps: int
  base: int = 16
  pbar: int | None = None


def bounded_while_loop(cond_fun: Callable, body_fun: Callable, init_val: Any, max_steps: int, base: int = 16,
                       pbar=None) -> Any:
  """A while loop of at most ``max_steps`` steps whose body may write Variables, and which
  reverse-mode differentiates (``jax.lax.while_loop`` does not).

  The loop runs ``body_fun`` while ``cond_fun`` is true and fewer than ``max_steps`` steps have
  run. Variables ``body_fun`` writes travel in the carry and hold their final values afterwards;
  an RNG stream it draws from advances once per step run. The compiled program has room for
  ``max_steps`` steps (rounded up to a power of ``base``) in nested scans; steps past the end
  pass their value through, and cost little when not batched. Gradients keep about
  ``base * log_base(max_steps)`` carries.

  Args:
    cond_fun: ``cond_fun(val) -> bool scalar``; it may read Variables but not write them.
    body_fun: ``body_fun(val) -> val``, returning the structure of ``init_val``.
    init_val: the initial loop value (a pytree).
    max_steps: the most steps the loop runs (a positive int).
    base: slots per nesting level (an int >= 2). Default ``16``: fewer levels compile faster,
      ``2`` keeps the fewest values for a backward pass.
    pbar: a :class:`ProgressBar` or an int update frequency; its total is ``max_steps`` and it
      ends full when the loop stops early. Default ``None``.

  Returns:
    The loop value once ``cond_fun`` is false or ``max_steps`` steps have run.

  Raises:
    TypeError: ``cond_fun`` or ``body_fun`` is not callable, ``max_steps`` or ``base`` is not an
      int, or ``cond_fun`` does not return a boolean scalar.
    ValueError: ``max_steps < 1`` or ``base < 2``, ``cond_fun`` writes a Variable, or
      ``body_fun`` creates Variables, returns another structure or changes a written Variable's
      shape or dtype.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import brainnx as bnx
    >>> steps = nnx.Variable(jnp.array(0))
    >>> def double(x):
    ...   steps[...] += 1
    ...   return x * 2
    >>> float(bnx.bounded_while_loop(lambda x: x < 100, double, 1.0, max_steps=5)), int(steps[...])
    (32.0, 5)
  """
  check_loop_callable(cond_fun, f'{_NAME} cond_fun')
  check_loop_callable(body_fun, f'{_NAME} body_fun')
  for what, value, least in (('max_steps', max_steps, 1), ('base', base, 2)):
    if not is_int(value):
      raise TypeError(f'{_NAME}: {what} must be an int, got {value!r} ({type(value).__name__})')
    if value < least:
      raise ValueError(f'{_NAME}: {what} must be at least {least}, got {what}={value}')
  bar, rest = split_pbar(pbar)
  config = BoundedWhileConfig(max_steps=max_steps, base=base, pbar=rest)
  return call(_bounded_impl, config, (cond_fun, body_fun, bar), (init_val,))


def _bounded_impl(config: BoundedWhileConfig, roots: tuple, init_val):
  cond_fun, body_fun, bar = roots
  max_steps, base = config.max_steps, config.base
  if in_python():

    def python_loop():
      val, steps = init_val, 0
      while steps < max_steps and cond_fun(val):
        val, steps = body_fun(val), steps + 1
      return val

    return all_or_nothing((cond_fun, body_fun), (init_val,), python_loop)

  body, cond_w, body_w = while_parts(cond_fun, body_fun, init_val, _NAME)
  runner = runner_for(bar or config.pbar, max_steps)

  def going(carry):
    state, i, _ = carry
    return jnp.logical_and(i < max_steps, cond_w(state))

  def step(carry):
    state, i, run_id = carry
    state = body_w(state)
    if runner:
      runner.step(run_id, i)
    return state, i + 1, run_id

  run_id = runner.start() if runner else jnp.int32(0)
  start = ((body.initial_written(), dyn_leaves(init_val)), jnp.int32(0), run_id)
  slots = base ** max(0, math.ceil(math.log(max_steps, base) - 1e-9))  # a power of base >= max_steps
  (written, leaves), _, _ = jax.lax.cond(going(start), lambda c: _nested(going, step, c, slots, base), lambda c: c, start)
  if runner:
    runner.step(run_id, jnp.int32(max_steps - 1))  # an early stop fills the bar
  body.write_back(written)
  return body.output(leaves)


def _nested(going: Callable, step: Callable, carry, slots: int, base: int):
  """Up to ``slots`` steps (a power of ``base``), while ``going``; the caller checked it once."""
  if slots == 1:
    return step(carry)

  def slot(c, _):
    return jax.lax.cond(going(c), lambda c: _nested(going, step, c, slots // base, base), lambda c: c, c), None

  if slots > base:  # the innermost level is recomputed from its level's checkpoint, not saved
    slot = jax.checkpoint(slot, prevent_cse=False)
  return jax.lax.scan(slot, carry, None, length=base)[0]
