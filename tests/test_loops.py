"""Loops against jax.lax.scan / while_loop on the pure equivalent."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import brainnx as bnx
from helpers import assert_same_tree, concrete, no_tracers, reported_temp_bytes

XS = jax.random.normal(jax.random.key(0), (12, 3))


def test_scan_accumulating_batchstat_equals_lax_scan():
  stat = nnx.BatchStat(jnp.zeros(3))
  w = nnx.Param(jnp.array([1.0, 2.0, 3.0]))

  def step(c, x):
    stat[...] = 0.9 * stat[...] + x * w[...]
    return c + stat[...].sum(), stat[...]

  carry, ys = bnx.scan(step, 0.0, XS)

  def pure(c, x):
    (total, s) = c
    s = 0.9 * s + x * jnp.array([1.0, 2.0, 3.0])
    return (total + s.sum(), s), s

  (ref_total, ref_stat), ref_ys = jax.lax.scan(pure, (0.0, jnp.zeros(3)), XS)
  np.testing.assert_allclose(carry, ref_total, rtol=1e-5)
  np.testing.assert_allclose(ys, ref_ys, rtol=1e-5)
  np.testing.assert_allclose(stat[...], ref_stat, rtol=1e-5)
  np.testing.assert_array_equal(w[...], [1.0, 2.0, 3.0])


def test_read_only_variables_are_not_carried():
  w = nnx.Param(jnp.ones(3))
  stat = nnx.BatchStat(jnp.zeros(3))

  def step(c, x):
    stat[...] += x * w[...]
    return c + 1.0, None

  jaxpr, _ = bnx.make_jaxpr(lambda xs: bnx.scan(step, 0.0, xs))(XS)
  scan_eqn = next(e for e in jaxpr.jaxpr.eqns if e.primitive.name == 'scan')
  assert scan_eqn.params['num_carry'] == 2  # the BatchStat and the user carry
  consts = scan_eqn.invars[: scan_eqn.params['num_consts']]
  assert [tuple(v.aval.shape) for v in consts] == [(3,)]  # w enters as a loop constant


def test_reverse_cumsum():
  total = nnx.Variable(jnp.array(0))

  def step(c, x):
    before = total[...]
    total[...] += x
    return c, before

  _, ys = bnx.scan(step, None, jnp.arange(5), reverse=True)
  assert ys.tolist() == [10, 9, 7, 4, 0] and int(total[...]) == 10


@pytest.mark.parametrize('unroll', [1, 3, True])
def test_unroll_and_length(unroll):
  count = nnx.Variable(jnp.array(0))

  def step(c, _):
    count[...] += 1
    return c * 2, count[...]

  carry, ys = bnx.scan(step, 1, None, length=6, unroll=unroll)
  assert int(carry) == 64 and ys.tolist() == [1, 2, 3, 4, 5, 6] and int(count[...]) == 6


def test_disable_jit_equals_a_python_loop():
  """Compiled and under ``disable_jit``, scan equals the same steps run by a Python loop
  (the RNG draws come from an ``nnx.Rngs`` of the same seed, drawn in order)."""
  def run():
    stat = nnx.BatchStat(jnp.zeros(3))
    rngs = nnx.Rngs(0)

    def step(c, x):
      stat[...] += x + rngs.normal((3,))
      return c + 1, stat[...]

    carry, ys = bnx.scan(step, 0, XS)
    return carry, ys, stat[...], rngs.default.count[...]

  plain = nnx.Rngs(0)
  stat, ys = jnp.zeros(3), []
  for x in XS:
    stat = stat + x + plain.normal((3,))
    ys.append(stat)
  expected = (len(XS), jnp.stack(ys), stat, len(XS))
  compiled = run()
  with jax.disable_jit():
    eager = run()
  for got in (compiled, eager):
    for a, b in zip(got, expected):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_rng_inside_loop_differs_each_step_and_reproduces():
  def draws(seed):
    rngs = nnx.Rngs(seed)
    ys = bnx.for_loop(lambda _: rngs.normal(()), jnp.arange(6))
    return ys, rngs

  ys, rngs = draws(0)
  assert len(set(np.asarray(ys).tolist())) == 6 and int(rngs.default.count[...]) == 6
  np.testing.assert_array_equal(draws(0)[0], ys)
  plain = nnx.Rngs(0)
  np.testing.assert_allclose(ys, jnp.stack([plain.normal(()) for _ in range(6)]), rtol=1e-6)


def test_scan_errors_match_lax_scan():
  with pytest.raises(ValueError, match='different leading axis sizes: 3, 4'):
    bnx.scan(lambda c, x: (c, x), 0, (jnp.ones(3), jnp.ones(4)))
  with pytest.raises(ValueError, match='`length` argument of 5 which disagrees'):
    bnx.scan(lambda c, x: (c, x), 0, jnp.ones(3), length=5)
  with pytest.raises(ValueError, match='no values to scan over and `length` not provided'):
    bnx.scan(lambda c, x: (c, x), 0, None)
  with pytest.raises(TypeError, match='f argument should be a callable'):
    bnx.scan(3, 0, jnp.ones(3))
  with pytest.raises(TypeError, match='pbar must be'):
    bnx.scan(lambda c, x: (c, x), 0, jnp.ones(3), pbar='yes')
  with pytest.raises(ValueError, match='must be positive'):
    bnx.scan(lambda c, x: (c, x), 0, jnp.ones(3), pbar=0)
  with pytest.raises(ValueError, match='must return a pair'):
    bnx.scan(lambda c, x: c, 0, jnp.ones(3))
  with pytest.raises(ValueError, match='no leading axis'):
    bnx.scan(lambda c, x: (c, x), 0, jnp.float32(1.0))


def test_scan_refuses_shape_change_and_new_variables():
  v = nnx.Variable(jnp.zeros(2))
  with pytest.raises(ValueError, match=r"Variable at \('v',\) changes shape"):
    bnx.scan(lambda c, x: (v.set_value(jnp.zeros(3)), None), None, jnp.ones(3))
  assert no_tracers(v)


def test_variables_created_in_a_scan_body_come_out_stacked_per_step():
  holder = nnx.Dict()
  xs = jnp.arange(3.0)
  bnx.scan(lambda c, x: (holder.__setitem__('h', nnx.Variable(x * 2)), None), None, xs)
  assert no_tracers(holder)
  np.testing.assert_array_equal(holder['h'][...], jax.lax.scan(lambda c, x: (c, x * 2), None, xs)[1])
  with pytest.raises(ValueError, match='creates Variables'):  # other loops still refuse them
    bnx.while_loop(lambda c: c < 2, lambda c: (holder.__setitem__('w', nnx.Variable(c)), c + 1)[1], 0)


def test_exception_in_body_leaves_state_exact():
  stat = nnx.BatchStat(jnp.ones(3))

  def step(c, x):
    stat[...] = stat[...] * 5
    raise RuntimeError('body failure')

  with pytest.raises(RuntimeError, match='body failure'):
    bnx.scan(step, 0.0, XS)
  np.testing.assert_array_equal(stat[...], jnp.ones(3))
  assert no_tracers(stat)


def test_for_loop():
  acc = nnx.Variable(jnp.zeros(()))

  def body(a, b):
    acc[...] += a * b
    return acc[...]

  ys = bnx.for_loop(body, jnp.arange(4.0), jnp.arange(4.0))
  np.testing.assert_allclose(ys, np.cumsum(np.arange(4.0) ** 2))
  assert float(acc[...]) == 14.0


# -- checkpointed ---------------------------------------------------------------------


def _rnn(w_val, xs, loop, **kw):
  """A tanh RNN whose weight is a Param and whose running sum of states is a BatchStat."""
  w = nnx.Param(w_val)
  h_stat = nnx.BatchStat(jnp.zeros(3))

  def cell(h, x):
    h = jnp.tanh(h @ w[...] + x)
    h_stat[...] = h_stat[...] + h
    return h, (h ** 2).sum()

  h, ys = loop(cell, jnp.zeros(3), xs, **kw)
  return (h ** 2).sum() + ys.sum() + h_stat[...].sum(), (h, ys, h_stat[...])


def _rnn_pure(w, xs):
  """The oracle: the same RNN on plain arrays, the BatchStat carried by ``jax.lax.scan``."""
  def cell(carry, x):
    h, h_stat = carry
    h = jnp.tanh(h @ w + x)
    return (h, h_stat + h), (h ** 2).sum()

  (h, h_stat), ys = jax.lax.scan(cell, (jnp.zeros(3), jnp.zeros(3)), xs)
  return (h ** 2).sum() + ys.sum() + h_stat.sum(), (h, ys, h_stat)


@pytest.mark.parametrize('length', [1, 7, 16, 17, 1000])
@pytest.mark.parametrize('base', [2, 16])
def test_checkpointed_equals_lax_scan_values_and_gradients(length, base):
  """Values, the carried Variable and gradients equal ``jax.lax.scan`` on the pure RNN; at
  1000 steps and base 2 the recursion is 10 levels deep (compiled under ``jax.jit``, a few s)."""
  xs = jax.random.normal(jax.random.key(length), (length, 3)) * 0.5
  w0 = jax.random.normal(jax.random.key(1), (3, 3)) * 0.5
  (v_ref, aux_ref), g_ref = jax.jit(jax.value_and_grad(lambda w: _rnn_pure(w, xs), has_aux=True))(w0)
  loss = lambda w: _rnn(w, xs, bnx.checkpointed_scan, base=base)  # noqa: E731
  (v, aux), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(w0)
  np.testing.assert_allclose(v, v_ref, rtol=1e-4)
  np.testing.assert_allclose(g, g_ref, rtol=1e-4, atol=1e-6)
  for a, b in zip(jax.tree.leaves(aux), jax.tree.leaves(aux_ref), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_checkpointed_scan_uses_less_reverse_mode_memory():
  xs = jnp.ones((1024, 16, 64))  # length 1024, batch 16, width 64
  w = jnp.eye(64) * 0.5

  def loss(w, xs, loop, **kw):
    h, _ = loop(lambda h, x: (jnp.tanh(h @ w + x), None), jnp.zeros((16, 64)), xs, **kw)
    return h.sum()

  def temp_bytes(fn):
    return reported_temp_bytes(jax.jit(jax.grad(fn)).lower(w, xs))

  plain = temp_bytes(lambda w, xs: loss(w, xs, jax.lax.scan))
  ours = temp_bytes(lambda w, xs: loss(w, xs, bnx.scan))
  ckpt = temp_bytes(lambda w, xs: loss(w, xs, bnx.checkpointed_scan, base=8))
  # lax.scan saves one (16, 64) carry per step: 1024 of them. With base 8, the checkpointed
  # scan holds at most base * ceil(log_8 1024) = 8 * 4 = 32 carries at once, 1/32 of that;
  # 0.1 leaves room for the residuals of the one segment being recomputed.
  assert plain >= 1024 * 16 * 64 * 4, plain
  assert ours <= 1.05 * plain, (ours, plain)
  assert ckpt < 0.1 * plain, (ckpt, plain)


def test_checkpointed_errors():
  for base in (1, True, 2.0):
    with pytest.raises(ValueError, match='base >= 2'):
      bnx.checkpointed_scan(lambda c, x: (c, x), 0, jnp.ones(3), base=base)
  with pytest.raises(ValueError, match='checkpointed_scan: length must be non-negative, got length=-1'):
    bnx.checkpointed_scan(lambda c, x: (c + 1, None), 0.0, None, length=-1)
  with pytest.raises(ValueError, match='must return a pair'):
    bnx.checkpointed_scan(lambda c, x: (c, x, x), 0, jnp.ones(3))


def test_checkpointed_for_loop_equals_a_python_loop():
  stat = nnx.BatchStat(jnp.zeros(()))

  def body(x):
    stat[...] += x
    return stat[...]

  ys = bnx.checkpointed_for_loop(body, jnp.arange(10.0), base=3)
  np.testing.assert_array_equal(ys, np.cumsum(np.arange(10.0)))  # the Python loop, closed form
  assert float(stat[...]) == 45.0


# -- while and fori ---------------------------------------------------------------------


def test_while_loop_with_written_variables():
  steps = nnx.Variable(jnp.array(0))
  limit = nnx.Param(jnp.array(50.0))

  def body(x):
    steps[...] += 1
    return x * 2

  out = bnx.while_loop(lambda x: x < limit[...], body, 1.0)
  ref = jax.lax.while_loop(lambda c: c[1] < 50.0, lambda c: (c[0] + 1, c[1] * 2), (0, 1.0))
  assert float(out) == float(ref[1]) and int(steps[...]) == int(ref[0])


def test_cond_fun_writing_is_refused():
  seen = nnx.Variable(jnp.array(0))

  def cond(x):
    seen[...] += 1
    return x < 3

  with pytest.raises(ValueError, match=r"cond_fun writes Variable at \('seen',\)"):
    bnx.while_loop(cond, lambda x: x + 1, 0)
  assert int(seen[...]) == 0 and no_tracers(seen)


def test_while_and_fori_under_vmap_have_per_element_trip_counts():
  steps = nnx.Variable(jnp.zeros((4,), jnp.int32))

  def run(limit):
    def body(x):
      steps[...] += 1
      return x + 1

    return bnx.while_loop(lambda x: x < limit, body, 0)

  limits = jnp.array([1, 3, 0, 5])
  out = bnx.vmap(run, state_in_axes={0: steps})(limits)
  np.testing.assert_array_equal(out, limits)
  np.testing.assert_array_equal(steps[...], limits)

  def fori(n):
    return bnx.fori_loop(0, n, lambda i, acc: acc + i, 0)

  np.testing.assert_array_equal(bnx.vmap(fori)(limits), [0, 3, 0, 10])


def test_fori_loop_concrete_and_traced_bounds():
  acc = nnx.Variable(jnp.zeros(()))

  def body(i, total):
    acc[...] += i
    return total + i * 2

  assert int(bnx.fori_loop(0, 5, body, 0)) == 20 and float(acc[...]) == 10.0
  traced = bnx.jit(lambda n: bnx.fori_loop(0, n, body, 0))
  assert int(traced(4)) == 12 and float(acc[...]) == 16.0
  assert int(bnx.fori_loop(3, 3, body, 7)) == 7
  g = jax.grad(lambda w: bnx.fori_loop(0, 3, lambda i, c: c * w, 1.0))(2.0)
  assert float(g) == 12.0


def test_eager_loops_replay_compiled_code():
  runs = []

  def step(c, x):
    runs.append(1)
    return c + x, None

  xs = jnp.arange(4.0)
  for _ in range(3):
    bnx.scan(step, 0.0, xs)
  assert len(runs) == 1


# -- lengths, names, and state held fixed over the steps -----------------------------


@pytest.mark.parametrize('loop', ['checkpointed_scan', 'scan'])
def test_zero_length_scan_returns_init_and_empty_outputs_like_lax_scan(loop):
  stat = nnx.BatchStat(jnp.float32(3.0))

  def body(c, x):
    stat[...] += 1.0
    return c + x.sum(), x * 2

  ref_c, ref_ys = jax.lax.scan(lambda c, x: (c + x.sum(), x * 2), jnp.float32(1.0), jnp.ones((0, 3)))
  c, ys = getattr(bnx, loop)(body, jnp.float32(1.0), jnp.ones((0, 3)))
  np.testing.assert_array_equal(c, ref_c)
  assert ys.shape == ref_ys.shape == (0, 3) and ys.dtype == ref_ys.dtype
  assert float(stat[...]) == 3.0  # the body never ran
  ref_c, _ = jax.lax.scan(lambda c, _: (c + 1, None), 0.0, None, length=0)
  assert float(getattr(bnx, loop)(lambda c, _: (c + 1, None), 0.0, None, length=0)[0]) == float(ref_c)


def test_checkpointed_for_loop_of_zero_length_matches_lax_scan():
  ref = jax.lax.scan(lambda c, x: (c, x * 2), None, jnp.ones((0, 3)))[1]
  out = bnx.checkpointed_for_loop(lambda x: x * 2, jnp.ones((0, 3)))
  assert out.shape == ref.shape and out.dtype == ref.dtype


@pytest.mark.parametrize('loop', ['scan', 'checkpointed_scan'])
def test_negative_or_fractional_lengths_are_refused(loop):
  with pytest.raises(ValueError, match=f'{loop}: length must be non-negative, got length=-1'):
    getattr(bnx, loop)(lambda c, x: (c + 1, None), 0.0, None, length=-1)
  with pytest.raises(TypeError, match=rf'{loop}: length must be an int, got 1.5 \(float\)'):
    getattr(bnx, loop)(lambda c, x: (c + 1, None), 0.0, None, length=1.5)


def test_loop_errors_name_the_loop_called():
  with pytest.raises(ValueError, match='^for_loop got a scalar'):
    bnx.for_loop(lambda x: x, jnp.ones(()))
  with pytest.raises(ValueError, match='^for_loop: the loop body creates Variables'):
    bnx.for_loop(lambda x: nnx.Linear(2, 2, rngs=nnx.Rngs(0)), jnp.ones(3))
  with pytest.raises(ValueError, match='^checkpointed_for_loop got a scalar'):
    bnx.checkpointed_for_loop(lambda x: x, jnp.ones(()))
  with pytest.raises(ValueError, match='^for_loop: length must be non-negative'):
    bnx.for_loop(lambda x: x, jnp.ones(3), length=-3)


def _dropout_scan_oracle(seed, steps, width):
  """A Python loop in which every step draws with the stream's pre-loop count (a fixed key)."""
  drop = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=seed))
  count = int(drop.rngs.count[...])
  outs = []
  for _ in range(steps):
    drop.rngs.count[...] = count
    outs.append(drop(jnp.ones(width)))
  return np.stack(outs), int(drop.rngs.count[...])


