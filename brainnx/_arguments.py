"""A call's arguments, split into static values, graph nodes and array data.

Graph nodes (Modules, Variables, Rngs, ...) travel by reference, never
through a JAX transform; static arguments are part of the trace key; all
other leaves are dynamic.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from brainnx._arguments import CallArgs
  >>> model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
  >>> call = CallArgs.split((model, jnp.ones(2), 'relu'), {}, static_argnums=(2,))
  >>> call.kinds
  ('node', 'dyn', 'static')
  >>> args, kwargs = call.rebuild(call.dyn, call.nodes)
  >>> args[0] is model, args[2]
  (True, 'relu')
"""

from __future__ import annotations

import dataclasses
from typing import Any, Hashable, Sequence

import jax

from brainnx._discovery import is_graph_node

__all__ = ['CallArgs', 'normalize_static_argnums', 'contains_graph_node']

_PLAIN = (int, float, complex, bool, type(None), str)


def contains_graph_node(x: Any) -> bool:
  """Whether ``x`` is, or holds somewhere inside, a Variable or NNX Pytree."""
  if isinstance(x, jax.Array) or isinstance(x, _PLAIN):
    return False
  if is_graph_node(x):
    return True
  if isinstance(x, (tuple, list)):
    return any(map(contains_graph_node, x))
  if isinstance(x, dict):
    return any(map(contains_graph_node, x.values()))
  return any(map(is_graph_node, jax.tree.leaves(x, is_leaf=is_graph_node)))


def normalize_static_argnums(static_argnums, what: str = 'static_argnums') -> tuple[int, ...]:
  if isinstance(static_argnums, int):
    static_argnums = (static_argnums,)
  nums = tuple(static_argnums)
  for n in nums:
    if not isinstance(n, int) or isinstance(n, bool):
      raise TypeError(f'{what} must be ints, got {n!r}')
    if n < 0:
      raise ValueError(
        f'{what} must be non-negative, got {n}: count positions from the left '
        '(brainnx does not resolve negative positions)'
      )
  return nums


def _check_hashable(value, where: str) -> None:
  try:
    hash(value)
  except TypeError as e:
    raise TypeError(
      f'static argument {where} of type {type(value).__name__} is not hashable: '
      'static arguments are compared by value and must be hashable '
      '(pass a tuple instead of a list, or make it a dynamic argument)'
    ) from e


@dataclasses.dataclass(eq=False)
class CallArgs:
  """One call's arguments, classified position by position.

  ``kinds[i]`` is ``'static'``, ``'node'`` (a graph node itself), ``'dyn'``
  (no graph node inside) or ``'mixed'`` (a container holding graph nodes,
  flattened with the nodes kept aside). Keywords follow the positional
  arguments in ``kinds``, in ``kw_names`` order.
  """

  kinds: tuple[str, ...]
  kw_names: tuple[str, ...]
  statics: tuple[tuple[int, Any], ...]  # (slot, value)
  nodes: tuple[Any, ...]  # graph nodes, in slot order (mixed ones expanded)
  dyn: tuple[Any, ...]  # dynamic values: whole args for 'dyn', leaves for 'mixed'
  mixed: tuple[tuple[int, Any, tuple[bool, ...]], ...]  # (slot, treedef, is-node mask)
  n_args: int

  @classmethod
  def split(cls, args: Sequence, kwargs: dict, static_argnums=(), static_argnames=()) -> 'CallArgs':
    values = list(args) + list(kwargs.values())
    names = tuple(kwargs)
    kinds, statics, nodes, dyn, mixed = [], [], [], [], []
    for slot, value in enumerate(values):
      is_static = (
        slot in static_argnums if slot < len(args) else names[slot - len(args)] in static_argnames
      )
      if is_static:
        where = f'at position {slot}' if slot < len(args) else f'{names[slot - len(args)]!r}'
        _check_hashable(value, where)
        kinds.append('static')
        statics.append((slot, value))
      elif is_graph_node(value):
        kinds.append('node')
        nodes.append(value)
      elif not contains_graph_node(value):
        kinds.append('dyn')
        dyn.append(value)
      else:
        leaves, treedef = jax.tree.flatten(value, is_leaf=is_graph_node)
        mask = tuple(map(is_graph_node, leaves))
        kinds.append('mixed')
        mixed.append((slot, treedef, mask))
        for leaf, is_node in zip(leaves, mask):
          (nodes if is_node else dyn).append(leaf)
    return cls(tuple(kinds), names, tuple(statics), tuple(nodes), tuple(dyn), tuple(mixed), len(args))

  @property
  def signature(self) -> Hashable:
    """Everything about the call that is not array data (nodes by position)."""
    return (self.kinds, self.kw_names, self.statics, tuple((s, t, m) for s, t, m in self.mixed), self.n_args)

  def rebuild(self, dyn: Sequence, nodes: Sequence) -> tuple[tuple, dict]:
    """The ``(args, kwargs)`` of the call with ``dyn`` and ``nodes`` put back."""
    dyn_it, node_it = iter(dyn), iter(nodes)
    statics = dict(self.statics)
    mixed = {slot: (treedef, mask) for slot, treedef, mask in self.mixed}
    values = []
    for slot, kind in enumerate(self.kinds):
      if kind == 'static':
        values.append(statics[slot])
      elif kind == 'node':
        values.append(next(node_it))
      elif kind == 'dyn':
        values.append(next(dyn_it))
      else:
        treedef, mask = mixed[slot]
        leaves = [next(node_it) if is_node else next(dyn_it) for is_node in mask]
        values.append(jax.tree.unflatten(treedef, leaves))
    args = tuple(values[: self.n_args])
    return args, dict(zip(self.kw_names, values[self.n_args :]))
