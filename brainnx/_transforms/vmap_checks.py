"""The checks a mapped call makes on how its Variables are laid out, and the messages they give.

- a ``state_in_axes`` / ``state_out_axes`` entry whose filter matches none
  of the Variables the function reaches is refused, naming the entry;
- a Variable that a brainnx ``vmap`` built stacked (its ``stacked``
  metadata) broadcast into a mapped call of its own size is refused with the
  ``state_in_axes`` to write, unless an explicit ``{None: filter}`` says so;
- an ``nnx.Rngs`` stream already split (``nnx.split_rngs``) reaching a
  mapped call broadcast, or split inside it, is explained;
- ``nnx.StateAxes`` in ``in_axes`` becomes the ``state_in_axes`` entries it
  means, scoped to its argument.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> import brainnx as bnx
  >>> rngs = nnx.Rngs(0)
  >>> model = bnx.vmap(lambda: nnx.Linear(2, 2, rngs=rngs), axis_size=3)()
  >>> model.kernel.stacked
  Stacked(axis=0, size=3, ndim=3)
  >>> try:
  ...   bnx.vmap(lambda: model(jnp.ones(2)), axis_size=3)()
  ... except bnx.BatchAxisError as e:
  ...   print(str(e).split('Map it with ')[1].split(';')[0])
  state_in_axes={0: nnx.Param}
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from brainnx import _compat
from brainnx._engine.discovery import Discovery
from brainnx._engine.roots import RootKind
from brainnx._engine.errors import BatchAxisError
from brainnx._engine.tracing import used_vars
from brainnx._engine.outputs import Leaf, New, is_output_leaf
from brainnx._engine.filters import (
  AxisRules, code, filter_code, mark_stacked, rules_code, stacked_of, stacks_exempt, types_code,
)


def _listing(names: Sequence[str], most: int = 4) -> str:
  shown = ', '.join(names[:most])
  return shown + (f' and {len(names) - most} more' if len(names) > most else '')


def check_rules_reach(name: str, rules: AxisRules, named: Sequence[tuple[tuple, Any]], reached: str) -> None:
  """``ValueError`` naming the first entry of ``rules`` whose filter matches none of ``named``."""
  missing = rules.unmatched(named)
  if not missing:
    return
  axis, _, flt = missing[0]
  variables = [v for _, v in named]
  if variables:
    described = _listing([f'{type(v).__name__} at {tuple(p)!r}' for p, v in named])
    plain = [v for v in variables if not isinstance(v, nnx.RngState)] or variables
    hint = f'filters select Variables by type, tag or path, e.g. {rules.what}={{{axis}: {types_code(plain)}}}'
  else:
    described, hint = 'none', f'drop {rules.what}'
  if isinstance(flt, str):
    hint += f" ({flt!r} is a tag: it matches Variables created with tag={flt!r})"
  raise ValueError(f'{name}: {rules.entry_code(missing[0])} matches none of the Variables {reached} ({described}): {hint}')


def _user_rules_code(rules: AxisRules) -> list | None:
  """The user's entries as ``(axis, code)`` pairs, or ``None`` if one cannot be written back."""
  pairs = []
  for axis, predicate, flt in rules.entries:
    text = filter_code(flt)
    if text is None or type(predicate).__name__ == '_InArgument':
      return None
    pairs.append((axis, code(text)))
  return pairs


def stacked_hint(rules: AxisRules, offenders: Sequence[tuple[Any, Any]], what: str = 'state_in_axes',
                 selecting: str | None = None) -> tuple[str, str]:
  """``(line to map them, line to broadcast them)`` for stacked ``(Variable, Stacked)`` pairs;
  ``selecting``: filter code that matches them alone (default: their types)."""
  by_axis: dict = {}
  for var, record in offenders:
    by_axis.setdefault(record.axis, []).append(var)
  if selecting is not None and len(by_axis) == 1:
    new = [(next(iter(by_axis)), code(selecting))]
    everything = code(selecting)
  else:
    new = [(axis, code(types_code(vs))) for axis, vs in by_axis.items()]
    everything = code(types_code([v for v, _ in offenders]))
  user = _user_rules_code(rules)
  if user is None:
    mapped = f'{what}={rules_code(new)} (added to your other entries)' if rules else f'{what}={rules_code(new)}'
  else:
    mapped = f'{what}={rules_code(user + new)}'
  return mapped, f'{what}={{None: {everything}}}'