def test_recurrent_dropout_broadcast_stream_matches_a_python_loop_with_a_fixed_key():
  drop = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=5))
  _, ys = bnx.scan(lambda h, x: (h, drop(x)), None, jnp.ones((4, 16)), state_in_axes={None: 'dropout'})
  ref, ref_count = _dropout_scan_oracle(5, 4, 16)
  np.testing.assert_array_equal(ys, ref)
  assert int(drop.rngs.count[...]) == ref_count == 1  # the loop advanced the stream as one step does
  assert len({tuple(np.asarray(y)) for y in ys}) == 1  # one mask for every step
  _, again = bnx.scan(lambda h, x: (h, drop(x)), None, jnp.ones((4, 16)), state_in_axes={None: 'dropout'})
  assert not np.array_equal(again[0], ys[0])  # the next loop draws a new mask


def test_recurrent_dropout_under_jit_and_for_loop_matches_the_fixed_key_loop():
  drop = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=7))
  out = bnx.jit(lambda xs: bnx.for_loop(drop, xs, state_in_axes={None: nnx.RngState}))(jnp.ones((3, 16)))
  ref, ref_count = _dropout_scan_oracle(7, 3, 16)
  np.testing.assert_array_equal(out, ref)
  assert int(drop.rngs.count[...]) == ref_count


