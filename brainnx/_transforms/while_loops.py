"""``while_loop`` and ``fori_loop`` whose body reads and writes Variables.

Variables the body writes travel in the loop carry and hold their final
values afterwards; ``cond_fun`` may only read.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> import brainnx as bnx
  >>> calls = nnx.Variable(jnp.array(0))
  >>> def body(i, x):
  ...   calls[...] += 1
  ...   return x + i
  >>> int(bnx.fori_loop(0, 4, body, 0)), int(calls[...])
  (6, 4)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from brainnx import _compat
from brainnx._engine.discovery import discover
from brainnx._engine.nodes import is_graph_node
from brainnx._engine.config import Config
from brainnx._engine.eager import call
from brainnx._engine.loop_body import LoopBody, all_or_nothing, dyn_leaves, in_python
from brainnx._transforms.progress import split_pbar
from brainnx._transforms.scan import ScanConfig, check_loop_callable, run_scan


@dataclasses.dataclass(frozen=True, kw_only=True)
class WhileConfig(Config):
  """A ``while_loop``'s settings: only its name (``fori_loop`` with traced bounds runs as one)."""

  name: str = 'while_loop'


@dataclasses.dataclass(frozen=True, kw_only=True)
class ForiConfig(Config):
  """A ``fori_loop`` with concrete bounds (it runs as a scan): ``lower``, ``upper`` and ``pbar``,
  an int update frequency (a :class:`ProgressBar` object is a root)."""

  name: str = 'fori_loop'
  lower: int
  upper: int
  pbar: int | None = None


def while_loop(cond_fun: Callable, body_fun: Callable, init_val: Any) -> Any:
  """``jax.lax.while_loop`` whose body may write Variables (``cond_fun`` may only read).

  Variables ``body_fun`` writes travel in the loop carry and hold their
  final values afterwards.

  Args:
    cond_fun: ``cond_fun(val) -> bool scalar``; the loop runs while it is
      true. It may read Variables but not write them.
    body_fun: ``body_fun(val) -> val``, returning the structure of
      ``init_val``; it may read and write Variables.
    init_val: the initial loop value (a pytree).

  Returns:
    The loop value once ``cond_fun`` is false.

  Raises:
    TypeError: if ``cond_fun`` or ``body_fun`` is not callable, or
      ``cond_fun`` does not return a boolean scalar.
    ValueError: if ``cond_fun`` writes a Variable, ``body_fun`` does not
      return ``init_val``'s structure or creates Variables, or a Variable it
      writes changes shape, dtype or structure.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import brainnx as bnx
    >>> steps = nnx.Variable(jnp.array(0))
    >>> def body(x):
    ...   steps[...] += 1
    ...   return x * 2
    >>> float(bnx.while_loop(lambda x: x < 100, body, 1.0)), int(steps[...])
    (128.0, 7)
  """
  check_loop_callable(cond_fun, 'while_loop cond_fun')
  check_loop_callable(body_fun, 'while_loop body_fun')
  return call(_while_impl, WhileConfig(), (cond_fun, body_fun), (init_val,))


def while_parts(cond_fun, body_fun, init_val, name: str):
  """``(body, cond_w, body_w)`` of a while loop over ``init_val``: the body's :class:`LoopBody` and
  the pure condition and step on the carry ``(written values, loop-value leaves)``, checked as
  ``jax.lax.while_loop`` checks them (and ``cond_fun`` may only read)."""
  disc = discover((cond_fun, body_fun), (init_val,), {})
  body = LoopBody(body_fun, (init_val,), name, disc)
  cond = LoopBody(cond_fun, (init_val,), name, disc)
  if cond.written:
    names = ', '.join(disc.describe(i) for i in cond.written)
    raise ValueError(f'{name}: cond_fun writes {names}; cond_fun may only read Variables')
  shapes = jax.tree.leaves(cond.trace.out_shapes(cond.disc))
  if len(shapes) != 1 or shapes[0].shape != () or shapes[0].dtype != jnp.bool_:
    raise TypeError(f'{name}: cond_fun must return a boolean scalar, got {cond.trace.out_shapes(cond.disc)}')
  init_struct = jax.tree.structure(init_val, is_leaf=is_graph_node)
  out_markers = jax.tree.unflatten(body.trace.out_spec.treedef, list(range(len(body.trace.out_spec.slots))))
  if jax.tree.structure(out_markers) != init_struct:
    raise ValueError(f'{name}: body_fun must return the structure of init_val ({init_struct})')

  def cond_w(carry):
    written, leaves = carry
    values = list(body.values)
    for i, x in zip(body.written, written):
      values[i] = x
    return cond.run_readonly(values, leaves)[0]

  def body_w(carry):
    written, leaves = carry
    return body.run(written, leaves)

  return body, cond_w, body_w


def _while_impl(config: WhileConfig, roots: tuple, init_val):
  cond_fun, body_fun = roots
  return run_while(config, cond_fun, body_fun, init_val)


