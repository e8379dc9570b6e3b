"""Stateful loops: ``scan``, ``for_loop``, ``checkpointed_scan``/``checkpointed_for_loop``,
``while_loop`` and ``fori_loop``.

The loop body is traced once with the Variables it reaches; Variables it
writes travel in the loop carry, Variables it only reads enter as constants,
and the final values are written back after the loop.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> import brainnx as bnx
  >>> total = nnx.BatchStat(jnp.zeros(()))
  >>> def step(carry, x):
  ...   total[...] += x
  ...   return carry + 1, total[...]
  >>> carry, ys = bnx.scan(step, 0, jnp.arange(5.0))
  >>> int(carry), ys.tolist(), float(total[...])
  (5, [0.0, 1.0, 3.0, 6.0, 10.0], 10.0)
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from brainnx import _compat
from brainnx._engine.arguments import CallArgs
from brainnx._engine.discovery import Discovery, discover, is_graph_node
from brainnx._engine.eager import run
from brainnx._engine.filters import stacks_exempt
from brainnx._transforms.progress import ProgressBar, check_pbar, runner_for
from brainnx._transforms import scan_state
from brainnx._engine.state import abstract_args, abstract_states, aval_key, finish_call, read_values, write_values
from brainnx._engine.tracing import Trace, trace_call, tracing_config
from brainnx._engine.errors import BatchAxisError, check_callable
from brainnx._engine.outputs import Leaf
from brainnx._engine.caches import LRUCache
from brainnx._transforms import layer_checks

__all__ = [
  'scan', 'for_loop', 'checkpointed_scan', 'checkpointed_for_loop', 'while_loop', 'fori_loop',
]


def _check_callable(f, name: str) -> None:
  if not callable(f):  # jax.lax.scan's words
    raise TypeError(f'{name}: f argument should be a callable, got {type(f).__name__}')
  check_callable(f, name)


def leading_length(xs, length, name: str) -> int:
  """The common leading-axis size of ``xs`` (checked against ``length`` when given)."""
  lengths = []
  for leaf in _dyn_leaves(xs):
    shape = jnp.shape(leaf)
    if not shape:
      raise ValueError(f'{name} got a scalar, a value with no leading axis to scan over: {leaf!r}')
    lengths.append(shape[0])
  if length is not None:
    length = _check_length(length, name)
    if any(n != length for n in lengths):
      raise ValueError(f'{name} got `length` argument of {length} which disagrees with leading axis sizes {lengths}')
    return length
  if len(set(lengths)) > 1:
    raise ValueError(
      f'{name} got values with different leading sizes (different leading axis sizes: '
      f'{", ".join(map(str, lengths))}); give every input the same leading axis length'
    )
  if not lengths:
    raise ValueError(f'{name} got no values to scan over and `length` not provided')
  return lengths[0]


def _check_length(length, name: str) -> int:
  """``length`` as a non-negative int, else an error naming it."""
  if isinstance(length, bool) or not hasattr(type(length), '__index__'):
    raise TypeError(f'{name}: length must be an int, got {length!r} ({type(length).__name__})')
  length = int(length)
  if length < 0:
    raise ValueError(f'{name}: length must be non-negative, got length={length}')
  return length


def _is_key(x) -> bool:
  return hasattr(x, 'dtype') and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _strong(x):
  """``x`` as a strongly typed array (loop carries must keep one type)."""
  if _is_key(x) or not (hasattr(x, 'dtype') or isinstance(x, (int, float, bool, complex))):
    return x
  return jax.lax.convert_element_type(x, jnp.result_type(x))


def _split_pbar(pbar) -> tuple:
  """``(ProgressBar or None, hashable rest)``: a bar object is held weakly by the eager cache."""
  check_pbar(pbar)
  return (pbar, None) if isinstance(pbar, ProgressBar) else (None, pbar)


_BRANCHING = ('cond', 'switch', 'ifelse')  # constructs whose _Body is a branch, not a loop body


class _Body:
  """``f(*args)`` traced as a pure function of carried and constant values.

  ``written`` Variables (indices into the discovery) travel in the carry;
  the rest of the touched ones are read from their current values. A call
  with other abstract values (JAX promoting a weakly typed carry) traces
  again; a write that changes a carried Variable's shape or dtype is an
  error naming it.
  """

  def __init__(self, f: Callable, args: tuple, name: str, disc: Discovery | None = None, sliced: tuple = (),
               keep_new: bool = False, fixed: tuple = ()):
    self.f, self.name = f, name
    self.keep_new = keep_new  # Variables the body creates (Module.sow) come out stacked per step
    self.call = CallArgs.split(args, {})
    self.disc = disc if disc is not None else discover(f, args, {})
    self.values = read_values(self.disc.variables)
    self.sliced = tuple(sliced)  # Variables stacked on axis 0 that each step sees one slice of
    self.fixed = tuple(fixed)  # Variables every step sees at their pre-loop value (broadcast)
    self.per_step = self.sliced + self.fixed  # given to each step, not carried: see run_step
    self.restructured = frozenset()  # written Variables whose value may change structure (every branch agrees)
    self._dyn_def = jax.tree.structure(list(self.call.dyn))
    self._traces = LRUCache(32)  # the trace cache StatefulFunction and jit use, per abstract signature
    self.contents = self.disc.snapshot()
    avals = abstract_states(self.disc, self.values)
    for i in self.sliced:
      avals[i] = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype, weak_type=a.weak_type), avals[i])
    self.trace = self.last_trace = self._trace_for(avals, abstract_args(self.call.dyn))
    if (self.trace.attachments and not keep_new) or self.trace.out_spec.new_nodes():
      if name in _BRANCHING:
        raise ValueError(
          f'{name}: a branch creates Variables or Modules; create them before calling {name} '
          '(or use brainnx.vmap_new_states outside it) and only update them inside'
        )
      raise ValueError(
        f'{name}: the loop body creates Variables or Modules; create them before the loop '
        '(or use brainnx.vmap_new_states outside it) and only update them inside'
      )

  def _trace_for(self, state_avals, dyn_avals) -> Trace:
    key = (aval_key(state_avals), aval_key(dyn_avals), tracing_config())
    trace = self._traces.get(key)
    if trace is None:
      trace = trace_call(self.f, self.disc, self.call, state_avals, dyn_avals)
      self._traces.set(key, trace)
    return trace

  @property
  def written(self) -> tuple[int, ...]:
    """Written Variables that travel in the carry (sliced and fixed ones come out per step instead)."""
    return tuple(i for i in self.trace.written if i not in self.per_step)

  def initial_written(self) -> list:
    return [jax.tree.map(_strong, self.values[i]) for i in self.written]

  def run(self, carried: list, dyn_leaves: list) -> tuple[list, list]:
    """Evaluate: ``(new written values, output leaves)``, carried values keeping their types."""
    new, out_leaves, _, _ = self.run_step(carried, dyn_leaves, ())
    return new, out_leaves

  def run_step(self, carried: list, dyn_leaves: list, slices: Sequence) -> tuple[list, list, list, list]:
    """``run`` with this step's values of the ``per_step`` Variables (slices, then fixed values);
    also returns their new values and the values of Variables the step created."""
    pos = {i: k for k, i in enumerate(self.written)}
    at = {i: k for k, i in enumerate(self.per_step)}
    states = [carried[pos[i]] if i in pos else slices[at[i]] if i in at else x for i, x in enumerate(self.values)]
    dyn = jax.tree.unflatten(self._dyn_def, list(dyn_leaves))
    trace = self._trace_for(abstract_states(self.disc, states), abstract_args(dyn))
    if trace.written != self.trace.written:
      raise ValueError(f'{self.name}: the body writes other Variables when traced again with new input types')
    outs, created, out_leaves = trace.run([states[i] for i in trace.states], dyn_leaves)
    self.last_trace = trace
    new = dict(zip(trace.written, outs))
    carried_out = [new[i] if i in self.restructured else self._keep_type(new[i], c, i)
                   for c, i in zip(carried, self.written)]
    slices_out = [self._keep_type(new[i], s, i) if i in new else s for s, i in zip(slices, self.per_step)]
    return carried_out, out_leaves, slices_out, created

  def run_readonly(self, values: list, dyn_leaves: list) -> list:
    """Output leaves for the given value of every discovered Variable (a body that writes nothing)."""
    dyn = jax.tree.unflatten(self._dyn_def, list(dyn_leaves))
    trace = self._trace_for(abstract_states(self.disc, values), abstract_args(dyn))
    return trace.run([values[i] for i in trace.states], dyn_leaves)[2]

  def _keep_type(self, new, old, i):
    inside, kept = ('inside a branch', 'Variables a branch writes') if self.name in _BRANCHING else (
      'inside the loop', 'loop-carried Variables')
    if jax.tree.structure(new) != jax.tree.structure(old):
      raise ValueError(
        f'{self.name}: {self.disc.describe(i)} changes its value\'s structure {inside}, '
        f'from {jax.tree.structure(old)} to {jax.tree.structure(new)} (e.g. Module.sow appending '
        f'per step); {kept} must keep it: return per-step values as outputs instead, or sow outside'
      )

    def one(n, o):
      if jnp.shape(n) != jnp.shape(o):
        raise ValueError(
          f'{self.name}: {self.disc.describe(i)} changes shape {inside}, '
          f'from {jnp.shape(o)} to {jnp.shape(n)}; {kept} must keep their shape'
        )
      if _is_key(n):
        return n
      if jnp.result_type(n) != jnp.result_type(o) and not jax.typeof(n).weak_type:
        raise ValueError(
          f'{self.name}: {self.disc.describe(i)} changes dtype {inside}, from '
          f'{jnp.result_type(o)} to {jnp.result_type(n)}; {kept} must keep their '
          'dtype: cast the new value back, e.g. `v[...] = new.astype(v.dtype)`'
        )
      return jax.lax.convert_element_type(n, jnp.result_type(o))

    return jax.tree.map(one, new, old)

  def write_back(self, final: list) -> None:
    write_values(self.disc, self.written, final)


def _pair_layout(body: _Body, init) -> int:
  """Number of carry leaves in ``f``'s ``(carry, y)`` output; checks the structure."""
  spec = body.trace.out_spec
  markers = jax.tree.unflatten(spec.treedef, list(range(len(spec.slots))))
  if not (isinstance(markers, tuple) and len(markers) == 2):
    raise ValueError(f'{body.name}: f must return a pair (carry, y), got {jax.tree.structure(markers)}')
  carry_struct = jax.tree.structure(init, is_leaf=is_graph_node)
  if jax.tree.structure(markers[0]) != carry_struct:
    raise ValueError(
      f'{body.name}: the carry f returns has structure {jax.tree.structure(markers[0])} but the '
      f'initial carry has {carry_struct}; they must match'
    )
  n_carry_slots = len(jax.tree.leaves(markers[0]))
  return sum(1 for s in spec.slots[:n_carry_slots] if type(s) is Leaf)