def test_a_carried_stream_draws_a_new_key_every_step_unlike_a_broadcast_one():
  rngs = nnx.Rngs(dropout=0)
  _, keys = bnx.scan(lambda c, _: (c, jax.random.key_data(rngs.dropout())), None, None, length=3)
  key0 = nnx.Rngs(dropout=0).dropout.key[...]
  np.testing.assert_array_equal(keys, np.stack([jax.random.key_data(jax.random.fold_in(key0, i)) for i in range(3)]))


def test_broadcast_variables_are_read_only_and_unhonoured_axes_are_refused():
  p = nnx.Param(jnp.arange(2.0))
  c, _ = bnx.scan(lambda c, x: (c + p[...] * x, None), jnp.zeros(2), jnp.ones((3, 2)), state_in_axes={None: nnx.Param})
  ref, _ = jax.lax.scan(lambda c, x: (c + jnp.arange(2.0) * x, None), jnp.zeros(2), jnp.ones((3, 2)))
  np.testing.assert_array_equal(c, ref)

  def write(c, x):
    p[...] += x
    return c, None

  with pytest.raises(ValueError, match=r"scan: Param at \('p',\) is broadcast over the steps .* read-only"):
    bnx.scan(write, 0.0, jnp.ones((3, 2)), state_in_axes={None: nnx.Param})
  np.testing.assert_array_equal(p[...], jnp.arange(2.0))
  for axes in ({1: nnx.Param}, {-1: 'dropout'}):
    with pytest.raises(ValueError, match=r'scan: state_in_axes=\{.*\} is not honoured'):
      bnx.scan(write, 0.0, jnp.ones((3, 2)), state_in_axes=axes)
  with pytest.raises(ValueError, match=r'for_loop: state_in_axes=\{2: .*\} is not honoured'):
    bnx.for_loop(lambda x: x, jnp.ones(3), state_in_axes={2: nnx.Param})

