"""Leak, exception and thread safety of every transform.

For each transform: a successful call and a failing one (fault at trace
time, at run time, and inside a nested transform) leave no tracer in any
Variable or Rngs (also under ``jax.checking_leaks()``); after a failure
every Variable and Rngs holds its exact pre-call value and the next call
works.
"""

import ctypes
import gc
import io
import threading
import time
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import psutil
import pytest
from flax import nnx
from jax.experimental import checkify

import brainnx as bnx
from helpers import MLP, assert_same_values, concrete, linear, no_tracers, run_in_threads, values_of


class World(nnx.Module):
  """Everything a transform can touch: params, stats, a counter, RNG streams, dropout."""

  def __init__(self):
    self.mlp = MLP(3, 4, 3, rngs=nnx.Rngs(0))
    self.stat = nnx.BatchStat(jnp.zeros(3))
    self.count = nnx.Variable(jnp.array(0))
    self.rngs = nnx.Rngs(1, dropout=2)
    self.drop = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=3))

  def touch(self, x):
    """Reads and writes every kind of state; returns a (3,) value."""
    self.count[...] += 1
    h = self.mlp(x) + self.rngs.normal((3,)) + self.drop(jnp.ones(3))
    self.stat[...] = self.stat[...] + h
    return h


class Boom(Exception):
  pass


def explode(flag):
  if flag:
    raise Boom('run-time fault')


def fault(kind, world, x):
  """``world.touch(x)`` followed by a fault of the given kind."""
  h = world.touch(x)
  if kind == 'trace':
    raise Boom('trace-time fault')
  if kind == 'run':
    jax.debug.callback(explode, jnp.asarray(1))
  if kind == 'nested':
    bnx.vmap(lambda: _raise(Boom('nested fault')), axis_size=2)()
  return h


FAULT_MESSAGES = {'trace': 'trace-time fault', 'run': 'run-time fault', 'nested': 'nested fault'}


def _raise(error):
  raise error


X = jnp.ones(3)
XS = jnp.ones((4, 3))

# Each case: (name, run(world, kind)). ``kind`` is None for a clean call.
CASES = [
  ('jit', lambda w, k: bnx.jit(lambda x: fault(k, w, x))(X)),
  ('vmap', lambda w, k: bnx.vmap(lambda x: fault(k, w, x), state_out_axes={0: nnx.BatchStat})(XS)),
  ('jit(vmap)', lambda w, k: bnx.jit(bnx.vmap(lambda x: fault(k, w, x), state_out_axes={0: nnx.BatchStat}))(XS)),
  ('scan', lambda w, k: bnx.scan(lambda c, x: (c, fault(k, w, x)), None, XS)),
  ('checkpointed_scan', lambda w, k: bnx.checkpointed_scan(lambda c, x: (c, fault(k, w, x)), None, XS, base=2)),
  ('for_loop in vmap', lambda w, k: bnx.vmap(lambda xs: bnx.for_loop(lambda x: fault(k, w, x), xs), in_axes=None, axis_size=2, state_out_axes={0: nnx.BatchStat})(XS)),
  ('while_loop', lambda w, k: bnx.while_loop(lambda i: i < 2, lambda i: (fault(k, w, X), i + 1)[1], 0)),
  ('fori_loop', lambda w, k: bnx.fori_loop(0, 3, lambda i, c: c + fault(k, w, X).sum(), 0.0)),
  ('bounded_while_loop', lambda w, k: bnx.bounded_while_loop(lambda i: i < 2, lambda i: (fault(k, w, X), i + 1)[1], 0, 4, base=2)),
  ('grad', lambda w, k: bnx.grad(lambda x: fault(k, w, x).sum(), grad_states=w.mlp)(X)),
  ('value_and_grad in jit', lambda w, k: bnx.jit(bnx.value_and_grad(lambda x: fault(k, w, x).sum(), grad_states=nnx.Param))(X)),
  ('pmap', lambda w, k: bnx.pmap(lambda x: fault(k, w, x), state_out_axes={0: nnx.BatchStat})(XS)),
  ('map', lambda w, k: bnx.map(lambda x: fault(k, w, x), XS)),
  ('make_jaxpr', lambda w, k: bnx.make_jaxpr(lambda x: fault(k, w, x))(X)),
]


