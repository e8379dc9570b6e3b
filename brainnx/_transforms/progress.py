"""``ProgressBar``: a tqdm bar driven from inside compiled loops.

Each execution of a loop opens its own bar through a host callback (unordered: XLA before jax
0.9 refuses an ordered one in a program sharded over several devices)
that returns a run id; every ``freq`` steps a debug callback moves that
run's bar to ``step + 1``. Updates only move forward, so steps that JAX
re-runs (``jax.checkpoint`` recomputation in a backward pass) or repeats
(one callback per batch element when the message depends on the batch) draw
nothing, and a closed bar never writes again. The step counter is never
batched, so under ``vmap`` one bar is drawn.

Example:
  >>> import io, jax.numpy as jnp
  >>> import brainnx as bnx
  >>> out = io.StringIO()
  >>> carry, ys = bnx.scan(lambda c, x: (c + x, c), 0.0, jnp.arange(5.0),
  ...                      pbar=bnx.ProgressBar(freq=1, file=out))
  >>> '5/5' in out.getvalue(), float(carry)
  (True, 10.0)
"""

from __future__ import annotations

import functools
import inspect
import itertools
import math
import threading
import weakref
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from brainnx import _compat
from brainnx._engine.host_calls import never_fails
from brainnx._engine.nodes import is_int


