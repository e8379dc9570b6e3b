"""Scan over layers: a stacked model read whole by a loop of its own length is refused.

A model built with ``vmap(lambda: Block(rngs), axis_size=L)()`` carries its
``stacked`` record (see :mod:`brainnx._engine.filters`). A ``scan`` or
``for_loop`` of ``L`` steps whose body reads such a Variable without
``state_in_axes`` slicing it would give every step the whole stack: it is a
``BatchAxisError`` with the ``state_in_axes`` to write, unless an explicit
``{None: filter}`` holds it fixed on purpose. Variables the body writes (an
ensemble trained step by step) travel in the carry and are not concerned.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> import brainnx as bnx
  >>> rngs = nnx.Rngs(0)
  >>> stack = bnx.vmap(lambda: nnx.Linear(3, 3, rngs=rngs), axis_size=4)()
  >>> try:
  ...   bnx.scan(lambda h, _: (stack(h), None), jnp.ones(3), None, length=4)
  ... except bnx.BatchAxisError as e:
  ...   print(str(e).split('write ')[1].split(';')[0])
  state_in_axes={0: nnx.Param}
  >>> bnx.scan(lambda h, _: (stack(h), None), jnp.ones(3), None, state_in_axes={0: nnx.Param})[0].shape
  (3,)
"""

from __future__ import annotations

from typing import Any, Sequence

from brainnx._engine.discovery import Discovery
from brainnx._engine.errors import BatchAxisError
from brainnx._engine.filters import AxisRules, filter_code, stacked_of
from brainnx._engine.nodes import is_int
from brainnx._transforms.vmap_checks import check_rules_reach, stacked_hint


def from_state_axes(state_axes, name: str) -> dict:
  """An ``nnx.StateAxes`` given to ``scan`` as the ``{axis: filter}`` it means; ``nnx.Carry`` is
  refused with what to write (brainnx carries the Variables a body writes by itself)."""
  pairs = []
  for flt, axis in state_axes.items():
    if axis is not None and not is_int(axis):
      raise TypeError(
        f'{name}: nnx.StateAxes entry {{{filter_code(flt) or repr(flt)}: {filter_code(axis) or repr(axis)}}}: '
        'a brainnx scan carries every Variable its body writes by itself, so there is no nnx.Carry '
        'to give; keep only the stacked entries, e.g. state_in_axes={0: nnx.Param}'
      )
    pairs.append((axis, flt))
  grouped: dict = {}
  for axis, flt in pairs:
    grouped.setdefault(axis, []).append(flt)
  return {axis: flts[0] if len(flts) == 1 else tuple(flts) for axis, flts in grouped.items()}


def check_rules(disc: Discovery, rules: AxisRules, name: str) -> None:
  """``ValueError`` naming a ``state_in_axes`` entry that matches none of the Variables reached."""
  check_rules_reach(name, rules, list(zip(disc.paths, disc.variables)), 'the body reaches')


def _stacks(disc: Discovery, indices, n: int, rules: AxisRules) -> list[int]:
  """Those of ``indices`` stacked on axis 0 with ``n`` members and matched by no rule."""
  found = []
  for i in indices:
    path, var = disc.paths[i], disc.variables[i]
    if rules.axis_of(path, var)[0]:
      continue
    record = stacked_of(var)
    if record is not None and record.axis == 0 and record.size == n:
      found.append(i)
  return found


def _error(name: str, disc: Discovery, stacks: Sequence[int], n: int, rules: AxisRules,
           failure: Exception | None = None) -> BatchAxisError:
  pairs = [(disc.variables[i], stacked_of(disc.variables[i])) for i in stacks]
  mapped, held = stacked_hint(rules, pairs)
  others = [disc.describe(i) for i in stacks[1:4]]
  also = f' (and {", ".join(others)}{" ..." if len(stacks) > 4 else ""})' if others else ''
  return BatchAxisError(
    f'{name}: {disc.describe(stacks[0])}{also} is stacked ({n} members on axis 0, built by a brainnx '
    f'vmap) and the loop runs {n} steps, but no state_in_axes entry slices it, so every step '
    f'reads the whole stack{f" (and tracing the body failed: {type(failure).__name__}: {failure})" if failure else ""}. '
    'To scan over it, one slice per step (scan over layers), '
    f'write {mapped}; to hold the whole stack fixed over the steps on purpose, {held}'
  )


def check_read_stacks(disc: Discovery, trace, sliced: Sequence[int], n: int, rules: AxisRules, name: str) -> None:
  """Refuse stacked Variables of ``n`` members the body reads whole and does not write."""
  check_rules_reach(name, rules, list(zip(disc.paths, disc.variables)), 'the body reaches')
  candidates = [i for i in sorted(trace.read) if i not in trace.written and i not in sliced]
  stacks = _stacks(disc, candidates, n, rules)
  if stacks:
    raise _error(name, disc, stacks, n, rules)


def explain_failure(disc: Discovery, n: int, rules: AxisRules, error: Exception, name: str) -> Any:
  """When tracing the body failed and it reaches stacked Variables of ``n`` members that no rule
  slices, raise the ``BatchAxisError`` that explains it (from ``error``); else return."""
  stacks = _stacks(disc, range(len(disc.variables)), n, rules)
  if stacks:
    raise _error(name, disc, stacks, n, rules, error) from error
