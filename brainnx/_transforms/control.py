"""Stateful control flow: ``cond``, ``switch`` and ``ifelse``.

Every branch is traced with the Variables the branches reach (the engine's state step, as
in a loop body); the Variables any branch writes are outputs of the whole construct, and a
branch that does not write one passes its value through. RNG streams therefore advance only
where the branch that draws from them ran. Under ``vmap`` with a batched predicate JAX runs
every branch and selects, and the written values follow the mapping's out-axis rules.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> import brainnx as bnx
  >>> hits = nnx.Variable(jnp.array(0))
  >>> def hit(x):
  ...   hits[...] += 1
  ...   return x * 2
  >>> float(bnx.cond(True, hit, lambda x: x, 3.0)), int(hits[...])
  (6.0, 1)
  >>> float(bnx.cond(False, hit, lambda x: x, 3.0)), int(hits[...])
  (3.0, 1)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from brainnx._engine.discovery import discover
from brainnx._engine.config import Config
from brainnx._engine.eager import call
from brainnx._engine.errors import check_callable
from brainnx._engine.loop_body import LoopBody, all_or_nothing, dyn_leaves, in_python, strong_typed


@dataclasses.dataclass(frozen=True, kw_only=True)
class SwitchConfig(Config):
  """A branching construct: ``name`` is ``'cond'``, ``'switch'`` or ``'ifelse'``; its branches
  are its roots (``cond``'s as ``(false_fun, true_fun)``, indexed by the predicate)."""

  name: str = 'switch'


def cond(pred, true_fun: Callable, false_fun: Callable, *operands) -> Any:
  """``jax.lax.cond`` for branches that read and write Variables.

  Args:
    pred: a boolean or real number scalar (Python or array; batched under ``vmap``); as in
      ``jax.lax.cond``, any non-zero number (``-1``, ``0.5``, ``nan``) is true.
    true_fun, false_fun: the branches, called as ``branch(*operands)``; both must return
      the same structure, shapes and dtypes, and the same non-array (static) values.
    *operands: the branches' arguments.

  Returns:
    The output of the branch taken.

  Raises:
    TypeError: a branch is not callable, the branches return different static values, or
      ``pred`` is not a boolean or real number scalar (``None``, a string, a complex number,
      an array of another shape).
    ValueError: the branches return different structures (naming ``true_fun`` /
      ``false_fun``), or one creates Variables.

  Example:
    >>> import brainnx as bnx
    >>> float(bnx.cond(2 > 1, lambda x: x + 1, lambda x: x - 1, 1.0))
    2.0
  """
  _check_branches((true_fun, false_fun), 'cond', ('true_fun', 'false_fun'))
  given, pred = pred, _scalar(pred, 'cond', 'the predicate `pred`', 'a boolean or number scalar')
  if jnp.issubdtype(pred.dtype, jnp.complexfloating):
    raise TypeError(f'cond: the predicate `pred` must be a boolean or real number scalar, got dtype {pred.dtype}')
  # any non-zero number is true, tested on the value as given, as jax.lax.cond does: a Python
  # 1e-40 is true although float32 would flush it to zero, and 2**40 needs no int32
  truth = pred if pred.dtype == jnp.bool_ else given != 0
  return call(_switch_impl, SwitchConfig(name='cond'), (false_fun, true_fun), (jnp.asarray(truth), *operands))


def switch(index, branches: Sequence[Callable], *operands) -> Any:
  """``jax.lax.switch`` for branches that read and write Variables; ``index`` is clamped
  to ``[0, len(branches) - 1]`` as in ``jax.lax.switch``.

  Args:
    index: an integer scalar (batched under ``vmap``).
    branches: a non-empty sequence of callables, each called as ``branch(*operands)``.
    *operands: the branches' arguments.

  Returns:
    The output of the selected branch.

  Raises:
    TypeError: a branch is not callable, or ``index`` is not an integer scalar (a bool,
      float, string or ``None`` is refused, as by ``jax.lax.switch``).
    ValueError: no branches, branches returning different structures (naming the branch),
      or a branch creating Variables.

  Example:
    >>> import brainnx as bnx
    >>> [float(bnx.switch(i, [lambda x: x, lambda x: 2 * x], 3.0)) for i in (0, 1, 5)]
    [3.0, 6.0, 6.0]
  """
  branches = tuple(branches)
  _check_branches(branches, 'switch')
  index = _scalar(index, 'switch', '`index`', 'an integer scalar')
  if not jnp.issubdtype(index.dtype, jnp.integer):
    raise TypeError(f'switch: `index` must be an integer scalar, got dtype {index.dtype}')
  return call(_switch_impl, SwitchConfig(name='switch'), branches, (index, *operands))


def ifelse(conditions: Sequence, branches: Sequence[Callable], *operands) -> Any:
  """Run the branch of the first true condition; when none is true, the last branch.

  Args:
    conditions: boolean scalars (bool dtype, shape ``()``), as many as ``branches``.
    branches: callables, each called as ``branch(*operands)``.
    *operands: the branches' arguments.

  Returns:
    The output of the branch that ran.

  Raises:
    TypeError: a branch is not callable, or a condition is not a boolean scalar.
    ValueError: ``len(conditions) != len(branches)``, or as :func:`switch`.

  Example:
    >>> import brainnx as bnx
    >>> x = 5.0
    >>> float(bnx.ifelse([x < 0, x < 10, True], [lambda: -1.0, lambda: 1.0, lambda: 2.0]))
    1.0
  """
  branches = tuple(branches)
  _check_branches(branches, 'ifelse')
  conditions = list(conditions)
  if len(conditions) != len(branches):
    raise ValueError(f'ifelse: {len(conditions)} conditions for {len(branches)} branches: give one per branch')
  flags = []
  for k, c in enumerate(conditions):
    c = _scalar(c, 'ifelse', f'condition {k}', 'a boolean scalar')
    if c.dtype != jnp.bool_:
      raise TypeError(f'ifelse: condition {k} must be a boolean scalar, got dtype {c.dtype} (compare it, e.g. `x > 0`)')
    flags.append(c)
  flags = jnp.stack(flags)
  index = jnp.where(jnp.any(flags), jnp.argmax(flags), len(branches) - 1).astype(jnp.int32)
  return call(_switch_impl, SwitchConfig(name='ifelse'), branches, (index, *operands))


def _scalar(value, name: str, what: str, expected: str):
  """``value`` as an array scalar of a bool or number dtype, else ``TypeError`` naming ``what``."""
  if value is None or isinstance(value, (str, bytes)):
    raise TypeError(f'{name}: {what} must be {expected}, got {value!r}')
  try:
    array = value if hasattr(value, 'dtype') and hasattr(value, 'shape') else np.asarray(value)
  except (TypeError, ValueError):
    raise TypeError(f'{name}: {what} must be {expected}, got {type(value).__name__} {value!r}') from None
  if array.shape != ():
    raise TypeError(f'{name}: {what} must be {expected}, got a value of shape {tuple(array.shape)}')
  if not (array.dtype == jnp.bool_ or jnp.issubdtype(array.dtype, jnp.number)):
    raise TypeError(f'{name}: {what} must be {expected}, got dtype {array.dtype}')
  return array


def _check_branches(branches: tuple, name: str, labels: tuple | None = None) -> None:
  if not branches:
    raise ValueError(f'{name}: needs at least one branch')
  for k, b in enumerate(branches):
    if not callable(b):
      label = labels[k] if labels else f'branch {k}'
      raise TypeError(f'{name}: {label} is not callable (got {type(b).__name__})')
    check_callable(b, f'{name}: {labels[k] if labels else f"branch {k}"}')


class _Shape(tuple):
  """An array output's ``(shape, dtype)``, as errors print it."""

  def __repr__(self):
    return f'{self[1]}{list(self[0])}'


def _signature(leaf):
  """What every branch must agree on for one output leaf: an array's shape and dtype, or a
  static (non-array) value itself."""
  if hasattr(leaf, 'shape') and hasattr(leaf, 'dtype'):
    return _Shape((tuple(leaf.shape), leaf.dtype))
  return leaf


def _label(name: str, k: int) -> str:
  """How errors call branch ``k``: cond's branches by their parameter names."""
  return ('false_fun', 'true_fun')[k] if name == 'cond' else f'branch {k}'


def _restructured(bodies: list, written: list) -> frozenset:
  """Written Variables whose value every branch gives one new structure (a ``sow`` into
  ``nnx.capture``'s buffer in each branch): the construct's output takes that structure, as a
  ``lax.cond`` output may differ from its operands."""
  out = set()
  for i in written:
    defs = []
    for b in bodies:
      trace = b.trace
      if i not in trace.written:
        break
      defs.append(dict(zip(trace.written, trace.out_defs))[i])
    else:
      if all(d == defs[0] for d in defs) and defs[0] != jax.tree.structure(bodies[0].values[i]):
        out.add(i)
  return frozenset(out)


def _switch_impl(config: SwitchConfig, branches: tuple, index, *operands):
  name = config.name
  if in_python():  # as jax.lax.cond under jax.disable_jit(): only the branch taken runs
    branch = branches[int(np.clip(index, 0, len(branches) - 1))]
    return all_or_nothing(branch, operands, lambda: branch(*operands))
  disc = discover(branches, operands, {})
  bodies = [LoopBody(b, operands, name, disc) for b in branches]
  shapes = [jax.tree.map(_signature, b.trace.out_shapes(b.disc)) for b in bodies]
  for k, s in enumerate(shapes[1:], start=1):
    if jax.tree.structure(s) != jax.tree.structure(shapes[0]) or jax.tree.leaves(s) != jax.tree.leaves(shapes[0]):
      static = [x for x in jax.tree.leaves(s) + jax.tree.leaves(shapes[0]) if not isinstance(x, _Shape)]
      error = TypeError if static else ValueError  # as jax.lax.cond: a wrong type, or wrong shapes
      raise error(
        f'{name}: {_label(name, k)} returns {s!r} but {_label(name, 0)} returns {shapes[0]!r}: every branch must '
        'return the same structure, shapes and dtypes'
        + (', and the same non-array (static) values, which leave the construct as they are' if static else '')
      )
  written = sorted({i for b in bodies for i in b.written})
  restructured = _restructured(bodies, written)
  for b in bodies:
    b.restructured = restructured
  start = [jax.tree.map(strong_typed, bodies[0].values[i]) for i in written]
  operand_leaves = dyn_leaves(operands)

  def branch_fn(body: LoopBody):
    def run_branch(values, leaves):
      by_index = dict(zip(written, values))
      new, out = body.run([by_index[i] for i in body.written], leaves)
      by_index.update(zip(body.written, new))
      return [by_index[i] for i in written], out

    return run_branch

  fns = [branch_fn(b) for b in bodies]
  if index.dtype == jnp.bool_:  # cond's predicate: jax.lax.cond's program (no clamp of an index)
    new_values, out_leaves = jax.lax.cond(index, fns[1], fns[0], start, operand_leaves)
  else:
    new_values, out_leaves = jax.lax.switch(index, fns, start, operand_leaves)
  bodies[0].write_back(new_values, written)
  return bodies[0].trace.out_spec.rebuild(list(out_leaves), disc)
