"""cond / switch / ifelse against ``jax.lax.cond`` / ``jax.lax.switch`` on the pure state."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import brainnx as bnx
from helpers import assert_same_values, values_of


class Counter(nnx.Module):
  def __init__(self):
    self.total = nnx.BatchStat(jnp.zeros(2))
    self.hits = nnx.Variable(jnp.array(0))
    self.rngs = nnx.Rngs(0)


def _pure_branches(k):
  """Branch ``k`` on pure arrays: (total, hits) -> (total, hits, out)."""
  def add(total, hits, x):
    return total + x, hits + 1, x.sum()

  def scale(total, hits, x):
    return total * 2.0, hits, x.mean()

  def keep(total, hits, x):
    return total, hits, jnp.float32(0.0)

  return [add, scale, keep][k]


def _stateful_branches(c):
  def add(x):
    c.total[...] += x
    c.hits[...] += 1
    return x.sum()

  def scale(x):
    c.total[...] = c.total[...] * 2.0
    return x.mean()

  def keep(x):
    return jnp.float32(0.0)

  return [add, scale, keep]


@pytest.mark.parametrize('index', [0, 1, 2, -3, 7])
def test_switch_matches_lax_switch_and_clamps(index):
  c = Counter()
  c.total[...] = jnp.array([1.0, 2.0])
  x = jnp.array([0.5, 1.5])
  oracle = jax.lax.switch(index, [_pure_branches(k) for k in range(3)], c.total[...], c.hits[...], x)
  out = bnx.switch(index, _stateful_branches(c), x)
  np.testing.assert_allclose(out, oracle[2])
  np.testing.assert_allclose(c.total[...], oracle[0])
  assert int(c.hits[...]) == int(oracle[1])


@pytest.mark.parametrize('pred', [True, False])
def test_cond_inside_jit_and_the_rng_advances_only_where_drawn(pred):
  c = Counter()
  count0 = int(c.rngs.default.count[...])

  @bnx.jit
  def f(p, x):
    return bnx.cond(p, lambda x: x + c.rngs.normal(()), lambda x: x * 0.0, x)

  out = f(pred, jnp.float32(1.0))
  assert int(c.rngs.default.count[...]) == count0 + (1 if pred else 0)
  if not pred:
    assert float(out) == 0.0


def test_ifelse_first_true_wins_and_last_runs_when_none_is():
  hits = nnx.Variable(jnp.zeros(3, jnp.int32))

  def branch(k):
    def f():
      hits[...] = hits[...].at[k].add(1)
      return jnp.int32(k)

    return f

  branches = [branch(k) for k in range(3)]
  assert int(bnx.ifelse([False, True, True], branches)) == 1
  assert int(bnx.ifelse([False, False, False], branches)) == 2
  assert hits[...].tolist() == [0, 1, 1]
  with pytest.raises(ValueError, match='2 conditions for 3 branches'):
    bnx.ifelse([True, False], branches)


def test_batched_predicate_under_vmap_follows_out_axis_rules():
  c = Counter()
  preds = jnp.array([True, False, True])
  x = jnp.ones(2)
  branches = _stateful_branches(c)[:2]
  # a write that differs per element needs a declared axis, as every mapped write
  with pytest.raises(bnx.BatchAxisError, match=r"Variable at \('c', '(hits|total)'\) is broadcast into the mapped call"):
    bnx.vmap(lambda p: bnx.cond(p, branches[0], branches[1], x))(preds)
  total, hits = c.total[...], c.hits[...]
  outs = bnx.vmap(lambda p: bnx.cond(p, branches[0], branches[1], x), state_out_axes={0: nnx.Not(nnx.RngState)})(preds)
  oracle = jax.vmap(lambda p: jax.lax.cond(p, _pure_branches(0), _pure_branches(1), total, hits, x))(preds)
  np.testing.assert_allclose(outs, oracle[2])
  np.testing.assert_allclose(c.total[...], oracle[0])  # stacked: one row per element
  np.testing.assert_array_equal(c.hits[...], oracle[1])


def test_grad_through_cond_equals_jax():
  w = nnx.Param(jnp.array(2.0))

  def loss(x):
    return bnx.cond(x > 0, lambda x: (w[...] * x) ** 2, lambda x: w[...] * x, x)

  for x in (3.0, -3.0):
    g = bnx.grad(loss, grad_states=w)(jnp.float32(x))
    ref = jax.grad(lambda w: jax.lax.cond(x > 0, lambda x: (w * x) ** 2, lambda x: w * x, x))(2.0)
    np.testing.assert_allclose(g, ref)


def test_cond_inside_scan_carries_the_written_state():
  acc = nnx.Variable(jnp.float32(0.0))

  def step(c, x):
    bnx.cond(x > 1, lambda: acc.set_value(acc[...] + x), lambda: None)
    return c, acc[...]

  _, ys = bnx.scan(step, 0.0, jnp.arange(4.0))
  _, ref = jax.lax.scan(lambda a, x: (jnp.where(x > 1, a + x, a),) * 2, jnp.float32(0.0), jnp.arange(4.0))
  np.testing.assert_allclose(ys, ref)
  assert float(acc[...]) == 5.0


def test_mismatched_branches_and_errors_leave_state_exact():
  c = Counter()
  before = values_of(c)
  with pytest.raises(ValueError, match='cond: true_fun returns .* but false_fun returns'):
    bnx.cond(True, lambda: jnp.zeros(2), lambda: jnp.zeros(3))
  with pytest.raises(ValueError, match='branch 1 returns'):
    bnx.switch(0, [lambda: jnp.zeros(2), lambda: jnp.zeros(3)])
  with pytest.raises(TypeError, match='branch 1 is not callable'):
    bnx.switch(0, [lambda: 1.0, 'nope'])

  def boom():
    c.total[...] += 1.0
    raise RuntimeError('inside a branch')

  with pytest.raises(RuntimeError, match='inside a branch'):
    bnx.cond(True, boom, lambda: None)
  assert_same_values(before, values_of(c))
  assert float(bnx.cond(True, lambda: c.total[...].sum() + 1, lambda: 0.0)) == 1.0  # next call works


# -- predicates and indices, as jax.lax.cond / jax.lax.switch take them --------------

NUMBER_PREDICATES = [-1, 0, 2, 0.5, -0.0, 0.0, float('nan'), True, False, np.int8(3), np.uint8(0), jnp.float32(-2.5)]


def _lax_cond_of(p, c):
  """jax.lax.cond on the pure state of a Counter: (out, new total)."""
  return jax.lax.cond(p, lambda t: (jnp.float32(1.0), t + 1.0), lambda t: (jnp.float32(0.0), t), c.total[...])


def _bnx_cond_of(p, c):
  def hit():
    c.total[...] += 1.0
    return jnp.float32(1.0)

  return bnx.cond(p, hit, lambda: jnp.float32(0.0))


@pytest.mark.parametrize('pred', NUMBER_PREDICATES, ids=repr)
def test_cond_takes_any_nonzero_number_as_true_like_lax_cond(pred):
  c = Counter()
  oracle_out, oracle_total = _lax_cond_of(pred, c)
  assert float(_bnx_cond_of(pred, c)) == float(oracle_out)
  np.testing.assert_array_equal(c.total[...], oracle_total)


def test_cond_number_predicates_under_jit_match_lax_cond_under_jax_jit():
  c = Counter()
  f = bnx.jit(lambda p: _bnx_cond_of(p, c))
  for pred in (-1, 0, 3, 0.5, 0.0, -2.0):
    oracle_out, oracle_total = jax.jit(lambda p: _lax_cond_of(p, c))(pred)
    assert float(f(pred)) == float(oracle_out), pred
    np.testing.assert_array_equal(c.total[...], oracle_total)


@pytest.mark.parametrize('preds', [jnp.array([-1, 0, 2, 7]), jnp.array([0.5, 0.0, -3.0, -0.0])], ids=['int', 'float'])
def test_batched_number_predicates_under_vmap_match_jax_vmap_of_lax_cond(preds):
  oracle = jax.vmap(lambda p: jax.lax.cond(p, lambda x: x + 1.0, lambda x: x * 0.0, jnp.float32(2.0)))(preds)
  out = bnx.vmap(lambda p: bnx.cond(p, lambda x: x + 1.0, lambda x: x * 0.0, jnp.float32(2.0)))(preds)
  np.testing.assert_array_equal(out, oracle)


@pytest.mark.parametrize(
  'pred, match',
  [
    (None, 'predicate `pred` must be a boolean or number scalar, got None'),
    ('yes', "predicate `pred` must be a boolean or number scalar, got 'yes'"),
    (1 + 2j, 'predicate `pred` must be a boolean or real number scalar, got dtype complex'),
    (jnp.array([True, False]), r'predicate `pred` must be a boolean or number scalar, got a value of shape \(2,\)'),
    ([True], r'predicate `pred` .* shape \(1,\)'),
  ],
  ids=['none', 'str', 'complex', 'vector', 'list'],
)
def test_cond_refuses_what_lax_cond_refuses_with_a_type_error_naming_the_predicate(pred, match):
  with pytest.raises(TypeError, match=r'(?i)pred'):  # the oracle: jax.lax.cond refuses it too
    jax.lax.cond(pred, lambda: 1.0, lambda: 0.0)
  c = Counter()
  before = values_of(c)
  with pytest.raises(TypeError, match=match):
    _bnx_cond_of(pred, c)
  assert_same_values(before, values_of(c))


@pytest.mark.parametrize('index', ['1', 1.5, True, None, 1j, jnp.array([1])], ids=repr)
def test_switch_refuses_what_lax_switch_refuses_naming_the_index(index):
  branches = [lambda: 0.0, lambda: 1.0]
  with pytest.raises(TypeError, match=r'(Index type must be an integer|Branch index must be scalar)'):  # the oracle
    jax.lax.switch(index, branches)
  with pytest.raises(TypeError, match='switch: `index` must be an integer scalar'):
    bnx.switch(index, branches)


def test_ifelse_conditions_must_be_boolean_scalars():
  branches = [lambda: 0.0, lambda: 1.0]
  # a vector condition: lax.cond refuses a non-scalar predicate in the same way
  with pytest.raises(TypeError, match='Pred must be a scalar'):
    jax.lax.cond(jnp.array([False, True]), *branches)
  with pytest.raises(TypeError, match=r'ifelse: condition 0 must be a boolean scalar, got a value of shape \(2,\)'):
    bnx.ifelse([jnp.array([False, True]), jnp.array([True, True])], branches)
  with pytest.raises(TypeError, match='ifelse: condition 1 must be a boolean scalar, got dtype int32'):
    bnx.ifelse([False, jnp.int32(1)], branches)
  with pytest.raises(TypeError, match='ifelse: condition 0 must be a boolean scalar, got None'):
    bnx.ifelse([None, True], branches)


def test_ifelse_batched_boolean_conditions_match_a_nested_lax_cond_under_vmap():
  xs = jnp.array([-2.0, 0.0, 3.0])

  def oracle(x):
    return jax.lax.cond(x < 0, lambda: -1.0, lambda: jax.lax.cond(x == 0, lambda: 0.0, lambda: 1.0))

  out = bnx.vmap(lambda x: bnx.ifelse([x < 0, x == 0, True], [lambda: -1.0, lambda: 0.0, lambda: 1.0]))(xs)
  np.testing.assert_array_equal(out, jax.vmap(oracle)(xs))


def test_branch_errors_speak_of_branches_not_loops():
  v = nnx.Variable(jnp.zeros(2))
  with pytest.raises(ValueError, match='cond: a branch creates Variables') as info:
    bnx.cond(True, lambda: nnx.Variable(jnp.ones(1)), lambda: nnx.Variable(jnp.ones(1)))
  assert 'loop' not in str(info.value)

  def widen():
    v.set_value(jnp.zeros(3))

  with pytest.raises(ValueError, match='changes shape inside a branch') as info:
    bnx.switch(0, [widen, lambda: None])
  assert 'loop' not in str(info.value)
  with pytest.raises(TypeError, match='cond: true_fun is not callable'):
    bnx.cond(True, 'nope', lambda: None)


@pytest.mark.parametrize('pred', [1e-40, 2**40, -0.0, float('nan'), np.float32(1e-40), jnp.float32(1e-40), True, 0, 3])
def test_a_predicate_is_true_exactly_when_jax_lax_cond_takes_true_fun(pred):
  counter = nnx.Variable(jnp.int32(0))

  def true_fun():
    counter[...] += 1
    return 1

  want = jax.lax.cond(pred, lambda: 1, lambda: 0)  # a Python 1e-40 is true; float32's is flushed to 0
  assert int(bnx.cond(pred, true_fun, lambda: 0)) == int(want)
  assert int(counter[...]) == int(want)
  if not isinstance(pred, int) or abs(pred) < 2**31:  # jit's arguments are int32
    assert int(bnx.jit(lambda p: bnx.cond(p, lambda: 1, lambda: 0))(pred)) == int(
      jax.jit(lambda p: jax.lax.cond(p, lambda: 1, lambda: 0))(pred))


def test_branches_may_return_the_same_static_values_and_must_not_differ_in_them():
  def pair(sign):  # a static tag beside an array, and None: what brainnx.jit passes through
    return lambda x: {'kind': 'moment', 'value': sign * x, 'note': None}

  x = jnp.arange(3.0)
  for call in (lambda p, x: bnx.cond(p, pair(1), pair(-1), x), bnx.jit(lambda p, x: bnx.cond(p, pair(1), pair(-1), x))):
    for p in (True, False):
      out = call(p, x)
      want = jax.lax.cond(p, lambda x: x, lambda x: -x, x)
      assert out['kind'] == 'moment' and out['note'] is None
      np.testing.assert_array_equal(out['value'], want)
  out = bnx.switch(1, [lambda: 'a', lambda: 'a'])
  assert out == 'a'
  batched = bnx.vmap(lambda p, x: bnx.cond(p, pair(1), pair(-1), x))(jnp.array([True, False]), jnp.ones((2, 3)))
  assert batched['kind'] == 'moment'
  np.testing.assert_array_equal(batched['value'], jax.vmap(lambda p, x: jnp.where(p, x, -x))(jnp.array([True, False]), jnp.ones((2, 3))))
  with pytest.raises(TypeError, match="cond: true_fun returns 'a' but false_fun returns 'b'.*static"):
    bnx.cond(True, lambda: 'a', lambda: 'b')
  with pytest.raises(TypeError, match=r"switch: branch 1 returns float32\[2\] but branch 0 returns 'a'"):
    bnx.jit(lambda: bnx.switch(0, [lambda: 'a', lambda: jnp.ones(2)]))()
  assert int(bnx.ifelse([False, True], [lambda: 2, lambda: 3])) == 3  # Python numbers are arrays
  with pytest.raises(TypeError, match=r"ifelse: branch 1 returns 'up' but branch 0 returns 'down'"):
    bnx.ifelse([True, False], [lambda: 'down', lambda: 'up'])


@pytest.mark.parametrize('operand', [np.ones(3, np.float32), 1.5, jnp.ones(3)], ids=['numpy', 'float', 'jax'])
def test_a_passed_through_operand_comes_back_as_a_new_array(operand):
  """Every branch returns its operand: the output is a JAX Array, as ``jax.lax.cond`` gives (it
  was the numpy array itself, or the Python float)."""
  want = jax.lax.cond(True, lambda x: x, lambda x: x, operand)
  for got in (bnx.cond(True, lambda x: x, lambda x: x, operand), bnx.switch(1, [lambda x: x] * 2, operand)):
    assert type(got) is type(want) and (got is operand) == (want is operand)  # a jax Array: itself
    assert (got.dtype, got.weak_type, got.shape) == (want.dtype, want.weak_type, want.shape)
    np.testing.assert_array_equal(got, want)


def test_under_disable_jit_only_the_branch_taken_runs():
  """brainstate's control-flow tutorial: under ``jax.disable_jit()`` ``jax.lax.cond`` runs the
  taken branch only, so branches may return different static values; so does brainnx, and a
  failing branch leaves every Variable as it was."""
  ran, v = [], nnx.Variable(jnp.zeros(()))

  def left():
    ran.append('left')
    v[...] += 1
    return 'left'

  def right():
    ran.append('right')
    return 2.0

  with jax.disable_jit():
    assert jax.lax.cond(True, left, right) == 'left'
    v[...] = 0.0
    ran.clear()
    assert bnx.cond(True, left, right) == 'left' and ran == ['left'] and float(v[...]) == 1.0
    assert bnx.cond(False, left, right) == 2.0 and ran == ['left', 'right']
    assert bnx.switch(7, [right, left], ) == 'left'  # clamped, as jax.lax.switch

    def fails():
      v[...] += 10
      raise RuntimeError('in the branch')

    with pytest.raises(RuntimeError, match='in the branch'):
      bnx.cond(True, fails, right)
    assert float(v[...]) == 2.0


@pytest.mark.parametrize('construct', ['cond', 'switch'])
def test_a_weakly_typed_write_in_a_branch_keeps_the_variable_dtype(construct):
  """``v.set_value(1)`` / ``v.set_value(2)`` (weak ints) in every branch leave a float32 Variable
  float32, holding 1.0, as ``jax.lax.cond`` with the Variable's value as an operand gives it (a
  write is not a change of structure)."""
  v = nnx.Variable(jnp.zeros((), jnp.float32))
  if construct == 'cond':
    bnx.cond(jnp.array(True), lambda: v.set_value(1), lambda: v.set_value(2))
  else:
    bnx.switch(jnp.array(0), [lambda: v.set_value(1), lambda: v.set_value(2)])
  oracle = jax.lax.cond(True, lambda a: a * 0 + 1, lambda a: a * 0 + 2, jnp.zeros((), jnp.float32))
  assert v[...].dtype == oracle.dtype == jnp.float32
  np.testing.assert_array_equal(v[...], oracle)