@pytest.mark.parametrize('name,run', CASES, ids=[c[0] for c in CASES])
def test_clean_call_leaves_no_tracer(name, run):
  world = World()
  with jax.checking_leaks():
    jax.block_until_ready(run(world, None))
  assert no_tracers(world)


# make_jaxpr runs nothing, so it has no run-time fault
FAULTS = [(name, run, kind) for kind in ('trace', 'run', 'nested') for name, run in CASES
          if (name, kind) != ('make_jaxpr', 'run')]


@pytest.mark.parametrize('name,run,kind', FAULTS, ids=[f'{k}-{n}' for n, _, k in FAULTS])
def test_fault_leaves_state_exact_and_next_call_works(name, run, kind):
  world = World()
  before = values_of(world)
  # a trace-time or nested fault is the Boom itself; a run-time one comes back as JAX's
  # runtime error carrying Boom's message
  raised = Boom if kind != 'run' else (Boom, jax.errors.JaxRuntimeError)
  with pytest.raises(raised, match=FAULT_MESSAGES[kind]):
    jax.block_until_ready(run(world, kind))
  assert_same_values(before, values_of(world))
  assert no_tracers(world)
  jax.block_until_ready(run(world, None))  # the next call works
  assert no_tracers(world)


def test_debug_nans_at_run_time_leaves_state_exact():
  world = World()
  before = values_of(world)
  f = bnx.jit(lambda x: world.touch(x) * jnp.log(x - 1.0))
  with jax.debug_nans(True):
    with pytest.raises(FloatingPointError, match='invalid value'):
      jax.block_until_ready(f(jnp.zeros(3)))
  assert_same_values(before, values_of(world))
  f(X)
  assert int(world.count[...]) == 1


def test_checkify_nan_check():
  model = MLP(3, 4, 3, rngs=nnx.Rngs(0))
  forward = bnx.jit(lambda x: model(x) * jnp.log(x))
  err, out = checkify.checkify(forward, errors=checkify.float_checks)(-jnp.ones(3))
  with pytest.raises(checkify.JaxRuntimeError, match='nan'):
    err.throw()
  err, out = checkify.checkify(forward, errors=checkify.float_checks)(jnp.ones(3))
  err.throw()  # no error
  # a function that writes cannot run under an unmanaged transform: refused, nothing written
  world = World()
  before = values_of(world)
  with pytest.raises(RuntimeError, match='JAX transform that brainnx does not manage'):
    checkify.checkify(bnx.jit(lambda x: world.touch(x)), errors=checkify.float_checks)(X)
  assert_same_values(before, values_of(world))
  assert no_tracers(world)


def test_threads_on_separate_modules_with_shared_transforms():
  worlds = [World() for _ in range(6)]
  step = bnx.jit(lambda w, x: w.touch(x))
  mapped = bnx.vmap(lambda w, x: w.mlp(x), in_axes=(None, 0))
  refs = [(values_of(w), w.mlp(XS)) for w in worlds]

  def work(i):
    for _ in range(4):
      step(worlds[i], X)
      np.testing.assert_allclose(mapped(worlds[i], XS), refs[i][1], rtol=1e-6)

  run_in_threads(work, 6)
  for w in worlds:
    assert int(w.count[...]) == 4 and no_tracers(w)
    np.testing.assert_allclose(w.mlp(XS), refs[worlds.index(w)][1], rtol=1e-6)  # parameters untouched


# The caches' bounds: the plan, compiled-program and trace caches of one jitted function.
BOUNDS = {'plans': 16, 'compiled': 64, 'traces': 128}


