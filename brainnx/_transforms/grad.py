"""``grad`` and ``value_and_grad`` with respect to Variables (and arguments).

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

import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from brainnx import _compat
from brainnx._engine.arguments import ArgKind, CallArgs, check_argnums, resolve_argnums
from brainnx._engine.discovery import Discovery, holds_graph_node, is_graph_node
from brainnx._engine.eager import run
from brainnx._engine.filters import filter_code, to_filter
from brainnx._engine.call import StatefulCall
from brainnx._engine.state import read_values
from brainnx._engine.errors import check_callable

__all__ = ['grad', 'value_and_grad']


class _Targets:
  """What to differentiate: Variables (with how to package their grads) and argnums."""

  def __init__(self, spec, disc: Discovery, call_args: tuple, argnums, name: str = 'grad', filters: dict | None = None):
    self.name = name
    self.variables: list = []  # unique Variables, in input order
    self.spec = spec
    self._pack_state = lambda grads: None
    if spec is not None:
      self._pack_state = self._resolve(spec, disc)
    self.argnums = argnums  # resolved: non-negative, in range, distinct
    self.node_args = {}  # argnum -> pack function for graph-node arguments
    for k in argnums or ():
      if holds_graph_node(call_args[k]):  # a node, or a State/dict/list holding them, as nnx.grad takes
        self.node_args[k] = self._node(call_args[k], (filters or {}).get(k, nnx.Param), k)

  def _index(self, variable) -> int:
    for k, v in enumerate(self.variables):
      if v is variable:
        return k
    self.variables.append(variable)
    return len(self.variables) - 1

  def _node(self, node, selects=nnx.Param, argnum: int | None = None):
    """How to pack the gradient of ``node``, as ``nnx.grad`` does: a Module's Variables that
    ``selects`` (on paths relative to the Module) as an ``nnx.State``; a Variable whole; a
    State, dict or list holding them, the same container of their gradients."""
    if isinstance(node, nnx.Variable):
      k = self._index(node)
      return lambda grads: grads[k]
    if is_graph_node(node):
      flat = list(nnx.to_flat_state(nnx.state(node, to_filter(selects))))
      slots = [(path, var, self._index(var)) for path, var in flat]
      return lambda grads: nnx.from_flat_state([(path, _grad_leaf(var, grads[k])) for path, var, k in slots])
    leaves, treedef = jax.tree.flatten(node, is_leaf=is_graph_node)
    packs = []
    for x in leaves:
      if isinstance(x, nnx.Variable):
        k = self._index(x)
        packs.append(lambda grads, x=x, k=k: _grad_leaf(x, grads[k]))
      elif is_graph_node(x):
        packs.append(self._node(x, selects))
      else:
        raise TypeError(
          f'{self.name}: argument {argnum} (argnums) holds arrays beside Variables or Modules '
          f'({type(x).__name__}); pass the arrays as an argument of their own, or hold them in Variables'
        )
    return lambda grads: treedef.unflatten([pack(grads) for pack in packs])

  def _resolve(self, spec, disc: Discovery):
    if is_graph_node(spec):
      return self._node(spec)
    if isinstance(spec, dict) and spec and all(is_graph_node(v) for v in spec.values()):
      packs = {key: self._node(v) for key, v in spec.items()}
      return lambda grads: {key: pack(grads) for key, pack in packs.items()}
    if isinstance(spec, (list, tuple)) and spec and all(is_graph_node(v) for v in spec):
      packs = [self._node(v) for v in spec]
      return lambda grads: type(spec)(pack(grads) for pack in packs)
    predicate = to_filter(spec)
    matched = [(p, v) for p, v in zip(disc.paths, disc.variables) if predicate(p, v)]
    if not matched:
      shown = ', '.join(repr(tuple(p)) for p in disc.paths[:4]) + (', ...' if len(disc.paths) > 4 else '')
      raise ValueError(
        f'{self.name}: grad_states={spec!r} matches none of the Variables the function uses. A filter sees '
        f'paths that start at the root: an argument position or a captured name ({shown}). Match inside '
        "them (nnx.PathContains('name')), or differentiate an argument on its own paths with "
        'argnums=nnx.DiffState(k, filter), as nnx.grad does'
      )
    slots = [(path, var, self._index(var)) for path, var in matched]
    return lambda grads: GradsByRoot(nnx.from_flat_state([(path, _grad_leaf(var, grads[k])) for path, var, k in slots]))

  def check_differentiable(self, disc: Discovery) -> None:
    for v in self.variables:
      for leaf in jax.tree.leaves(_compat.raw_value(v)):
        dtype = jnp.result_type(leaf)
        if not jnp.issubdtype(dtype, jnp.inexact):
          i = disc.index_of(v)
          where = disc.describe(i) if i is not None else type(v).__name__
          raise TypeError(
            f'{self.name}: cannot differentiate with respect to {where} (dtype {dtype}): only '
            f'floating-point Variables have gradients; {self._fix(v, disc.paths[i] if i is not None else ())}'
          )

  def _fix(self, variable, path) -> str:
    """What to write instead, for a non-differentiable ``variable`` the selection took."""
    if not isinstance(variable, nnx.Param):
      return 'select the floating-point ones, e.g. grad_states=nnx.Param'
    name = path[-1] if path else None
    chosen = filter_code(self.spec) if self.spec is not None and not is_graph_node(self.spec) else None
    around = f'nnx.All({chosen or "nnx.Param"}, nnx.Not(nnx.PathContains({name!r})))'
    return (
      'it is an nnx.Param, so grad_states=nnx.Param (or passing its Module) selects it too. Hold it '
      f'in an nnx.Variable instead (self.{name if isinstance(name, str) else "step"} = '
      f'nnx.Variable(...) in the Module), or select around it: grad_states={around}'
    )

  def pack_states(self, grads):
    return self._pack_state(grads)


class _RootKeyedState(nnx.State):
  """An ``nnx.State`` whose subclasses register their own pytree flattening (below)."""

  def __init_subclass__(cls) -> None:  # nnx.State's hook would register a sort of the raw keys
    pass


class GradsByRoot(_RootKeyedState):
  """Gradients selected by a filter, nested by root name (``grads['model']['l1']['kernel']``).

  ``grads[root]`` is an ``nnx.State`` shaped like ``nnx.state(root, nnx.Param)``, ready for
  ``optimizer.update(root, grads[root])``; passing the whole object to an optimizer is refused
  with a message saying so. ``jax.tree`` functions work on it as on any ``nnx.State``. Roots are
  argument positions (ints) and captured names (strs) side by side: its leaves are ordered by
  root with ints first, then strs.
  """


def _root_items(grads: GradsByRoot) -> list:
  return sorted(grads.raw_mapping.items(), key=lambda kv: (not isinstance(kv[0], int), kv[0]))


jax.tree_util.register_pytree_with_keys(
  GradsByRoot,
  lambda g: ([(jax.tree_util.DictKey(k), v) for k, v in _root_items(g)], tuple(k for k, _ in _root_items(g))),
  lambda keys, leaves: GradsByRoot(zip(keys, leaves)),
  lambda g: ([v for _, v in _root_items(g)], tuple(k for k, _ in _root_items(g))),
)


def _nested_by_root(grads) -> str:
  keys = list(grads.keys()) or ['model']
  holder = keys[0] if isinstance(keys[0], str) else 'model'  # a captured name, or the argument
  return (
    f"these gradients are nested by root name ({', '.join(map(repr, keys))}): pass one root's entry "
    f'to the optimizer of that root, e.g. optimizer.update({holder}, grads[{keys[0]!r}])'
  )


_compat.refuse_nnx_flatten(GradsByRoot, _nested_by_root)


def _grad_leaf(var, grad):
  """A gradient in the shape ``nnx.State`` gives its state: a Variable, or a data array as is."""
  return var.copy(grad) if isinstance(var, nnx.Variable) else grad


def _pure_call(fun, grad_states, argnums, has_aux, args, kwargs, name='grad', filters=None):
  """The call as a pure function of the selected Variables' and arguments' values.

  Returns ``(pure, target_vals, arg_vals, stateful, pack)``: ``pure(t, a)`` gives
  ``(value, (value, output leaves, written values))``; ``stateful`` is the :class:`StatefulCall`
  (``stateful.write_back(written values)`` writes the other Variables back, inside
  ``stateful.rolling_back()``, then ``aux_of(stateful, output leaves, has_aux)`` is the aux);
  ``pack(g_states, g_args)`` packs derivatives like the selection. ``filters`` maps a
  differentiated argument to what its Modules contribute (``nnx.DiffState``'s filter;
  ``nnx.Param`` when absent).
  """
  stateful = StatefulCall.enter(fun, args, kwargs, name=name)
  call, disc, values = stateful.call, stateful.disc, stateful.values
  targets = _Targets(grad_states, disc, args, argnums, name, filters)
  targets.check_differentiable(disc)
  target_at = [disc.index_of(v) for v in targets.variables]
  diff_args = tuple(k for k in (argnums or ()) if k not in targets.node_args)
  for k in diff_args:
    if call.kinds[k] is not ArgKind.DYN:
      raise TypeError(f'{name}: argument {k} (argnums) must be arrays, not a container holding Modules')

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


def _grad_call(fun, grad_states, argnums, argnums_is_int, has_aux, args, kwargs, transform=jax.grad, name='grad',
               filters=None):
  """``(value, aux, grads)`` of one call; other writes applied.

  ``transform`` is ``jax.grad``, ``jax.jacrev``, ``jax.jacfwd`` or the diagonal hessian. A
  Jacobian of a function returning a pytree has that pytree's structure outermost, as
  ``jax.jacrev`` gives it: each output leaf holds the derivatives as the selection packs them.
  """
  by_arg = {}
  if argnums is not None:
    argnums = resolve_argnums(argnums, len(args), name)
    by_arg = dict(zip(argnums, filters or ()))
  pure, target_vals, arg_vals, stateful, pack = _pure_call(fun, grad_states, argnums, has_aux, args, kwargs, name, by_arg)
  with stateful.rolling_back():
    derivs, (value, out_leaves, written_vals) = transform(pure, argnums=(0, 1), has_aux=True)(target_vals, arg_vals)
    stateful.write_back(written_vals)
    aux = aux_of(stateful, out_leaves, has_aux)
  out_def = jax.tree.structure(value)
  per_leaf = []
  for g_states, g_args in out_def.flatten_up_to(derivs):
    state_grads, by_arg = pack(g_states, g_args)
    per_leaf.append(_selected(grad_states, argnums, argnums_is_int, state_grads, by_arg))
  return value, aux, jax.tree.unflatten(out_def, per_leaf)


def _diff_states(argnums):
  """``argnums`` with flax's ``nnx.DiffState(argnum, filter)`` entries as their ints, and each
  position's filter (``nnx.Param`` where an int was given); ``None`` without a DiffState."""
  if isinstance(argnums, nnx.DiffState):
    return argnums.argnum, (argnums.filter,)
  if isinstance(argnums, (tuple, list)) and any(isinstance(a, nnx.DiffState) for a in argnums):
    return (
      tuple(a.argnum if isinstance(a, nnx.DiffState) else a for a in argnums),
      tuple(a.filter if isinstance(a, nnx.DiffState) else nnx.Param for a in argnums),
    )
  return argnums, None


