"""vmap: every rule of docs/api/mapping.md, against jax.vmap on pure pytrees or a Python loop."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import brainnx as bnx
from helpers import MLP, assert_same_tree, assert_same_values, nnx_split_draws, mlp_params, mlp_pure, needs_devices, no_tracers, values_of

X = jax.random.normal(jax.random.key(0), (5, 3))


def ensemble(n=8, seed=0):
  rngs = nnx.Rngs(seed)
  return bnx.vmap(lambda: MLP(3, 4, 2, rngs=rngs), axis_size=n)()


# -- stacked parameters ------------------------------------------------------------


def test_ensemble_creation_stacks_and_members_differ():
  rngs = nnx.Rngs(0)
  ens = bnx.vmap(lambda: MLP(3, 4, 2, rngs=rngs), axis_size=8)()
  assert ens.l1.kernel.shape == (8, 3, 4) and ens.l2.bias.shape == (8, 2)
  kernels = np.asarray(ens.l1.kernel[...]).reshape(8, -1)
  assert len({tuple(k.round(6)) for k in kernels}) == 8
  assert int(rngs.default.count[...]) == 1 and no_tracers(ens)
  # member i equals a module built from the i-th split key
  keys = jax.random.split(jax.random.fold_in(jax.random.key(0), 0), 8)
  member = MLP(3, 4, 2, rngs=nnx.Rngs(keys[3]))
  np.testing.assert_allclose(ens.l1.kernel[3], member.l1.kernel[...], rtol=1e-6)


def test_stacked_forward_matches_jax_vmap_closure_and_argument():
  ens = ensemble()
  ref = jax.vmap(mlp_pure, in_axes=(0, None))(mlp_params(ens), X)
  by_closure = bnx.vmap(lambda x: ens(x), in_axes=None, state_in_axes={0: nnx.Param})(X)
  by_arg = bnx.vmap(lambda m, x: m(x), in_axes=(0, None))(ens, X)
  np.testing.assert_allclose(by_closure, ref, rtol=1e-6)
  np.testing.assert_allclose(by_arg, ref, rtol=1e-6)


def test_out_axes_for_outputs_and_created_modules():
  ens = ensemble(4)
  ref = jax.vmap(mlp_pure, in_axes=(0, None), out_axes=1)(mlp_params(ens), X)
  np.testing.assert_allclose(bnx.vmap(lambda m, x: m(x), in_axes=(0, None), out_axes=1)(ens, X), ref, rtol=1e-6)
  rngs = nnx.Rngs(0)
  made = bnx.vmap(lambda: nnx.Linear(3, 2, rngs=rngs), axis_size=4, out_axes=1)()
  assert made.kernel.shape == (3, 4, 2)


def test_shorthand_equals_dict_form():
  ens = ensemble(4)
  a = bnx.vmap(lambda x: ens(x), in_axes=None, state_in_axes=nnx.Param)(X)
  b = bnx.vmap(lambda x: ens(x), in_axes=None, state_in_axes={0: nnx.Param})(X)
  np.testing.assert_array_equal(a, b)
  want = jax.vmap(mlp_pure, in_axes=(0, None))(mlp_params(ens), X)  # the independent oracle
  np.testing.assert_allclose(a, want, rtol=1e-6)


def test_undeclared_read_only_variable_is_broadcast_unchanged():
  w = nnx.Param(jnp.arange(3.0))
  out = bnx.vmap(lambda x: x * w[...])(X)
  np.testing.assert_allclose(out, X * jnp.arange(3.0))
  np.testing.assert_array_equal(w[...], jnp.arange(3.0))


def test_unbatched_write_happens_once():
  count = nnx.Variable(jnp.array(0))

  def f(x):
    count[...] += 1
    return x

  bnx.vmap(f)(X)
  assert int(count[...]) == 1


def test_declared_per_element_accumulation_over_two_calls():
  acc = nnx.BatchStat(jnp.zeros((5,)))

  def f(x):
    acc[...] += x.sum()
    return acc[...]

  g = bnx.vmap(f, state_in_axes={0: nnx.BatchStat})
  g(X)
  out = g(X)
  np.testing.assert_allclose(acc[...], 2 * X.sum(1), rtol=1e-6)
  np.testing.assert_allclose(out, 2 * X.sum(1), rtol=1e-6)


def test_write_goes_out_on_declared_axis():
  acc = nnx.BatchStat(jnp.zeros((3, 5)))  # batch on axis 1

  def f(x):
    acc[...] = acc[...] + x
    return x

  bnx.vmap(f, state_in_axes={1: nnx.BatchStat}, state_out_axes={1: nnx.BatchStat})(X)
  np.testing.assert_allclose(acc[...], X.T)


# -- unexpected writes ------------------------------------------------------------


def test_policy_raise_warn_ignore_and_bad_policy():
  acc = nnx.Variable(jnp.zeros(()))

  def f(x):
    acc[...] += x.sum()

  with pytest.raises(bnx.BatchAxisError, match=r"Variable at \('acc',\).*state_out_axes=\{0"):
    bnx.vmap(f)(X)
  assert float(acc[...]) == 0.0 and no_tracers(acc)
  with pytest.warns(UserWarning, match='differs per batch element') as caught:
    bnx.vmap(f, unexpected_out_state_mapping='warn')(X)
  assert [w.filename for w in caught] == [__file__]  # the warning points at the user's line
  np.testing.assert_allclose(acc[...], X.sum(1), rtol=1e-6)
  acc2 = nnx.Variable(jnp.zeros(()))
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    bnx.vmap(lambda x: acc2.set_value(acc2[...] + x.sum()), unexpected_out_state_mapping='ignore')(X)
  assert acc2.shape == (5,)
  with pytest.raises(ValueError, match='unexpected_out_state_mapping'):
    bnx.vmap(f, unexpected_out_state_mapping='loud')


def test_declared_broadcast_with_batched_write_raises():
  acc = nnx.BatchStat(jnp.zeros(()))
  with pytest.raises(bnx.BatchAxisError, match="BatchStat at \\('acc',\\) is declared state_out_axes=None"):
    bnx.vmap(lambda x: acc.set_value(x.sum()), state_out_axes={None: nnx.BatchStat})(X)
  assert float(acc[...]) == 0.0


def test_in_out_axis_conflict():
  acc = nnx.BatchStat(jnp.zeros((5, 3)))
  with pytest.raises(bnx.BatchAxisError, match='mapped in on axis 0 .* declares axis 1'):
    bnx.vmap(lambda x: acc[...] + x, state_in_axes={0: nnx.BatchStat}, state_out_axes={1: nnx.BatchStat})(X)
  assert bnx.BatchAxisError.__mro__[1] is ValueError
  np.testing.assert_array_equal(acc[...], jnp.zeros((5, 3)))


# -- batch size and axes -----------------------------------------------------------


def test_a_bool_is_no_size_or_axis():
  """True is an int to Python, never a batch size here (jax.vmap refuses it as an axis too)."""
  with pytest.raises(TypeError, match=r'axis_size must be an int, got axis_size=True \(bool\)'):
    bnx.vmap(lambda: jnp.ones(2), axis_size=True)()
  with pytest.raises(TypeError, match='in_axes must be an int, None or a tuple, got True'):
    bnx.vmap(lambda x: x, in_axes=True)(X)
  with pytest.raises(TypeError, match='in_axes'):
    jax.vmap(lambda x: x, in_axes=True)(X)


def test_an_output_declared_out_axes_none_that_depends_on_the_batch_is_refused():
  """As jax.vmap: out_axes=None promises one value for every element."""
  with pytest.raises(ValueError, match='out_axes=None but depends on the batch'):
    bnx.vmap(lambda x: x * 2, out_axes=None)(X)
  with pytest.raises(ValueError, match='out_axes'):
    jax.vmap(lambda x: x * 2, out_axes=None)(X)
  np.testing.assert_array_equal(bnx.vmap(lambda x: jnp.ones(2), out_axes=None)(X), jax.vmap(lambda x: jnp.ones(2), out_axes=None)(X))


def test_inconsistent_sizes():
  w = nnx.Param(jnp.ones((4, 3)))
  with pytest.raises(ValueError, match=r"inconsistent batch sizes \[4, 5\]"):
    bnx.vmap(lambda x: x * w[...], state_in_axes=nnx.Param)(X)
  with pytest.raises(ValueError, match='size 7: axis_size'):
    bnx.vmap(lambda x: x, axis_size=7)(X)
  with pytest.raises(ValueError, match="size 5: argument 0; size 2: keyword argument 'y'"):
    bnx.vmap(lambda x, y: x)(X, y=jnp.ones(2))


def test_mapped_scalar_and_nothing_mapped():
  with pytest.raises(ValueError, match='argument 0 is a scalar'):
    bnx.vmap(lambda x: x)(1.0)
  with pytest.raises(ValueError, match='nothing is mapped'):
    bnx.vmap(lambda x: x, in_axes=None)(X)


def test_state_axis_out_of_range_is_a_value_error():
  w = nnx.Param(jnp.ones(3))
  with pytest.raises(ValueError, match=r"Param at \('w',\) is mapped on axis 2 \(state_in_axes\) but its value has shape \(3,\)"):
    bnx.vmap(lambda x: x * w[...], state_in_axes={2: nnx.Param})(X)
  model = MLP(3, 4, 2, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"Param at \(0, 'l1', 'bias'\) is mapped on axis 1 \(in_axes of argument 0\)"):
    bnx.vmap(lambda m, x: m(x), in_axes=(1, None))(model, X)


def test_in_axes_tuple_length_checked():
  with pytest.raises(ValueError, match='length 1 but the function got 2'):
    bnx.vmap(lambda a, b: a, in_axes=(0,))(X, X)


def test_kwargs_are_mapped_on_axis_zero():
  out = bnx.vmap(lambda x, *, y: x + y)(X, y=X)
  np.testing.assert_allclose(out, 2 * X)


# -- filters ---------------------------------------------------------------------


class Pair(nnx.Module):
  def __init__(self):
    self.a = nnx.Param(jnp.arange(5.0))
    self.b = nnx.Param(jnp.arange(5.0) * 10)
    self.tagged = nnx.Variable(jnp.arange(5.0), tag='per_member')


@pytest.mark.parametrize(
  'spec',
  [
    lambda p: {0: nnx.PathContains('a'), None: ...},
    lambda p: {0: p.a},
    lambda p: {0: [p.a]},
    lambda p: {0: lambda path, v: path[-1] == 'a', None: ...},
    lambda p: {0: nnx.All(nnx.Param, nnx.Not(nnx.PathContains('b')))},
    lambda p: {None: nnx.PathContains('b'), 0: nnx.Any(nnx.Param)},
  ],
  ids=['PathContains', 'instance', 'instance-list', 'callable', 'All/Not', 'order'],
)
def test_filters_select_the_mapped_variable(spec):
  p = Pair()
  out = bnx.vmap(lambda: p.a[...] + p.b[...].sum(), axis_size=5, state_in_axes=spec(p))()
  np.testing.assert_allclose(out, jnp.arange(5.0) + 100.0)


def test_tag_filter():
  p = Pair()
  out = bnx.vmap(lambda: p.tagged[...] * 2, axis_size=5, state_in_axes={0: 'per_member'})()
  np.testing.assert_allclose(out, jnp.arange(5.0) * 2)


def test_bad_filter_and_axis_key():
  with pytest.raises(TypeError, match='axis keys must be int or None'):
    bnx.vmap(lambda x: x, state_in_axes={'0': nnx.Param})
  with pytest.raises(TypeError, match='is not a filter'):
    bnx.vmap(lambda x: x, state_in_axes={0: 3.5})


# -- randomness ------------------------------------------------------------------


def test_rng_draws_equal_nnx_split_rngs_then_stay_independent():
  rngs = nnx.Rngs(0)
  f = bnx.vmap(lambda: rngs.normal(()), axis_size=4)
  first = f()
  np.testing.assert_array_equal(first, nnx_split_draws(0, 4))  # the first call's keys are flax's
  assert int(rngs.default.count[...]) == 1
  second = f()
  assert int(rngs.default.count[...]) == 2
  assert len(set(np.asarray(jnp.concatenate([first, second])).tolist())) == 8
  # later calls need not repeat flax's keys, only be fresh normal draws: with 4,000 elements a
  # mean, standard deviation or correlation more than 5 standard errors off fails (p < 1e-6)
  big = bnx.vmap(lambda: rngs.normal(()), axis_size=4000)
  a, b = np.asarray(big()), np.asarray(big())
  se = 1 / np.sqrt(a.size)
  for draws in (a, b):
    assert abs(draws.mean()) < 5 * se and abs(draws.std() - 1) < 5 * se * np.sqrt(0.5)
  assert abs(np.corrcoef(a, b)[0, 1]) < 5 * se


def test_rng_reseed_reproduces_and_cold_equals_warm():
  rngs = nnx.Rngs(0)
  f = bnx.vmap(lambda: rngs.normal(()), axis_size=4)
  nnx.reseed(rngs, default=7)
  a = f()
  nnx.reseed(rngs, default=7)
  np.testing.assert_array_equal(f(), a)

  draw = lambda r: r.normal(())  # noqa: E731
  warm = bnx.vmap(draw, in_axes=None, axis_size=4)
  warm(nnx.Rngs(1))  # compiled and cached
  cold = bnx.vmap(draw, in_axes=None, axis_size=4)(nnx.Rngs(7))
  np.testing.assert_array_equal(warm(nnx.Rngs(7)), cold)
  np.testing.assert_array_equal(cold, nnx_split_draws(7, 4))  # and both are flax's draws


def test_nested_vmap_draws_six_distinct():
  rngs = nnx.Rngs(2)
  out = bnx.vmap(lambda: bnx.vmap(lambda: rngs.normal(()), axis_size=3)(), axis_size=2)()
  assert out.shape == (2, 3) and len(set(np.asarray(out).ravel().tolist())) == 6
  assert int(rngs.default.count[...]) == 1


def test_presplit_keys_are_used_as_given():
  keys = jax.random.split(jax.random.key(3), 4)
  stream = nnx.Rngs(keys)
  out = bnx.vmap(lambda: stream.normal(()), axis_size=4, state_in_axes={0: nnx.RngState})()
  ref = jax.vmap(lambda k: jax.random.normal(jax.random.fold_in(k, 0), ()))(keys)
  np.testing.assert_allclose(out, ref, rtol=1e-6)
  np.testing.assert_array_equal(stream.default.count[...], jnp.ones(4, jnp.uint32))


def test_a_forked_stream_passed_on_a_mapped_argument_is_used_as_given():
  """nnx.Rngs(...).fork(split=4) holds one key per element: mapped in, each element draws from
  its own key (not split again), as under nnx.vmap, and each key's count advances once."""
  def forked():  # flax 0.12.4 has fork(split=n) only; later versions deprecate it for split(n)
    rngs = nnx.Rngs(0)
    return rngs.split(4) if hasattr(nnx.Rngs, 'split') else rngs.fork(split=4)

  ours, theirs = forked(), forked()
  got = bnx.vmap(lambda r: r.normal(()), in_axes=0)(ours)
  want = nnx.vmap(lambda r: r.normal(()), in_axes=0)(theirs)
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(ours.default.count[...], theirs.default.count[...])