def test_caches_fill_to_their_bounds_and_stay_there():
  """More distinct arguments than any cache holds: each cache reaches its bound, never more, and
  calls on the newest and on evicted signatures still give the pure function's values.

  ``lower`` builds plans, programs and traces without an XLA compile, so the bounds are cheap
  to reach: a new list of Variables per call is a new plan and, with a new length, a new
  program; a new input shape is a new trace.
  """
  f = bnx.jit(lambda vs, x: sum(v[...] for v in vs) * x)
  lists = [[nnx.Variable(jnp.full(2, float(k))) for _ in range(k + 1)] for k in range(BOUNDS['compiled'] + 4)]
  for vs in lists:
    f.lower(vs, 2.0)
  for n in range(BOUNDS['traces'] + 4 - len(lists)):
    f.lower(lists[-1], jnp.ones((n + 1, 2)))
  assert f.cache_sizes() == BOUNDS
  for k in (len(lists) - 1, 0):
    np.testing.assert_allclose(f(lists[k], 3.0), jnp.full(2, 3.0 * k * (k + 1)))
  assert f.cache_sizes() == BOUNDS


# -- threads racing fresh traces; memory freed after calls -------------------------------------------

G_SHARED = nnx.Linear(3, 4, rngs=nnx.Rngs(7))


def test_warm_calls_race_fresh_traces():
  """Warm calls in one thread stay exact while another thread traces fresh functions on the same module."""
  kernel, bias = np.asarray(G_SHARED.kernel[...]), np.asarray(G_SHARED.bias[...])
  expect = np.asarray(X) @ kernel + bias
  warm = bnx.jit(lambda x: G_SHARED(x))
  read_kernel = bnx.jit(lambda: G_SHARED.kernel[...])
  warm(X), read_kernel()
  deadline = time.monotonic() + 1.5
  errors, counts = [], {'a': 0, 'b': 0}

  def thread_b():
    try:
      while time.monotonic() < deadline:
        y, k = warm(X), read_kernel()
        assert not isinstance(y, jax.core.Tracer) and not isinstance(k, jax.core.Tracer)
        np.testing.assert_allclose(y, expect, rtol=1e-5)
        np.testing.assert_array_equal(k, kernel)
        counts['b'] += 1
    except BaseException as e:
      errors.append(e)

  def make(k):
    return bnx.jit(lambda x: G_SHARED(x) + k)

  def thread_a():
    try:
      k = 0.0
      while time.monotonic() < deadline:
        k += 1.0
        y = make(k)(X)
        assert not isinstance(y, jax.core.Tracer)
        np.testing.assert_allclose(y, expect + k, rtol=1e-5)
        counts['a'] += 1
    except BaseException as e:
      errors.append(e)

  threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=30)
  assert not any(t.is_alive() for t in threads), 'threads did not finish'
  if errors:
    raise errors[0]
  assert counts['a'] >= 2 and counts['b'] >= 2, counts
  np.testing.assert_array_equal(concrete(G_SHARED.kernel), kernel)


def _dead(*refs):
  gc.collect()
  return all(r() is None for r in refs)


def test_module_argument_freed_while_jit_alive():
  """A module passed as a jit argument is not kept alive by the jitted function."""
  m = linear()
  g = bnx.jit(lambda m, x: m(x))
  g(m, X)
  r = weakref.ref(m)
  del m
  assert _dead(r)
  other = linear(seed=1)  # the jitted function still works, on another module of the same kind
  np.testing.assert_allclose(g(other, X), X @ other.kernel[...] + other.bias[...], rtol=1e-6)


def test_module_argument_freed_plain_jax_sanity():
  """Sanity for the oracle: plain jax.jit over a pure function frees the module."""
  m = linear()
  g = jax.jit(lambda k, b, x: x @ k + b)
  g(m.kernel[...], m.bias[...], X)
  r = weakref.ref(m)
  del m
  assert _dead(r)


def _closure_pair(fn_of_m):
  m = nnx.Linear(3, 3, rngs=nnx.Rngs(0))
  return m, fn_of_m(m)


def test_scan_closure_freed():
  """An eagerly scanned closure (and the module it holds) is freed afterwards; plain jax frees it too."""
  for scan in (jax.lax.scan, bnx.scan):
    m, f = _closure_pair(lambda m: lambda c, x: (c + m(x).sum(), c))
    scan(f, 0.0, jnp.ones((2, 3)))
    rf, rm = weakref.ref(f), weakref.ref(m)
    del f, m
    assert _dead(rf, rm), scan.__module__


