"""Which Variables a ``scan`` / ``for_loop`` step sees a slice of, and which it sees fixed.

Two kinds of Variables are not carried from step to step:

* *sliced*: stacked on axis 0 (a Module built with ``vmap(..., axis_size=L)``, split
  ``Rngs``). Step ``i`` sees slice ``i``; the slices it writes are stacked back. They are the
  Variables of graph nodes passed in ``xs``, and those ``state_in_axes`` maps to ``0``.
* *fixed*: those ``state_in_axes`` maps to ``None`` (broadcast). Every step sees the value they
  had before the loop. They are read-only, except an RNG stream's count: a step's draws from a
  fixed stream are the same in every step, and after the loop the count is the one a single
  step leaves (the loop drew as one step does), so the next loop draws new keys.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> import brainnx as bnx
  >>> rngs = nnx.Rngs(dropout=0)
  >>> _, keys = bnx.scan(lambda c, _: (c, rngs.dropout()), None, None, length=3,
  ...                    state_in_axes={None: 'dropout'})
  >>> bool((jax.random.key_data(keys) == jax.random.key_data(keys)[0]).all()), int(rngs.dropout.count[...])
  (True, 1)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from brainnx import _compat
from brainnx._engine.discovery import Discovery
from brainnx._engine.nodes import is_graph_node
from brainnx._engine.roots import RootKind
from brainnx._engine.filters import AxisRules


_XS = 1  # the position of ``x`` in the body's ``f(carry, x)``


@dataclasses.dataclass(frozen=True)
class StepState:
  """Discovery indices of the sliced and the fixed Variables of one scan body."""

  sliced: tuple[int, ...]
  fixed: tuple[int, ...]
  from_xs: frozenset  # the sliced ones that came in through ``xs`` (for messages)


def check_scan_rules(state_in_axes, name: str) -> None:
  """Refuse, when the loop is called, ``state_in_axes`` that are not rules (``TypeError``, as
  every transform refuses them) or axes a scan does not honour (``ValueError``). Runs on every
  call: rules keyed by 0 and None alone pass without being parsed."""
  if isinstance(state_in_axes, dict) and all(k is None or (k == 0 and type(k) is int) for k in state_in_axes):
    return
  for axis, _, flt in AxisRules(state_in_axes, 'state_in_axes', name).entries:
    if axis not in (None, 0):
      raise ValueError(
        f'{name}: state_in_axes={{{axis!r}: {flt!r}}} is not honoured: a scan takes axis 0 (each step '
        'sees one slice of a stacked Variable) or None (every step sees the same value, e.g. '
        'recurrent dropout); other axes: move them to the front first'
      )


def holds_nodes(xs) -> bool:
  """Whether ``xs`` holds a graph node (a stacked Module, split Rngs)."""
  return any(is_graph_node(leaf) for leaf in jax.tree.leaves(xs, is_leaf=is_graph_node))


def step_state(disc: Discovery, rules: AxisRules, name: str) -> StepState:
  """The sliced and fixed Variables of a body discovered from ``(init, x)``: ``state_in_axes``
  (its ``rules``) first, then the Variables of graph nodes in ``x``."""
  sliced, fixed, from_xs = [], [], set()
  for i, (path, var) in enumerate(zip(disc.paths, disc.variables)):
    hit, axis = rules.axis_of(path, var)
    if hit:
      if axis is None:
        fixed.append(i)
      elif axis == 0:
        sliced.append(i)
      else:
        raise ValueError(f'{name}: state_in_axes scans over axis 0 only; {disc.describe(i)} is given axis {axis}')
      continue
    root = disc.roots[disc.root_of[i]]
    if root.kind is RootKind.ARG and root.name == _XS:
      sliced.append(i)
      from_xs.add(i)
  return StepState(tuple(sliced), tuple(fixed), frozenset(from_xs))


def stacked_length(disc: Discovery, state: StepState) -> int | None:
  """The leading axis of the first sliced Variable (the loop length when nothing else gives it)."""
  for i in state.sliced:
    leaves = jax.tree.leaves(_compat.raw_value(disc.variables[i]))
    if leaves and jnp.ndim(leaves[0]):
      return int(jnp.shape(leaves[0])[0])
  return None


def check_stacked(disc: Discovery, state: StepState, values: list, n: int, name: str) -> None:
  """Every sliced Variable has leading axis ``n``, or a ``ValueError`` naming it."""
  for i in state.sliced:
    sizes = {jnp.shape(leaf)[0] if jnp.ndim(leaf) else None for leaf in jax.tree.leaves(values[i])}
    if sizes != {n}:
      how = 'it is in xs' if i in state.from_xs else 'state_in_axes'
      raise ValueError(
        f'{name}: {disc.describe(i)} is scanned over ({how}) but its leading axis is '
        f'{sorted(sizes, key=str)}, not the loop length {n}'
      )


def fixed_writes(disc: Discovery, state: StepState, written, name: str) -> tuple[int, ...]:
  """The fixed Variables the body writes: RNG counts only, else a ``ValueError`` naming one."""
  out = []
  for i in state.fixed:
    if i not in written:
      continue
    if not isinstance(disc.variables[i], nnx.RngCount):
      raise ValueError(
        f'{name}: {disc.describe(i)} is broadcast over the steps (state_in_axes None: every step '
        'sees its pre-loop value) and is read-only there, but the body writes it; carry it '
        '(no state_in_axes entry) or scan over it (axis 0)'
      )
    out.append(i)
  return tuple(out)