def _dyn_leaves(x) -> list:
  return [leaf for leaf in jax.tree.leaves(x, is_leaf=is_graph_node) if not is_graph_node(leaf)]


def _step_example(xs):
  """One step's ``x``: abstract slices of the arrays; graph nodes as they are (their stacked
  Variables are sliced by the body, see :mod:`scan_state`)."""
  return jax.tree.map(
    lambda a: a if is_graph_node(a) else jax.ShapeDtypeStruct(jnp.shape(a)[1:], jnp.result_type(a)),
    xs, is_leaf=is_graph_node,
  )


def _scan_parts(f, init, xs, name, state_in_axes=None, keep_new=True):
  args = (init, _step_example(xs))
  disc = discover(f, args, {})
  state = scan_state.step_state(disc, state_in_axes, name)
  body = _Body(f, args, name, disc, state.sliced, keep_new=keep_new, fixed=state.fixed)
  n_carry = _pair_layout(body, init)
  return body, n_carry, state


def _rules_key(state_in_axes, name: str = 'scan'):
  """``state_in_axes`` as a hashable tuple of ``(axis, filter)`` (the eager cache's key)."""
  if state_in_axes is None:
    return None
  if isinstance(state_in_axes, nnx.StateAxes):  # flax's {filter: axis}, in its order
    state_in_axes = layer_checks.from_state_axes(state_in_axes)
  scan_state.check_scan_rules(state_in_axes, name)
  items = state_in_axes.items() if isinstance(state_in_axes, dict) else [(0, state_in_axes)]
  return tuple((axis, tuple(f) if isinstance(f, list) else f) for axis, f in items)


