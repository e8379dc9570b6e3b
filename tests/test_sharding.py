"""Many devices: jit shardings, flax sharding metadata, shard_map, a sharded ensemble.

Runs on the 4 CPU devices that ``conftest.py`` forces. Oracles: ``jax.jit`` and
``jax.shard_map`` on the pure function of ``nnx.split`` state; the ensemble against
``jax.jit(jax.vmap)`` of a pure optax step on plain arrays.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import brainnx as bnx
from brainnx.examples.ensemble import MIN_VARIANCE, MLP, make_data

assert jax.device_count() >= 4, 'needs the 4 CPU devices that tests/conftest.py forces'


def _mesh(name='x', kind=AxisType.Explicit):
  return jax.make_mesh((4,), (name,), axis_types=(kind,))


# ------------------------------------------------------------------ jit shardings


def test_in_and_out_shardings_refer_to_the_users_arguments_and_output():
  mesh = _mesh()
  s, rep = NamedSharding(mesh, P('x')), NamedSharding(mesh, P())
  x = jnp.arange(8.0)
  model = nnx.Linear(8, 8, rngs=nnx.Rngs(0))
  f = lambda m, x: (m(x), x * 2)  # noqa: E731
  ours = bnx.jit(f, in_shardings=(None, s), out_shardings=(rep, s))(model, x)
  graphdef, state = nnx.split(model)
  theirs = jax.jit(lambda st, x: f(nnx.merge(graphdef, st), x), in_shardings=(None, s), out_shardings=(rep, s))(state, x)
  for a, b in zip(ours, theirs):
    np.testing.assert_allclose(a, b, rtol=1e-6)
    assert a.sharding == b.sharding
  # one sharding for every argument, as jax.jit allows
  assert bnx.jit(lambda a, b: a + b, in_shardings=s)(x, x).sharding.is_equivalent_to(s, 1)


def test_shardings_errors_name_the_argument():
  mesh = _mesh()
  s = NamedSharding(mesh, P('x'))
  model = nnx.Linear(8, 8, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r'in_shardings has 1 entries for 2 positional argument'):
    bnx.jit(lambda a, b: a, in_shardings=(s,))(jnp.ones(8), jnp.ones(8))
  with pytest.raises(ValueError, match=r'in_shardings\[0\] is .* graph node passed by reference.*state_shardings'):
    bnx.jit(lambda m, x: m(x), in_shardings=(s, None))(model, jnp.ones(8))
  with pytest.raises(ValueError, match=r'out_shardings lays out array outputs.*graph nodes'):
    bnx.jit(lambda: nnx.Linear(8, 8, rngs=nnx.Rngs(0)), out_shardings=s)()
  with pytest.raises(TypeError, match=r'state_shardings: the keys are shardings or PartitionSpecs'):
    bnx.jit(lambda: None, state_shardings={nnx.Param: P('x')})


def test_state_shardings_lay_variables_out_and_they_keep_it_after_every_step():
  mesh = _mesh()
  col = NamedSharding(mesh, P(None, 'x'))
  model = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
  opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  x = jnp.linspace(-1, 1, 8).reshape(2, 4)
  # oracle: the pure step under jax.jit with the same layout for the kernels
  graphdef, state = nnx.split((model, opt))
  state = jax.tree.map(jnp.copy, state)  # own buffers: the brainnx step donates the model's
  shardings = jax.tree.map_with_path(
    lambda path, _: col if 'kernel' in str(path) and len(_.shape) == 2 else None, state)

  def pure(state, x):
    m, o = nnx.merge(graphdef, state)
    loss, g = nnx.value_and_grad(lambda m: (m(x) ** 2).mean())(m)
    o.update(m, g)
    return loss, nnx.state((m, o))

  pure_step = jax.jit(pure, in_shardings=(shardings, None), out_shardings=(None, shardings))

  @bnx.jit(state_shardings={col: nnx.All(nnx.PathContains('kernel'), lambda _, v: v.get_value().ndim == 2)},
           donate_states=True)
  def step(x):
    loss, g = bnx.value_and_grad(lambda: (model(x) ** 2).mean(), grad_states=model)()
    opt.update(model, g)
    return loss

  for _ in range(3):
    loss = step(x)
    ref_loss, state = pure_step(state, x)
    assert model.kernel[...].sharding.is_equivalent_to(col, 2)
    assert opt.opt_state[0].mu['kernel'][...].sharding.is_equivalent_to(col, 2)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  m_ref, _ = nnx.merge(graphdef, state)
  np.testing.assert_allclose(model.kernel[...], m_ref.kernel[...], rtol=1e-6)
  assert step.cache_sizes()['compiled'] == 1  # laid out once, no new program per step


def test_state_shardings_with_partition_specs_need_a_mesh_and_must_divide():
  w = nnx.Param(jnp.ones((6, 2)))
  with pytest.raises(ValueError, match=r'PartitionSpec, which needs a mesh.*jax.set_mesh'):
    bnx.jit(lambda: w[...] * 2, state_shardings={P('x'): nnx.Param})()
  with jax.set_mesh(_mesh()):
    with pytest.raises(ValueError, match=r"Param at \('w',\) has shape \(6, 2\); dimension 0 \(size 6\) does not divide into 4"):
      bnx.jit(lambda: w[...] * 2, state_shardings={P('x'): nnx.Param})()
  np.testing.assert_array_equal(w[...], np.ones((6, 2)))


@pytest.mark.parametrize('kind', [AxisType.Explicit, AxisType.Auto])
def test_flax_sharding_metadata_is_honoured_under_set_mesh(kind):
  mesh = jax.make_mesh((2, 2), ('data', 'model'), axis_types=(kind, kind))
  init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, 'model'))
  make = lambda: nnx.Linear(4, 8, kernel_init=init, rngs=nnx.Rngs(0))  # noqa: E731
  with jax.set_mesh(mesh):
    ours, theirs = bnx.jit(make)(), nnx.jit(make)()
    abstract = bnx.eval_shape(make)
  assert ours.kernel[...].sharding == theirs.kernel[...].sharding
  assert ours.kernel[...].sharding.spec == P(None, 'model')
  np.testing.assert_array_equal(ours.kernel[...], theirs.kernel[...])
  assert abstract.kernel.get_value().shape == (4, 8)
  assert nnx.get_partition_spec(nnx.state(abstract))['kernel'].get_value() == P(None, 'model')


# ------------------------------------------------------------------ shard_map


def test_shard_map_writes_back_with_collectives_and_matches_jax_shard_map():
  mesh = _mesh()
  w = nnx.Param(jnp.arange(8.0))
  total = nnx.Variable(jnp.zeros(()))
  x = jax.device_put(jnp.linspace(0, 1, 8), NamedSharding(mesh, P('x')))

  def f(x):
    total[...] += jax.lax.psum(x.sum(), 'x')
    w[...] = w[...] * 2 + x
    return x * w[...]

  def pure(w, total, x):
    total = total + jax.lax.psum(x.sum(), 'x')
    w = w * 2 + x
    return x * w, w, total

  ref_w = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P('x')))
  ref_out, ref_w, ref_total = jax.shard_map(
    pure, mesh=mesh, in_specs=(P('x'), P(), P('x')), out_specs=(P('x'), P('x'), P()))(ref_w, jnp.zeros(()), x)
  out = bnx.shard_map(f, mesh=mesh, in_specs=P('x'), out_specs=P('x'), state_in_specs={P('x'): nnx.Param})(x)
  np.testing.assert_allclose(out, ref_out)
  np.testing.assert_allclose(w[...], ref_w)
  np.testing.assert_allclose(total[...], ref_total)
  assert w[...].sharding.spec == P('x')
  # under jit, and with the mesh from jax.set_mesh
  with jax.set_mesh(mesh):
    jitted = bnx.jit(bnx.shard_map(f, in_specs=P('x'), out_specs=P('x'), state_in_specs={P('x'): nnx.Param}))
    jitted(x)
  ref_out, ref_w, ref_total = jax.shard_map(
    pure, mesh=mesh, in_specs=(P('x'), P(), P('x')), out_specs=(P('x'), P('x'), P()))(ref_w, ref_total, x)
  np.testing.assert_allclose(w[...], ref_w)
  np.testing.assert_allclose(total[...], ref_total)


def test_shard_map_state_out_specs_gather_a_per_device_statistic():
  mesh = jax.make_mesh((4,), ('x',), axis_types=(AxisType.Auto,))
  stats = nnx.BatchStat(jnp.zeros((4, 3)))

  def f(x):  # each device writes its own row
    stats[...] = jnp.broadcast_to(x.mean(0), (1, 3))
    return x

  x = jnp.arange(24.0).reshape(8, 3)
  bnx.shard_map(f, mesh=mesh, in_specs=P('x'), out_specs=P('x'), state_in_specs={P('x'): nnx.BatchStat})(x)
  np.testing.assert_allclose(stats[...], x.reshape(4, 2, 3).mean(1))
  assert stats[...].sharding.spec == P('x')


def test_shard_map_errors_name_the_variable_and_leave_state_exact():
  mesh = _mesh()
  w = nnx.Param(jnp.arange(6.0))
  counter = nnx.Variable(jnp.zeros(()))
  x = jax.device_put(jnp.ones(8), NamedSharding(mesh, P('x')))
  sm = lambda f, **kw: bnx.shard_map(f, mesh=mesh, in_specs=P('x'), out_specs=P('x'), **kw)  # noqa: E731
  with pytest.raises(ValueError, match=r"state_in_specs: Param at \('w',\) has shape \(6,\); dimension 0 \(size 6\) does not divide into 4"):
    sm(lambda x: x * w[...].sum(), state_in_specs={P('x'): nnx.Param})(x)
  with pytest.raises(ValueError, match=r"Param at \('w',\) has shape \(6,\), but its spec P\('x', None\) names 2"):
    sm(lambda x: x * w[...].sum(), state_in_specs={P('x', None): nnx.Param})(x)
  with pytest.raises(TypeError, match=r'pass array arguments positionally'):
    sm(lambda x: x)(x=x)

  def fails(x):
    counter[...] += 1
    raise RuntimeError('boom')

  with pytest.raises(RuntimeError, match='boom'):
    sm(fails)(x)
  assert float(counter[...]) == 0.0
  with pytest.raises(ValueError, match=r'no mesh'):
    bnx.shard_map(lambda x: x, in_specs=P('x'), out_specs=P('x'))(x)


# ------------------------------------------------------------------ a sharded ensemble


def _ensemble(members=8):
  rngs = nnx.Rngs(0)
  ensemble = bnx.vmap(lambda: MLP(8, rngs=rngs), axis_size=members)()
  optimizers = bnx.vmap(lambda m: nnx.Optimizer(m, optax.adam(1e-2), wrt=nnx.Param))(ensemble)
  return ensemble, optimizers


def _step(**vmap_kw):
  @bnx.vmap(in_axes=(0, 0, None, None), **vmap_kw)
  def step(model, opt, x, y):
    loss, grads = bnx.value_and_grad(lambda m: ((m(x) - y) ** 2).mean(), argnums=0)(model)
    opt.update(model, grads)
    return loss

  return step


def _pure_mlp(p, x):
  """The demo's ``MLP`` (mean and softplus variance) on a dict of arrays."""
  out = jax.nn.relu(x @ p['l1']['kernel'] + p['l1']['bias']) @ p['l2']['kernel'] + p['l2']['bias']
  return jnp.concatenate([out[:, :1], jax.nn.softplus(out[:, 1:]) + MIN_VARIANCE], axis=-1)