def test_a_stack_of_streams_is_split_stream_by_stream():
  """The engine's split of a stream of several keys: each key gives its own keys per element."""
  from brainnx._engine.rng import split_per_element

  keys, count = jax.random.split(jax.random.key(3), 3), jnp.uint32(5)
  got = split_per_element(keys, count, 4)
  assert got.shape == (4, 3)
  for j in range(3):  # the oracle: one stream at a time
    want = jax.random.split(jax.random.fold_in(keys[j], count), 4)
    np.testing.assert_array_equal(jax.random.key_data(got[:, j]), jax.random.key_data(want))
  one = split_per_element(keys[0], count, 4)
  np.testing.assert_array_equal(jax.random.key_data(one), jax.random.key_data(jax.random.split(jax.random.fold_in(keys[0], count), 4)))


def test_broadcast_stream_opt_out_gives_same_key():
  rngs = nnx.Rngs(1)
  out = bnx.vmap(lambda: rngs.normal(()), axis_size=3, state_in_axes={None: nnx.RngState})()
  assert len(set(np.asarray(out).tolist())) == 1


def test_dropout_masks_differ_per_element():
  class Net(nnx.Module):
    def __init__(self, rngs):
      self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
      return self.drop(x)

  net = Net(nnx.Rngs(dropout=3))
  masks = bnx.vmap(lambda x: net(x), in_axes=None, axis_size=6)(jnp.ones(16))
  assert len({tuple(np.asarray(m).tolist()) for m in masks}) == 6
  assert int(net.drop.rngs.count[...]) == 1