def _in_python() -> bool:
  """Under ``jax.disable_jit()`` with concrete values, loops run as Python loops (inside an
  outer trace, e.g. ``jax.vmap``, they stay JAX loops, as ``jax.lax``'s do)."""
  return jax.config.jax_disable_jit and _compat.at_top_level()


def _all_or_nothing(f, args, loop: Callable):
  """Run a Python loop; if a step fails, every Variable it reaches gets its pre-call value."""
  disc = discover(f, args, {})
  before, contents = read_values(disc.variables), disc.snapshot()
  try:
    return loop()
  except BaseException:
    write_values(disc, range(len(before)), before)
    disc.restore(contents)
    raise


def _python_scan(f, init, xs, n, reverse, runner):
  run_id = runner._open() if runner else None
  carry, ys = init, []
  order = range(n - 1, -1, -1) if reverse else range(n)
  for step, i in enumerate(order):
    carry, y = f(carry, jax.tree.map(lambda a: a[i], xs))
    ys.append(y)
    if runner:
      runner.step_eager(run_id, step, carry, y)
  if reverse:
    ys.reverse()
  if not ys:
    raise ValueError('zero-length scan is not supported under jax.disable_jit(): the output type is unknown')
  return carry, jax.tree.map(lambda *e: jnp.stack(e), *ys)