def _reason(disc: Discovery, i: int, rules: AxisRules) -> str:
  root = disc.roots[disc.root_of[i]]
  if rules:
    return 'it matches none of the state_in_axes entries'
  if root.kind is RootKind.ARG:
    return f'in_axes=None for argument {root.name}'
  return f'it is reached through the {root.kind.value} {root.name!r} and no state_in_axes entry maps it'


def stacked_broadcasts(cfg, disc: Discovery, axes: Sequence, matched: Sequence, size: int) -> tuple[int, ...]:
  """The Variables a brainnx vmap built stacked with ``size`` members that would come into a
  mapped call of that size broadcast (no rule says so): refused if the function reads them."""
  if stacks_exempt(cfg.fn):
    return ()
  offenders = []
  for i, var in enumerate(disc.variables):
    if axes[i] is not None or matched[i]:
      continue
    record = stacked_of(var)
    if record is not None and record.size == size:
      offenders.append(i)
  return tuple(offenders)


def read_inputs(trace_mapped: Callable[[], Any], state_in: Sequence) -> set[int] | None:
  """Indices of the entries of ``state_in`` whose value the mapped function uses (its trace,
  ``trace_mapped()``, a ``ClosedJaxpr`` over ``(state_in, dyn)``); ``None`` if tracing failed
  (a stack read whole often has the wrong shape for the body)."""
  try:
    closed = trace_mapped()
  except Exception:  # noqa: BLE001 - the refusal says what is wrong, not the shape error after it
    return None
  jaxpr = closed.jaxpr
  used = used_vars(jaxpr)
  read, at = set(), 0
  for i, value in enumerate(state_in):
    n = len(jax.tree.leaves(value))
    if any(v in used for v in jaxpr.invars[at:at + n]):
      read.add(i)
    at += n
  return read


def check_stacked_broadcast(cfg, disc: Discovery, offenders: Sequence[int], size: int) -> None:
  """Refuse stacked Variables (``offenders``, see :func:`stacked_broadcasts`) that the function
  reads broadcast into a call of their size."""
  if offenders:
    first = offenders[0]
    record = stacked_of(disc.variables[first])
    mapped, broadcast = stacked_hint(cfg.state_in, [(disc.variables[i], stacked_of(disc.variables[i])) for i in offenders],
                                     selecting=_selecting(disc, offenders))
    others = [disc.describe(i) for i in offenders[1:]]
    also = f' (and {_listing(others)})' if others else ''
    root = disc.roots[disc.root_of[first]]
    as_arg = f', or pass in_axes={record.axis} for argument {root.name}' if root.kind is RootKind.ARG and not cfg.state_in else ''
    raise BatchAxisError(
      f'{cfg.name}: {disc.describe(first)}{also} is stacked (axis {record.axis}, {record.size} members, '
      f'built by a brainnx vmap) but would be broadcast into this mapped call of size {size} '
      f'({_reason(disc, first, cfg.state_in)}), so every element would see the whole stack '
      f'instead of its own member. Map it with {mapped}{as_arg}; or, to give every element the '
      f'whole stack on purpose, write {broadcast}'
    )


def _selecting(disc: Discovery, offenders: Sequence[int]) -> str | None:
  """A filter matching the ``offenders`` and no other Variable the function reaches: their
  types when those select only them, else their names (``None`` if neither does)."""
  chosen = set(offenders)
  variables = [disc.variables[i] for i in offenders]
  kinds = tuple({type(v) for v in variables})
  if not any(isinstance(v, kinds) for k, v in enumerate(disc.variables) if k not in chosen):
    return None  # the types alone: stacked_hint's default
  names = sorted({disc.paths[i][-1] for i in offenders}, key=str)
  if not all(isinstance(n, str) for n in names):
    return None
  named = lambda path: any(n in path for n in names)  # noqa: E731 - what nnx.PathContains matches
  if any(named(p) for k, p in enumerate(disc.paths) if k not in chosen):
    return None
  contains = [f'nnx.PathContains({n!r})' for n in names]
  return contains[0] if len(contains) == 1 else 'nnx.Any(' + ', '.join(contains) + ')'


