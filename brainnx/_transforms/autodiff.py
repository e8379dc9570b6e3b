"""Jacobians, Hessians, ``vjp`` and ``jvp`` of stateful functions, selected like :func:`grad`.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> import brainnx as bnx
  >>> w = nnx.Param(jnp.array([1.0, 2.0]))
  >>> bnx.jacrev(lambda x: w[...] * x, grad_states=w)(jnp.array([3.0, 4.0])).tolist()
  [[3.0, 0.0], [0.0, 4.0]]
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax

from brainnx._engine.arguments import check_argnums, resolve_argnums
from brainnx._engine.eager import run
from brainnx._transforms.grad import GradFunction, _pure_call, _selected, aux_of
from brainnx._engine.errors import check_callable

__all__ = ['jacrev', 'jacfwd', 'hessian', 'vjp', 'jvp']


def _derivative(transform, name: str):
  def make(
    fun: Callable,
    grad_states: Any = None,
    argnums: int | Sequence[int] | None = None,
    has_aux: bool = False,
    return_value: bool = False,
  ) -> GradFunction:
    check_callable(fun, name)
    return GradFunction(fun, grad_states, argnums, has_aux, return_value, with_value_first=False, transform=transform,
                        name=name)

  make.__name__ = make.__qualname__ = name
  make.__doc__ = f"""``jax.{name}`` of a stateful function, with ``grad_states`` / ``argnums`` as :func:`grad`.

  Args:
    fun: the function; other Variables it writes keep their new values.
    grad_states: the Variables to differentiate (a graph node, a container of nodes, Variables,
      or a filter), packaged as :func:`grad` packages gradients.
    argnums: positional arguments to differentiate too (default ``0`` when ``grad_states``
      is ``None``).
    has_aux: ``fun`` returns ``(value, aux)``.
    return_value: also return the value: ``(derivative, value)``.

  Returns:
    A function returning the derivative (``(state_derivative, arg_derivative)`` with both
    selections), plus ``aux`` / ``value`` as :func:`grad`. ``hessian`` gives each selected
    Variable's (and argument's) own block, ``d2f / dx dx``.

  Raises:
    TypeError: ``fun`` is not callable, or a selected Variable is not floating point.

  Example:
    >>> import jax.numpy as jnp
    >>> import brainnx as bnx
    >>> bnx.{name}(lambda x: (x ** 3).sum())(jnp.array([1.0, 2.0])).tolist() == (
    ...     [[6.0, 0.0], [0.0, 12.0]] if '{name}' == 'hessian' else [3.0, 12.0])
    True
  """
  return make


def _diagonal_hessian(f, argnums, has_aux):
  """``jax.hessian`` keeping, for each selected value, its own block ``d2f / dx dx``."""
  full = jax.hessian(f, argnums=argnums, has_aux=has_aux)

  def diagonal(*args):
    h, aux = full(*args)
    blocks = tuple([h[g][k][g][k] for k in range(len(args[g]))] for g in range(len(argnums)))
    return blocks, aux

  return diagonal


_diagonal_hessian.__name__ = 'hessian'

jacrev = _derivative(jax.jacrev, 'jacrev')
jacfwd = _derivative(jax.jacfwd, 'jacfwd')
hessian = _derivative(_diagonal_hessian, 'hessian')


def vjp(fun: Callable, *primals, grad_states: Any = None, argnums: int | Sequence[int] | None = None,
        has_aux: bool = False) -> tuple:
  """``jax.vjp`` of a stateful function at ``primals``, with ``grad_states`` / ``argnums`` as
  :func:`grad` (without either, every primal is differentiated).

  Args:
    fun: the function; Variables it writes (other than selected ones) keep their new values.
    *primals: its positional arguments.
    grad_states, argnums: what to differentiate, as in :func:`grad`.
    has_aux: ``fun`` returns ``(value, aux)``.

  Returns:
    ``(value, vjp_fn)`` or ``(value, vjp_fn, aux)``; ``vjp_fn(cotangent)`` returns the
    derivatives packaged as :func:`grad` packages gradients.

  Raises:
    TypeError: ``fun`` is not callable, or a selected Variable is not floating point.

  Example:
    >>> import jax.numpy as jnp
    >>> import brainnx as bnx
    >>> y, pull = bnx.vjp(lambda x: x * 2, jnp.ones(2))
    >>> pull(jnp.array([1.0, 3.0]))[0].tolist()   # one cotangent per primal, as jax.vjp
    [2.0, 6.0]
  """
  check_callable(fun, 'vjp')
  nums, argnums_is_int = check_argnums(argnums, 'vjp')
  if nums is None and grad_states is None:
    nums = tuple(range(len(primals)))
  if nums is not None:
    nums = resolve_argnums(nums, len(primals), 'vjp')
  pure, target_vals, arg_vals, stateful, pack = _pure_call(fun, grad_states, nums, has_aux, primals, {}, 'vjp')
  with stateful.rolling_back():
    value, pull, (_, out_leaves, written_vals) = jax.vjp(pure, target_vals, arg_vals, has_aux=True)
    stateful.write_back(written_vals)
    aux = aux_of(stateful, out_leaves, has_aux)

  def vjp_fn(cotangent):
    g_states, g_args = pull(cotangent)
    return _selected(grad_states, nums, argnums_is_int, *pack(g_states, g_args))

  return (value, vjp_fn, aux) if has_aux else (value, vjp_fn)


def jvp(fun: Callable, primals: Sequence, tangents: Sequence, has_aux: bool = False) -> tuple:
  """``jax.jvp`` of a stateful function in JAX's form: Variables are held constant (read,
  and written back, but not differentiated).

  Args:
    fun: the function.
    primals, tangents: sequences of the positional arguments and their tangents.
    has_aux: ``fun`` returns ``(value, aux)``.

  Returns:
    ``(value, tangent_out)`` or ``(value, tangent_out, aux)``.

  Raises:
    TypeError: ``fun`` is not callable.

  Example:
    >>> import jax.numpy as jnp
    >>> import brainnx as bnx
    >>> bnx.jvp(lambda x: x ** 2, (jnp.float32(3.0),), (jnp.float32(1.0),))[1].tolist()
    6.0
  """
  check_callable(fun, 'jvp')
  if not isinstance(primals, (tuple, list)) or not isinstance(tangents, (tuple, list)):
    raise TypeError(
      'jvp: primals and tangents must be tuples or lists (one entry per positional argument, as '
      f'jax.jvp takes them); got {type(primals).__name__} and {type(tangents).__name__}'
    )
  return run(_jvp_impl, (fun,), (has_aux,), (tuple(primals), tuple(tangents)))


def _jvp_impl(fun, primals, tangents, has_aux):
  nums = tuple(range(len(primals)))
  pure, target_vals, arg_vals, stateful, _ = _pure_call(fun, None, nums, has_aux, primals, {}, 'jvp')
  with stateful.rolling_back():
    value, tangent_out, (_, out_leaves, written_vals) = jax.jvp(
      lambda *a: pure(target_vals, list(a)), tuple(arg_vals), tuple(tangents), has_aux=True
    )
    stateful.write_back(written_vals)
    aux = aux_of(stateful, out_leaves, has_aux)
  return (value, tangent_out, aux) if has_aux else (value, tangent_out)