def scan(
  f: Callable, init: Any, xs: Any, length: int | None = None, reverse: bool = False, unroll: int | bool = 1, pbar=None,
  state_in_axes: Any = None,
) -> tuple[Any, Any]:
  """``jax.lax.scan`` for a body that reads and writes Variables.

  ``f(carry, x) -> (carry, y)``; Variables it writes are carried from step
  to step and hold their final values afterwards. The body is traced once;
  Variables it only reads enter as constants.

  Args:
    f: the body, ``f(carry, x) -> (carry, y)``; the carry it returns must
      have the structure of ``init``.
    init: the initial carry (a pytree).
    xs: a pytree of arrays scanned over their leading axis.
    length: the number of steps; must agree with ``xs``'s leading size.
      Default ``None``: that size.
    reverse: scan from the last element to the first. Default ``False``.
    unroll: steps unrolled per loop iteration, as in ``jax.lax.scan``.
      Default ``1``.
    pbar: a :class:`ProgressBar`, or an int update frequency. Default
      ``None``: no bar.
    state_in_axes: a filter (or ``{0: filter}``) of Variables stacked on axis 0 to scan
      over: step ``i`` sees slice ``i`` of each, and its writes are stacked back (the "scan
      over layers" of a model built with ``vmap(lambda: Block(rngs), axis_size=L)()``).
      Without ``xs`` or ``length`` the loop runs over their leading axis.

  Variables the body creates and attaches (``Module.sow`` of an ``nnx.Intermediate``) come
  out stacked over the steps, as ``nnx.scan`` gives them with a scanned-out axis.

  Returns:
    ``(carry, ys)``: the final carry and every step's ``y`` stacked along a
    new leading axis.

  Raises:
    TypeError: if ``f`` is not callable, or ``pbar`` is not ``None``, a
      ``ProgressBar`` or an int.
    ValueError: if ``pbar`` is a non-positive int; if ``xs`` holds a scalar
      or leaves of different leading sizes, ``length`` disagrees with them,
      or there is nothing to scan over and no ``length``; if ``f`` does not
      return a ``(carry, y)`` pair whose carry has ``init``'s structure, or
      creates Variables; or if a Variable it writes changes shape, dtype or
      structure from step to step.

  Example:
    >>> import jax.numpy as jnp
    >>> import brainnx as bnx
    >>> bnx.scan(lambda c, x: (c + x, c + x), 0, jnp.arange(5), reverse=True)[1].tolist()
    [10, 10, 9, 7, 4]
  """
  _check_callable(f, 'scan')
  bar, rest = _split_pbar(pbar)
  return run(_scan_impl, (f, bar), (length, reverse, unroll, rest, _rules_key(state_in_axes, 'scan')), (init, xs))


def _scan_impl(f, bar, init, xs, length, reverse, unroll, pbar, state_in_axes=None, name='scan', layers_check=True,
               keep_new=True):
  over_nodes = scan_state.holds_nodes(xs)
  if (state_in_axes is not None or over_nodes) and length is None and not _dyn_leaves(xs):
    length = _stacked_length(f, init, xs, state_in_axes, name)
  n = leading_length(xs, length, name)
  runner = runner_for(bar or pbar, n)
  if _in_python() and state_in_axes is None and not over_nodes:
    return _all_or_nothing(f, (init, xs), lambda: _python_scan(f, init, xs, n, reverse, runner))
  layers_check = layers_check and not stacks_exempt(f)
  try:
    body, n_carry, state = _scan_parts(f, init, xs, name, state_in_axes, keep_new)
  except Exception as e:
    if layers_check and not isinstance(e, BatchAxisError):
      layer_checks.explain_failure(discover(f, (init, _step_example(xs)), {}), n, state_in_axes, e)
    raise
  if layers_check:
    layer_checks.check_read_stacks(body.disc, body.trace, body.sliced, n, state_in_axes)
  stacked = [body.values[i] for i in body.sliced]
  scan_state.check_stacked(body.disc, state, body.values, n, name)
  fixed_values = [body.values[i] for i in body.fixed]
  fixed_written = scan_state.fixed_writes(body.disc, state, body.trace.written, name)
  keep = [k for k, i in enumerate(body.fixed) if i in fixed_written]  # per-step outputs of fixed ones

  def step(carry, x):
    (written, leaves, counter), (x_leaves, slices) = carry, x
    written, out, per_step, created = body.run_step(written, leaves + x_leaves, list(slices) + fixed_values)
    slices, fixed_out = per_step[: len(body.sliced)], per_step[len(body.sliced) :]
    new_leaves, y = out[:n_carry], out[n_carry:]
    if runner:
      run_id, i = counter
      runner.step(run_id, i, _rebuild_part(body, out, 0), _rebuild_part(body, out, 1))
      counter = (run_id, i + 1)
    return (written, new_leaves, counter), (y, slices, [fixed_out[k] for k in keep], created)

  counter = (runner.start(), jnp.int32(0)) if runner else None
  (written, leaves, _), (ys, slices, fixed_out, created) = jax.lax.scan(
    step, (body.initial_written(), _dyn_leaves(init), counter), (_dyn_leaves(xs), stacked),
    length=n, reverse=reverse, unroll=unroll,
  )
  body.write_back(written)
  sliced_written = [k for k, i in enumerate(body.sliced) if i in body.trace.written]
  write_values(body.disc, [body.sliced[k] for k in sliced_written], [slices[k] for k in sliced_written])
  if n:  # a fixed stream's count: what one step leaves (every step leaves the same)
    write_values(body.disc, fixed_written, [jax.tree.map(lambda a: a[-1], v) for v in fixed_out])
  # what the body attached comes out stacked over the steps
  return finish_call(body.disc, body.last_trace.attachments, created, body.trace.out_spec, list(leaves) + list(ys))[0]