# -- weak types as jax.lax, dtype changes, errors under disable_jit ----------------------------------

def test_eager_scan_weak_int_init():
  """Eager scan with a Python int init matches jax.lax.scan in values and dtypes."""
  fn = lambda c, x: (c + x, c)
  assert_same_tree(bnx.scan(fn, 0, jnp.ones(3)), jax.lax.scan(fn, 0, jnp.ones(3)))


def test_eager_scan_weak_int_init_bfloat16():
  """Eager scan with an int init over bf16 xs matches jax.lax.scan (bf16 carry)."""
  fn = lambda c, x: (c + x, c)
  xs = jnp.ones(3, jnp.bfloat16)
  assert_same_tree(bnx.scan(fn, 0, xs), jax.lax.scan(fn, 0, xs))


def test_fori_loop_weak_int_init():
  """fori_loop(0, 3, c + 1.5, 0) equals jax.lax.fori_loop (jax 0.10 gives 4.5 float32; no error)."""
  fn = lambda i, c: c + 1.5
  assert_same_tree(bnx.fori_loop(0, 3, fn, 0), jax.lax.fori_loop(0, 3, fn, 0))


def test_while_loop_weak_int_init():
  """while_loop on a Python int init equals jax.lax.while_loop."""
  args = (lambda c: c < 3, lambda c: c + 1, 0)
  assert_same_tree(bnx.while_loop(*args), jax.lax.while_loop(*args))