class ProgressBar:
  """A progress bar for ``scan``, ``for_loop``, their checkpointed forms, ``fori_loop`` and
  ``bounded_while_loop``.

  Pass it as a loop's ``pbar=`` argument (an int ``pbar=n`` is shorthand for
  ``ProgressBar(freq=n)``). Every execution of the loop opens its own tqdm
  bar, whose total is the loop's length; it is updated from inside the
  compiled loop by host callbacks and only ever moves forward.

  Args:
    freq: update every ``freq`` steps (a positive int). Default ``None``:
      about 20 updates per loop, unless ``count`` is given.
    count: update about ``count`` times per loop (a positive int; exclusive
      with ``freq``). Default ``None``.
    desc: a label string, or ``(format, fn)`` where
      ``fn(dict(i=..., carry=..., y=...))`` returns a dict of values
      (computed on device) formatted into ``format``. Default ``None``: no label.
    **tqdm_kwargs: passed to ``tqdm.tqdm`` (``file``, ``ncols``, ``leave``,
      ...); ``total`` is set by the loop.

  Raises:
    ValueError: if both ``freq`` and ``count`` are given, or either is not a
      positive int; when a loop starts, if ``freq`` or ``count`` is larger
      than its number of steps.
    TypeError: if ``desc`` is neither a string nor a ``(format string,
      function)`` pair, if ``total`` is passed, or if a keyword is not one
      ``tqdm.tqdm`` accepts.

  Example:
    >>> import io, jax.numpy as jnp
    >>> import brainnx as bnx
    >>> out = io.StringIO()
    >>> pbar = bnx.ProgressBar(count=4, desc=('x={x:.0f}', lambda d: {'x': d['y']}), file=out)
    >>> ys = bnx.for_loop(lambda x: x * 10, jnp.arange(8.0), pbar=pbar)
    >>> '8/8' in out.getvalue(), 'x=70' in out.getvalue()
    (True, True)
  """

  def __init__(self, freq: int | None = None, count: int | None = None, desc: Any = None, **tqdm_kwargs) -> None:
    if freq is not None and count is not None:
      raise ValueError('ProgressBar: give freq or count, not both')
    for name, value in (('freq', freq), ('count', count)):
      if value is not None and (not is_int(value) or value <= 0):
        raise ValueError(f'ProgressBar: {name} must be a positive int, got {value!r}')
    if desc is not None and not isinstance(desc, str):
      if not (isinstance(desc, tuple) and len(desc) == 2 and isinstance(desc[0], str) and callable(desc[1])):
        raise TypeError('ProgressBar: desc must be a string or a (format string, function) pair')
    if 'total' in tqdm_kwargs:
      raise TypeError('ProgressBar: total is set by the loop; do not pass it')
    unknown = sorted(set(tqdm_kwargs) - _tqdm_keywords())
    if unknown:
      raise TypeError(
        f'ProgressBar: {", ".join(map(repr, unknown))} is not a tqdm keyword '
        f'(known: {", ".join(sorted(_tqdm_keywords()))})'
      )
    self.freq, self.count, self.desc = freq, count, desc
    self.tqdm_kwargs = tqdm_kwargs
    self._bars: dict[int, Any] = {}
    self._ids = itertools.count(1)
    self._lock = threading.Lock()
    # made inside a trace (``pbar=ProgressBar()`` inline in a jitted function): nobody else
    # holds it, so the program that draws it keeps it alive
    self.inline = not _compat.at_top_level()

  def __repr__(self) -> str:
    return f'ProgressBar(freq={self.freq}, count={self.count}, desc={self.desc!r})'

  def init(self, n: int) -> '_Runner':
    """A runner for a loop of ``n`` steps (used by the loop transforms)."""
    for name, value in (('freq', self.freq), ('count', self.count)):
      if value is not None and value > n:
        raise ValueError(f'ProgressBar: {name}={value} is larger than the loop ({n} steps)')
    if self.freq is not None:
      freq = self.freq
    elif self.count is not None:
      freq = max(1, math.ceil(n / self.count))
    else:
      freq = max(1, n // 20)
    return _Runner(self, int(n), freq)

  # -- host side ---------------------------------------------------------------

  def _open(self, n: int) -> np.int32:
    from tqdm import tqdm

    with self._lock:
      run = next(self._ids)
      label = self.desc if isinstance(self.desc, str) else None
      self._bars[run] = tqdm(total=n, desc=label, **self.tqdm_kwargs)
      if n == 0:
        self._bars.pop(run).close()
    return np.int32(run)

  def _update(self, run, step, values) -> None:
    with self._lock:
      bar = self._bars.get(int(run))
      if bar is None:
        return
      target = min(int(step) + 1, bar.total)
      if isinstance(self.desc, tuple) and values is not None:
        bar.set_description(self.desc[0].format(**{k: np.asarray(v) for k, v in values.items()}), refresh=False)
      if target > bar.n:
        try:
          bar.update(target - bar.n)
        except BaseException:  # a Ctrl-C inside tqdm: this run's bar is closed, not left open
          self._bars.pop(int(run)).close()
          raise
      if bar.n >= bar.total:
        bar.close()
        del self._bars[int(run)]


@functools.lru_cache(maxsize=1)
def _tqdm_keywords() -> frozenset:
  from tqdm import tqdm

  params = inspect.signature(tqdm.__init__).parameters
  return frozenset(n for n, p in params.items() if p.kind is not p.VAR_KEYWORD) - {'self', 'iterable', 'desc', 'total'}


class _Runner:
  """The traced side of one loop's bar.

  A compiled program keeps its callbacks, so they hold the bar weakly: a
  dropped bar is freed, and a program still running without it draws nothing.
  A bar created inside the traced function (inline) is held by its program.
  """

  def __init__(self, bar: ProgressBar, n: int, freq: int):
    self._bar = (lambda: bar) if bar.inline else weakref.ref(bar)
    self.n, self.freq = n, freq
    self.desc = bar.desc

  @property
  def bar(self) -> ProgressBar | None:
    return self._bar()

  @functools.partial(never_fails, default=lambda: np.int32(0))  # run 0: a bar nobody draws
  def _open(self) -> np.int32:
    bar = self._bar()
    return bar._open(self.n) if bar is not None else np.int32(0)

  @never_fails
  def _update(self, run, step, values) -> None:
    bar = self._bar()
    if bar is not None:
      bar._update(run, step, values)

  @never_fails
  def _update_nth(self, first: int, every: int, run, k, values) -> None:
    self._update(run, first + int(k) * every, values)

  def start(self) -> jax.Array:
    """Open a bar for this execution; returns its run id (traced)."""
    return io_callback(self._open, jax.ShapeDtypeStruct((), jnp.int32), ordered=False)

  def report(self, run, k, carry=None, y=None, first: int = 0, every: int = 1) -> None:
    """Report that step ``first + k * every`` (0-based, unbatched) is done, unconditionally (the
    host computes the step from the counter ``k``: a program needs no arithmetic for it)."""
    desc = self.desc
    values = desc[1](dict(i=first + k * every, carry=carry, y=y)) if isinstance(desc, tuple) else None
    jax.debug.callback(functools.partial(self._update_nth, first, every), run, k, values)

  def step(self, run, i, carry=None, y=None) -> None:
    """Report that step ``i`` (0-based, unbatched) is done when it is a reporting step (every
    ``freq`` steps and the last); the message's values are computed in that branch only."""
    due = jnp.logical_or((i + 1) % self.freq == 0, i + 1 >= self.n)
    jax.lax.cond(due, lambda: self.report(run, i, carry, y), lambda: None)

  def step_eager(self, run, i, carry=None, y=None) -> None:
    desc = self.desc
    values = desc[1](dict(i=i, carry=carry, y=y)) if isinstance(desc, tuple) else None
    if (i + 1) % self.freq == 0 or i + 1 >= self.n:
      self._update(run, i, values)


def check_pbar(pbar: Any) -> None:
  """``TypeError``/``ValueError`` unless ``pbar`` is ``None``, a ``ProgressBar`` or a positive int."""
  if pbar is None or isinstance(pbar, ProgressBar):
    return
  if is_int(pbar):
    if pbar <= 0:
      raise ValueError(f'pbar={pbar}: an int pbar is the update frequency and must be positive')
    return
  raise TypeError(f'pbar must be None, a ProgressBar or a positive int, got {type(pbar).__name__}')


def split_pbar(pbar: Any) -> tuple:
  """``(ProgressBar or None, int frequency or None)``: a bar object is a transform's root (held
  weakly by the eager cache), a frequency part of its config."""
  check_pbar(pbar)
  return (pbar, None) if isinstance(pbar, ProgressBar) else (None, pbar)


def runner_for(pbar: Any, n: int) -> _Runner | None:
  """``pbar`` (``None``, a ``ProgressBar`` or a positive int) as a runner for ``n`` steps; ``None``
  (nothing compiled) for a bar made with ``disable=True`` in a single-process job. Under
  ``jax.distributed`` every process must compile the same program, so there a disabled bar (the
  one of every process but 0, typically) keeps its callbacks and draws nothing."""
  check_pbar(pbar)
  if pbar is None:
    return None
  if isinstance(pbar, ProgressBar):
    if pbar.tqdm_kwargs.get('disable') is True and jax.process_count() == 1:
      return None
    return pbar.init(n)
  return _Runner(_shared_bar(pbar), n, pbar)


_INT_BARS: dict[int, ProgressBar] = {}


def _shared_bar(freq: int) -> ProgressBar:
  """The bar behind ``pbar=freq``: one per frequency, kept for the program that draws it."""
  return _INT_BARS.setdefault(freq, ProgressBar(freq=freq))


def progress_scan(step: Callable, init, xs, *, length: int, reverse: bool, unroll, runner: _Runner | None,
                  parts: Callable):
  """``jax.lax.scan(step, init, xs, length, reverse, unroll)`` that moves ``runner``'s bar (if any)
  every ``runner.freq`` steps, with no per-step cost: the loop runs as an outer loop over chunks of
  ``freq`` steps, each an inner ``jax.lax.scan`` of exactly the plain step, followed by one host
  callback (and the steps that do not fill a chunk as one more scan). ``parts(carry, y)`` turns a
  chunk's final carry and last ``y`` into the ``(carry, y)`` the bar's message sees.
  """
  if runner is None:
    return jax.lax.scan(step, init, xs, length=length, reverse=reverse, unroll=unroll)
  freq = runner.freq
  chunks, rest = divmod(length, freq)
  run_id = runner.start()

  def chunk(carry, x, size: int, k, first: int):  # step first + k * freq ends the chunk
    carry, ys = jax.lax.scan(step, carry, x, length=size, reverse=reverse, unroll=unroll)
    runner.report(run_id, k, *parts(carry, jax.tree.map(lambda a: a[0 if reverse else -1], ys)), first, freq)
    return carry, ys

  def whole(carry, done: int):
    def outer(carry, x):
      carry, k = carry
      carry, ys = chunk(carry, x, freq, k, done + freq - 1)
      return (carry, k + 1), ys

    body_xs = jax.tree.map(lambda a: a[: chunks * freq].reshape(chunks, freq, *a.shape[1:]), xs)
    (carry, _), ys = jax.lax.scan(outer, (carry, jnp.int32(0)), body_xs, length=chunks, reverse=reverse)
    return carry, jax.tree.map(lambda a: a.reshape(chunks * freq, *a.shape[2:]), ys)

  def tail(carry, done: int):
    return chunk(carry, jax.tree.map(lambda a: a[chunks * freq :], xs), rest, jnp.int32(0), done + rest - 1)

  if not rest:
    return whole(init, 0)
  if not chunks:
    return tail(init, 0)
  if reverse:  # the last rows run first
    carry, tail_ys = tail(init, 0)
    carry, ys = whole(carry, rest)
  else:
    carry, ys = whole(init, 0)
    carry, tail_ys = tail(carry, chunks * freq)
  return carry, jax.tree.map(lambda a, b: jnp.concatenate([a, b]), ys, tail_ys)