def _stacked_length(f, init, xs, state_in_axes, name='scan') -> int | None:
  """The loop length a scan over stacked Variables alone takes: their leading axis."""
  disc = discover(f, (init, _step_example(xs)), {})
  layer_checks.check_rules(disc, state_in_axes)
  return scan_state.stacked_length(disc, scan_state.step_state(disc, state_in_axes, name))


def _rebuild_part(body: _Body, leaves, which: int):
  """The carry (0) or y (1) part of a step's output, for progress messages."""
  try:
    return body.trace.out_spec.rebuild(list(leaves), body.disc)[which]
  except Exception:
    return None


def _for_body(f):
  def step(carry, x):
    return carry, f(*x)

  step.__wrapped__ = f
  return step


def for_loop(
  f: Callable, *xs, length: int | None = None, reverse: bool = False, unroll: int | bool = 1, pbar=None,
  state_in_axes: Any = None,
) -> Any:
  """Apply ``f(*x)`` over the leading axis of ``xs``; returns the stacked outputs.

  A :func:`scan` without a carry: Variables ``f`` writes are carried from
  step to step and hold their final values afterwards.

  Args:
    f: the body, called as ``f(*x)`` with one leading-axis slice of each of
      ``xs``.
    *xs: pytrees of arrays looped over their leading axis (same size).
    length: the number of steps; must agree with the leading sizes.
      Default ``None``: that size.
    reverse: loop from the last element to the first (outputs keep their
      positions). Default ``False``.
    unroll: steps unrolled per loop iteration, as in ``jax.lax.scan``.
      Default ``1``.
    pbar: a :class:`ProgressBar`, or an int update frequency. Default
      ``None``: no bar.
    state_in_axes: a filter (or ``{0: filter}``) of Variables stacked on axis 0 to scan
      over: step ``i`` sees slice ``i`` of each, and its writes are stacked back (the "scan
      over layers" of a model built with ``vmap(lambda: Block(rngs), axis_size=L)()``).
      Without ``xs`` or ``length`` the loop runs over their leading axis.

  Returns:
    ``f``'s outputs for every step, stacked along a new leading axis.

  Raises:
    TypeError: if ``f`` is not callable, or ``pbar`` is not ``None``, a
      ``ProgressBar`` or an int.
    ValueError: as :func:`scan`: a non-positive int ``pbar``, scalar or
      mismatched inputs or ``length``, no inputs and no ``length``, Variables
      created in ``f``, or a written Variable changing shape, dtype or
      structure.

  Example:
    >>> import jax.numpy as jnp
    >>> import brainnx as bnx
    >>> bnx.for_loop(lambda a, b: a * b, jnp.arange(3), jnp.arange(3)).tolist()
    [0, 1, 4]
  """
  _check_callable(f, 'for_loop')
  bar, rest = _split_pbar(pbar)
  return run(_for_impl, (f, bar), (length, reverse, unroll, rest, _rules_key(state_in_axes, 'for_loop')), xs)


def _for_impl(f, bar, *args):
  *xs, length, reverse, unroll, pbar, state_in_axes = args
  return _scan_impl(_for_body(f), bar, None, tuple(xs), length, reverse, unroll, pbar, state_in_axes, 'for_loop')[1]


# -- checkpointed loops -------------------------------------------------------------


def _check_base(base) -> int:
  if isinstance(base, bool) or not isinstance(base, int) or base < 2:
    raise ValueError(f'checkpointed loops need an int base >= 2, got {base!r}')
  return base


def _digits(length: int, base: int) -> list[tuple[int, int]]:
  """``length`` in base ``base``: ``[(depth, digit), ...]``, most significant first."""
  if length < 0:
    raise ValueError(f'checkpointed loops need a non-negative length, got {length}')
  digits, depth = [], 0
  while length:
    length, digit = divmod(length, base)
    digits.append((depth, digit))
    depth += 1
  return [(d, a) for d, a in reversed(digits) if a]


def _nested_scan(step, carry, length: int, base: int):
  """``lax.scan(step, carry, None, length)`` with reverse-mode memory O(base * log_base(length)).

  ``length`` is split into its digits in base ``base``; digit ``a`` at depth
  ``d`` runs ``a`` blocks of ``base**d`` steps, a block being ``base``
  checkpointed blocks of the depth below (the innermost level, ``base``
  plain steps, is not checkpointed). A backward pass then keeps one carry
  per step of each level and recomputes the rest. ``step`` reads its inputs
  itself (by the step counter in its carry), so no slice of them is kept.
  """

  def block(depth):
    if depth == 1:
      return lambda c, _: jax.lax.scan(step, c, None, length=base)
    below = jax.checkpoint(block(depth - 1), prevent_cse=False)
    return lambda c, _: jax.lax.scan(below, c, None, length=base)

  if length == 0:  # as jax.lax.scan: the carry as given, every output with a leading axis of 0
    return jax.lax.scan(step, carry, None, length=0)
  pieces = []
  for depth, count in _digits(length, base):
    body = step if depth == 0 else jax.checkpoint(block(depth), prevent_cse=False)
    carry, ys = jax.lax.scan(body, carry, None, length=count)
    pieces.append(jax.tree.map(lambda y: y.reshape((count * base**depth,) + y.shape[depth + 1 :]), ys))
  ys = pieces[0] if len(pieces) == 1 else jax.tree.map(lambda *p: jnp.concatenate(p), *pieces)
  return carry, ys