def test_checkpointed_scan_weak_int_init():
  """checkpointed_scan with a Python int init matches jax.lax.scan."""
  fn = lambda c, x: (c + x, c)
  assert_same_tree(bnx.checkpointed_scan(fn, 0, jnp.ones(3)), jax.lax.scan(fn, 0, jnp.ones(3)))


def _run_loop(kind, write):
  if kind == 'scan':
    return bnx.scan(lambda c, x: (write() or c, c), 0.0, jnp.ones(2))
  if kind == 'for_loop':
    return bnx.for_loop(lambda x: write() or x, jnp.ones(2))
  if kind == 'fori_loop':
    return bnx.fori_loop(0, 2, lambda i, c: write() or c, 0.0)
  if kind == 'while_loop':
    return bnx.while_loop(lambda c: c < 2, lambda c: write() or c + 1, 0)
  raise AssertionError(kind)


@pytest.mark.parametrize('kind', ['scan', 'for_loop', 'fori_loop', 'while_loop'])
def test_loop_body_changes_variable_dtype(kind):
  """A loop body that changes a Variable's dtype raises an error naming the Variable (jax.lax.scan raises too)."""
  with pytest.raises(TypeError, match='the dtypes do not match'):  # the oracle: a dtype-changing carry is an error in JAX
    jax.lax.scan(lambda c, x: (c.astype(jnp.int32), None), jnp.zeros(3), None, length=2)
  dtype_var = nnx.Variable(jnp.zeros(3))

  def write():  # set_value: `v[...] = ...` would cast back to the Variable's dtype
    dtype_var.set_value(dtype_var.get_value().astype(jnp.int32))

  with pytest.raises(ValueError, match=r"Variable at \('dtype_var',\) changes dtype inside the loop, from float32 to int32"):
    _run_loop(kind, write)
  raw = concrete(dtype_var)
  assert raw.dtype == jnp.float32


