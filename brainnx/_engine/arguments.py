"""A call's arguments, split into static values, references and array data.

References (Modules, Variables, Rngs, plain objects holding them) travel by
reference, never through a JAX transform; static arguments are part of the
trace key (by type and value, as in ``jax.jit``); all other leaves are
dynamic.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from brainnx._engine.arguments import ArgKind, CallArgs, StaticArgs
  >>> model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
  >>> statics = StaticArgs.resolve(lambda m, x, act: m(x), static_argnums=2)
  >>> call = CallArgs.split((model, jnp.ones(2), 'relu'), {}, statics)
  >>> call.kinds == (ArgKind.REF, ArgKind.DYN, ArgKind.STATIC)
  True
  >>> args, kwargs = call.rebuild(call.dyn, call.refs)
  >>> args[0] is model, args[2]
  (True, 'relu')
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
from typing import Any, Callable, Hashable, Sequence

import jax

from brainnx._engine.nodes import holds_graph_node, is_int, is_reference, static_key


class ArgKind(enum.Enum):
  """How one argument travels into a traced call."""

  STATIC = 'static'  # hashable, baked into the trace
  REF = 'reference'  # a graph node or plain object holding one: passed as is
  DYN = 'dynamic'  # array data: an input of the trace
  MIXED = 'mixed'  # a container of array data and references, flattened


def _int_tuple(argnums, what: str) -> tuple[int, ...]:
  """``argnums`` (an int or a sequence of ints) as a tuple, else ``TypeError`` naming ``what``."""
  if is_int(argnums):
    return (argnums,)
  if isinstance(argnums, (str, bytes)) or not isinstance(argnums, (tuple, list, range)):
    raise TypeError(f'{what} must be an int or a sequence of ints, got {argnums!r} ({type(argnums).__name__})')
  for n in argnums:
    if not is_int(n):
      raise TypeError(f'{what} must be an int or a sequence of ints, got {n!r} ({type(n).__name__}) in {argnums!r}')
  return tuple(argnums)


def check_argnums(argnums, name: str) -> tuple[tuple[int, ...] | None, bool]:
  """A differentiation transform's ``argnums`` (``None``, an int or ints; a bool counts as an
  int, as in ``jax.grad``): ``(tuple or None, given as an int)``; anything else is a
  ``TypeError`` naming ``argnums`` and ``name``."""
  if argnums is None:
    return None, False
  if isinstance(argnums, bool):  # a bool is an int, as jax.grad takes it
    argnums = int(argnums)
  elif isinstance(argnums, (tuple, list)):
    argnums = tuple(int(n) if isinstance(n, bool) else n for n in argnums)
  return _int_tuple(argnums, f'{name}: argnums'), is_int(argnums)


def resolve_argnums(nums: tuple[int, ...], n_args: int, name: str) -> tuple[int, ...]:
  """``nums`` against a call with ``n_args`` positional arguments, as ``jax.grad`` resolves them:
  negative positions count from the right; out of range or repeated → ``ValueError``."""
  resolved = []
  for n in nums:
    if not -n_args <= n < n_args:
      raise ValueError(
        f'{name}: argnums={n} is out of range: the function got {n_args} positional '
        f'argument(s), so argnums must be in [{-n_args}, {n_args - 1}]'
      )
    resolved.append(n % n_args)
  repeated = sorted({n for n in resolved if resolved.count(n) > 1})
  if repeated:
    raise ValueError(
      f'{name}: argnums={nums} names argument(s) {repeated} more than once (negative positions '
      'count from the right); give each argument once'
    )
  return tuple(resolved)


def normalize_argnums(argnums, what: str = 'static_argnums') -> tuple[int, ...]:
  nums = _int_tuple(argnums, what)
  for n in nums:
    if n < 0:
      raise ValueError(
        f'{what} must be non-negative, got {n}: count positions from the left '
        '(brainnx does not resolve negative positions)'
      )
  return nums


def _str_tuple(names, what: str) -> tuple[str, ...]:
  if isinstance(names, str):
    return (names,)
  if not isinstance(names, (tuple, list)) or not all(isinstance(n, str) for n in names):
    raise TypeError(f'{what} must be a str or a sequence of strs, got {names!r} ({type(names).__name__})')
  return tuple(names)


@dataclasses.dataclass(frozen=True)
class StaticArgs:
  """Which arguments are static, by position and by name, resolved against ``fun``'s signature
  as ``jax.jit`` does: a static name also covers that argument passed by position, a static
  position also covers it passed by keyword."""

  argnums: tuple[int, ...] = ()
  argnames: tuple[str, ...] = ()

  @classmethod
  def resolve(cls, fun: Callable, static_argnums=(), static_argnames=(), *, what: str = 'jit',
              role: str = 'static') -> 'StaticArgs':
    """The selection ``static_argnums`` / ``static_argnames`` make; ``role`` names them in
    errors (``'donate'``: ``jit``'s donated arguments are selected the same way)."""
    nums = normalize_argnums(static_argnums, f'{what}: {role}_argnums')
    names = _str_tuple(static_argnames, f'{what}: {role}_argnames')
    if not nums and not names:
      return cls()
    try:
      params = list(inspect.signature(fun).parameters.values())
    except (TypeError, ValueError):  # no signature to check against: take them as given
      return cls(nums, names)
    kind = inspect.Parameter
    positional = [p.name for p in params if p.kind in (kind.POSITIONAL_ONLY, kind.POSITIONAL_OR_KEYWORD)]
    by_keyword = {p.name for p in params if p.kind in (kind.POSITIONAL_OR_KEYWORD, kind.KEYWORD_ONLY)}
    has_varargs = any(p.kind is kind.VAR_POSITIONAL for p in params)
    has_varkw = any(p.kind is kind.VAR_KEYWORD for p in params)
    too_far = [n for n in nums if n >= len(positional)]
    if too_far and not has_varargs:
      raise ValueError(
        f'{what}: {role}_argnums={nums} but the function accepts {len(positional)} positional '
        f'argument(s) ({", ".join(positional) or "none"})'
      )
    unknown = [n for n in names if n not in by_keyword]
    if unknown and not has_varkw:
      raise ValueError(
        f'{what}: {role}_argnames {unknown} are not parameters of the function '
        f'(its parameters: {", ".join(p.name for p in params) or "none"})'
      )
    nums_all = set(nums) | {positional.index(n) for n in names if n in positional}
    names_all = set(names) | {positional[n] for n in nums if n < len(positional) and positional[n] in by_keyword}
    return cls(tuple(sorted(nums_all)), tuple(sorted(names_all)))

  def is_static(self, slot: int, n_args: int, kw_names: Sequence[str]) -> bool:
    if slot < n_args:
      return slot in self.argnums
    return kw_names[slot - n_args] in self.argnames


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

  ``kinds`` has one :class:`ArgKind` per positional argument, then one per
  keyword in ``kw_names`` order.
  """

  kinds: tuple[ArgKind, ...]
  kw_names: tuple[str, ...]
  statics: tuple[tuple[int, Any], ...]  # (slot, value)
  refs: tuple[Any, ...]  # references, in slot order (mixed ones expanded)
  dyn: tuple[Any, ...]  # dynamic values: whole args for DYN, leaves for MIXED
  mixed: tuple[tuple[int, Any, tuple[bool, ...]], ...]  # (slot, treedef, is-reference mask)
  n_args: int

  @classmethod
  def split(cls, args: Sequence, kwargs: dict, statics: StaticArgs = StaticArgs()) -> 'CallArgs':
    values = list(args) + list(kwargs.values())
    names = tuple(kwargs)
    kinds, static_vals, refs, dyn, mixed = [], [], [], [], []
    for slot, value in enumerate(values):
      if statics.is_static(slot, len(args), names):
        where = f'at position {slot}' if slot < len(args) else f'{names[slot - len(args)]!r}'
        _check_hashable(value, where)
        kinds.append(ArgKind.STATIC)
        static_vals.append((slot, value))
      elif is_reference(value):
        kinds.append(ArgKind.REF)
        refs.append(value)
      elif not holds_graph_node(value):
        kinds.append(ArgKind.DYN)
        dyn.append(value)
      else:
        leaves, treedef = jax.tree.flatten(value, is_leaf=is_reference)
        mask = tuple(map(is_reference, leaves))
        kinds.append(ArgKind.MIXED)
        mixed.append((slot, treedef, mask))
        for leaf, is_ref in zip(leaves, mask):
          (refs if is_ref else dyn).append(leaf)
    return cls(tuple(kinds), names, tuple(static_vals), tuple(refs), tuple(dyn), tuple(mixed), len(args))

  @property
  def signature(self) -> Hashable:
    """Everything about the call that is not array data (references by position)."""
    statics = tuple((slot, static_key(v)) for slot, v in self.statics)
    return (self.kinds, self.kw_names, statics, self.mixed, self.n_args)

  @property
  def has_mixed(self) -> bool:
    return bool(self.mixed)

  def slots_of(self, kind: ArgKind) -> tuple[int, ...]:
    return tuple(s for s, k in enumerate(self.kinds) if k is kind)

  def rebuild(self, dyn: Sequence, refs: Sequence) -> tuple[tuple, dict]:
    """The ``(args, kwargs)`` of the call with ``dyn`` and ``refs`` put back."""
    dyn_it, ref_it = iter(dyn), iter(refs)
    statics = dict(self.statics)
    mixed = {slot: (treedef, mask) for slot, treedef, mask in self.mixed}
    values = []
    for slot, kind in enumerate(self.kinds):
      if kind is ArgKind.STATIC:
        values.append(statics[slot])
      elif kind is ArgKind.REF:
        values.append(next(ref_it))
      elif kind is ArgKind.DYN:
        values.append(next(dyn_it))
      else:
        treedef, mask = mixed[slot]
        leaves = [next(ref_it) if is_ref else next(dyn_it) for is_ref in mask]
        values.append(jax.tree.unflatten(treedef, leaves))
    args = tuple(values[: self.n_args])
    return args, dict(zip(self.kw_names, values[self.n_args :]))