def checkpointed_scan(
  f: Callable, init: Any, xs: Any, length: int | None = None, base: int = 16, pbar=None
) -> tuple[Any, Any]:
  """``scan`` with the same values and gradients, and less reverse-mode memory.

  Reverse-mode memory grows like O(base * log_base(length)) steps instead of
  O(length): the steps are split into nested checkpointed blocks of
  ``base`` steps, and a backward pass recomputes the inner steps.

  Args:
    f: the body, ``f(carry, x) -> (carry, y)`` (see :func:`scan`).
    init: the initial carry (a pytree).
    xs: a pytree of arrays scanned over their leading axis.
    length: the number of steps; must agree with ``xs``'s leading size.
      Default ``None``: that size.
    base: the block size of each checkpointing level (an int >= 2). Default
      ``16``.
    pbar: a :class:`ProgressBar`, or an int update frequency. Default
      ``None``: no bar.

  Returns:
    ``(carry, ys)``, as :func:`scan`.

  Raises:
    TypeError: if ``f`` is not callable, or ``pbar`` is not ``None``, a
      ``ProgressBar`` or an int.
    ValueError: if ``base`` is not an int >= 2, the loop has zero steps, or
      for the problems :func:`scan` reports.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import brainnx as bnx
    >>> def total(w):
    ...   return bnx.checkpointed_scan(lambda c, x: (jnp.tanh(c * w + x), c), 0.0, jnp.ones(100), base=4)[0]
    >>> bool(jnp.allclose(jax.grad(total)(0.5), jax.grad(lambda w: bnx.scan(
    ...     lambda c, x: (jnp.tanh(c * w + x), c), 0.0, jnp.ones(100))[0])(0.5)))
    True
  """
  _check_callable(f, 'checkpointed_scan')
  base = _check_base(base)
  bar, rest = _split_pbar(pbar)
  return run(_checkpointed_impl, (f, bar), (length, base, rest), (init, xs))


def _checkpointed_impl(f, bar, init, xs, length, base, pbar, name='checkpointed_scan'):
  if scan_state.holds_nodes(xs):
    raise TypeError(
      f'{name}: xs holds a graph node (a Module or Rngs); scanning over stacked Variables is '
      'done by scan and for_loop: use one of them (under brainnx.remat for less memory)'
    )
  n = leading_length(xs, length, name)
  runner = runner_for(bar or pbar, n)
  if _in_python() and n:
    return _all_or_nothing(f, (init, xs), lambda: _python_scan(f, init, xs, n, False, runner))
  body, n_carry, _ = _scan_parts(f, init, xs, name, keep_new=False)

  xs_leaves = _dyn_leaves(xs)

  def step(carry, _):
    written, leaves, (run_id, i) = carry
    # inputs are read by index from the (loop-constant) xs, so that the checkpointed
    # levels keep only carries as residuals, never slices of xs
    x_leaves = [  # a zero-length loop only traces its step: a slice of nothing is zeros
      jax.lax.dynamic_index_in_dim(x, i, keepdims=False) if n else jnp.zeros(jnp.shape(x)[1:], jnp.result_type(x))
      for x in xs_leaves
    ]
    written, out = body.run(written, leaves + x_leaves)
    if runner:
      runner.step(run_id, i, _rebuild_part(body, out, 0), _rebuild_part(body, out, 1))
    return (written, out[:n_carry], (run_id, i + 1)), out[n_carry:]

  run_id = runner.start() if runner else jnp.int32(0)
  init_carry = (body.initial_written(), _dyn_leaves(init), (run_id, jnp.int32(0)))
  (written, leaves, _), ys = _nested_scan(step, init_carry, n, base)
  body.write_back(written)
  return body.trace.out_spec.rebuild(list(leaves) + list(ys), body.disc)