# -- collectives, nesting, composition ----------------------------------------------


def test_psum_and_axis_index_with_written_variable():
  total = nnx.Variable(jnp.zeros(()))
  seen = nnx.Variable(jnp.zeros((5,), jnp.int32))

  def f(x):
    total[...] += jax.lax.psum(x.sum(), 'i')
    seen[...] = jax.lax.axis_index('i')
    return x.sum() / jax.lax.psum(x.sum(), 'i')

  out = bnx.vmap(f, axis_name='i', state_in_axes={0: seen})(X)

  def pure(t, x):
    return t + jax.lax.psum(x.sum(), 'i'), jax.lax.axis_index('i'), x.sum() / jax.lax.psum(x.sum(), 'i')

  t_ref, seen_ref, out_ref = jax.vmap(pure, in_axes=(None, 0), out_axes=(None, 0, 0), axis_name='i')(0.0, X)
  np.testing.assert_allclose(out, out_ref, rtol=1e-6)
  np.testing.assert_allclose(total[...], t_ref, rtol=1e-6)
  np.testing.assert_array_equal(seen[...], seen_ref)


def test_nested_vmap_with_variables_at_both_levels():
  w = nnx.Param(jnp.arange(6.0).reshape(2, 3))  # outer axis 0, inner axis 0 of the rest
  b = nnx.Param(jnp.arange(2.0) * 100)  # outer only

  def inner(x):
    return x * w[...] + b[...]

  def outer(x):
    return bnx.vmap(inner, state_in_axes={0: w})(x)

  out = bnx.vmap(outer, in_axes=None, axis_size=2, state_in_axes={0: nnx.Param})(jnp.ones(3))
  ref = jax.vmap(lambda wi, bi: jax.vmap(lambda wij: 1.0 * wij + bi)(wi))(w[...], b[...])
  np.testing.assert_allclose(out, ref)


