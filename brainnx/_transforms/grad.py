"""``grad``, ``value_and_grad``, Jacobians, Hessians, ``vjp`` and ``jvp`` with respect to
Variables (and arguments).

The Variables to differentiate are taken out of the call as inputs of a pure
function; every other Variable the function writes (batch statistics, RNG
counts, counters) is written back after the call, as in the forward pass.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> import brainnx as bnx
  >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
  >>> loss = lambda x: (model(x) ** 2).sum()
  >>> grads = bnx.grad(loss, grad_states=model)(jnp.ones((4, 2)))
  >>> sorted(grads), type(grads['kernel']).__name__
  (['bias', 'kernel'], 'Param')
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
from flax import nnx

from brainnx._engine.arguments import ArgKind, CallArgs, check_argnums, resolve_argnums
from brainnx._engine.call import StatefulCall
from brainnx._engine.nodes import is_graph_node
from brainnx._engine.config import Config
from brainnx._engine.eager import call, eager, program
from brainnx._engine.errors import check_callable
from brainnx._engine.state import read_values
from brainnx._transforms.grad_targets import GradTargets, diff_states


@dataclasses.dataclass(frozen=True, kw_only=True)
class GradConfig(Config):
  """A differentiating transform's settings, parsed once when it is built.

  ``transform`` is ``jax.grad``, ``jax.jacrev``, ``jax.jacfwd`` or the diagonal Hessian
  (``vjp`` and ``jvp`` call ``jax.vjp``/``jax.jvp`` themselves and leave it unused);
  ``argnums`` resolved to a tuple (``argnums_is_int``: the user gave one int) with each
  position's ``nnx.DiffState`` filter in ``filters`` (``None`` without one); the output is
  ``grads`` plus ``value`` / ``aux`` as ``return_value``, ``has_aux`` and
  ``with_value_first`` (``value_and_grad``'s order) say.
  """

  name: str = 'grad'
  grad_states: Any = None
  argnums: tuple | None = None
  argnums_is_int: bool = False
  filters: tuple | None = None
  has_aux: bool = False
  return_value: bool = False
  with_value_first: bool = False
  transform: Callable = jax.grad

  @classmethod
  def parse(cls, name: str, grad_states, argnums, **fields) -> 'GradConfig':
    argnums, filters = diff_states(argnums)
    argnums, argnums_is_int = check_argnums(argnums, name)
    if argnums is None and grad_states is None:
      argnums, argnums_is_int = (0,), True
    return cls(name=name, grad_states=grad_states, argnums=argnums, argnums_is_int=argnums_is_int, filters=filters,
               **fields)


def _pure_call(config: GradConfig, fun: Callable, args: tuple, kwargs: dict, argnums, filters=None):
  """The call as a pure function of the selected Variables' and arguments' values.

  Returns ``(pure, target_vals, arg_vals, stateful, pack)``: ``pure(t, a)`` gives
  ``(value, (value, output leaves, written values))``; ``stateful`` is the :class:`StatefulCall`
  (``stateful.write_back(written values)`` writes the other Variables back, inside
  ``stateful.rolling_back()``, then ``aux_of(stateful, output leaves, has_aux)`` is the aux);
  ``pack(g_states, g_args)`` packs derivatives like the selection. ``filters`` maps a
  differentiated argument to what its Modules contribute (``nnx.DiffState``'s filter;
  ``nnx.Param`` when absent).
  """
  grad_states, has_aux, name = config.grad_states, config.has_aux, config.name
  stateful = StatefulCall.enter(fun, args, kwargs, name=name)
  call_args, disc, values = stateful.call, stateful.disc, stateful.values
  targets = GradTargets(grad_states, disc, args, argnums, name, filters)
  targets.check_differentiable(disc)
  target_at = [disc.index_of(v) for v in targets.variables]
  diff_args = tuple(k for k in (argnums or ()) if k not in targets.node_args)
  for k in diff_args:
    if call_args.kinds[k] is not ArgKind.DYN:
      raise TypeError(
        f'{name}: argument {k} (argnums) is a {type(args[k]).__name__}, which is not a JAX type to '
        'differentiate: pass arrays (a pytree of them), or Modules and Variables'
      )

  def pure(target_vals, arg_vals):
    states = list(values)
    for i, x in zip(target_at, target_vals):
      if i is not None:
        states[i] = x
    new_args = list(args)
    for k, x in zip(diff_args, arg_vals):
      new_args[k] = x
    dyn_call = CallArgs.split(tuple(new_args), kwargs)
    step = stateful.step(states, dyn_call.dyn, dyn_call)
    out = step.out
    if has_aux:
      if not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError(f'{name}: with has_aux=True the function must return a pair (value, aux)')
      value = out[0]
    else:
      value = out
    nodes = [x for x in jax.tree.leaves(value, is_leaf=is_graph_node) if is_graph_node(x)]
    if nodes:
      raise ValueError(
        f'{name}: the value the function returns holds a {type(nodes[0]).__name__}; it must be arrays. '
        'Return Modules and Variables (ones it creates too) in aux, with has_aux=True'
      )
    # the whole output leaves as aux leaves: ``aux_of`` rebuilds aux with the caller's objects
    return value, (value, step.split_out(disc, name)[1], step.written_values())

  def pack(g_states, g_args):
    by_arg = dict(zip(diff_args, g_args))
    by_arg.update({k: pack_node(g_states) for k, pack_node in targets.node_args.items()})
    return targets.pack_states(g_states), by_arg

  target_vals = [values[i] if i is not None else read_values([v])[0] for i, v in zip(target_at, targets.variables)]
  return pure, target_vals, [args[k] for k in diff_args], stateful, pack


def aux_of(stateful: StatefulCall, out_leaves, has_aux: bool):
  """The aux of a differentiated call, rebuilt from its output leaves after the write-back:
  Modules it created are built anew and Variables it returned are the caller's (``None``
  without ``has_aux``)."""
  out = stateful.output(out_leaves)
  return out[1] if has_aux else None


def _selected(grad_states, argnums, argnums_is_int, state_grads, by_arg):
  """The derivatives as the user selected them: ``state``, ``arg`` or ``(state, arg)``."""
  arg_grads = None
  if argnums is not None:
    arg_grads = by_arg[argnums[0]] if argnums_is_int else tuple(by_arg[k] for k in argnums)
  if grad_states is not None and argnums is not None:
    return state_grads, arg_grads
  return state_grads if grad_states is not None else arg_grads


def _grad_call(config: GradConfig, fun: Callable, args: tuple, kwargs: dict):
  """``(value, aux, grads)`` of one call; other writes applied.

  A Jacobian of a function returning a pytree has that pytree's structure outermost, as
  ``jax.jacrev`` gives it: each output leaf holds the derivatives as the selection packs them.
  """
  argnums, by_arg = config.argnums, {}
  if argnums is not None:
    argnums = resolve_argnums(argnums, len(args), config.name)
    by_arg = dict(zip(argnums, config.filters or ()))
  pure, target_vals, arg_vals, stateful, pack = _pure_call(config, fun, args, kwargs, argnums, by_arg)
  with stateful.rolling_back():
    differentiated = config.transform(pure, argnums=(0, 1), has_aux=True)
    try:
      derivs, (value, out_leaves, written_vals) = differentiated(target_vals, arg_vals)
    except TypeError as e:
      if 'scalar-output' not in str(e):
        raise
      raise TypeError(_not_a_scalar(config.name, fun, e)) from None
    stateful.write_back(written_vals)
    aux = aux_of(stateful, out_leaves, config.has_aux)
  out_def = jax.tree.structure(value)
  per_leaf = []
  for g_states, g_args in out_def.flatten_up_to(derivs):
    state_grads, by_arg = pack(g_states, g_args)
    per_leaf.append(_selected(config.grad_states, argnums, config.argnums_is_int, state_grads, by_arg))
  return value, aux, jax.tree.unflatten(out_def, per_leaf)


def _not_a_scalar(name: str, fun, error: TypeError) -> str:
  """``name``'s message for a function whose value is not a scalar (JAX's words, then the fix)."""
  said = str(error).split('\n')[0]
  if isinstance(fun, nnx.Module):
    return (
      f'{name}: {said} The function is the {type(fun).__name__} Module itself, so {name} differentiates '
      f'its output with respect to its argument. To differentiate a loss with respect to the model\'s '
      f'Params, pass a function returning a scalar: bnx.{name}(lambda x: loss(model(x)), grad_states=model)'
    )
  return f'{name}: {said} Return a scalar (a loss: .sum() or .mean() of the output), or use jacrev/jacfwd'


def _grad_impl(config: GradConfig, roots: tuple, *args, **kwargs):
  """The output a differentiating transform returns, in the order its config says."""
  value, aux, grads = _grad_call(config, roots[0].fun, args, kwargs)
  if config.with_value_first:
    return ((value, aux) if config.has_aux else value), grads
  if config.return_value and config.has_aux:
    return grads, value, aux
  if config.return_value:
    return grads, value
  if config.has_aux:
    return grads, aux
  return grads


class GradFunction:
  """The callable ``grad`` / ``value_and_grad`` / ``jacrev`` / ``jacfwd`` / ``hessian`` return;
  it keeps its compiled program (made at the first eager call) on itself."""

  def __init__(self, fun: Callable, config: GradConfig):
    self.fun, self.config = fun, config
    self._program = None
    functools.update_wrapper(self, fun, updated=())
    self.__wrapped__ = fun
    # what a call reads: the function, and the selected Variables by identity (discovery sees a
    # selected Variable swapped out of the graph the function reads, read or not)
    self.__discovery_roots__ = (fun, config.grad_states)

  def __call__(self, *args, **kwargs):
    if not eager():
      return _grad_impl(self.config, (self,), *args, **kwargs)
    if self._program is None:
      self._program = program(_grad_impl, self.config, (self,), discover_from=self.__discovery_roots__)
    return self._program(*args, **kwargs)

  def __get__(self, obj, objtype=None):
    """Decorating a method: ``self`` is bound as the first argument (``argnums`` count it)."""
    return self if obj is None else functools.partial(self, obj)


def grad(
  fun: Callable,
  grad_states: Any = None,
  argnums: int | Sequence[int] | None = None,
  has_aux: bool = False,
  return_value: bool = False,
) -> Callable:
  """Gradient of a scalar function with respect to Variables and/or arguments.

  The Variables to differentiate are taken out of the call as inputs of a
  pure function. Other Variables the function writes (batch statistics, RNG
  counts, counters) keep their new values, as after the forward pass.

  Args:
    fun: the function; it returns a scalar (or ``(scalar, aux)`` with
      ``has_aux``) and may read and write the Variables it reaches.
    grad_states: the Variables to differentiate. A graph node: grads are an
      ``nnx.State`` of its ``nnx.Param``s, ready for
      ``nnx.Optimizer.update(model, grads)``. A tuple/list/dict of nodes: the
      same container of States. A Variable or list of Variables: arrays. A
      filter over the Variables the function uses: an ``nnx.State`` nested
      by root name; ``grads['model']`` feeds
      ``optimizer.update(model, grads['model'])``, and passing the whole
      nest to an optimizer raises a ``ValueError`` saying so. Default
      ``None``: no Variables.
    argnums: an int, an ``nnx.DiffState(argnum, filter)``, or a sequence
      of them: positional arguments to differentiate, as ``nnx.grad`` takes
      them (a Module argument gets a State of its Variables the filter
      selects on its own paths, ``nnx.Param`` for an int; a State or dict of
      Variables, all of them). Default ``None``; ``0`` when ``grad_states``
      is also ``None``.
    has_aux: ``fun`` returns ``(value, aux)``; ``aux`` is returned, not
      differentiated, and may hold Modules ``fun`` creates. Default ``False``.
    return_value: also return ``fun``'s value. Default ``False``.

  Returns:
    A function with ``fun``'s arguments returning ``grads``, or
    ``(grads, aux)`` / ``(grads, value)`` / ``(grads, value, aux)`` for
    ``has_aux`` / ``return_value``. With both ``grad_states`` and
    ``argnums``, ``grads`` is ``(state_grads, arg_grads)``; ``arg_grads`` is
    one gradient for an int ``argnums``, a tuple for a sequence.

  Raises:
    TypeError: if ``fun`` is not callable; when called, if ``grad_states``
      is not a node, Variable(s) or filter, a selected Variable is not
      floating-point, a differentiated argument is a container holding
      Modules, or with ``has_aux=True`` ``fun`` does not return a pair.
    ValueError: when called, if ``argnums`` names an argument beyond those
      passed, a filter ``grad_states`` matches none of the Variables the
      function uses, the function attaches Variables it creates, or its
      value holds a Module or Variable.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import brainnx as bnx
    >>> w = nnx.Param(jnp.array([1.0, 2.0]))
    >>> g, value = bnx.grad(lambda x: (w[...] * x).sum() ** 2, grad_states=w, return_value=True)(jnp.ones(2))
    >>> g.tolist(), float(value)
    ([6.0, 6.0], 9.0)
  """
  check_callable(fun, 'grad')
  return GradFunction(fun, GradConfig.parse('grad', grad_states, argnums, has_aux=has_aux, return_value=return_value))


def value_and_grad(
  fun: Callable,
  grad_states: Any = None,
  argnums: int | Sequence[int] | None = None,
  has_aux: bool = False,
) -> Callable:
  """``(value, grads)`` (``((value, aux), grads)`` with ``has_aux``), as :func:`grad`.

  One call computes the function's value and its gradient. Variables are
  selected, and other writes kept, exactly as by :func:`grad`.

  Args:
    fun: the function; it returns a scalar (or ``(scalar, aux)`` with
      ``has_aux``).
    grad_states: the Variables to differentiate (see :func:`grad`). Default
      ``None``.
    argnums: positional arguments to differentiate, an int or a sequence of
      ints. Default ``None``; ``0`` when ``grad_states`` is also ``None``.
    has_aux: ``fun`` returns ``(value, aux)``. Default ``False``.

  Returns:
    A function with ``fun``'s arguments returning ``(value, grads)``, or
    ``((value, aux), grads)`` with ``has_aux``; ``grads`` as for :func:`grad`.

  Raises:
    TypeError: if ``fun`` is not callable; when called, for the problems
      :func:`grad` reports (a non-floating-point Variable, ``has_aux``
      without a pair, ...).
    ValueError: when called, for the problems :func:`grad` reports
      (``argnums`` out of range, a filter matching nothing, Variables
      created inside).

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import brainnx as bnx
    >>> model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    >>> loss, grads = bnx.value_and_grad(lambda x: model(x).mean(), grad_states=model)(jnp.ones((2, 3)))
    >>> grads['bias'][...].tolist()
    [1.0]
  """
  check_callable(fun, 'value_and_grad')
  config = GradConfig.parse('value_and_grad', grad_states, argnums, has_aux=has_aux, with_value_first=True)
  return GradFunction(fun, config)


# -- Jacobians, Hessians, vjp and jvp ---------------------------------------------


def _derivative(transform, name: str):
  def make(
    fun: Callable,
    grad_states: Any = None,
    argnums: int | Sequence[int] | None = None,
    has_aux: bool = False,
    return_value: bool = False,
  ) -> GradFunction:
    check_callable(fun, name)
    config = GradConfig.parse(name, grad_states, argnums, has_aux=has_aux, return_value=return_value, transform=transform)
    return GradFunction(fun, config)

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
  config = GradConfig(name='vjp', grad_states=grad_states, argnums=nums, argnums_is_int=argnums_is_int,
                      has_aux=has_aux)
  pure, target_vals, arg_vals, stateful, pack = _pure_call(config, fun, primals, {}, nums)
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
  config = GradConfig(name='jvp', has_aux=has_aux)
  return call(_jvp_impl, config, (fun,), (tuple(primals), tuple(tangents)))


def _jvp_impl(config: GradConfig, roots: tuple, primals, tangents):
  (fun,), has_aux = roots, config.has_aux
  pure, target_vals, arg_vals, stateful, _ = _pure_call(config, fun, primals, {}, tuple(range(len(primals))))
  with stateful.rolling_back():
    value, tangent_out, (_, out_leaves, written_vals) = jax.jvp(
      lambda *a: pure(target_vals, list(a)), tuple(arg_vals), tuple(tangents), has_aux=True
    )
    stateful.write_back(written_vals)
    aux = aux_of(stateful, out_leaves, has_aux)
  return (value, tangent_out, aux) if has_aux else (value, tangent_out)