def check_presplit(cfg, disc: Discovery, presplit: Sequence[int]) -> None:
  """Refuse a stream ``nnx.split_rngs`` split that comes into the mapped call broadcast."""
  for k in presplit:
    key = disc.variables[k]
    raise BatchAxisError(
      f'{cfg.name}: the nnx.Rngs stream {disc.describe(k)} holds {int(np.prod(jnp.shape(_compat.raw_value(key))))} keys (shape {jnp.shape(_compat.raw_value(key))}, as '
      'nnx.split_rngs leaves it) but comes into the mapped call broadcast. brainnx.vmap splits every '
      'stream itself, one key per element, advancing the stream once: drop nnx.split_rngs and pass '
      'the nnx.Rngs as it is; or, to use these keys as they are, one per element, write '
      'state_in_axes={0: nnx.RngState}'
    )


def raise_clearer(name: str, error: ValueError) -> None:
  """Raise a clearer error for a failure inside the mapped function (from ``error``), or return:
  ``nnx.split_rngs`` applied inside it leaves a stream holding several keys where one is drawn."""
  if 'accepts a single key' not in str(error):
    return
  tb, functions = error.__traceback__, set()
  while tb is not None:
    functions.add(tb.tb_frame.f_code.co_name)
    tb = tb.tb_next
  if not any('split_rngs' in f for f in functions):
    return
  raise ValueError(
    f'{name}: nnx.split_rngs was applied inside the mapped function, so an nnx.Rngs stream held '
    f'several keys where one was drawn ({error}). brainnx.{name} already gives every element its '
    'own key from each stream (and advances the stream once, keeping its count, where '
    'nnx.split_rngs restarts each member at count 0): remove nnx.split_rngs and draw from the '
    'nnx.Rngs as it is'
  ) from error


def mark_results(spec, result, out_axes: Sequence, size: int, partition_name=None) -> None:
  """Give the Variables of Modules created inside the call, returned stacked, their record."""
  if not spec.new_nodes():
    return
  flat = jax.tree.flatten(result, is_leaf=is_output_leaf)[0]
  if len(flat) != len(spec.slots):
    return
  it = iter(out_axes)
  for slot, obj in zip(spec.slots, flat):
    if type(slot) is Leaf:
      next(it)
    elif type(slot) is New:
      axes: dict = {}
      for (path, _), axis in zip(slot.leaf_vars, [next(it) for _ in slot.leaf_vars]):
        axes.setdefault(tuple(path), axis)
      named = [((), obj)] if isinstance(obj, nnx.Variable) else nnx.to_flat_state(nnx.state(obj))
      for path, var in named:
        axis = axes.get(tuple(path))
        if isinstance(axis, int) and isinstance(var, nnx.Variable):
          mark_stacked(var, axis, size, partition_name)


def split_state_axes(in_axes, what: str = 'in_axes') -> tuple[Any, AxisRules]:
  """``(in_axes, rules)``: every ``nnx.StateAxes`` given as a whole ``in_axes`` entry becomes
  ``state_in_axes`` entries scoped to its argument (``None`` left in its place)."""
  rules = AxisRules(None, 'state_in_axes')
  if isinstance(in_axes, nnx.StateAxes):
    return None, AxisRules.in_argument(in_axes, None, 'state_in_axes')
  if isinstance(in_axes, (tuple, list)) and any(isinstance(a, nnx.StateAxes) for a in in_axes):
    entries = []
    for k, a in enumerate(in_axes):
      if isinstance(a, nnx.StateAxes):
        rules = rules + AxisRules.in_argument(a, k, 'state_in_axes')
        entries.append(None)
      else:
        entries.append(a)
    return type(in_axes)(entries), rules
  return in_axes, rules


def state_axes_at(spec, where: str) -> Exception:
  """The error for an ``nnx.StateAxes`` found where brainnx cannot read it (nested in ``in_axes``,
  or in ``out_axes``), with the rewrite."""
  pairs = [(axis, flt) for flt, axis in spec.items()]
  if 'out_axes' in where:
    return TypeError(
      f'{where}: brainnx gives Modules created inside the call out_axes (0 by default) and places '
      f'their Variables with state_out_axes: write out_axes=0, state_out_axes={rules_code(pairs)} '
      'instead of nnx.StateAxes'
    )
  return TypeError(
    f'{where}: an nnx.StateAxes is read only as a whole in_axes entry of a positional argument; '
    f'here write state_in_axes={rules_code(pairs)} (and None in in_axes for that part)'
  )