def checkpointed_for_loop(f: Callable, *xs, length: int | None = None, base: int = 16, pbar=None) -> Any:
  """``for_loop`` with the memory profile of :func:`checkpointed_scan`.

  Values and gradients are those of :func:`for_loop`; reverse-mode memory
  grows like O(base * log_base(length)) steps.

  Args:
    f: the body, called as ``f(*x)`` with one leading-axis slice of each of
      ``xs``.
    *xs: pytrees of arrays looped over their leading axis (same size).
    length: the number of steps; must agree with the leading sizes.
      Default ``None``: that size.
    base: the block size of each checkpointing level (an int >= 2). Default
      ``16``.
    pbar: a :class:`ProgressBar`, or an int update frequency. Default
      ``None``: no bar.

  Returns:
    ``f``'s outputs for every step, stacked along a new leading axis.

  Raises:
    TypeError: if ``f`` is not callable, or ``pbar`` is not ``None``, a
      ``ProgressBar`` or an int.
    ValueError: if ``base`` is not an int >= 2, the loop has zero steps, or
      for the problems :func:`for_loop` reports.

  Example:
    >>> import jax.numpy as jnp
    >>> import brainnx as bnx
    >>> bnx.checkpointed_for_loop(lambda x: x * 2, jnp.arange(5), base=2).tolist()
    [0, 2, 4, 6, 8]
  """
  _check_callable(f, 'checkpointed_for_loop')
  base = _check_base(base)
  bar, rest = _split_pbar(pbar)
  return run(_checkpointed_for_impl, (f, bar), (length, base, rest), xs)


def _checkpointed_for_impl(f, bar, *args):
  *xs, length, base, pbar = args
  return _checkpointed_impl(_for_body(f), bar, None, tuple(xs), length, base, pbar, 'checkpointed_for_loop')[1]


# -- while and fori ---------------------------------------------------------------


def while_loop(cond_fun: Callable, body_fun: Callable, init_val: Any) -> Any:
  """``jax.lax.while_loop`` whose body may write Variables (``cond_fun`` may only read).

  Variables ``body_fun`` writes travel in the loop carry and hold their
  final values afterwards.

  Args:
    cond_fun: ``cond_fun(val) -> bool scalar``; the loop runs while it is
      true. It may read Variables but not write them.
    body_fun: ``body_fun(val) -> val``, returning the structure of
      ``init_val``; it may read and write Variables.
    init_val: the initial loop value (a pytree).

  Returns:
    The loop value once ``cond_fun`` is false.

  Raises:
    TypeError: if ``cond_fun`` or ``body_fun`` is not callable, or
      ``cond_fun`` does not return a boolean scalar.
    ValueError: if ``cond_fun`` writes a Variable, ``body_fun`` does not
      return ``init_val``'s structure or creates Variables, or a Variable it
      writes changes shape, dtype or structure.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import brainnx as bnx
    >>> steps = nnx.Variable(jnp.array(0))
    >>> def body(x):
    ...   steps[...] += 1
    ...   return x * 2
    >>> float(bnx.while_loop(lambda x: x < 100, body, 1.0)), int(steps[...])
    (128.0, 7)
  """
  _check_callable(cond_fun, 'while_loop cond_fun')
  _check_callable(body_fun, 'while_loop body_fun')
  return run(_while_impl, (cond_fun, body_fun), (), (init_val,))


def _while_parts(cond_fun, body_fun, init_val, name: str):
  """``(body, cond_w, body_w)`` of a while loop over ``init_val``: the body's :class:`_Body` and
  the pure condition and step on the carry ``(written values, loop-value leaves)``, checked as
  ``jax.lax.while_loop`` checks them (and ``cond_fun`` may only read)."""
  disc = discover((cond_fun, body_fun), (init_val,), {})
  body = _Body(body_fun, (init_val,), name, disc)
  cond = _Body(cond_fun, (init_val,), name, disc)
  if cond.written:
    names = ', '.join(disc.describe(i) for i in cond.written)
    raise ValueError(f'{name}: cond_fun writes {names}; cond_fun may only read Variables')
  shapes = jax.tree.leaves(cond.trace.out_shapes(cond.disc))
  if len(shapes) != 1 or shapes[0].shape != () or shapes[0].dtype != jnp.bool_:
    raise TypeError(f'{name}: cond_fun must return a boolean scalar, got {cond.trace.out_shapes(cond.disc)}')
  init_struct = jax.tree.structure(init_val, is_leaf=is_graph_node)
  out_markers = jax.tree.unflatten(body.trace.out_spec.treedef, list(range(len(body.trace.out_spec.slots))))
  if jax.tree.structure(out_markers) != init_struct:
    raise ValueError(f'{name}: body_fun must return the structure of init_val ({init_struct})')

  def cond_w(carry):
    written, leaves = carry
    values = list(body.values)
    for i, x in zip(body.written, written):
      values[i] = x
    return cond.run_readonly(values, leaves)[0]

  def body_w(carry):
    written, leaves = carry
    return body.run(written, leaves)

  return body, cond_w, body_w