def test_gradient_through_vmap():
  w = nnx.Param(jnp.array([1.0, 2.0, 3.0]))

  def loss(x):
    return bnx.vmap(lambda xi: jnp.sum(jnp.tanh(xi * w[...])))(x).sum()

  def pure(wv, x):
    return jax.vmap(lambda xi: jnp.sum(jnp.tanh(xi * wv)))(x).sum()

  np.testing.assert_allclose(jax.grad(loss)(X), jax.grad(pure, argnums=1)(w[...], X), rtol=1e-5)


def test_control_flow_inside_vmap():
  total = nnx.Variable(jnp.zeros(()))

  def f(x):
    c, _ = jax.lax.scan(lambda c, xi: (c + xi, None), 0.0, x)
    y = jax.lax.cond(c > 0, lambda: c, lambda: -c)
    n = jax.lax.while_loop(lambda n: n < 3, lambda n: n + 1, 0)
    carry, _ = bnx.scan(lambda c, xi: (c + xi, None), 0.0, x)
    total[...] += 1.0
    return y + n + carry

  out = bnx.vmap(f)(X)
  ref = jax.vmap(lambda x: jnp.abs(x.sum()) + 3 + x.sum())(X)
  np.testing.assert_allclose(out, ref, rtol=1e-5)
  assert float(total[...]) == 1.0


def test_jit_of_vmap_traces_once_and_eager_replays():
  ens = ensemble(4)
  runs = []

  def fwd(x):
    runs.append(1)
    return ens(x)

  jf = bnx.jit(bnx.vmap(fwd, in_axes=None, state_in_axes={0: nnx.Param}))
  jf(X), jf(X)
  assert len(runs) == 1
  eager = bnx.vmap(fwd, in_axes=None, state_in_axes={0: nnx.Param})
  eager(X)  # a first eager call compiles: the function runs once per abstract signature
  assert len(runs) == 2
  eager(X), eager(X + 1), eager(X)  # replayed
  assert len(runs) == 2


@needs_devices(4)
def test_spmd_axis_name_shards_the_batch_axis_as_jax_vmap_does():
  """A sharding constraint inside the mapped function gets the mesh axis on its batch
  dimension, in the lowered program and on the output, exactly as under ``jax.vmap``."""
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = jax.make_mesh((4,), ('b',), axis_types=(AxisType.Auto,))

  def g(x):
    return jax.lax.with_sharding_constraint(x * 2, NamedSharding(mesh, P()))

  x = jnp.ones((4, 8))
  ref = jax.jit(jax.vmap(g, spmd_axis_name='b'))
  constraint = '<@mesh, [{"b"}, {}]>'
  assert constraint in ref.lower(x).as_text()
  assert constraint in bnx.jit(bnx.vmap(g, spmd_axis_name='b')).lower(x).as_text()
  assert constraint not in bnx.jit(bnx.vmap(g)).lower(x).as_text()  # the check can fail
  for out in (bnx.vmap(g, spmd_axis_name='b')(x), bnx.jit(bnx.vmap(g, spmd_axis_name='b'))(x)):
    assert out.sharding.spec == ref(x).sharding.spec == P('b')
    np.testing.assert_array_equal(out, 2 * x)


def test_exception_inside_leaves_everything_exact():
  ens = ensemble(4)
  rngs = nnx.Rngs(5)
  count = nnx.Variable(jnp.array(0))
  before = (values_of(ens), values_of(rngs))

  def f(x):
    count[...] += 1
    ens.l1.kernel[...] = ens.l1.kernel[...] * 0
    rngs.normal(())
    raise RuntimeError('inside vmap')

  with pytest.raises(RuntimeError, match='inside vmap'):
    bnx.vmap(f, in_axes=None, state_in_axes={0: nnx.Param})(X)
  assert_same_values(before[0], values_of(ens))
  assert_same_values(before[1], values_of(rngs))
  assert int(count[...]) == 0 and no_tracers(ens) and no_tracers(rngs)
  out = bnx.vmap(lambda x: ens(x), in_axes=None, state_in_axes={0: nnx.Param})(X)
  assert out.shape == (4, 5, 2)


