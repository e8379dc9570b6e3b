"""ProgressBar: one bar per execution, ending at exactly n/n, results unchanged."""

import io
import os
import re
import signal
import threading
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import brainnx as bnx


def bar(**kw):
  out = io.StringIO()
  return bnx.ProgressBar(file=out, mininterval=0, ascii=True, **kw), out


def bars(out: io.StringIO):
  """Per closed bar: the list of (done, total) states it showed."""
  text = out.getvalue()
  assert text.endswith('\n'), 'a bar was left open'
  return [[(int(a), int(b)) for a, b in re.findall(r'(\d+)/(\d+)', line)] for line in text.split('\n')[:-1]]


def assert_one_complete_bar(out, n):
  (states,) = bars(out)
  assert states[-1] == (n, n)
  done = [d for d, _ in states]
  assert done == sorted(done) and max(done) == n and all(t == n for _, t in states)


def step(c, x):
  return c + x, c * 2


def test_scan_bar_reaches_n_once_and_results_unchanged():
  pbar, out = bar(freq=3)
  with_bar = bnx.scan(step, 0.0, jnp.arange(10.0), pbar=pbar)
  assert_one_complete_bar(out, 10)
  without = bnx.scan(step, 0.0, jnp.arange(10.0))
  oracle = jax.lax.scan(step, 0.0, jnp.arange(10.0))  # the independent oracle
  for a, b, c in zip(jax.tree.leaves(with_bar), jax.tree.leaves(without), jax.tree.leaves(oracle), strict=True):
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, c)


def test_a_bar_given_as_pbar_is_not_taken_for_the_same_objects_given_as_a_method():
  """scan(bound, ...) where ``bound`` is ``step`` bound to the bar, then scan(step, ..., pbar=bar):
  the same two objects in other places. The second call draws its bar (its program is its own)."""
  pbar, out = bar(freq=1)

  def flexible(*args):  # called bound (bar, c, x) or plain (c, x)
    return step(*args[-2:])

  first = bnx.scan(types.MethodType(flexible, pbar), 0.0, jnp.arange(4.0))
  assert out.getvalue() == ''
  second = bnx.scan(flexible, 0.0, jnp.arange(4.0), pbar=pbar)
  assert_one_complete_bar(out, 4)
  oracle = jax.lax.scan(step, 0.0, jnp.arange(4.0))
  for a, b, c in zip(jax.tree.leaves(first), jax.tree.leaves(second), jax.tree.leaves(oracle), strict=True):
    np.testing.assert_array_equal(a, c)
    np.testing.assert_array_equal(b, c)


def test_default_frequency_is_about_twenty_updates():
  pbar, out = bar()
  bnx.for_loop(lambda x: x, jnp.arange(200.0), pbar=pbar)
  (states,) = bars(out)
  assert 15 <= len({d for d, _ in states}) <= 25


def test_count_sets_number_of_updates():
  pbar, out = bar(count=4)
  bnx.for_loop(lambda x: x, jnp.arange(40.0), pbar=pbar)
  (states,) = bars(out)
  assert sorted({d for d, _ in states}) == [0, 10, 20, 30, 40]


def test_each_execution_draws_its_own_bar():
  pbar, out = bar(freq=1)
  f = bnx.jit(lambda xs: bnx.scan(step, 0.0, xs, pbar=pbar))
  f(jnp.arange(5.0))
  f(jnp.arange(5.0))
  assert [s[-1] for s in bars(out)] == [(5, 5), (5, 5)]


def test_inside_vmap_one_bar():
  pbar, out = bar(freq=1)
  f = bnx.vmap(lambda xs: bnx.scan(step, 0.0, xs, pbar=pbar)[0])
  np.testing.assert_allclose(f(jnp.ones((3, 10))), 10.0)
  assert_one_complete_bar(out, 10)


def test_inside_vmap_with_batched_description():
  pbar, out = bar(freq=1, desc=('carry={carry:.1f}', lambda d: {'carry': d['carry']}))
  bnx.vmap(lambda xs: bnx.scan(step, 0.0, xs, pbar=pbar)[0])(jnp.ones((3, 6)))
  assert_one_complete_bar(out, 6)
  assert 'carry=' in out.getvalue()


def test_checkpointed_backward_pass_draws_nothing_more():
  pbar, out = bar(freq=1)
  g = jax.grad(lambda w: bnx.checkpointed_scan(lambda c, x: (jnp.tanh(c * w + x), c), 0.1, jnp.ones(30), base=3, pbar=pbar)[0])
  g(0.5)
  assert_one_complete_bar(out, 30)