def _pure_params(ensemble):
  return {n: {k: jnp.asarray(getattr(getattr(ensemble, n), k)[...]) for k in ('kernel', 'bias')} for n in ('l1', 'l2')}


@pytest.mark.parametrize('kind', [AxisType.Explicit, AxisType.Auto])
def test_sharded_ensemble_holds_two_members_per_device_and_equals_pure_jax(kind):
  x, y, _ = make_data(0, 32)
  tx = optax.adam(1e-2)

  def pure_step(p, s, x, y):
    loss, g = jax.value_and_grad(lambda p: ((_pure_mlp(p, x) - y) ** 2).mean())(p)
    updates, s = tx.update(g, s, p)
    return optax.apply_updates(p, updates), s, loss

  mesh = jax.make_mesh((4,), ('ens',), axis_types=(kind,))
  ensemble, optimizers = _ensemble()
  params = _pure_params(ensemble)
  opt_state = jax.vmap(tx.init)(params)
  pure = jax.jit(jax.vmap(pure_step, in_axes=(0, 0, None, None)))
  with jax.set_mesh(mesh):
    sharded = bnx.jit(_step(spmd_axis_name='ens'), state_shardings={P('ens'): ...})
    for _ in range(20):
      loss = sharded(ensemble, optimizers, x, y)
      params, opt_state, ref_loss = pure(params, opt_state, x, y)
  for node in (ensemble, optimizers):
    for path, v in nnx.iter_graph(node):
      if isinstance(v, nnx.Variable):
        value = v.get_value()
        assert value.sharding.spec[0] == 'ens', path
        assert sorted(s.device.id for s in value.addressable_shards) == [0, 1, 2, 3]
        assert {s.data.shape[0] for s in value.addressable_shards} == {2}, path
  assert loss.sharding.spec == P('ens')
  # float32 sums split across devices round differently: 20 adam steps of lr 1e-2 stay within
  # a few ulps of the parameters' scale
  np.testing.assert_allclose(loss, ref_loss, rtol=2e-5, atol=2e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6), _pure_params(ensemble), params)