# -- working with NNX inside ---------------------------------------------------------


def _train_members_one_by_one(members, x, y, steps):
  losses = []
  for m in members:
    opt = nnx.Optimizer(m, optax.adam(1e-2), wrt=nnx.Param)
    for _ in range(steps):
      loss, g = nnx.value_and_grad(lambda m: ((m(x) - y) ** 2).mean())(m)
      opt.update(m, g)
    losses.append(loss)
  return jnp.stack(losses)


def test_nnx_grad_and_optimizer_inside_vmap_match_a_loop_over_members():
  y = jnp.ones((5, 2))
  ens = ensemble(3)
  members = [nnx.merge(*nnx.split(MLP(3, 4, 2, rngs=nnx.Rngs(0)))) for _ in range(3)]
  for i, m in enumerate(members):
    for name in ('l1', 'l2'):
      getattr(m, name).kernel[...] = getattr(ens, name).kernel[i]
      getattr(m, name).bias[...] = getattr(ens, name).bias[i]
  opt = bnx.vmap(lambda m: nnx.Optimizer(m, optax.adam(1e-2), wrt=nnx.Param))(ens)

  def step(m, o, x, y):
    loss, g = nnx.value_and_grad(lambda m: ((m(x) - y) ** 2).mean())(m)
    o.update(m, g)
    return loss

  train = bnx.jit(bnx.vmap(step, in_axes=(0, 0, None, None)))
  for _ in range(4):
    losses = train(ens, opt, X, y)
  ref = _train_members_one_by_one(members, X, y, 4)
  np.testing.assert_allclose(losses, ref, rtol=1e-5)
  np.testing.assert_allclose(ens.l1.kernel[2], members[2].l1.kernel[...], rtol=1e-5)
  np.testing.assert_array_equal(opt.step[...], [4, 4, 4])


def test_nnx_grad_on_captured_module_inside_vmap():
  ens = ensemble(3)
  y = jnp.ones((5, 2))

  def loss_grad(x):
    return nnx.grad(lambda m: ((m(x) - y) ** 2).mean())(ens)['l1']['kernel'][...]

  g = bnx.vmap(loss_grad, in_axes=None, state_in_axes={0: nnx.Param})(X)
  ref = jax.vmap(jax.grad(lambda p: ((mlp_pure(p, X) - y) ** 2).mean()))(mlp_params(ens))['l1']['kernel']
  np.testing.assert_allclose(g, ref, rtol=1e-5)


def test_batchnorm_per_element_and_broadcast_error():
  xs = jax.random.normal(jax.random.key(1), (4, 6, 3))
  bns = bnx.vmap(lambda: nnx.BatchNorm(3, momentum=0.5, rngs=nnx.Rngs(0)), axis_size=4)()
  bnx.vmap(lambda m, x: m(x))(bns, xs)
  np.testing.assert_allclose(bns.mean[...], 0.5 * xs.mean(1), rtol=1e-5, atol=1e-6)
  shared = nnx.BatchNorm(3, rngs=nnx.Rngs(0))
  with pytest.raises(bnx.BatchAxisError, match=r"BatchStat at \('shared', 'mean'\)"):
    bnx.vmap(lambda x: shared(x))(xs)
  np.testing.assert_array_equal(shared.mean[...], jnp.zeros(3))


# -- vmap_new_states -----------------------------------------------------------------


def test_vmap_new_states_stacks_tags_and_excludes():
  cell = nnx.Dict(w=nnx.Param(jnp.ones(3)))

  @bnx.vmap_new_states(state_tag='hidden', state_to_exclude=nnx.Cache)
  def init(x):
    cell['h'] = nnx.Variable(x * cell['w'][...])
    cell['c'] = nnx.Cache(cell['w'][...] * 2)  # the same for every element

  init(X)
  np.testing.assert_allclose(cell['h'][...], X)
  assert cell['h'].tag == 'hidden' and cell['c'].shape == (3,)
  assert no_tracers(cell)


def test_vmap_new_states_excluded_batched_raises_and_bad_size():
  cell = nnx.Dict(w=nnx.Param(jnp.ones(3)))

  def init(x):
    cell['c'] = nnx.Cache(x)

  with pytest.raises(bnx.BatchAxisError, match='state_to_exclude'):
    bnx.vmap_new_states(init, state_to_exclude=nnx.Cache)(X)
  assert not hasattr(cell, 'c')  # `'c' in cell` raises before flax 0.12.6
  with pytest.raises(ValueError, match='axis_size must be positive'):
    bnx.vmap_new_states(init, axis_size=0)


def test_plain_vmap_refuses_batched_new_variable():
  cell = nnx.Dict(w=nnx.Param(jnp.ones(3)))
  with pytest.raises(bnx.BatchAxisError, match='vmap_new_states'):
    bnx.vmap(lambda x: cell.__setitem__('h', nnx.Variable(x)))(X)
  assert not hasattr(cell, 'h') and no_tracers(cell)


# -- weak types, empty batches, vmap_new_states axes -------------------------------------------------

def test_vmap_broadcast_weak_float():
  """vmap with in_axes=(0, None) keeps a Python float weak, as jax.vmap does."""
  fn = lambda a, s: a * s
  a = jnp.ones((2, 3), jnp.bfloat16)
  assert_same_tree(bnx.vmap(fn, in_axes=(0, None))(a, 2.0), jax.vmap(fn, in_axes=(0, None))(a, 2.0))


def test_vmap_axis_size_weak_float():
  """vmap with in_axes=None and axis_size keeps a Python float weak, as jax.vmap does."""
  fn = lambda s: jnp.ones(3, jnp.bfloat16) * s
  assert_same_tree(bnx.vmap(fn, in_axes=None, axis_size=2)(2.0), jax.vmap(fn, in_axes=None, axis_size=2)(2.0))


