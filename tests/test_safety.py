"""Leak, exception and thread safety of every transform.

For each transform: a successful call and a failing one (fault at trace
time, at run time, and inside a nested transform) leave no tracer in any
Variable or Rngs (also under ``jax.checking_leaks()``); after a failure
every Variable and Rngs holds its exact pre-call value and the next call
works.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental import checkify

import brainnx as bnx
from helpers import MLP, assert_same_values, no_tracers, run_in_threads, values_of


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
