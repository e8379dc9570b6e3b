"""pmap on the 4 CPU devices of conftest.py and map, against jax.pmap / jax.lax.map on pure pytrees,
flax's own nnx.split_rngs + nnx.vmap for the RNG keys, or a Python loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import brainnx as bnx
from helpers import MLP, mlp_params, mlp_pure, needs_devices, nnx_split_draws

X = jax.random.normal(jax.random.key(0), (5, 3))


def ensemble(n=8, seed=0):
  rngs = nnx.Rngs(seed)
  return bnx.vmap(lambda: MLP(3, 4, 2, rngs=rngs), axis_size=n)()


@needs_devices(4)
def test_pmap_on_four_devices_equals_jax_pmap():
  ens = ensemble(4)
  p = bnx.pmap(lambda m, x: m(x), in_axes=(0, None))(ens, X)
  ref = jax.pmap(mlp_pure, in_axes=(0, None))(mlp_params(ens), X)
  np.testing.assert_allclose(p, ref, rtol=1e-6)
  r = nnx.Rngs(5)
  np.testing.assert_allclose(bnx.pmap(lambda: r.normal(()), axis_size=4)(), nnx_split_draws(5, 4), rtol=1e-6)
  count, acc = nnx.Variable(jnp.array(0)), nnx.Variable(jnp.zeros(()))
  bnx.pmap(lambda x: count.set_value(count[...] + 1))(jnp.ones(4))
  assert int(count[...]) == 1
  with pytest.raises(bnx.BatchAxisError, match=r"Variable at \('acc',\)"):
    bnx.pmap(lambda x: acc.set_value(acc[...] + x))(jnp.arange(4.0))
  total = nnx.Variable(jnp.zeros(()))
  bnx.pmap(lambda x: total.set_value(total[...] + jax.lax.psum(x, 'd')), axis_name='d')(jnp.arange(4.0))
  assert float(total[...]) == float(jax.pmap(lambda x: jax.lax.psum(x, 'd'), axis_name='d')(jnp.arange(4.0))[0]) == 6.0


def test_map_sequential_writes_and_chunks_match():
  xs = jnp.arange(14.0).reshape(7, 2)
  seen = nnx.Variable(jnp.zeros(()))

  def f(row):
    seen[...] += 1
    return row.sum() * 2

  out = bnx.map(f, xs)
  np.testing.assert_allclose(out, xs.sum(1) * 2)
  assert float(seen[...]) == 7
  np.testing.assert_allclose(bnx.map(lambda r: r.sum() * 2, xs, batch_size=3), xs.sum(1) * 2)
  np.testing.assert_allclose(bnx.map(lambda r: r.sum() * 2, xs, batch_size=7), xs.sum(1) * 2)


def test_map_rng_per_element_and_errors():
  rngs = nnx.Rngs(0)
  draws = bnx.map(lambda x: x + rngs.normal(()), jnp.zeros(6), batch_size=4)
  assert len(set(np.asarray(draws).tolist())) == 6
  seen = nnx.Variable(jnp.zeros(()))
  with pytest.raises(ValueError, match=r"may not write Variable at \('seen',\)"):
    bnx.map(lambda x: seen.set_value(x), jnp.zeros(6), batch_size=2)
  with pytest.raises(ValueError, match='batch_size must be a positive int'):
    bnx.map(lambda x: x, jnp.zeros(6), batch_size=0)
  with pytest.raises(ValueError, match='scalar'):
    bnx.map(lambda x: x, jnp.float32(1.0))
  with pytest.raises(ValueError, match='different leading sizes'):
    bnx.map(lambda x, y: x, jnp.zeros(3), jnp.zeros(4))


def test_map_batch_size_one_and_a_remainder_match_a_loop():
  """batch_size=1 is a valid size (one element per step), and a batch_size that does not divide
  the length runs the remainder too; True is no size."""
  xs = jnp.arange(10.0).reshape(5, 2)
  want = np.stack([np.asarray(x.sum() * 2) for x in xs])  # the oracle: a Python loop
  for size in (1, 2, 3, 5):
    np.testing.assert_allclose(bnx.map(lambda r: r.sum() * 2, xs, batch_size=size), want)
  with pytest.raises(ValueError, match='batch_size must be a positive int, got True'):
    bnx.map(lambda r: r, xs, batch_size=True)


@needs_devices(4)
def test_pmap_static_broadcasted_argnums_as_jax_pmap():
  """A static argument reaches the function as the Python value (a branch on it works)."""
  f = lambda x, n: x * n if n > 1 else x - n  # noqa: E731
  xs = jnp.ones((2, 3))
  for n in (3, 1):
    got = bnx.pmap(f, static_broadcasted_argnums=1)(xs, n)
    np.testing.assert_allclose(got, jax.pmap(f, static_broadcasted_argnums=1)(xs, n))


@needs_devices(4)
def test_pmap_tracing_a_function_that_writes_other_variables_the_second_time_is_an_error():
  """pmap traces twice on a first call; a function whose second trace writes other Variables
  (a Python counter picking the target) is refused, and nothing is written."""
  first, second = nnx.Variable(jnp.zeros(())), nnx.Variable(jnp.zeros(()))
  traces = []

  def f(x):
    traces.append(1)
    (first if len(traces) == 1 else second)[...] += 1.0
    return x

  with pytest.raises(RuntimeError, match='did something else when traced again'):
    bnx.pmap(f)(jnp.ones((2, 3)))
  assert float(first[...]) == float(second[...]) == 0.0


def test_negative_axis_size_and_pmap_over_too_many_elements_are_named():
  with pytest.raises(ValueError, match='axis_size=-1'):
    bnx.vmap(lambda: 1.0, axis_size=-1)
  n = jax.local_device_count()
  with pytest.raises(ValueError, match=rf'{n + 1} elements but there are only {n} devices'):
    bnx.pmap(lambda x: x * 2)(jnp.ones(n + 1))


@needs_devices(4)
def test_pmap_writing_a_broadcast_counter_traces_on_its_first_call_only():
  count = nnx.Variable(jnp.zeros(()))
  traces = []

  def step(x):
    traces.append(1)
    count[...] += 1
    return x * 2

  f = bnx.pmap(step)
  per_call = []
  for _ in range(4):
    out = f(jnp.ones((2, 3)))
    per_call.append(len(traces))
    traces.clear()
  assert per_call == [2, 0, 0, 0]  # twice on the first call (documented), then none
  assert float(count[...]) == 4.0
  np.testing.assert_array_equal(np.asarray(out), np.asarray(jax.pmap(lambda x: x * 2)(jnp.ones((2, 3)))))


@needs_devices(4)
def test_a_counter_a_two_device_pmap_wrote_is_read_by_a_four_device_pmap_as_jax_pmap_reads_it():
  step = lambda c, x: (c + 1.0, x * 2)  # noqa: E731
  pure = jax.pmap(step, in_axes=(None, 0), out_axes=(None, 0))
  c_ref = jnp.float32(0)
  counter = nnx.Variable(jnp.float32(0))

  def stateful(x):
    counter[...], y = step(counter[...], x)
    return y

  f = bnx.pmap(stateful)
  for n in (2, 4, 2):  # the counter moves between 2- and 4-device programs
    x = jnp.arange(3.0 * n).reshape(n, 3)
    c_ref, y_ref = pure(np.asarray(c_ref), x)  # moved by hand: jax 0.8's pmap refuses it where brainnx moves it
    np.testing.assert_array_equal(f(x), y_ref)
    assert float(counter[...]) == float(c_ref)
  assert float(c_ref) == 3.0


@needs_devices(2)
def test_pmap_reads_a_variable_committed_to_another_device():
  """A Variable committed to device 1 (jax.pmap takes such inputs; brainnx raised jax's
  DeviceAssignmentMismatchError): the values equal jax.pmap's on the pure function."""
  scale = nnx.Variable(jax.device_put(jnp.full((), 3.0), jax.devices()[1]))
  x = jnp.arange(4.0)
  f = bnx.pmap(lambda x: x * scale[...])
  want = jax.pmap(lambda x, s: x * s, in_axes=(0, None))(x, np.asarray(scale[...]))  # jax 0.8's refuses it committed
  np.testing.assert_array_equal(f(x), want)
  np.testing.assert_array_equal(f(x), want)  # warm
