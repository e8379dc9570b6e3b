"""StatefulFunction and make_jaxpr: read/write classification, order, jaxpr shape, cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import brainnx as bnx
from helpers import MLP, mlp_params, mlp_pure, run_in_threads


def same(xs, ys):
  """Identity comparison (Variables compare their values with ==)."""
  return len(xs) == len(ys) and all(x is y for x, y in zip(xs, ys))


def test_read_only_and_written_classification():
  a = nnx.Param(jnp.ones(3))  # read only
  b = nnx.BatchStat(jnp.zeros(3))  # read and written
  c = nnx.Variable(jnp.zeros(3))  # written only
  d = nnx.Variable(jnp.zeros(3))  # written, then read
  unused = nnx.Variable(jnp.zeros(3))

  def f(x):
    b[...] = b[...] + x * a[...]
    c[...] = x - 1
    d[...] = x * 2
    _ = unused.shape  # metadata only: not a read of its value
    return d[...] + 1

  sf = bnx.StatefulFunction(f)
  x = jnp.arange(3.0)
  assert same(sf.get_read_states(x), (a, b))
  assert same(sf.get_write_states(x), (b, c, d))
  assert same(sf.get_states(x), (a, b, c, d))
  assert all(v is not unused for v in sf.get_states(x))


def test_states_in_first_touch_order():
  first, second, third = (nnx.Variable(jnp.zeros(())) for _ in range(3))

  def f():
    x = third[...] + 1  # touched first, though discovered last
    first[...] = x  # written second
    return second[...] + x

  assert same(bnx.StatefulFunction(f).get_states(), (third, first, second))


def test_jaxpr_inputs_and_outputs():
  w = nnx.Param(jnp.ones((2, 3)))
  s = nnx.BatchStat(jnp.zeros(3))

  def f(x):
    y = x @ w[...]
    s[...] += y
    return y, y.sum()

  x = jnp.ones(2)
  closed, states = bnx.make_jaxpr(f)(x)
  assert same(states, (w, s))
  # inputs: w, s, x; outputs: w, s (all touched, return_only_write=False), y, y.sum()
  assert [tuple(a.shape) for a in closed.in_avals] == [(2, 3), (3,), (2,)]
  assert [tuple(a.shape) for a in closed.out_avals] == [(2, 3), (3,), (3,), ()]
  closed, states, shapes = bnx.make_jaxpr(f, return_only_write=True, return_shape=True)(x)
  assert [tuple(a.shape) for a in closed.out_avals] == [(3,), (3,), ()]
  assert shapes[0].shape == (3,) and shapes[1].shape == ()


def test_jaxpr_matches_pure_function():
  model = MLP(3, 5, 2, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (4, 3))
  sf = bnx.StatefulFunction(lambda x: model(x))
  new_vals, out = sf.jaxpr_call([v.get_value() for v in sf.get_states(x)], x)
  np.testing.assert_allclose(out, mlp_pure(mlp_params(model), x), rtol=1e-6)
  assert len(new_vals) == 4


def test_jaxpr_call_is_pure_and_call_writes_back():
  count = nnx.Variable(jnp.array(0))

  def f(x):
    count[...] += 1
    return x + count[...]

  sf = bnx.StatefulFunction(f)
  (new,), out = sf.jaxpr_call([jnp.array(10)], 1)
  assert int(new) == 11 and int(out) == 12 and int(count[...]) == 0
  assert int(sf(1)) == 2 and int(count[...]) == 1


def test_make_jaxpr_leaves_no_tracer_and_no_new_attribute():
  model = nnx.Dict(w=nnx.Param(jnp.ones(2)))

  def f():
    model['cache'] = nnx.Cache(model['w'][...] * 2)
    model['w'][...] = model['w'][...] + 1

  bnx.make_jaxpr(f)()
  assert 'cache' not in model
  assert isinstance(model['w'].get_raw_value(), jax.Array)
  np.testing.assert_array_equal(model['w'][...], jnp.ones(2))


def test_static_arguments_and_cache_per_signature():
  calls = []

  def f(x, n):
    calls.append(n)
    return x * n

  sf = bnx.StatefulFunction(f, static_argnums=1)
  sf.make_jaxpr(jnp.ones(2), 2).make_jaxpr(jnp.ones(2), 2)
  assert calls == [2]
  sf.make_jaxpr(jnp.ones(2), 3)
  sf.make_jaxpr(jnp.ones(3), 3)
  sf.make_jaxpr(jnp.ones(3, jnp.int32), 3)
  assert calls == [2, 3, 3, 3]
  stats = sf.get_cache_stats()['jaxpr_cache']
  assert stats['size'] == 4 and stats['hits'] >= 1
  sf.clear_cache()
  assert sf.get_cache_stats()['jaxpr_cache']['size'] == 0


def test_weak_type_is_part_of_the_signature_as_in_jax():
  """A weakly typed Python scalar and a float32 array are two traces, as under jax.jit."""
  calls, jax_calls = [], []

  def f(x):
    calls.append(1)
    return x * 2

  def g(x):
    jax_calls.append(1)
    return x * 2

  sf = bnx.StatefulFunction(f)
  sf.make_jaxpr(1.0)  # weakly typed float32
  sf.make_jaxpr(jnp.float32(1.0))  # strongly typed float32
  sf.make_jaxpr(2.0)  # weak again: cached
  jg = jax.jit(g)
  jg(1.0), jg(jnp.float32(1.0)), jg(2.0)
  assert len(calls) == len(jax_calls) == 2
  assert sf.get_jaxpr(1.0).jaxpr.invars[0].aval.weak_type


def test_cache_is_bounded():
  sf = bnx.StatefulFunction(lambda x: x + 1, cache_size=3)
  for n in range(1, 8):
    sf.make_jaxpr(jnp.ones(n))
  assert sf.get_cache_stats()['jaxpr_cache']['size'] == 3


def test_cache_is_thread_safe():
  w = nnx.Param(jnp.ones(3))
  sf = bnx.StatefulFunction(lambda x: x.sum() * w[...], cache_size=8)

  def work(n):
    for k in range(1, 12):
      jaxpr = sf.get_jaxpr(jnp.ones((n + k) % 5 + 1))
      assert jaxpr.in_avals[1].shape == ((n + k) % 5 + 1,), jaxpr

  run_in_threads(work, 6)
  assert sf.get_cache_stats()['jaxpr_cache']['size'] <= 8
  assert isinstance(w.get_raw_value(), jax.Array)


def test_errors_restore_values_and_trace_levels():
  w = nnx.Param(jnp.ones(2))

  def f():
    w[...] = w[...] * 5
    raise RuntimeError('inside')

  with pytest.raises(RuntimeError, match='inside'):
    bnx.StatefulFunction(f).make_jaxpr()
  np.testing.assert_array_equal(w[...], jnp.ones(2))
  w[...] = jnp.zeros(2)  # still writable at top level
  assert isinstance(w.get_raw_value(), jax.Array)


def test_a_variable_holding_a_leaked_tracer_is_refused_by_name_when_called():
  """A raw jax.jit left its tracer in the Variable: calling the StatefulFunction names it (as
  every transform does), instead of JAX's unexpected-tracer error, and leaves it as it was."""
  v = nnx.Variable(jnp.ones(2))
  sf = bnx.StatefulFunction(lambda x: x * v[...])
  np.testing.assert_array_equal(sf(jnp.full(2, 3.0)), jnp.full(2, 3.0))
  leaked = []
  jax.jit(lambda x: leaked.append(x) or x)(jnp.ones(2))
  v.set_value(leaked[0])
  with pytest.raises(RuntimeError, match=r"Variable at \('v',\) holds a leaked tracer"):
    sf(jnp.ones(2))
  assert v.get_value() is leaked[0]


