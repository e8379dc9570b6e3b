"""Where Variables end up: ``state_shardings`` for Variables created inside ``jit``,
``shard_map``'s layout of the Variables it reads, ``state_out_specs`` for written ones only,
and errors naming the Variable for a mesh axis that does not exist.

Oracles: ``jax.jit(..., out_shardings=...)`` and ``jax.device_put`` for layouts,
``nnx.shard_map`` with an ``nnx.StateSharding`` for the state a shard_map reads, the
eager module for values. (Many hosts: ``tests/test_transformer.py``.)
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import brainnx as bnx

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason='needs 4 devices (tests/conftest.py forces them on CPU)')


def _mesh(kind=AxisType.Explicit, name='d'):
  return jax.make_mesh((4,), (name,), axis_types=(kind,))


# ------------------------------------------------------------ Variables created inside jit


@pytest.mark.parametrize('kind', [AxisType.Explicit, AxisType.Auto])
def test_state_shardings_lay_out_a_module_created_inside_the_call(kind):
  mesh = _mesh(kind)
  s = NamedSharding(mesh, P('d'))
  build = lambda: nnx.Linear(4, 8, rngs=nnx.Rngs(0))  # noqa: E731
  lin = bnx.jit(build, state_shardings={s: nnx.PathContains('kernel')})()
  expected = build()
  theirs = jax.jit(lambda: nnx.split(build())[1]['kernel'].get_value(), out_shardings=s)()
  np.testing.assert_array_equal(lin.kernel[...], expected.kernel[...])
  np.testing.assert_array_equal(lin.bias[...], expected.bias[...])
  assert lin.kernel[...].sharding.is_equivalent_to(theirs.sharding, 2)
  assert lin.bias[...].sharding.is_fully_replicated  # no rule: left to JAX, whole on every device


def test_state_shardings_lay_out_a_variable_attached_to_a_known_module_inside_the_call():
  mesh = _mesh(AxisType.Auto)
  holder = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

  def attach():
    holder.stats = nnx.BatchStat(jnp.arange(8.0))

  with jax.set_mesh(mesh):
    bnx.jit(attach, state_shardings={P('d'): nnx.BatchStat})()
  np.testing.assert_array_equal(holder.stats[...], np.arange(8.0))
  assert holder.stats[...].sharding.is_equivalent_to(jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P('d'))).sharding, 1)
  assert isinstance(holder.kernel[...].sharding, jax.sharding.SingleDeviceSharding)  # matched by no rule


def test_a_created_variable_whose_spec_does_not_fit_is_named():
  mesh = _mesh()
  with pytest.raises(ValueError, match=r"state_shardings: Param at \('kernel',\).*created inside.*dimension 0 \(size 3\)"):
    bnx.jit(lambda: nnx.Linear(3, 8, rngs=nnx.Rngs(0)), state_shardings={NamedSharding(mesh, P('d')): nnx.Param})()


# ------------------------------------------------------------ a mesh axis that does not exist


def test_a_spec_naming_an_axis_the_mesh_lacks_names_the_variable_and_the_axes():
  mesh = _mesh()
  lin = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
  before = np.asarray(lin.kernel[...])
  with jax.set_mesh(mesh):
    step = bnx.jit(lambda: lin(jnp.ones(4)), state_shardings={P('y'): nnx.PathContains('kernel')})
    with pytest.raises(ValueError, match=r"state_shardings: Param at \('lin', 'kernel'\): its spec P\('y',\) names mesh axis 'y', which the mesh does not have \(its axes: \('d',\)\)"):
      step()
  np.testing.assert_array_equal(lin.kernel[...], before)
  assert isinstance(lin.kernel[...].sharding, jax.sharding.SingleDeviceSharding)


def test_shard_map_spec_naming_an_axis_the_mesh_lacks_names_the_variable():
  lin = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
  f = bnx.shard_map(lambda m: m.kernel[...].sum(keepdims=True), mesh=_mesh(), in_specs=None, out_specs=P(),
                    state_in_specs={P('y'): nnx.PathContains('kernel')})
  with pytest.raises(ValueError, match=r"state_in_specs: Param at \(.*'kernel'\): its spec P\('y',\) names mesh axis 'y'.*\('d',\)"):
    f(lin)


# ------------------------------------------------------------ shard_map layouts


def _model():
  return nnx.Sequential(nnx.Linear(4, 8, use_bias=False, rngs=nnx.Rngs(0)), nnx.Linear(8, 4, use_bias=False, rngs=nnx.Rngs(1)))


def test_shard_map_leaves_the_variables_it_reads_laid_out_as_nnx_shard_map_does():
  mesh = _mesh(AxisType.Auto)  # nnx.shard_map wants the state laid out already on an explicit mesh
  first = lambda path, v: tuple(path[-3:]) == ('layers', 0, 'kernel')  # noqa: E731  (under either root)
  rules = {P(None, 'd'): first}

  def forward(m, x):
    h = x @ m.layers[0].kernel[...]  # a column block of the hidden layer per device
    rows = jax.lax.dynamic_slice_in_dim(m.layers[1].kernel[...], jax.lax.axis_index('d') * 2, 2, 0)
    return jax.lax.psum(h @ rows, 'd')

  ours_model, theirs_model = _model(), _model()
  x = jnp.ones((2, 4))
  ours = bnx.shard_map(forward, mesh=mesh, in_specs=(None, P()), out_specs=P(), state_in_specs=rules)(ours_model, x)
  theirs = nnx.shard_map(forward, mesh=mesh, in_specs=(nnx.StateSharding({first: P(None, 'd'), ...: P()}), P()), out_specs=P())(theirs_model, x)
  np.testing.assert_allclose(ours, theirs, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(nnx.state(ours_model)), jax.tree.leaves(nnx.state(theirs_model))):
    np.testing.assert_array_equal(a, b)
    assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (a.sharding, b.sharding)
  assert ours_model.layers[0].kernel[...].sharding.spec == P(None, 'd')


def test_shard_map_lays_out_the_state_it_reads_on_an_explicit_mesh():
  mesh = _mesh(AxisType.Explicit)
  lin = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
  before = np.asarray(lin.kernel[...])
  total = bnx.shard_map(lambda m: jax.lax.psum(m.kernel[...].sum(keepdims=True), 'd'), mesh=mesh, in_specs=None,
                        out_specs=P(), state_in_specs={P(None, 'd'): nnx.PathContains('kernel')})(lin)
  np.testing.assert_allclose(total, before.sum(keepdims=True), rtol=1e-5)
  expected = jax.device_put(before, NamedSharding(mesh, P(None, 'd'))).sharding
  assert lin.kernel[...].sharding.is_equivalent_to(expected, 2)
  assert lin.bias[...].sharding.is_equivalent_to(NamedSharding(mesh, P()), 1)  # no rule: replicated
  np.testing.assert_array_equal(lin.kernel[...], before)


def test_shard_map_state_out_specs_apply_to_written_variables_only():
  mesh = _mesh(AxisType.Auto)
  scale = nnx.Variable(jnp.asarray(2.0))  # read only, a scalar: P('d') could not apply to it
  total = nnx.Variable(jnp.zeros(4))

  def accumulate(x):
    total[...] = total[...] + x.sum() * scale[...]

  bnx.shard_map(accumulate, mesh=mesh, in_specs=P('d'), out_specs=None, state_out_specs={P('d'): ...},
                state_in_specs={P('d'): lambda path, v: v is total})(jnp.arange(8.0))
  # the oracle: jax.shard_map on the pure function of the two values
  expected = jax.shard_map(lambda t, s, x: t + x.sum() * s, mesh=mesh, in_specs=(P('d'), P(), P('d')),
                           out_specs=P('d'))(jnp.zeros(4), jnp.asarray(2.0), jnp.arange(8.0))
  np.testing.assert_array_equal(total[...], expected)
  assert total[...].sharding.spec == P('d')
  assert float(scale[...]) == 2.0 and scale[...].shape == ()


def test_a_per_shard_value_written_into_a_replicated_variable_comes_back_gathered():
  """brainstate's sharded-data, replicated-state case: each shard writes its own (2,) value into
  a Variable it read replicated; state_out_specs={P('d'): ...} puts the shards back together."""
  mesh = _mesh(AxisType.Auto)
  seen = nnx.Variable(jnp.zeros(2))

  def f(x):
    seen[...] = x + seen[...]  # a per-shard value
    return x.sum(keepdims=True)

  x = jnp.arange(8.0)
  out = bnx.shard_map(f, mesh=mesh, in_specs=P('d'), out_specs=P('d'), state_out_specs={P('d'): ...})(x)
  # the oracle: jax.shard_map on the pure function, the value in P() and out P('d')
  want_seen, want_out = jax.shard_map(lambda s, x: (x + s, x.sum(keepdims=True)), mesh=mesh,
                                      in_specs=(P(), P('d')), out_specs=(P('d'), P('d')))(jnp.zeros(2), x)
  np.testing.assert_array_equal(out, want_out)
  np.testing.assert_array_equal(seen[...], want_seen)
  assert seen[...].shape == (8,) and seen[...].sharding.spec == P('d')


def test_shard_map_state_out_spec_that_does_not_fit_a_written_variable_is_named():
  mesh = _mesh(AxisType.Auto)
  count = nnx.Variable(jnp.zeros(()))

  def bump(x):
    count[...] += 1.0

  with pytest.raises(ValueError, match=r"state_out_specs: Variable at \('count',\) has shape \(\), but its spec P\('d',\) names 1"):
    bnx.shard_map(bump, mesh=mesh, in_specs=P('d'), out_specs=None, state_out_specs={P('d'): ...})(jnp.arange(8.0))
  assert float(count[...]) == 0.0


# -- sharding metadata of stacked layers, as flax's transform_metadata gives it ---------------


class _ShardedBlock(nnx.Module):
  def __init__(self, rngs):
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, 'model'))
    self.lin = nnx.Linear(8, 8, kernel_init=init, rngs=rngs)

  def __call__(self, x):
    return jnp.tanh(self.lin(x))


def _flax_stack(partition):
  @nnx.split_rngs(splits=2)
  @nnx.vmap(in_axes=0, out_axes=0, axis_size=2, transform_metadata={nnx.PARTITION_NAME: partition})
  def make(rngs):
    return _ShardedBlock(rngs)

  return make(nnx.Rngs(0))


def _train(stack, run_layers, steps=3):
  opt = nnx.Optimizer(stack, optax.adam(1e-2), wrt=nnx.Param)
  x = jnp.linspace(-1.0, 1.0, 32).reshape(4, 8)

  def loss(stack):
    return (run_layers(stack, x) ** 2).mean()

  losses = []
  for _ in range(steps):
    value, grads = nnx.value_and_grad(loss)(stack)
    opt.update(stack, grads)
    losses.append(float(value))
  return opt, losses


@pytest.mark.parametrize('partition', [None, 'data'])
def test_stacked_layers_carry_sharding_metadata_at_their_rank_as_flax_transform_metadata(partition):
  mesh = jax.make_mesh((2, 2), ('data', 'model'), axis_types=(AxisType.Auto, AxisType.Auto))
  with jax.set_mesh(mesh):
    theirs = _flax_stack(partition)
    rngs = nnx.Rngs(0)
    meta = None if partition is None else {nnx.PARTITION_NAME: partition}
    ours = bnx.vmap(lambda: _ShardedBlock(rngs), axis_size=2, transform_metadata=meta)()
    for name in ('kernel', 'bias'):
      mine, want = getattr(ours.lin, name), getattr(theirs.lin, name)
      assert mine.get_metadata().get('out_sharding') == want.get_metadata().get('out_sharding'), name
      assert mine[...].sharding.is_equivalent_to(want[...].sharding, mine[...].ndim), name
      np.testing.assert_array_equal(mine[...], want[...])
    assert ours.lin.kernel.get_metadata()['out_sharding'] == (partition, None, 'model')
    # the optimizer built under the mesh follows the metadata: its moments are laid out as flax's
    flax_layers = lambda stack, x: nnx.scan(lambda h, blk: (blk(h), None), in_axes=(nnx.Carry, 0))(x, stack)[0]  # noqa: E731
    our_layers = lambda stack, x: bnx.scan(lambda h, _: (stack(h), None), x, None, state_in_axes={0: ...})[0]  # noqa: E731
    our_opt, our_losses = _train(ours, our_layers)
    their_opt, their_losses = _train(theirs, flax_layers)
    np.testing.assert_allclose(our_losses, their_losses, rtol=1e-6)
    mu, want_mu = our_opt.opt_state[0].mu['lin']['kernel'], their_opt.opt_state[0].mu['lin']['kernel']
    assert mu[...].shape == (2, 8, 8)
    assert mu[...].sharding.is_equivalent_to(want_mu[...].sharding, 3)
    assert mu.get_metadata().get('out_sharding') == want_mu.get_metadata().get('out_sharding')
    np.testing.assert_allclose(ours.lin.kernel[...], theirs.lin.kernel[...], rtol=1e-6)
  # restoring through flax's abstract model: the shardings its metadata gives fit the arrays
  def build():
    rngs = nnx.Rngs(0)
    return bnx.vmap(lambda: _ShardedBlock(rngs), axis_size=2, transform_metadata=meta)()

  _, abstract = nnx.get_abstract_model(build, mesh)
  _, want_abstract = nnx.get_abstract_model(lambda: _flax_stack(partition), mesh)
  kernel, want_kernel = abstract['lin']['kernel'], want_abstract['lin']['kernel']
  assert kernel.shape == want_kernel.shape == (2, 8, 8)
  assert kernel.sharding.spec == want_kernel.sharding.spec == P(partition, None, 'model')