def test_fori_loop_and_checkpointed_for_loop_bars():
  pbar, out = bar(freq=2)
  assert int(bnx.fori_loop(0, 7, lambda i, c: c + i, 0, pbar=pbar)) == 21
  assert_one_complete_bar(out, 7)
  pbar, out = bar(freq=2)
  bnx.checkpointed_for_loop(lambda x: x * 2, jnp.arange(9.0), base=2, pbar=pbar)
  assert_one_complete_bar(out, 9)


def test_int_pbar_and_string_desc():
  stat = nnx.BatchStat(jnp.zeros(()))

  def body(x):
    stat[...] += x
    return stat[...]

  ys = bnx.for_loop(body, jnp.arange(6.0), pbar=2)
  np.testing.assert_allclose(ys, np.cumsum(np.arange(6.0)))
  pbar, out = bar(freq=1, desc='training')
  bnx.for_loop(lambda x: x, jnp.arange(3.0), pbar=pbar)
  assert 'training' in out.getvalue()


def test_validation_errors():
  with pytest.raises(ValueError, match='freq or count, not both'):
    bnx.ProgressBar(freq=2, count=3)
  with pytest.raises(ValueError, match='freq must be a positive int'):
    bnx.ProgressBar(freq=0)
  with pytest.raises(ValueError, match='count must be a positive int'):
    bnx.ProgressBar(count=-1)
  with pytest.raises(TypeError, match='desc must be'):
    bnx.ProgressBar(desc=('{x}',))
  with pytest.raises(TypeError, match='total is set by the loop'):
    bnx.ProgressBar(total=3)
  with pytest.raises(ValueError, match='concrete'):
    bnx.jit(lambda n: bnx.fori_loop(0, n, lambda i, c: c, 0, pbar=1))(3)


def test_under_disable_jit():
  pbar, out = bar(freq=1)
  with jax.disable_jit():
    carry, _ = bnx.scan(step, 0.0, jnp.arange(4.0), pbar=pbar)
  assert float(carry) == 6.0
  assert_one_complete_bar(out, 4)


# -- keywords and sizes checked early ----------------------------------------------------------------

def test_progress_bar_keywords_and_sizes_are_checked_early():
  with pytest.raises(TypeError, match="'bogus' is not a tqdm keyword"):
    bnx.ProgressBar(bogus=1)
  with pytest.raises(ValueError, match=r'freq=100 is larger than the loop \(4 steps\)'):
    bnx.scan(lambda c, x: (c, x), 0.0, jnp.ones(4), pbar=bnx.ProgressBar(freq=100))
  with pytest.raises(ValueError, match=r'count=100 is larger than the loop \(4 steps\)'):
    bnx.for_loop(lambda x: x, jnp.ones(4), pbar=bnx.ProgressBar(count=100))



def test_ctrl_c_while_the_bar_draws_is_a_keyboard_interrupt(monkeypatch, caplog):
  """A Ctrl-C landing in tqdm (the bar's host callback) stops a loop that donates nothing, leaves
  the Variable as it was and comes out of the brainnx call as ``KeyboardInterrupt``, with no
  callback failure logged. (On an accelerator ``jit`` donates by default: a donating call waits,
  see the test after the next.)"""
  import tqdm

  total = nnx.Variable(jnp.zeros(()))

  def add(x):
    total[...] = total[...] + x
    return x

  pbar, _ = bar(freq=1)
  run = bnx.jit(lambda xs: bnx.for_loop(add, xs, pbar=pbar), donate_states=False)
  xs = jnp.arange(1.0, 6.0)
  run(xs)
  np.testing.assert_allclose(total[...], xs.sum())  # oracle: the plain sum
  real_update = tqdm.tqdm.update

  def update_then_ctrl_c(self, n=1):
    if self.n >= 2:
      raise KeyboardInterrupt  # where Python delivers a real Ctrl-C: inside the callback
    return real_update(self, n)

  monkeypatch.setattr(tqdm.tqdm, 'update', update_then_ctrl_c)
  caplog.clear()
  with pytest.raises(KeyboardInterrupt, match='^$'):
    run(xs)
  assert not [r for r in caplog.records if r.name.startswith('jax')], caplog.text
  np.testing.assert_allclose(total[...], xs.sum())  # the stopped call wrote nothing
  monkeypatch.setattr(tqdm.tqdm, 'update', real_update)
  run(xs)
  np.testing.assert_allclose(total[...], 2 * xs.sum())