def test_for_loop_closure_freed():
  """A closure run by eager for_loop (and its module) is freed afterwards."""
  m, f = _closure_pair(lambda m: lambda x: x + m(x))
  bnx.for_loop(f, jnp.ones((2, 3)))
  rf, rm = weakref.ref(f), weakref.ref(m)
  del f, m
  assert _dead(rf, rm)


def test_fori_loop_closure_freed():
  """A closure run by eager fori_loop (and its module) is freed afterwards; plain jax frees it too."""
  for fori in (jax.lax.fori_loop, bnx.fori_loop):
    m, f = _closure_pair(lambda m: lambda i, c: c + m(c))
    fori(0, 2, f, jnp.ones(3))
    rf, rm = weakref.ref(f), weakref.ref(m)
    del f, m
    assert _dead(rf, rm), fori.__module__


def test_vmap_closure_freed():
  """After dropping f and vmap(f), both (and the module) are freed; plain jax frees them too."""
  for vmap in (jax.vmap, bnx.vmap):
    m, f = _closure_pair(lambda m: lambda x: x + m(x))
    vf = vmap(f)
    vf(jnp.ones((2, 3)))
    rf, rv, rm = weakref.ref(f), weakref.ref(vf), weakref.ref(m)
    del f, vf, m
    assert _dead(rf, rv, rm), vmap.__module__


def test_jit_closure_freed():
  """After dropping f and jit(f), both (and the module) are freed; plain jax frees them too."""
  for jit in (jax.jit, bnx.jit):
    m, f = _closure_pair(lambda m: lambda x: x + m(x))
    jf = jit(f)
    jf(jnp.ones(3))
    rf, rj, rm = weakref.ref(f), weakref.ref(jf), weakref.ref(m)
    del f, jf, m
    assert _dead(rf, rj, rm), jit.__module__


def test_progress_bar_freed():
  """A ProgressBar used by an eager scan is freed after del."""
  pbar = bnx.ProgressBar(freq=1, file=io.StringIO())
  bnx.scan(lambda c, x: (c + x, c), 0.0, jnp.ones(3), pbar=pbar)
  r = weakref.ref(pbar)
  del pbar
  assert _dead(r)


def _rss_mb():
  gc.collect()
  try:  # hand freed heap pages back to the OS (glibc), so RSS tracks live memory
    ctypes.CDLL('libc.so.6').malloc_trim(0)
  except (OSError, AttributeError):
    pass
  return psutil.Process().memory_info().rss / 2**20


def test_many_scanned_closures_do_not_accumulate():
  """Eagerly scanning many distinct closures does not retain them: RSS grows like plain jax.lax.scan.

  Each closure holds a 4 MiB payload, so retaining closures is visible above
  allocator noise; jax.clear_caches() after each phase takes JAX's own
  compilation caches (shared by both phases) out of the comparison.
  N=40 (160 MiB if every closure were retained) keeps the test near 6 s (each distinct closure
  compiles once).
  """
  n = 40
  xs = jnp.ones(2)

  def make(i):
    payload = np.full(2**20, float(i), np.float32)  # 4 MiB, owned by this closure alone
    return lambda c, x: (c + x + payload.shape[0] * 0, c)

  def phase(scan, offset, count=n):
    for i in range(count):
      scan(make(i + offset), 0.0, xs)
    jax.clear_caches()
    return _rss_mb()

  phase(jax.lax.scan, -10, 3)  # warm-up of both paths
  phase(bnx.scan, -20, 3)
  start = _rss_mb()
  after_jax = phase(jax.lax.scan, 0)
  after_bnx = phase(bnx.scan, 10_000)
  baseline = max(after_jax - start, 0.0)
  grown = after_bnx - after_jax
  bound = baseline * 3 + 60.0 * n / 1000
  assert grown <= bound, f'brainnx grew RSS by {grown:.1f} MiB over {n} closures; plain jax.lax.scan {baseline:.1f} MiB'