# -- weak types as jax.lax, dtype changes, errors under disable_jit ----------------------------------

def test_loop_error_under_disable_jit_leaves_state_exact():
  acc = nnx.Variable(jnp.array(0.0))

  def step(c, x):
    acc[...] += 1.0
    if int(x) == 3:
      raise RuntimeError('step 3')
    return c, x

  def body(c):
    acc[...] += 1.0
    if int(c) == 3:
      raise RuntimeError('step 3')
    return c + 1

  with jax.disable_jit():
    with pytest.raises(RuntimeError, match='step 3'):
      bnx.scan(step, 0, jnp.arange(5))
    assert float(acc[...]) == 0.0
    with pytest.raises(RuntimeError, match='step 3'):
      bnx.while_loop(lambda c: c < 10, body, 0)
    assert float(acc[...]) == 0.0


def test_while_loop_inside_vmap_under_disable_jit_matches_lax():
  xs = jnp.zeros(3, jnp.int32)
  with jax.disable_jit():
    ours = jax.vmap(lambda x: bnx.while_loop(lambda c: c < 3, lambda c: c + 1, x))(xs)
    theirs = jax.vmap(lambda x: jax.lax.while_loop(lambda c: c < 3, lambda c: c + 1, x))(xs)
  np.testing.assert_array_equal(ours, theirs)



def test_a_weakly_typed_value_set_in_a_loop_comes_back_strongly_typed_as_lax_keeps_its_carry():
  v = nnx.Variable(jnp.zeros((), jnp.float32))

  def body(x):
    v.set_value(2.0)  # a Python float: weakly typed
    return x

  bnx.for_loop(body, jnp.arange(3.0))
  want = jax.lax.fori_loop(0, 3, lambda i, c: c * 0 + 2.0, jnp.float32(0.0))  # the oracle
  assert jax.typeof(v[...]) == jax.typeof(want) and not jax.typeof(v[...]).weak_type
  assert float(v[...]) == float(want)


# -- fori_loop's bounds and index, as jax.lax.fori_loop's ------------------------------------


def _index_type(loop, lower, upper, traced: bool):
  """(dtype, weak) of the index ``loop`` gives its body, with the bounds concrete or traced."""
  seen = []

  def body(i, c):
    seen.append((i.dtype, i.aval.weak_type))
    return c

  if traced:
    jax.jit(lambda lo, hi: loop(lo, hi, body, 0.0))(lower, upper)
  else:
    loop(lower, upper, body, 0.0)
  return seen[-1]


BOUNDS = [(0, 3), (jnp.int8(0), jnp.int8(3)), (np.int16(1), np.int16(4)), (0, jnp.int8(3)), (0.0, 3.0)]


@pytest.mark.parametrize('traced', [False, True])
@pytest.mark.parametrize('lower,upper', BOUNDS)
def test_fori_loop_index_has_lax_fori_loops_type_and_the_loop_its_result(lower, upper, traced):
  assert _index_type(bnx.fori_loop, lower, upper, traced) == _index_type(jax.lax.fori_loop, lower, upper, traced)
  counter = nnx.Variable(jnp.float32(0))

  def stateful(i, c):
    counter[...] += 1.0
    return c + i

  want = jax.lax.fori_loop(lower, upper, lambda i, c: c + i, jnp.float32(0))
  assert float(bnx.fori_loop(lower, upper, stateful, jnp.float32(0))) == float(want)
  assert float(counter[...]) == float(upper) - float(lower)


@pytest.mark.parametrize('lower,upper', [(0, 2.5), (True, 3), (0, '3'), (jnp.int8(0), jnp.int16(3)), (0, jnp.ones(2, int))])
def test_fori_loop_bounds_that_lax_refuses_are_type_errors(lower, upper):
  with pytest.raises(TypeError, match='.'):  # the oracle; jax's words differ from case to case
    jax.lax.fori_loop(lower, upper, lambda i, c: c, 0)
  with pytest.raises(TypeError, match='^fori_loop: (lower|upper|lower and upper) must'):
    bnx.fori_loop(lower, upper, lambda i, c: c, 0)
  with pytest.raises(TypeError, match='^fori_loop: lower and upper must have equal types'):
    bnx.jit(lambda u: bnx.fori_loop(0, u, lambda i, c: c, 0))(2.5)