@pytest.mark.parametrize('reverse', [False, True])
@pytest.mark.parametrize('n, freq', [(10, 3), (9, 3), (4, 4), (7, 1)])
def test_chunked_loop_equals_lax_scan_and_the_bar_ends_full(n, freq, reverse):
  """The bar's loop runs as chunks of ``freq`` steps plus the rest: carry and ys as
  ``jax.lax.scan``'s, a written Variable as a Python loop leaves it, the bar at n/n."""
  total = nnx.BatchStat(jnp.zeros(()))

  def body(c, x):
    total[...] = total[...] * 0.5 + x
    return c * 1.5 + x, (c, total[...])

  pbar, out = bar(freq=freq)
  xs = jnp.arange(1.0, n + 1.0)
  carry, ys = bnx.scan(body, 1.0, xs, reverse=reverse, pbar=pbar)
  assert out.getvalue().count('\n') == 1, repr(out.getvalue())
  assert_one_complete_bar(out, n)

  def pure(carry, x):
    c, t = carry
    t = t * 0.5 + x
    return (c * 1.5 + x, t), (c, t)

  (c_oracle, t_oracle), ys_oracle = jax.lax.scan(pure, (1.0, 0.0), xs, reverse=reverse)
  np.testing.assert_array_equal(carry, c_oracle)
  np.testing.assert_array_equal(total[...], t_oracle)
  for a, b in zip(ys, ys_oracle, strict=True):
    np.testing.assert_array_equal(a, b)


def _host_calls(fn, *args) -> int:
  """The host transfers in ``fn``'s compiled program: a callback is a custom-call on CPU and GPU,
  sends to the host (one or more a callback) on a TPU."""
  return len(re.findall(r' (custom-call|send)\(', jax.jit(fn).lower(*args).compile().as_text()))


def test_a_disabled_bar_compiles_no_host_call(monkeypatch):
  """``disable=True`` draws nothing and compiles nothing in a single-process job: the program is the
  one without a bar (no callback, no chunked loop). In a job of several processes every process
  compiles the same program, so there the disabled bar keeps its callbacks and draws nothing."""
  xs = jnp.arange(12.0)
  loop = lambda pbar, k=2: lambda xs: bnx.for_loop(lambda x: x * k, xs, pbar=pbar)  # noqa: E731
  plain = jax.jit(loop(None)).lower(xs).compile().as_text()
  enabled = _host_calls(loop(bnx.ProgressBar(freq=2)), xs)
  assert enabled > _host_calls(loop(None), xs)  # the count sees the bar's callbacks
  disabled = bnx.ProgressBar(freq=2, disable=True)
  off = jax.jit(loop(disabled)).lower(xs).compile().as_text()
  assert _host_calls(loop(disabled), xs) == _host_calls(loop(None), xs)
  assert off.count(' while(') == plain.count(' while(')
  monkeypatch.setattr(jax, 'process_count', lambda *a, **k: 2)
  pbar, out = bar(freq=2, disable=True)
  assert _host_calls(loop(pbar, 3), xs) == enabled
  np.testing.assert_array_equal(bnx.for_loop(lambda x: x * 3, xs, pbar=pbar), xs * 3)
  assert out.getvalue() == ''


def test_a_bar_keeps_donation_and_a_ctrl_c_waits_for_the_results(monkeypatch):
  """A progress bar's callbacks never fail a program, so ``donate_states`` still donates (the old
  buffer is deleted, as ``jax.jit(donate_argnums=0)`` on the pure loop deletes it); a Ctrl-C in the
  bar of a donating call is held back: the loop's results are written, then it is raised."""
  import tqdm

  w = nnx.Param(jnp.ones(3))
  pbar, out = bar(freq=1)
  run = bnx.jit(lambda xs: bnx.for_loop(lambda x: w.set_value(w[...] * 2 + x), xs, pbar=pbar), donate_states=True)
  xs = jnp.arange(4.0)
  before = w[...]
  run(xs)
  assert before.is_deleted()
  oracle = jax.lax.scan(lambda c, x: (c * 2 + x, None), jnp.ones(3), xs)[0]
  np.testing.assert_array_equal(w[...], oracle)
  real_update = tqdm.tqdm.update
  pressed = []

  def update_then_ctrl_c(self, n=1):
    if self.n >= 1 and not pressed:
      pressed.append(True)
      raise KeyboardInterrupt
    return real_update(self, n)

  monkeypatch.setattr(tqdm.tqdm, 'update', update_then_ctrl_c)
  with pytest.warns(RuntimeWarning, match='stops when its program ends'):
    with pytest.raises(KeyboardInterrupt, match='^$'):
      run(xs)
  oracle = jax.lax.scan(lambda c, x: (c * 2 + x, None), oracle, xs)[0]
  np.testing.assert_array_equal(w[...], oracle)  # the whole loop ran and was written back
  monkeypatch.setattr(tqdm.tqdm, 'update', real_update)
  run(xs)  # nothing pending is left behind
  np.testing.assert_array_equal(w[...], jax.lax.scan(lambda c, x: (c * 2 + x, None), oracle, xs)[0])