def _overlapping(monkeypatch, first, during):
  """Make the next read of Variable ``first`` run ``during()`` right after it, as another thread
  landing between the reads of a call's Variables would."""
  from brainnx import _compat

  real, done = _compat.raw_value, []

  def raw_value(v):
    value = real(v)
    if v is first and not done:
      done.append(1)
      during()
    return value

  monkeypatch.setattr(_compat, 'raw_value', raw_value)


def test_value_lists_kept_for_warm_calls_are_bounded_by_the_plan_cache_without_a_collection():
  """One wrapper called on 40 models in turn keeps 16 plans; the value lists (the Variables'
  arrays) kept for their warm calls go with the plans pushed out, at once, not at the next
  garbage collection."""
  from brainnx import _compat

  f = bnx.jit(lambda m, x: m(x))
  models = [nnx.Linear(2, 2, rngs=nnx.Rngs(i)) for i in range(40)]
  x = jnp.ones(2)
  gc.collect()
  gc.disable()
  try:
    before = len(_compat.KEPT_VALUES)
    for m in models:
      f(m, x)
      np.testing.assert_allclose(f(m, x), m(x), rtol=1e-6)
    kept = len(_compat.KEPT_VALUES) - before
  finally:
    gc.enable()
  assert f.cache_sizes()['plans'] == 16
  assert kept <= 16, kept


def test_a_read_overlapping_another_threads_trace_waits_and_sees_no_tracer(monkeypatch):
  """A warm call reads a, then another thread's trace swaps a tracer into b before the read of
  b: the read notices the change begun and reads again once the trace is done."""
  a, b = nnx.Variable(jnp.ones(3)), nnx.Variable(jnp.full(3, 2.0))
  f = bnx.jit(lambda x, *, k: x * a[...] + b[...] + k)  # a keyword: the general warm path
  x = jnp.ones(3)
  f(x, k=1.0), f(x, k=1.0)
  inside, release = threading.Event(), threading.Event()

  def uses_b(y):
    inside.set()
    release.wait(10)
    return y * b[...]

  other = threading.Thread(target=bnx.jit(uses_b), args=(jnp.ones(3),))

  def during():
    other.start()
    inside.wait(10)  # b holds the other thread's tracer now
    threading.Timer(0.3, release.set).start()

  _overlapping(monkeypatch, a, during)
  out = f(x, k=1.0)
  other.join(10)
  np.testing.assert_array_equal(out, x * 1.0 + 2.0 + 1.0)


def test_a_kept_value_list_is_not_kept_over_a_write_landing_while_it_was_read():
  """A warm call reads a, then another thread writes a (flax's set_value) before the read of b:
  this call used the old a, and the next call reads the new one (the list read meanwhile is not
  kept for it)."""
  from brainnx import _compat

  a, b = nnx.Variable(jnp.ones(3)), nnx.Variable(jnp.ones(3))
  f = bnx.jit(lambda x: x * a[...] + b[...])
  x = jnp.ones(3)
  f(x)
  f(x)
  real, fired = _compat.raw_value, []

  def raw_value(v):
    value = real(v)
    if v is a and not fired:
      fired.append(1)
      writer = threading.Thread(target=lambda: a.set_value(jnp.full(3, 5.0, jnp.float32)))
      writer.start()
      writer.join(10)
    return value

  a.set_value(jnp.full(3, 2.0, jnp.float32))  # strongly typed, as the first value: the call stays warm
  _compat.KEPT_VALUES.clear()  # as after any call that forgot them: the next call reads afresh
  _compat.raw_value = raw_value
  try:
    first = f(x)
  finally:
    _compat.raw_value = real
  second = f(x)
  assert fired
  np.testing.assert_array_equal(first, x * 2.0 + 1.0)  # read before the write
  np.testing.assert_array_equal(second, x * 5.0 + 1.0)