# -- weak types, empty batches, vmap_new_states axes -------------------------------------------------

def test_zero_size_batch_works_like_jax_vmap():
  xs = jnp.ones((0, 3))
  out = bnx.vmap(lambda x: x * 2)(xs)
  assert out.shape == jax.vmap(lambda x: x * 2)(xs).shape == (0, 3)
  const = bnx.vmap(lambda x: jnp.float32(1.5), out_axes=None)(xs)
  assert float(const) == float(jax.vmap(lambda x: jnp.float32(1.5), out_axes=None)(xs))
  calls = nnx.Variable(jnp.array(0))

  def counted(x):
    calls[...] += 1  # unbatched: written once, as for any batch
    return x

  assert bnx.vmap(counted)(xs).shape == (0, 3) and int(calls[...]) == 1


@pytest.mark.parametrize('under_jit', [False, True])
def test_an_empty_batch_has_axis_size_zero_and_runs_no_element_as_jax_vmap(under_jit):
  """psum over the axis, a counter stepped by it and host callbacks, against jax.vmap of the
  same function on the pure counter."""
  xs = jnp.ones((0, 3))

  def pure(count, x, log):
    jax.debug.callback(lambda v: log.append(v), x.sum())  # fires once per element that runs
    size = jax.lax.psum(1, 'i')
    return count + size, size + x.sum()

  ref_log, log = [], []
  ref_count, ref_out = jax.vmap(lambda x: pure(jnp.int32(5), x, ref_log), axis_name='i', out_axes=(None, 0))(xs)
  count = nnx.Variable(jnp.int32(5))

  def stateful(x):
    count[...], out = pure(count[...], x, log)
    return out

  f = bnx.vmap(stateful, axis_name='i')
  out = (bnx.jit(f) if under_jit else f)(xs)
  jax.effects_barrier()
  assert int(count[...]) == int(ref_count) == 5  # psum over no elements is 0
  assert out.shape == ref_out.shape == (0,) and log == ref_log == []
  size = bnx.vmap(lambda x: jax.lax.psum(1.0, 'i'), axis_name='i', out_axes=None)(xs)
  assert float(size) == float(jax.vmap(lambda x: jax.lax.psum(1.0, 'i'), axis_name='i', out_axes=None)(xs)) == 0.0


# -- aliasing, empty batches and new Variables' axes, against jax.vmap / nnx.vmap -------


class _Pair(nnx.Module):
  def __init__(self):
    self.p = nnx.Param(jnp.arange(6.0).reshape(2, 3))


@pytest.mark.parametrize('reads', [True, False], ids=['reads', 'ignores'])
def test_one_module_passed_twice_with_different_in_axes_is_refused_like_nnx_vmap(reads):
  m = _Pair()
  f = (lambda a, b: a.p[...] + 10 * b.p[...]) if reads else (lambda a, b: jnp.float32(1.0))
  with pytest.raises(ValueError, match='Inconsistent aliasing'):  # the oracle
    nnx.vmap(f, in_axes=(0, 1), axis_size=2)(m, m)
  before = np.asarray(m.p[...])
  with pytest.raises(bnx.BatchAxisError, match=r"reached as \(0, 'p'\) with axis 0 .* and as \(1, 'p'\) with axis 1"):
    bnx.vmap(f, in_axes=(0, 1), axis_size=2)(m, m)
  np.testing.assert_array_equal(m.p[...], before)


def test_one_module_passed_twice_with_the_same_in_axes_maps_like_nnx_vmap():
  m = _Pair()
  f = lambda a, b: a.p[...] + 10 * b.p[...]  # noqa: E731
  np.testing.assert_array_equal(bnx.vmap(f, in_axes=(1, 1))(m, m), nnx.vmap(f, in_axes=(1, 1))(m, m))


def test_a_zero_size_batch_drawing_from_a_stream_has_the_shape_jax_vmap_gives():
  rngs = nnx.Rngs(0)
  count = int(rngs.default.count[...])
  out = bnx.vmap(lambda x: x + rngs.normal(x.shape))(jnp.ones((0, 3)))
  keys = jax.random.split(jax.random.key(0), 0)
  ref = jax.vmap(lambda x, k: x + jax.random.normal(k, x.shape))(jnp.ones((0, 3)), keys)
  assert out.shape == ref.shape == (0, 3) and out.dtype == ref.dtype
  assert int(rngs.default.count[...]) == count + 1  # the stream advances once, as for any batch


def test_axis_size_zero_builds_an_empty_ensemble_like_nnx_split_rngs_and_vmap():
  ours, theirs = nnx.Rngs(0), nnx.Rngs(0)
  ensemble = bnx.vmap(lambda: nnx.Linear(2, 3, rngs=ours), axis_size=0)()

  @nnx.split_rngs(splits=0)
  @nnx.vmap(in_axes=(0,), out_axes=0, axis_size=0)
  def oracle(r):
    return nnx.Linear(2, 3, rngs=r)

  ref = oracle(theirs)
  assert ensemble.kernel.shape == ref.kernel.shape == (0, 2, 3)
  assert ensemble.bias.shape == ref.bias.shape == (0, 3)
  assert int(ours.default.count[...]) == int(theirs.default.count[...])


@pytest.mark.parametrize('size', [-1, -5])
def test_negative_axis_size_is_a_value_error_naming_axis_size(size):
  with pytest.raises(ValueError, match=f'vmap: axis_size must be non-negative, got axis_size={size}'):
    bnx.vmap(lambda: 1.0, axis_size=size)