@pytest.mark.skipif(signal.getsignal(signal.SIGINT) is not signal.default_int_handler,
                    reason='this process ignores Ctrl-C (a shell started it in the background): no SIGINT reaches Python')
def test_a_real_ctrl_c_during_a_donating_call_is_held_until_the_results_are_written(monkeypatch):
  """A Ctrl-C is a SIGINT, which Python handles in the main thread: inside the bar's callback on
  CPU, after the wait for the program on an accelerator (whose runtime threads run the callbacks).
  Either way a donating call holds it back, writes the whole loop's results, then raises it, and
  Python's own handler is back afterwards."""
  import tqdm

  w = nnx.Param(jnp.ones(3))
  pbar, _ = bar(freq=1)
  run = bnx.jit(lambda xs: bnx.for_loop(lambda x: w.set_value(w[...] * 2 + x), xs, pbar=pbar), donate_states=True)
  xs = jnp.arange(4.0)
  loop = lambda start: jax.lax.scan(lambda c, x: (c * 2 + x, None), start, xs)[0]  # noqa: E731 - the oracle
  run(xs)
  oracle = loop(jnp.ones(3))
  real_update = tqdm.tqdm.update
  sent = []

  def update_then_sigint(self, n=1):
    if not sent:
      sent.append(True)
      os.kill(os.getpid(), signal.SIGINT)
    return real_update(self, n)

  monkeypatch.setattr(tqdm.tqdm, 'update', update_then_sigint)
  with pytest.warns(RuntimeWarning, match='stops when its program ends'):
    with pytest.raises(KeyboardInterrupt, match='^$'):
      run(xs)
  oracle = loop(oracle)
  np.testing.assert_array_equal(w[...], oracle)
  assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
  monkeypatch.setattr(tqdm.tqdm, 'update', real_update)
  run(xs)  # nothing pending is left behind
  np.testing.assert_array_equal(w[...], loop(oracle))


def test_a_ctrl_c_in_a_callback_on_a_runtime_thread_is_held_back_too():
  """An accelerator's runtime runs host callbacks on its own threads, not the caller's: a Ctrl-C
  raised in the bar's callback there is held back for a donating program all the same."""
  from brainnx._engine import host_calls

  def draw():
    raise KeyboardInterrupt

  callback = host_calls.never_fails(draw)

  def program():  # a donating program whose runtime calls the bar back on a thread of its own
    runtime = threading.Thread(target=callback)
    runtime.start()
    runtime.join()
    return jnp.zeros(())

  with pytest.warns(RuntimeWarning, match='stops when its program ends'):
    host_calls.deferring_interrupts(program)()
  with pytest.raises(KeyboardInterrupt, match='^$'):
    host_calls.raise_pending_interrupt()
  host_calls.raise_pending_interrupt()  # raised once


@pytest.mark.skipif(signal.getsignal(signal.SIGINT) is not signal.default_int_handler,
                    reason='this process ignores Ctrl-C (a shell started it in the background): no SIGINT reaches Python')
@pytest.mark.parametrize('presses', [1, 2])
def test_a_ctrl_c_while_the_caller_waits_for_a_donating_program(presses):
  """On an accelerator the main thread waits for the program and handles a Ctrl-C there, outside
  every callback: a first one is held back until the results are written; a second one stops the
  call. Python's own handler is back either way, and nothing is left pending."""
  from brainnx._engine import host_calls

  def program():  # the wait: the main thread handles a SIGINT between two of its bytecodes
    for _ in range(presses):
      os.kill(os.getpid(), signal.SIGINT)
    return jnp.zeros(())

  if presses == 1:
    with pytest.warns(RuntimeWarning, match='stops when its program ends'):
      host_calls.deferring_interrupts(program)()
    with pytest.raises(KeyboardInterrupt, match='^$'):
      host_calls.raise_pending_interrupt()
  else:
    with pytest.warns(RuntimeWarning, match='stops when its program ends'), pytest.raises(KeyboardInterrupt, match='^$'):
      host_calls.deferring_interrupts(program)()
  host_calls.raise_pending_interrupt()  # nothing pending
  assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_bounded_while_loop_that_stops_early_ends_its_bar_full():
  """A ``bounded_while_loop`` that stops after 1 of its 10 steps still ends its bar at 10/10 (the
  rendered text), with the value ``jax.lax.while_loop`` gives."""
  pbar, out = bar(freq=1)
  result = bnx.bounded_while_loop(lambda c: c < 1, lambda c: c + 1, 0, max_steps=10, pbar=pbar)
  assert int(result) == int(jax.lax.while_loop(lambda c: c < 1, lambda c: c + 1, 0))
  assert_one_complete_bar(out, 10)