def test_a_flax_write_from_another_thread_during_a_trace_waits_and_is_kept():
  """Thread B writes a Variable (``set_value``, ``v[...] =``, ``nnx.update``) while thread A
  traces a function reading it: the write succeeds, as under ``nnx.jit`` (it raised
  TraceContextError), after A's trace, and A's next call reads it."""
  v = nnx.Variable(jnp.zeros(()))
  holder = nnx.Dict(v=v)
  tracing = threading.Event()
  writes = {
    'set_value': lambda: v.set_value(jnp.array(7.0)),
    'setitem': lambda: v.__setitem__(..., jnp.array(7.0)),
    'nnx.update': lambda: nnx.update(holder, nnx.State({'v': nnx.Variable(jnp.array(7.0))})),
  }
  for route, write in writes.items():
    v[...] = 0.0
    tracing.clear()
    errors = []

    def tracing_slowly(route):
      def slow(x):
        assert route  # a captured name per route: each route's function traces anew
        tracing.set()
        time.sleep(0.2)
        return x + v[...]

      return slow

    def writer():
      tracing.wait(timeout=30)
      try:
        write()
      except Exception as e:  # noqa: BLE001 - reported below
        errors.append(e)

    f = bnx.jit(tracing_slowly(route))
    t = threading.Thread(target=writer)
    t.start()
    first = f(1.0)
    t.join(timeout=30)
    assert not errors, (route, errors)
    assert float(first) == 1.0 and float(v[...]) == 7.0, route  # the trace saw the value before
    assert float(f(1.0)) == 8.0, route


def test_concurrent_writes_during_retraces_are_never_baked_into_a_trace():
  """Two threads write a Variable as fast as they can while a third traces new signatures of a
  function reading it; afterwards every cached trace reads the Variable's current value."""
  v = nnx.Variable(jnp.zeros(()))
  stop = threading.Event()

  def hammer():
    i = 0
    while not stop.is_set():
      v[...] = jnp.float32(i % 100 + 100)
      i += 1

  g = bnx.jit(lambda x, k: x + v[...] + k, static_argnums=1)
  threads = [threading.Thread(target=hammer) for _ in range(2)]
  for t in threads:
    t.start()
  try:
    for k in range(40):
      g(0.0, k)
  finally:
    stop.set()
    for t in threads:
      t.join(timeout=30)
  v[...] = 7.0
  assert [float(g(0.0, k)) for k in range(40)] == [7.0 + k for k in range(40)]


# -- issue 49: rollbacks a mutation run showed unguarded ---------------------------------------

def _raise_on_host(x):
  raise ValueError('host refused')


@pytest.mark.parametrize('caller', ['vmap first call (run op by op)', 'jit', 'StatefulFunction'])
def test_a_call_failing_after_its_trace_keeps_nothing_the_trace_attached(caller):
  """The trace attached a new Variable to the model; the run then fails (a host callback):
  afterwards the model is exactly as before, as after a failing eager Python call rolled back.
  (A transform's first call outside jit runs its program op by op, not compiled.)"""
  model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
  before = values_of(model)

  def f(x):
    model.extra = nnx.Param(jnp.ones(2))
    jax.debug.callback(_raise_on_host, x)
    return model(x)

  call = {'StatefulFunction': bnx.StatefulFunction(f), 'jit': bnx.jit(f)}.get(caller) or bnx.vmap(f)
  with pytest.raises(Exception, match='host refused'):
    call(jnp.ones((3, 2)) if caller.startswith('vmap') else jnp.ones(2))
  assert not hasattr(model, 'extra')
  assert_same_values(values_of(model), before)


MODEL_BOUND = None  # a global the failing function rebinds


def test_a_failed_call_that_rebound_a_global_from_a_module_to_a_plain_value_is_rolled_back():
  global MODEL_BOUND
  MODEL_BOUND = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
  module = MODEL_BOUND

  def f(x):
    global MODEL_BOUND
    MODEL_BOUND(x)
    MODEL_BOUND = 3  # the Module replaced by a plain value
    raise ValueError('after the rebinding')

  with pytest.raises(ValueError, match='after the rebinding'):
    bnx.jit(f)(jnp.ones(2))
  assert MODEL_BOUND is module  # as before the call


def test_a_closure_rebound_from_a_module_to_a_plain_value_is_rolled_back():
  model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
  module = model

  def f(x):
    nonlocal model
    model(x)
    model = None
    raise ValueError('after the rebinding')

  with pytest.raises(ValueError, match='after the rebinding'):
    bnx.jit(f)(jnp.ones(2))
  assert model is module
