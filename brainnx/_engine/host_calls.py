"""Host callbacks that never fail a program: brainnx's own (a ``ProgressBar``'s).

A program that calls back to the host can fail half-way when a callback raises, and then
buffers it was donated are gone; so ``jit`` does not donate into programs with host
callbacks, except those made with :func:`never_fails`. Such a callback turns an error into a
warning. A Ctrl-C that lands in it (on CPU the program runs callbacks in the calling thread)
stops a program that donates nothing at once, every Variable keeping its value; in a program
that donates (run under :func:`deferring_interrupts`) it is held back: the program runs to its
end, its results are written back, and the call then raises ``KeyboardInterrupt``. On an
accelerator the callbacks run on the runtime's threads and Python delivers a Ctrl-C to the main
thread, which waits for the program: there a donating call holds it back the same way, with
its own handler for the time of the wait. A second Ctrl-C while one is held back stops the call
(its donated Variables then hold deleted arrays: the user asked twice).

Example:
  >>> from brainnx._engine.host_calls import never_fails
  >>> quiet = never_fails(lambda: 1 / 0, default=None)
  >>> import warnings
  >>> with warnings.catch_warnings(record=True) as seen:
  ...   warnings.simplefilter('always')
  ...   quiet()
  >>> 'ZeroDivisionError' in str(seen[0].message)
  True
"""

from __future__ import annotations

import functools
import signal
import threading
import warnings
from typing import Any, Callable

import jax

from brainnx import _compat

_PENDING = threading.Event()
_LOCK = threading.Lock()
_DEFERRING = [0]  # donating programs running now: read by callbacks on any thread
_HOLD_MESSAGE = ('brainnx: Ctrl-C: this call donates its Variables, so it stops when its program ends, '
                 'with the results written back (press Ctrl-C again to stop it now)')


def _hold_back() -> None:
  """Hold a first Ctrl-C back (see the module); a second one raises."""
  if _PENDING.is_set():
    raise KeyboardInterrupt
  _PENDING.set()
  warnings.warn(_HOLD_MESSAGE, RuntimeWarning, stacklevel=2)


def never_fails(fn: Callable, default: Any = None) -> Callable:
  """``fn`` as a host callback that returns ``default`` instead of raising (see the module)."""

  @functools.wraps(fn)
  def call(*args, **kwargs):
    try:
      return fn(*args, **kwargs)
    except KeyboardInterrupt:
      if not _DEFERRING[0]:
        raise
      _hold_back()
    except Exception as e:  # noqa: BLE001 - a callback's failure would abort the program
      warnings.warn(f'brainnx: a host callback failed and was skipped: {type(e).__name__}: {e}',
                    RuntimeWarning, stacklevel=1)
    return default() if callable(default) else default

  call.brainnx_never_fails = True
  return call


class deferring_interrupts:  # noqa: N801 - used as a function
  """``compiled`` (a program that donates and calls :func:`never_fails` callbacks) run to its end
  with a Ctrl-C held back (see the module); :func:`raise_pending_interrupt` raises it later.
  Everything else (``lower``, ``trace``, ``__wrapped__``) is ``compiled``'s."""

  def __init__(self, compiled: Callable):
    self._compiled = compiled

  def __getattr__(self, name: str):
    return getattr(self._compiled, name)

  def __call__(self, *args):
    handler = _ctrl_c_handler()
    with _LOCK:
      _DEFERRING[0] += 1
    ended = False
    try:
      out = jax.block_until_ready(self._compiled(*args))
      ended = True
      return out
    finally:
      with _LOCK:
        _DEFERRING[0] -= 1
      if handler is not None:
        _put_back(handler)
      if not ended:  # the call raises: nothing is left to raise later
        _PENDING.clear()


def _ctrl_c_handler():
  """Python's Ctrl-C handler, replaced by one that holds a first Ctrl-C back while a donating
  program runs, when this is the main thread and the handler is Python's own; else ``None``."""
  if threading.current_thread() is not threading.main_thread():
    return None
  handler = signal.getsignal(signal.SIGINT)
  if handler is not signal.default_int_handler:
    return None
  signal.signal(signal.SIGINT, lambda signum, frame: _hold_back())
  return handler


def _put_back(handler) -> None:
  """Reinstall ``handler``. ``signal.signal`` first runs ours for a Ctrl-C not handled yet: a
  second one raises there, and the handler is reinstalled all the same."""
  try:
    signal.signal(signal.SIGINT, handler)
  except KeyboardInterrupt:
    signal.signal(signal.SIGINT, handler)
    _PENDING.clear()
    raise


def raise_pending_interrupt() -> None:
  """Raise the ``KeyboardInterrupt`` a callback held back, once the call's results are written."""
  if _PENDING.is_set():
    _PENDING.clear()
    raise KeyboardInterrupt


def is_never_failing(fn) -> bool:
  """Whether ``fn`` (a callback, maybe a ``functools.partial`` of one) was made by :func:`never_fails`."""
  while isinstance(fn, functools.partial):
    fn = fn.func
  return getattr(fn, 'brainnx_never_fails', False)


def calls_host(jaxpr) -> bool:
  """Whether a (closed) jaxpr, or one nested in it, calls back to the host (``jax.pure_callback``,
  ``io_callback``, ``jax.debug.callback``) with a callback that may fail: such a program can fail
  after it consumed its inputs. brainnx's own (a progress bar's) never fail (:mod:`host_calls`)."""
  inner = getattr(jaxpr, 'jaxpr', jaxpr)
  for eqn in getattr(inner, 'eqns', ()):
    if 'callback' in eqn.primitive.name and not is_never_failing(_compat.host_callback_target(eqn)):
      return True
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        if hasattr(sub, 'eqns') or hasattr(getattr(sub, 'jaxpr', None), 'eqns'):
          if calls_host(sub):
            return True
  return False
