"""What ``grad`` and its family differentiate, and how the derivatives come back packaged.

``grad_states`` selects Variables (a graph node, a container of nodes, Variables, or a filter
over the Variables the function reaches) and ``argnums`` positional arguments (Modules among
them contribute the Variables ``nnx.DiffState``'s filter selects on their own paths). A
:class:`GradTargets` lists the selected Variables once each and packs a flat list of their
derivatives in the shape of the selection: an ``nnx.State`` for a node, arrays for Variables,
:class:`GradsByRoot` for a filter.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from brainnx._engine.discovery import discover
  >>> from brainnx._transforms.grad_targets import GradTargets
  >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
  >>> f = lambda x: model(x).sum()
  >>> targets = GradTargets(model, discover(f, (jnp.ones(2),), {}), (jnp.ones(2),), None)
  >>> grads = targets.pack_states([v[...] * 0 + 1 for v in targets.variables])
  >>> sorted(grads), grads['bias'][...].tolist()
  (['bias', 'kernel'], [1.0])
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from brainnx import _compat
from brainnx._engine.discovery import Discovery
from brainnx._engine.nodes import holds_graph_node, is_graph_node
from brainnx._engine.filters import filter_code, to_filter


class GradTargets:
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

  def _node(self, node, selects=nnx.Param, argnum: int | None = None, seen: set | None = None):
    """How to pack the gradient of ``node``, as ``nnx.grad`` does: a Module's Variables that
    ``selects`` (on paths relative to the Module) as an ``nnx.State``; a Variable whole; a
    State, dict or list holding them, the same container of their gradients. A Variable met
    again (``seen``: ids met so far in this argument) has its gradient at its first place only:
    later places hold an empty ``nnx.State``, as flax's split of a shared Variable does."""
    seen = set() if seen is None else seen
    if isinstance(node, nnx.Variable):
      if id(node) in seen:
        return lambda grads: nnx.State({})
      seen.add(id(node))
      k = self._index(node)
      return lambda grads: grads[k]
    if is_graph_node(node):
      flat = [(path, var) for path, var in nnx.to_flat_state(nnx.state(node, to_filter(selects)))
              if id(var) not in seen]
      seen.update(id(var) for _, var in flat)
      slots = [(path, var, self._index(var)) for path, var in flat]
      return lambda grads: nnx.from_flat_state([(path, grad_leaf(var, grads[k])) for path, var, k in slots])
    leaves, treedef = jax.tree.flatten(node, is_leaf=is_graph_node)
    packs = []
    for x in leaves:
      if isinstance(x, nnx.Variable) and id(x) in seen:
        packs.append(lambda grads: nnx.State({}))
      elif isinstance(x, nnx.Variable):
        seen.add(id(x))
        k = self._index(x)
        packs.append(lambda grads, x=x, k=k: grad_leaf(x, grads[k]))
      elif is_graph_node(x):
        packs.append(self._node(x, selects, seen=seen))
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
    return lambda grads: GradsByRoot(nnx.from_flat_state([(path, grad_leaf(var, grads[k])) for path, var, k in slots]))

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


def grad_leaf(var, grad):
  """A gradient in the shape ``nnx.State`` gives its state: a Variable, or a data array as is."""
  return var.copy(grad) if isinstance(var, nnx.Variable) else grad


def diff_states(argnums):
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