def test_batched_new_variables_declared_unbatched_are_a_batch_axis_error_naming_them():
  rngs = nnx.Rngs(0)
  with pytest.raises(bnx.BatchAxisError, match=r"vmap: Param at \('kernel',\) of the Linear created inside is declared state_out_axes=None"):
    bnx.vmap(lambda: nnx.Linear(2, 3, rngs=rngs), axis_size=3, state_out_axes={None: nnx.Param})()
  # the oracle: nnx.vmap refuses a batched value placed unbatched too
  with pytest.raises(ValueError, match='got axis spec None but output was batched'):
    nnx.split_rngs(splits=3)(nnx.vmap(lambda r: nnx.Linear(2, 3, rngs=r), in_axes=0, out_axes=None, axis_size=3))(rngs)
  shared = bnx.vmap(lambda: nnx.Linear(2, 3, rngs=nnx.Rngs(1)), axis_size=3, state_out_axes={None: nnx.Param})()
  ref = nnx.Linear(2, 3, rngs=nnx.Rngs(1))  # independent of the batch: one shared copy is fine
  np.testing.assert_array_equal(shared.kernel[...], ref.kernel[...])

def test_vmap_new_states_honours_state_out_axes_and_side_effect_boxes():
  box = {}

  def init(x):
    box['a'] = nnx.BatchStat(x * 2)

  xs = jnp.arange(6.0).reshape(3, 2)
  bnx.vmap_new_states(init, state_out_axes={1: nnx.BatchStat})(xs)
  value = box['a'].get_value()
  assert isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer)
  np.testing.assert_array_equal(value, jnp.moveaxis(jax.vmap(lambda x: x * 2)(xs), 0, 1))


def _planes(x):
  return x[:, None] * jnp.arange(1.0, 4.0)  # (4,) -> (4, 3)


@pytest.mark.parametrize('axis', [2, -1])
def test_out_axes_past_the_first_two_place_the_batch_axis_as_jax_vmap(axis):
  xs = jnp.arange(20.0).reshape(5, 4)
  f = lambda x: _planes(x)[None] * jnp.ones((2, 1, 1))  # noqa: E731 - (2, 4, 3) per element
  got, want = bnx.vmap(f, out_axes=axis)(xs), jax.vmap(f, out_axes=axis)(xs)
  assert got.shape == want.shape == ((2, 4, 5, 3) if axis == 2 else (2, 4, 3, 5))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_state_out_axes_two_places_a_written_variable_as_jax_vmap_out_axes():
  v = nnx.Variable(jnp.zeros((4, 3)))

  def write(x):
    v[...] = _planes(x)
    return x

  xs = jnp.arange(20.0).reshape(5, 4)
  bnx.vmap(write, state_out_axes={2: nnx.Variable})(xs)
  want = jax.vmap(_planes, out_axes=2)(xs)
  assert v[...].shape == want.shape == (4, 3, 5)
  np.testing.assert_array_equal(np.asarray(v[...]), np.asarray(want))


def test_a_module_passed_by_keyword_is_mapped_on_axis_0():
  class Scales(nnx.Module):
    def __init__(self):
      self.w = nnx.Param(jnp.arange(6.0).reshape(3, 2))

  model = Scales()
  xs = jnp.ones((3, 2)) * 2
  got = bnx.vmap(lambda x, model: x * model.w[...])(xs, model=model)
  want = np.stack([np.asarray(xs[k] * model.w[...][k]) for k in range(3)])  # a Python loop per member
  np.testing.assert_array_equal(np.asarray(got), want)


def test_one_variable_passed_twice_with_different_in_axes_is_refused_like_nnx_vmap():
  v = nnx.Param(jnp.arange(6.0).reshape(2, 3))
  f = lambda a, b: a[...] + b[...]  # noqa: E731
  with pytest.raises(ValueError, match='Inconsistent aliasing'):  # the oracle
    nnx.vmap(f, in_axes=(0, 1), axis_size=2)(v, v)
  with pytest.raises(bnx.BatchAxisError, match=r'is also reached as \(1,\), with another batch axis'):
    bnx.vmap(f, in_axes=(0, 1), axis_size=2)(v, v)
  with pytest.raises(bnx.BatchAxisError, match='is also reached as'):  # an argument and a closure
    bnx.vmap(lambda a: a[...] + v[...], in_axes=0)(v)


@pytest.mark.parametrize('make, kind', [
  (lambda: nnx.Linear(2, 3, rngs=nnx.Rngs(0)), 'Linear'),
  (lambda: nnx.Sequential(nnx.Linear(2, 3, rngs=nnx.Rngs(1))), 'Sequential'),
])
def test_identical_members_warning_names_the_class_built(make, kind):
  """Every member built from one Rngs made inside is the same: the warning says which class, and
  the members are indeed equal (the oracle: member 0 against every other)."""
  with pytest.warns(UserWarning, match=f'no Param of the {kind} created inside depends on the batch'):
    stack = bnx.vmap(make, axis_size=3)()
  for leaf in jax.tree.leaves(nnx.state(stack, nnx.Param)):
    np.testing.assert_array_equal(leaf, jnp.broadcast_to(leaf[0], leaf.shape))


def _python_frames(call) -> int:
  """Python function calls one call of ``call`` makes (the ``sys.setprofile`` count; exact)."""
  import sys

  count = [0]

  def profile(frame, event, arg):
    count[0] += event == 'call'

  sys.setprofile(profile)
  try:
    call()
  finally:
    sys.setprofile(None)
  return count[0]