def run_while(config: WhileConfig, cond_fun: Callable, body_fun: Callable, init_val):
  """``while_loop(cond_fun, body_fun, init_val)`` in the current trace."""
  if in_python():

    def python_loop():
      val = init_val
      while cond_fun(val):
        val = body_fun(val)
      return val

    return all_or_nothing((cond_fun, body_fun), (init_val,), python_loop)

  body, cond_w, body_w = while_parts(cond_fun, body_fun, init_val, config.name)
  written, leaves = jax.lax.while_loop(cond_w, body_w, (body.initial_written(), dyn_leaves(init_val)))
  body.write_back(written)
  return body.output(leaves)


def fori_loop(lower, upper, body_fun: Callable, init_val: Any, pbar=None) -> Any:
  """``jax.lax.fori_loop`` whose body may write Variables.

  With concrete bounds it runs as a ``scan`` (reverse-differentiable, and
  ``pbar`` works); with traced bounds as a ``while_loop``.

  Args:
    lower: the first index (an int, or an integer scalar, concrete or
      traced); of ``upper``'s type, as ``jax.lax.fori_loop`` requires.
    upper: one past the last index.
    body_fun: ``body_fun(i, val) -> val``, returning the structure of
      ``init_val``; it may read and write Variables.
    init_val: the initial loop value (a pytree).
    pbar: a :class:`ProgressBar`, or an int update frequency (concrete
      bounds only). Default ``None``: no bar.

  Returns:
    The loop value after ``body_fun`` ran for ``i`` in ``range(lower,
    upper)`` (``init_val`` when that range is empty).

  Raises:
    TypeError: if ``body_fun`` is not callable, the bounds are not
      scalars of one type, or ``pbar`` is not ``None``, a ``ProgressBar``
      or an int.
    ValueError: if ``pbar`` is given with traced bounds or is a
      non-positive int, or for the problems :func:`scan` /
      :func:`while_loop` report (a body that creates Variables, changes a
      written Variable's shape or dtype, or returns another structure).

  Example:
    >>> import brainnx as bnx
    >>> int(bnx.fori_loop(0, 5, lambda i, total: total + i, 0))
    10
  """
  check_loop_callable(body_fun, 'fori_loop')
  index_type = _index_type(lower, upper)
  try:
    lo, hi = int(lower), int(upper)
  except (TypeError, jax.errors.ConcretizationTypeError):
    if pbar is not None:
      raise ValueError('fori_loop: a progress bar needs concrete (Python int) bounds') from None
    return _fori_while(lower, upper, body_fun, init_val, *index_type)
  bar, rest = split_pbar(pbar)
  return call(_fori_impl, ForiConfig(lower=lo, upper=hi, pbar=rest), (body_fun, bar), (init_val,))


def _is_weak(x) -> bool:
  """Whether ``x`` is weakly typed: a Python number, or an array or tracer made from one."""
  if isinstance(x, (int, float, complex)):
    return not isinstance(x, bool)
  return bool(getattr(getattr(x, 'aval', x), 'weak_type', False))


def _index_type(lower, upper):
  """``(dtype, weak)`` of ``fori_loop``'s index under traced bounds, checking the bounds as
  ``jax.lax.fori_loop`` does: scalars of one type, or two signed integer types of which one is
  weak (a Python int beside an int8 array)."""
  found = []
  for what, bound in (('lower', lower), ('upper', upper)):
    try:
      dtype = None if isinstance(bound, (str, bytes)) or bound is None else jnp.result_type(bound)
    except TypeError:
      dtype = None
    if dtype is None or jnp.ndim(bound) != 0:
      raise TypeError(f'fori_loop: {what} must be a scalar, as in jax.lax.fori_loop; got {bound!r}')
    found.append(dtype)
  lo, hi = found
  lo_weak, hi_weak = _is_weak(lower), _is_weak(upper)
  if lo == hi:
    return lo, lo_weak  # the index starts as ``lower``, weak or not
  if jnp.issubdtype(lo, jnp.signedinteger) and jnp.issubdtype(hi, jnp.signedinteger) and lo_weak != hi_weak:
    return (hi, False) if lo_weak else (lo, False)
  raise TypeError(
    f'fori_loop: lower and upper must have equal types, as in jax.lax.fori_loop; got {lo} and {hi}'
  )


def _fori_impl(config: ForiConfig, roots: tuple, init_val):
  body_fun, bar = roots
  lo, hi = config.lower, config.upper
  def step(carry, i):
    # concrete bounds give a weakly typed index, as jax.lax.fori_loop's (i * jnp.int8(1) is int8)
    return body_fun(_compat.weakly_typed(i), carry), None

  step.__wrapped__ = body_fun
  if hi <= lo:
    return init_val
  scan_config = ScanConfig(name='fori_loop', pbar=config.pbar, layers_check=False, keep_new=False)
  return run_scan(scan_config, step, bar, init_val, jnp.arange(lo, hi))[0]


def _fori_while(lower, upper, body_fun, init_val, index_dtype, weak):
  def cond(c):
    return c[0] < upper

  def body(c):
    return c[0] + 1, body_fun(_compat.weakly_typed(c[0]) if weak else c[0], c[1])

  body.__wrapped__ = body_fun
  return run_while(WhileConfig(name='fori_loop'), cond, body, (jnp.asarray(lower, index_dtype), init_val))[1]