def test_not_callable():
  with pytest.raises(TypeError, match='callable'):
    bnx.StatefulFunction(3)


def test_jaxpr_call_checks_state_count():
  w = nnx.Param(jnp.ones(2))
  sf = bnx.StatefulFunction(lambda: w[...] * 2)
  with pytest.raises(ValueError, match='expected 1 state values'):
    sf.jaxpr_call([])


# -- jaxpr_call checks its state values --------------------------------------------------------------

def _jaxpr_call_setup():
  weight_param = nnx.Param(jnp.ones(3))
  sf = bnx.StatefulFunction(lambda x: x * weight_param[...])
  x = jnp.arange(3.0)
  # sanity: the right state values work
  new_vals, out = sf.jaxpr_call([jnp.full(3, 2.0)], x)
  np.testing.assert_array_equal(out, x * 2.0)
  return sf, x


def test_jaxpr_call_wrong_shape_names_state():
  """jaxpr_call with a wrong-shaped state value raises ValueError naming the Param."""
  sf, x = _jaxpr_call_setup()
  with pytest.raises(ValueError, match=r"Param at \('weight_param',\) is float32\[5\], but the trace expects float32\[3\]"):
    sf.jaxpr_call([jnp.ones(5)], x)


def test_jaxpr_call_wrong_dtype():
  """jaxpr_call with an int32 value for a float32 Param raises ValueError."""
  sf, x = _jaxpr_call_setup()
  with pytest.raises(ValueError, match=r"Param at \('weight_param',\) is int32\[3\], but the trace expects float32\[3\]"):
    sf.jaxpr_call([jnp.ones(3, jnp.int32)], x)


def test_jaxpr_call_wrong_count():
  """jaxpr_call with the wrong number of state values raises ValueError."""
  sf, x = _jaxpr_call_setup()
  with pytest.raises(ValueError, match=r'expected 1 state values \(one per get_states\(\) entry\), got 0'):
    sf.jaxpr_call([], x)
  with pytest.raises(ValueError, match=r'expected 1 state values \(one per get_states\(\) entry\), got 2'):
    sf.jaxpr_call([jnp.ones(3), jnp.ones(3)], x)



def test_a_full_cache_keeps_the_newest_trace_and_drops_the_oldest():
  traces = []

  def f(x):
    traces.append(x.shape)
    return x + 1

  sf = bnx.StatefulFunction(f, cache_size=2)
  for n in (1, 2, 3):  # the third evicts the first
    sf(jnp.ones(n))
  assert len(traces) == 3
  sf(jnp.ones(3))  # the newest is kept: no trace
  sf(jnp.ones(2))
  assert len(traces) == 3
  sf(jnp.ones(1))  # the oldest was dropped: traced again
  assert traces[-1] == (1,) and len(traces) == 4


def test_a_trace_made_under_standard_promotion_is_not_reused_under_strict():
  """jax.jit refuses int32 + float32 under strict dtype promotion even after a call under the
  standard rules; so does brainnx's cached trace."""
  f = lambda x: x + jnp.float32(1.5)  # noqa: E731
  ours, theirs, x = bnx.jit(f), jax.jit(f), jnp.arange(3)
  np.testing.assert_allclose(ours(x), theirs(x))
  ours(x)
  with jax.numpy_dtype_promotion('strict'):
    with pytest.raises(jax.dtypes.TypePromotionError, match='no available implicit dtype promotion path'):
      theirs(x)
    with pytest.raises(jax.dtypes.TypePromotionError, match='no available implicit dtype promotion path'):
      ours(x)