def test_a_warm_vmap_or_jit_call_runs_a_handful_of_python_frames():
  """The warm path is a check and a compiled call: ``vmap``'s object keeps its program on itself
  (8 frames beyond the calling lambda), ``jit``'s plan is a closure (3); the values match."""
  model = MLP(4, 8, 1, rngs=nnx.Rngs(0))
  mapped, jitted = bnx.vmap(lambda row: model(row)), bnx.jit(lambda x: model(x))
  x = jnp.ones((6, 4))
  for f in (mapped, jitted):
    f(x)
    f(x)
  np.testing.assert_allclose(mapped(x), jax.vmap(lambda r: mlp_pure(mlp_params(model), r))(x), rtol=1e-5, atol=1e-6)
  assert _python_frames(lambda: mapped(x)) <= 10
  assert _python_frames(lambda: jitted(x)) <= 5


# -- issue 49: axes a mutation run showed unguarded (each against a Python loop) ---------------

def test_a_written_variable_mapped_in_on_axis_1_goes_back_out_on_axis_1():
  acc = nnx.Variable(jnp.zeros((3, 4)))
  xs = jnp.arange(4.0)

  def add(x):
    acc[...] = acc[...] + x

  bnx.vmap(add, state_in_axes={1: nnx.Variable})(xs)
  expected = np.zeros((3, 4))
  for k, x in enumerate(np.asarray(xs)):  # the oracle: column k gets element k
    expected[:, k] += x
  np.testing.assert_allclose(acc[...], expected)


def test_a_negative_in_axis_down_to_minus_ndim_is_accepted():
  x = jnp.arange(12.0).reshape(4, 3)
  for axis in (-2, -1):
    got = bnx.vmap(lambda row: row * 2, in_axes=axis)(x)
    np.testing.assert_allclose(got, jax.vmap(lambda row: row * 2, in_axes=axis)(x))


def test_an_unsplit_rngs_passed_as_a_mapped_argument_draws_one_key_per_element():
  """``bnx.vmap(f)(rngs, xs)`` with a plain ``nnx.Rngs`` (not ``Rngs.split``) in a mapped
  position: its key is split per element, its count stays unmapped and advances once. Oracle: a
  Python loop over the elements with the documented keys, ``split(fold_in(key, count), n)[e]``
  drawn as nnx draws (``fold_in`` with the count)."""
  rngs = nnx.Rngs(0)
  key = rngs.default.key[...]
  out = bnx.vmap(lambda r, x: r.normal(()) + x)(rngs, jnp.arange(4.0))
  keys = jax.random.split(jax.random.fold_in(key, 0), 4)
  oracle = [float(jax.random.normal(jax.random.fold_in(k, 0), ()) + e) for e, k in enumerate(keys)]
  np.testing.assert_allclose(out, oracle, rtol=1e-6)
  assert len(set(np.asarray(out - jnp.arange(4.0)).tolist())) == 4
  assert int(rngs.default.count[...]) == 1
  assert jax.random.key_data(rngs.default.key[...]).tolist() == jax.random.key_data(key).tolist()


# -- issue 55: a stacked Variable the function reaches but never reads -------------------------------

MAPPERS = {
  'vmap': lambda f, **kw: bnx.vmap(f, **kw),
  'pmap': lambda f, **kw: bnx.pmap(f, **kw),
  'vmap of jit': lambda f, **kw: bnx.vmap(bnx.jit(f), **kw),  # the inner program passes every Variable it found
}


def _cell_with_a_stack(rows):
  cell = {'w': nnx.Param(jnp.array([1.0, 2.0, 3.0])), 'b': nnx.Variable(jnp.ones(3))}

  def init(x):
    cell['h'] = nnx.Variable(x * 3.0)

  bnx.vmap_new_states(init)(rows)
  return cell, init


@pytest.mark.parametrize('mapper', list(MAPPERS))
def test_a_stack_reached_and_not_read_stays_out_of_the_mapping(mapper):
  rows = jnp.arange(6.0).reshape(2, 3)
  cell, _ = _cell_with_a_stack(rows)
  out = MAPPERS[mapper](lambda x: x * cell['w'][...] + cell['b'][...])(rows)
  oracle = jax.vmap(lambda x, w, b: x * w + b, in_axes=(0, None, None))(rows, cell['w'][...], cell['b'][...])
  np.testing.assert_array_equal(np.asarray(out), np.asarray(oracle))
  assert cell['h'][...].shape == (2, 3)  # untouched


def test_vmap_new_states_initialises_a_second_time_for_a_new_batch():
  rows = jnp.arange(6.0).reshape(2, 3)
  cell, init = _cell_with_a_stack(rows)
  bnx.vmap_new_states(init)(rows + 1.0)  # reaches the old stack, writes a new one
  np.testing.assert_array_equal(np.asarray(cell['h'][...]), np.asarray((rows + 1.0) * 3.0))


@pytest.mark.parametrize('mapper', list(MAPPERS))
def test_a_stack_read_whole_is_refused_with_a_filter_that_selects_only_it(mapper):
  rows = jnp.arange(6.0).reshape(2, 3)
  cell, _ = _cell_with_a_stack(rows)
  f = lambda x: x * cell['w'][...] + cell['h'][...]  # noqa: E731
  with pytest.raises(bnx.BatchAxisError, match=r"\('cell', 'h'\) is stacked .* Map it with state_in_axes=\{0: nnx.PathContains\('h'\)\}") as e:
    MAPPERS[mapper](f)(rows)
  hint = eval(str(e.value).split('Map it with state_in_axes=')[1].split(';')[0])  # the fix, as written
  out = MAPPERS[mapper](f, state_in_axes=hint)(rows)
  oracle = jax.vmap(lambda x, h: x * cell['w'][...] + h)(rows, cell['h'][...])
  np.testing.assert_array_equal(np.asarray(out), np.asarray(oracle))


def test_an_axis_size_of_another_type_is_a_type_error_naming_it():
  with pytest.raises(TypeError, match=r"vmap: axis_size must be an int, got axis_size='4' \(str\)"):
    bnx.vmap(lambda: 1.0, axis_size='4')