def test_fori_loop_refuses_created_variables_whatever_its_bounds():
  model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

  def body(i, c):
    model.seen = nnx.Intermediate(c)  # a sow-like attachment in every step
    return c + 1.0

  with pytest.raises(ValueError, match='^fori_loop: the loop body creates Variables'):
    bnx.fori_loop(0, 2, body, 0.0)
  with pytest.raises(ValueError, match='^fori_loop: the loop body creates Variables'):
    bnx.jit(lambda u: bnx.fori_loop(0, u, body, 0.0))(2)
  assert not hasattr(model, 'seen')


# -- bounded_while_loop: a while loop that reverse-differentiates ------------------------------


def _masked_scan(cond, body, init, max_steps):
  """The oracle: jax.lax.scan over max_steps slots, each running body while cond holds."""
  def slot(c, _):
    return jax.lax.cond(cond(c), body, lambda c: c, c), None

  return jax.lax.scan(slot, init, None, length=max_steps)[0]


@pytest.mark.parametrize('max_steps,base', [(1, 2), (7, 2), (16, 4), (50, 16)])
def test_bounded_while_loop_values_and_gradients_equal_a_masked_lax_scan(max_steps, base):
  w = nnx.Param(jnp.array([0.9, 1.1]))
  steps = nnx.Variable(jnp.int32(0))

  def body(c):
    steps[...] += 1
    return jnp.sin(c * w[...]) + c

  cond = lambda c: c.sum() < 6.0  # noqa: E731  (stops after a few steps, or runs into the bound)
  loss = lambda x: bnx.bounded_while_loop(cond, body, x, max_steps, base=base).sum()  # noqa: E731
  pure = lambda w, x: _masked_scan(cond, lambda c: jnp.sin(c * w) + c, x, max_steps).sum()  # noqa: E731
  x = jnp.array([0.3, 0.2])
  value, (g_w, g_x) = bnx.value_and_grad(loss, grad_states=w, argnums=0)(x)
  want_value, (want_w, want_x) = jax.value_and_grad(pure, argnums=(0, 1))(w[...], x)
  np.testing.assert_allclose(value, want_value, rtol=1e-6)
  np.testing.assert_allclose(g_w, want_w, rtol=1e-5)
  np.testing.assert_allclose(g_x, want_x, rtol=1e-5)
  # the steps run: as many as the Python loop takes, never more than max_steps
  c, taken = x, 0
  while taken < max_steps and float(c.sum()) < 6.0:
    c, taken = jnp.sin(c * w[...]) + c, taken + 1
  steps[...] = 0
  bnx.bounded_while_loop(cond, body, x, max_steps, base=base)
  assert int(steps[...]) == taken


@pytest.mark.parametrize('max_steps,base', [(5, 2), (7, 4), (20, 16)])
def test_bounded_while_loop_stops_at_max_steps_between_powers_of_base(max_steps, base):
  """The program has room for a power of base steps; the loop still runs exactly max_steps."""
  steps = nnx.Variable(jnp.int32(0))

  def body(c):
    steps[...] += 1
    return c * 1.5 + 1.0

  out = bnx.bounded_while_loop(lambda c: c < 1e30, body, 0.0, max_steps, base=base)
  want = 0.0
  for _ in range(max_steps):  # the oracle: a Python loop of max_steps steps
    want = want * 1.5 + 1.0
  assert int(steps[...]) == max_steps
  np.testing.assert_allclose(out, want, rtol=1e-6)


@pytest.mark.parametrize('loop', ['scan', 'checkpointed_scan'])
def test_a_length_that_disagrees_with_the_inputs_is_refused_as_jax_lax_scan_refuses_it(loop):
  """length=2 or 4 over 3 rows: jax.lax.scan refuses both; so do the scans, compiled or under
  disable_jit (a checkpointed scan would otherwise read rows that are not there)."""
  body = lambda c, x: (c + x, x)  # noqa: E731
  for length in (2, 4):
    with pytest.raises(ValueError, match=f'length` argument of {length} which disagrees'):
      jax.lax.scan(body, 0.0, jnp.ones(3), length=length)
    with pytest.raises(ValueError, match=rf'{loop} got `length` argument of {length} which disagrees with leading axis sizes \[3\]'):
      getattr(bnx, loop)(body, 0.0, jnp.ones(3), length=length)
    with jax.disable_jit(), pytest.raises(ValueError, match=f'{loop} got `length` argument of {length}'):
      getattr(bnx, loop)(body, 0.0, jnp.ones(3), length=length)


def test_bounded_while_loop_under_disable_jit_also_stops_at_max_steps():
  """With jax.disable_jit the loop runs in Python, and max_steps still bounds it."""
  steps = nnx.Variable(jnp.int32(0))

  def body(c):
    steps[...] += 1
    return c * 1.5 + 1.0

  with jax.disable_jit():
    out = bnx.bounded_while_loop(lambda c: c < 1e30, body, 0.0, 5, base=2)
  want = 0.0
  for _ in range(5):
    want = want * 1.5 + 1.0
  assert int(steps[...]) == 5
  np.testing.assert_allclose(out, want, rtol=1e-6)