class GradFunction:
  """The callable ``grad`` / ``value_and_grad`` return."""

  def __init__(self, fun, grad_states, argnums, has_aux, return_value, with_value_first, transform=jax.grad,
               name='grad'):
    self.fun, self.grad_states, self.has_aux, self.transform = fun, grad_states, has_aux, transform
    self.return_value, self.with_value_first, self.name = return_value, with_value_first, name
    argnums, self.filters = _diff_states(argnums)
    self.argnums, self.argnums_is_int = check_argnums(argnums, name)
    if self.argnums is None and grad_states is None:
      self.argnums, self.argnums_is_int = (0,), True
    functools.update_wrapper(self, fun, updated=())
    self.__wrapped__ = fun

  def _impl(self, *args, **kwargs):
    value, aux, grads = _grad_call(
      self.fun, self.grad_states, self.argnums, self.argnums_is_int, self.has_aux, args, kwargs, self.transform,
      self.name, self.filters,
    )
    if self.with_value_first:
      return ((value, aux) if self.has_aux else value), grads
    if self.return_value and self.has_aux:
      return grads, value, aux
    if self.return_value:
      return grads, value
    if self.has_aux:
      return grads, aux
    return grads

  def __call__(self, *args, **kwargs):
    return run(GradFunction._impl, (self,), (), args, kwargs, discover_from=(self.fun, self.grad_states))

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
  return GradFunction(fun, grad_states, argnums, has_aux, return_value, with_value_first=False)


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
  return GradFunction(fun, grad_states, argnums, has_aux, False, with_value_first=True, name='value_and_grad')