def _while_impl(cond_fun, body_fun, init_val, name='while_loop'):
  if _in_python():

    def python_loop():
      val = init_val
      while cond_fun(val):
        val = body_fun(val)
      return val

    return _all_or_nothing((cond_fun, body_fun), (init_val,), python_loop)

  body, cond_w, body_w = _while_parts(cond_fun, body_fun, init_val, name)
  written, leaves = jax.lax.while_loop(cond_w, body_w, (body.initial_written(), _dyn_leaves(init_val)))
  body.write_back(written)
  return body.trace.out_spec.rebuild(list(leaves), body.disc)


def fori_loop(lower, upper, body_fun: Callable, init_val: Any, pbar=None) -> Any:
  """``jax.lax.fori_loop`` whose body may write Variables.

  With concrete bounds it runs as a ``scan`` (reverse-differentiable, and
  ``pbar`` works); with traced bounds as a ``while_loop``.

  Args:
    lower: the first index (an int, or an integer scalar, concrete or
      traced); of ``upper``'s type, as ``jax.lax.fori_loop`` requires.
    upper: one past the last index.
    body_fun: ``body_fun(i, val) -> val``, returning the structure of
      ``init_val``; it may read and write Variables.
    init_val: the initial loop value (a pytree).
    pbar: a :class:`ProgressBar`, or an int update frequency (concrete
      bounds only). Default ``None``: no bar.

  Returns:
    The loop value after ``body_fun`` ran for ``i`` in ``range(lower,
    upper)`` (``init_val`` when that range is empty).

  Raises:
    TypeError: if ``body_fun`` is not callable, the bounds are not
      scalars of one type, or ``pbar`` is not ``None``, a ``ProgressBar``
      or an int.
    ValueError: if ``pbar`` is given with traced bounds or is a
      non-positive int, or for the problems :func:`scan` /
      :func:`while_loop` report (a body that creates Variables, changes a
      written Variable's shape or dtype, or returns another structure).

  Example:
    >>> import brainnx as bnx
    >>> int(bnx.fori_loop(0, 5, lambda i, total: total + i, 0))
    10
  """
  _check_callable(body_fun, 'fori_loop')
  index_type = _index_type(lower, upper)
  try:
    lo, hi = int(lower), int(upper)
  except (TypeError, jax.errors.ConcretizationTypeError):
    if pbar is not None:
      raise ValueError('fori_loop: a progress bar needs concrete (Python int) bounds') from None
    return _fori_while(lower, upper, body_fun, init_val, *index_type)
  bar, rest = _split_pbar(pbar)
  return run(_fori_impl, (body_fun, bar), (lo, hi, rest), (init_val,))


def _is_weak(x) -> bool:
  """Whether ``x`` is weakly typed: a Python number, or an array or tracer made from one."""
  if isinstance(x, (int, float, complex)):
    return not isinstance(x, bool)
  return bool(getattr(getattr(x, 'aval', x), 'weak_type', False))


def _index_type(lower, upper):
  """``(dtype, weak)`` of ``fori_loop``'s index under traced bounds, checking the bounds as
  ``jax.lax.fori_loop`` does: scalars of one type, or two signed integer types of which one is
  weak (a Python int beside an int8 array)."""
  found = []
  for what, bound in (('lower', lower), ('upper', upper)):
    try:
      dtype = None if isinstance(bound, (str, bytes)) or bound is None else jnp.result_type(bound)
    except TypeError:
      dtype = None
    if dtype is None or jnp.ndim(bound) != 0:
      raise TypeError(f'fori_loop: {what} must be a scalar, as in jax.lax.fori_loop; got {bound!r}')
    found.append(dtype)
  lo, hi = found
  lo_weak, hi_weak = _is_weak(lower), _is_weak(upper)
  if lo == hi:
    return lo, lo_weak  # the index starts as ``lower``, weak or not
  if jnp.issubdtype(lo, jnp.signedinteger) and jnp.issubdtype(hi, jnp.signedinteger) and lo_weak != hi_weak:
    return (hi, False) if lo_weak else (lo, False)
  raise TypeError(
    f'fori_loop: lower and upper must have equal types, as in jax.lax.fori_loop; got {lo} and {hi}'
  )


def _fori_impl(body_fun, bar, init_val, lo, hi, pbar):
  def step(carry, i):
    # concrete bounds give a weakly typed index, as jax.lax.fori_loop's (i * jnp.int8(1) is int8)
    return body_fun(_compat.weakly_typed(i), carry), None

  step.__wrapped__ = body_fun
  if hi <= lo:
    return init_val
  return _scan_impl(step, bar, init_val, jnp.arange(lo, hi), None, False, 1, pbar, None, 'fori_loop',
                    layers_check=False, keep_new=False)[0]


def _fori_while(lower, upper, body_fun, init_val, index_dtype, weak):
  def cond(c):
    return c[0] < upper

  def body(c):
    return c[0] + 1, body_fun(_compat.weakly_typed(c[0]) if weak else c[0], c[1])

  body.__wrapped__ = body_fun
  return _while_impl(cond, body, (jnp.asarray(lower, index_dtype), init_val), 'fori_loop')[1]
