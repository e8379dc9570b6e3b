"""``scan`` and ``for_loop``: loops whose body reads and writes Variables, and the parts the
other loops and ``map`` share with them.

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

import dataclasses
import functools
import inspect
import types
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from brainnx._engine.discovery import discover
from brainnx._engine.nodes import is_graph_node
from brainnx._engine.config import Config
from brainnx._engine.eager import call
from brainnx._engine.errors import BatchAxisError, check_callable
from brainnx._engine.filters import AxisRules, stacks_exempt
from brainnx._engine.loop_body import LoopBody, all_or_nothing, dyn_leaves, in_python
from brainnx._engine.outputs import Leaf
from brainnx._transforms import layer_checks, scan_state
from brainnx._transforms.progress import progress_scan, runner_for, split_pbar


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScanConfig(Config):
  """A ``scan``'s settings (``for_loop``, ``map`` and ``fori_loop`` run as one).

  ``pbar`` is an int update frequency (a :class:`ProgressBar` object is a root, held weakly);
  ``state_in_axes`` the ``(axis, filter)`` pairs of Variables stacked over the steps;
  ``layers_check`` explains a stacked model read whole; ``keep_new`` lets the body attach
  Variables (they come out stacked).
  """

  name: str = 'scan'
  length: int | None = None
  reverse: bool = False
  unroll: int | bool = 1
  pbar: int | None = None
  state_in_axes: tuple | None = None
  layers_check: bool = True
  keep_new: bool = True

  @functools.cached_property
  def rules(self) -> AxisRules:
    """``state_in_axes`` as the rules that place each Variable (parsed once per config)."""
    return AxisRules(dict(self.state_in_axes) if self.state_in_axes is not None else None, 'state_in_axes', self.name)


def _takes_positional(f, n: int) -> bool:
  """``f(*n positional arguments)`` binds, read off a plain function's (or bound method's) code
  object: the check every eager loop call makes, without ``inspect.signature``'s cost. False
  where unsure: :func:`check_loop_callable` then asks ``inspect``."""
  if type(f) is types.MethodType:
    f, n = f.__func__, n + 1
  if type(f) is not types.FunctionType:
    return False
  code = f.__code__
  if code.co_kwonlyargcount > len(f.__kwdefaults__ or ()):
    return False  # a keyword-only argument without a default
  takes = code.co_argcount
  return takes - len(f.__defaults__ or ()) <= n and (n <= takes or bool(code.co_flags & inspect.CO_VARARGS))


def _model_wrap(name: str) -> tuple[str, str]:
  """How loop ``name`` calls its function, and the wrap that runs a model at every step."""
  if 'scan' in name:
    return 'f(carry, x)', 'bnx.scan(lambda carry, x: (model(carry), None), init, xs)'
  return 'f(*x), one slice of each of xs', f'bnx.{name}(lambda x: model(x), xs)'


def check_loop_callable(f, name: str, n_args: int | None = None) -> None:
  """A loop's function is callable (``jax.lax.scan``'s words), no generator, and (``n_args``
  given) takes that many positional arguments, as the loop calls it."""
  if not callable(f):
    raise TypeError(f'{name}: f argument should be a callable, got {type(f).__name__}')
  check_callable(f, name)
  if n_args is None or _takes_positional(f, n_args):
    return
  try:
    signature = inspect.signature(f)
  except (TypeError, ValueError):  # no signature to check against
    return
  try:
    signature.bind(*([None] * n_args))
  except TypeError:
    what = f'the {type(f).__name__} Module' if isinstance(f, nnx.Module) else getattr(f, '__name__', type(f).__name__)
    called, wrap = _model_wrap(name)
    raise TypeError(
      f'{name} calls its function as {called}, {n_args} positional argument(s), but {what} takes '
      f'{signature}. To run a model at every step, wrap it: {wrap}'
    ) from None


def leading_length(xs, length, name: str) -> int:
  """The common leading-axis size of ``xs`` (checked against ``length`` when given)."""
  lengths = []
  for leaf in dyn_leaves(xs):
    shape = jnp.shape(leaf)
    if not shape:
      for items in _python_lists(xs):
        if items and all(not jnp.shape(x) for x in dyn_leaves(items)):
          raise ValueError(
            f'{name} got xs as a Python list of {len(items)} scalars: it scans over the leading axis of arrays, '
            'and a list is a pytree whose every item is one input with no axis. Scan over an array of '
            'them: jnp.asarray(xs)'
          )
      raise ValueError(
        f'{name} got a scalar ({type(leaf).__name__}, shape ()), a value with no leading axis to scan over: '
        'give each input a leading axis of one row per step'
      )
    lengths.append(shape[0])
  if length is not None:
    length = check_length(length, name)
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


def _python_lists(xs) -> list:
  """The Python lists ``xs`` is or holds as its items (``for_loop``'s positional arguments)."""
  if isinstance(xs, list):
    return [xs]
  return [x for x in xs if isinstance(x, list)] if isinstance(xs, tuple) else []


def note_list_of_arrays(error: BaseException, xs) -> None:
  """A body that failed (a TypeError, or an AttributeError such as ``x.sum()`` on a list) on
  ``xs`` given as a Python list of same-shaped arrays: each step got a list of rows (one of each
  array), which is rarely what was meant."""
  if not isinstance(error, (TypeError, AttributeError)):
    return
  if not isinstance(xs, (list, tuple)) or len(xs) < 2:
    return
  if all(hasattr(x, 'shape') for x in xs) and len({jnp.shape(x) for x in xs}) == 1:
    error.add_note(
      f'brainnx: xs is a Python {type(xs).__name__} of {len(xs)} arrays of shape {tuple(jnp.shape(xs[0]))}, so '
      f'each step gets a {type(xs).__name__} of {len(xs)} rows (row k of every array), not one of the arrays. To '
      'scan over the arrays themselves, stack them: jnp.stack(xs)'
    )


def note_module_body(error: BaseException, f, name: str) -> None:
  """A Module given as the body failed: say how the loop called it, and how to run a model per step."""
  if not isinstance(f, nnx.Module) or not isinstance(error, (TypeError, ValueError)):
    return
  called, wrap = _model_wrap(name)
  error.add_note(
    f'brainnx: {name} called the {type(f).__name__} Module given as its function as '
    f'{called.replace("f(", "model(", 1)}; its __call__ is {inspect.signature(f)}. To run a model '
    f'at every step, wrap it: {wrap}'
  )


def check_length(length, name: str) -> int:
  """``length`` as a non-negative int, else an error naming it."""
  if isinstance(length, bool) or not hasattr(type(length), '__index__'):
    raise TypeError(f'{name}: length must be an int, got {length!r} ({type(length).__name__})')
  length = int(length)
  if length < 0:
    raise ValueError(f'{name}: length must be non-negative, got length={length}')
  return length


def pair_layout(body: LoopBody, init) -> int:
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


def step_example(xs):
  """One step's ``x``: abstract slices of the arrays; graph nodes as they are (their stacked
  Variables are sliced by the body, see :mod:`scan_state`)."""
  return jax.tree.map(
    lambda a: a if is_graph_node(a) else jax.ShapeDtypeStruct(jnp.shape(a)[1:], jnp.result_type(a)),
    xs, is_leaf=is_graph_node,
  )


def scan_parts(f, init, xs, name, rules: AxisRules, keep_new=True):
  args = (init, step_example(xs))
  disc = discover(f, args, {})
  state = scan_state.step_state(disc, rules, name)
  body = LoopBody(f, args, name, disc, state.sliced, keep_new=keep_new, fixed=state.fixed)
  n_carry = pair_layout(body, init)
  return body, n_carry, state


def rules_key(state_in_axes, name: str = 'scan'):
  """``state_in_axes`` as a hashable tuple of ``(axis, filter)`` (the eager cache's key)."""
  if state_in_axes is None:
    return None
  if isinstance(state_in_axes, nnx.StateAxes):  # flax's {filter: axis}, in its order
    state_in_axes = layer_checks.from_state_axes(state_in_axes, name)
  scan_state.check_scan_rules(state_in_axes, name)
  items = state_in_axes.items() if isinstance(state_in_axes, dict) else [(0, state_in_axes)]
  return tuple((axis, tuple(f) if isinstance(f, list) else f) for axis, f in items)


def python_scan(f, init, xs, n, reverse, runner):
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
  check_loop_callable(f, 'scan', 2)
  bar, rest = split_pbar(pbar)
  config = ScanConfig(length=length, reverse=reverse, unroll=unroll, pbar=rest, state_in_axes=rules_key(state_in_axes, 'scan'))
  return call(_scan_impl, config, (f, bar), (init, xs))


def _scan_impl(config: ScanConfig, roots: tuple, init, xs):
  f, bar = roots
  return run_scan(config, f, bar, init, xs)


def run_scan(config: ScanConfig, f: Callable, bar, init, xs):
  """``scan(f, init, xs)`` as ``config`` says, in the current trace (``bar``: a ProgressBar or None)."""
  name, length, state_in_axes = config.name, config.length, config.state_in_axes
  over_nodes = scan_state.holds_nodes(xs)
  if (state_in_axes is not None or over_nodes) and length is None and not dyn_leaves(xs):
    length = stacked_length(f, init, xs, config.rules, name)
  n = leading_length(xs, length, name)
  runner = runner_for(bar or config.pbar, n)
  if in_python() and state_in_axes is None and not over_nodes:
    return all_or_nothing(f, (init, xs), lambda: python_scan(f, init, xs, n, config.reverse, runner))
  layers_check = config.layers_check and not stacks_exempt(f)
  try:
    body, n_carry, state = scan_parts(f, init, xs, name, config.rules, config.keep_new)
  except Exception as e:
    user_f, user_xs = f, xs
    if hasattr(f, 'for_body_of'):  # for_loop, map: f(*x), xs the tuple of their positional arguments
      user_f, user_xs = f.for_body_of, xs[0] if len(xs) == 1 else ()
    note_list_of_arrays(e, user_xs)
    note_module_body(e, user_f, name)
    if layers_check and not isinstance(e, BatchAxisError):
      layer_checks.explain_failure(discover(f, (init, step_example(xs)), {}), n, config.rules, e, name)
    raise
  if layers_check:
    layer_checks.check_read_stacks(body.disc, body.trace, body.sliced, n, config.rules, name)
  stacked = [body.values[i] for i in body.sliced]
  scan_state.check_stacked(body.disc, state, body.values, n, name)
  fixed_values = [body.values[i] for i in body.fixed]
  fixed_written = scan_state.fixed_writes(body.disc, state, body.trace.written, name)
  keep = [k for k, i in enumerate(body.fixed) if i in fixed_written]  # per-step outputs of fixed ones

  def step(carry, x):
    (written, leaves), (x_leaves, slices) = carry, x
    written, out, per_step, created = body.run_step(written, leaves + x_leaves, list(slices) + fixed_values)
    slices, fixed_out = per_step[: len(body.sliced)], per_step[len(body.sliced) :]
    return (written, out[:n_carry]), (out[n_carry:], slices, [fixed_out[k] for k in keep], created)

  def parts(carry, last):  # the bar's view of a chunk's end: (carry, y) as f returned them
    out = list(carry[1]) + list(last[0])
    return rebuild_part(body, out, 0), rebuild_part(body, out, 1)

  (written, leaves), (ys, slices, fixed_out, created) = progress_scan(
    step, (body.initial_written(), dyn_leaves(init)), (dyn_leaves(xs), stacked), length=n, reverse=config.reverse,
    unroll=config.unroll, runner=runner, parts=parts)
  body.write_back(written)
  sliced_written = [k for k, i in enumerate(body.sliced) if i in body.trace.written]
  body.write_back([slices[k] for k in sliced_written], [body.sliced[k] for k in sliced_written])
  if n:  # a fixed stream's count: what one step leaves (every step leaves the same)
    body.write_back([jax.tree.map(lambda a: a[-1], v) for v in fixed_out], fixed_written)
  # what the body attached comes out stacked over the steps
  return body.output(list(leaves) + list(ys), created)


def stacked_length(f, init, xs, rules: AxisRules, name: str) -> int | None:
  """The loop length a scan over stacked Variables alone takes: their leading axis."""
  disc = discover(f, (init, step_example(xs)), {})
  layer_checks.check_rules(disc, rules, name)
  return scan_state.stacked_length(disc, scan_state.step_state(disc, rules, name))


def rebuild_part(body: LoopBody, leaves, which: int):
  """The carry (0) or y (1) part of a step's output, for progress messages."""
  try:
    return body.trace.out_spec.rebuild(list(leaves), body.disc)[which]
  except Exception:
    return None


def for_body(f):
  def step(carry, x):
    return carry, f(*x)

  step.__wrapped__ = step.for_body_of = f
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
    state_in_axes: Variables stacked on axis 0 to loop over, one slice per step, as in
      :func:`scan`.

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
  check_loop_callable(f, 'for_loop', len(xs))
  bar, rest = split_pbar(pbar)
  config = ScanConfig(name='for_loop', length=length, reverse=reverse, unroll=unroll, pbar=rest,
                      state_in_axes=rules_key(state_in_axes, 'for_loop'))
  return call(_for_impl, config, (f, bar), xs)


def _for_impl(config: ScanConfig, roots: tuple, *xs):
  f, bar = roots
  return run_scan(config, for_body(f), bar, None, xs)[1]