def test_bounded_while_loop_draws_a_new_key_every_step_as_a_python_loop():
  rngs, plain = nnx.Rngs(3), nnx.Rngs(3)

  def body(c):
    i, total = c
    return i + 1, total + rngs.normal(())

  i, total = bnx.bounded_while_loop(lambda c: c[0] < 5, body, (0, 0.0), max_steps=8, base=2)
  assert int(i) == 5 and int(rngs.default.count[...]) == 5
  np.testing.assert_allclose(total, sum(float(plain.normal(())) for _ in range(5)), rtol=1e-5)


def test_bounded_while_loop_keeps_fewer_values_for_the_backward_pass_than_a_scan():
  """Memory O(base * log(max_steps)): XLA's temporaries for the gradient of 4096 steps of a
  (64,)-state stay far below those of jax.lax.scan, which saves every step."""
  n = 4096

  def grad_of(loop):
    return reported_temp_bytes(jax.jit(jax.grad(lambda x: loop(x).sum())).lower(jnp.ones(64)))

  body = lambda c: jnp.tanh(c) * 1.01  # noqa: E731
  scanned = grad_of(lambda x: jax.lax.scan(lambda c, _: (body(c), None), x, None, length=n)[0])
  bounded = grad_of(lambda x: bnx.bounded_while_loop(lambda c: c[0] < 1e9, body, x, n, base=8))
  assert scanned >= n * 64 * 4  # every step's (64,) float32 carry
  assert bounded * 10 < scanned, (bounded, scanned)


def test_bounded_while_loop_errors_name_it():
  with pytest.raises(ValueError, match=r'^bounded_while_loop: max_steps must be at least 1, got max_steps=0'):
    bnx.bounded_while_loop(lambda c: c < 1, lambda c: c + 1, 0, 0)
  with pytest.raises(ValueError, match=r'^bounded_while_loop: base must be at least 2'):
    bnx.bounded_while_loop(lambda c: c < 1, lambda c: c + 1, 0, 4, base=1)
  with pytest.raises(TypeError, match=r'^bounded_while_loop: max_steps must be an int'):
    bnx.bounded_while_loop(lambda c: c < 1, lambda c: c + 1, 0, 4.0)
  with pytest.raises(TypeError, match=r'^bounded_while_loop: cond_fun must return a boolean scalar'):
    bnx.bounded_while_loop(lambda c: c, lambda c: c + 1, 0, 4)
  v = nnx.Variable(jnp.zeros(()))
  with pytest.raises(ValueError, match=r"^bounded_while_loop: cond_fun writes Variable at \('v',\)"):
    bnx.bounded_while_loop(lambda c: (v.set_value(v[...] + 1), c < 1)[1], lambda c: c + 1, 0, 4)
  assert float(v[...]) == 0.0


# -- issue 49: loop semantics a mutation run showed unguarded (each against a Python loop) ------

def test_while_loop_condition_reads_the_values_the_body_wrote():
  count = nnx.Variable(jnp.array(0))

  def body(x):
    count[...] = count[...] + 1
    return x * 2

  out = bnx.while_loop(lambda x: (count[...] < 5) & (x < 1e6), body, 1.0)  # x bounds a wrong loop
  expected_count, expected_out = 0, 1.0  # the oracle: the same loop in Python
  while expected_count < 5 and expected_out < 1e6:
    expected_count, expected_out = expected_count + 1, expected_out * 2
  assert int(count[...]) == expected_count and float(out) == expected_out


@pytest.mark.parametrize('loop', ['for_loop', 'scan', 'fori_loop'])
def test_a_weakly_typed_write_to_a_carried_variable_keeps_its_dtype(loop):
  """``v.set_value(2)`` (a Python int, weakly typed) into a float Variable inside a loop body, as
  eager Python allows: accepted, and the Variable stays float32 holding the Python loop's value."""
  v = nnx.Variable(jnp.float32(1.0))
  total = nnx.Variable(jnp.float32(0.0))

  def step(i):
    total[...] = total[...] + v[...]
    v.set_value(2)

  if loop == 'for_loop':
    bnx.for_loop(step, jnp.arange(3.0))
  elif loop == 'scan':
    bnx.scan(lambda c, i: (step(i), None)[::-1], None, jnp.arange(3.0))
  else:
    bnx.fori_loop(0, 3, lambda i, c: step(i), None)
  assert v[...].dtype == jnp.float32 and total[...].dtype == jnp.float32
  assert float(v[...]) == 2.0 and float(total[...]) == 1.0 + 2.0 + 2.0  # the Python loop's sums
