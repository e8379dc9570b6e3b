"""Many devices: jit shardings, flax sharding metadata, shard_map, a sharded ensemble, and where
Variables end up (``state_shardings`` for Variables created inside ``jit``, ``shard_map``'s
layout of what it reads, ``state_out_specs`` for written ones only, errors naming the Variable).

Runs on the 4 CPU devices that ``conftest.py`` forces. Oracles: ``jax.jit`` (with
``out_shardings``) and ``jax.shard_map`` on the pure function of ``nnx.split`` state,
``jax.device_put`` for layouts, ``nnx.shard_map`` with an ``nnx.StateSharding`` for the state a
shard_map reads; the ensemble against ``jax.jit(jax.vmap)`` of a pure optax step on plain arrays.
(Many hosts: ``tests/test_transformer.py``.)"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import brainnx as bnx
from brainnx.examples.ensemble import MIN_VARIANCE, MLP, make_data
from helpers import needs_devices

pytestmark = needs_devices(4)


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
  with pytest.raises(TypeError, match=r"mesh must be a jax.sharding.Mesh .*got 'x'"):
    bnx.shard_map(lambda x: x, mesh='x', in_specs=P('x'), out_specs=P('x'))(x)


def test_shard_map_on_an_abstract_mesh_reads_variables_without_laying_them_out():
  """An AbstractMesh has no devices to lay Variables out on: they are read where they are."""
  mesh = jax.sharding.AbstractMesh((1,), ('d',))
  w = nnx.Param(jnp.arange(4.0))
  got = bnx.shard_map(lambda x: x * w[...], mesh=mesh, in_specs=P(), out_specs=P())(jnp.ones(4))
  np.testing.assert_array_equal(got, jnp.ones(4) * jnp.arange(4.0))


def test_transform_metadata_with_a_key_other_than_the_partition_name_is_refused():
  with pytest.raises(TypeError, match=r"transform_metadata must be a dict \{nnx.PARTITION_NAME"):
    bnx.vmap(lambda: nnx.Linear(2, 2, rngs=nnx.Rngs(0)), axis_size=2, transform_metadata={'partition': 'data'})()


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


@pytest.mark.parametrize('kind', [
  pytest.param(AxisType.Explicit, marks=pytest.mark.skipif(
    jax.__version_info__ < (0, 9), reason='jax < 0.9 refuses spmd_axis_name with arrays on an Explicit axis')),
  AxisType.Auto,
])
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


def _typed_mesh(kind=AxisType.Explicit, name='d'):
  return jax.make_mesh((4,), (name,), axis_types=(kind,))


# ------------------------------------------------------------ Variables created inside jit


@pytest.mark.parametrize('kind', [AxisType.Explicit, AxisType.Auto])
def test_state_shardings_lay_out_a_module_created_inside_the_call(kind):
  mesh = _typed_mesh(kind)
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
  mesh = _typed_mesh(AxisType.Auto)
  holder = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

  def attach():
    holder.stats = nnx.BatchStat(jnp.arange(8.0))

  with jax.set_mesh(mesh):
    bnx.jit(attach, state_shardings={P('d'): nnx.BatchStat})()
  np.testing.assert_array_equal(holder.stats[...], np.arange(8.0))
  assert holder.stats[...].sharding.is_equivalent_to(jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P('d'))).sharding, 1)
  assert isinstance(holder.kernel[...].sharding, jax.sharding.SingleDeviceSharding)  # matched by no rule


def test_a_created_variable_whose_spec_does_not_fit_is_named():
  mesh = _typed_mesh()
  with pytest.raises(ValueError, match=r"state_shardings: Param at \('kernel',\).*created inside.*dimension 0 \(size 3\)"):
    bnx.jit(lambda: nnx.Linear(3, 8, rngs=nnx.Rngs(0)), state_shardings={NamedSharding(mesh, P('d')): nnx.Param})()


# ------------------------------------------------------------ a mesh axis that does not exist


def test_a_spec_naming_an_axis_the_mesh_lacks_names_the_variable_and_the_axes():
  mesh = _typed_mesh()
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
  f = bnx.shard_map(lambda m: m.kernel[...].sum(keepdims=True), mesh=_typed_mesh(), in_specs=None, out_specs=P(),
                    state_in_specs={P('y'): nnx.PathContains('kernel')})
  with pytest.raises(ValueError, match=r"state_in_specs: Param at \(.*'kernel'\): its spec P\('y',\) names mesh axis 'y'.*\('d',\)"):
    f(lin)


# ------------------------------------------------------------ shard_map layouts


def _model():
  return nnx.Sequential(nnx.Linear(4, 8, use_bias=False, rngs=nnx.Rngs(0)), nnx.Linear(8, 4, use_bias=False, rngs=nnx.Rngs(1)))


def test_shard_map_leaves_the_variables_it_reads_laid_out_as_nnx_shard_map_does():
  mesh = _typed_mesh(AxisType.Auto)  # nnx.shard_map wants the state laid out already on an explicit mesh
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


def _first_kernel(path, variable):  # a flax filter, paths relative to the model
  return tuple(path) == ('layers', 0, 'kernel')


@pytest.mark.parametrize('form', ['state', 'state_sharding', 'filters'])
def test_flax_state_sharding_in_in_specs_lays_out_that_argument_as_nnx_shard_map(form):
  """flax's spelling works unchanged: an ``nnx.State`` of specs (``nnx.get_partition_spec``'s
  shape), or an ``nnx.StateSharding``, as a graph node's ``in_specs`` entry, paths relative to
  the node. Oracle: ``nnx.shard_map`` with the same entry."""
  mesh = _typed_mesh(AxisType.Auto)

  def forward(m, x):
    h = x @ m.layers[0].kernel[...]
    rows = jax.lax.dynamic_slice_in_dim(m.layers[1].kernel[...], jax.lax.axis_index('d') * 2, 2, 0)
    return jax.lax.psum(h @ rows, 'd')

  ours_model, theirs_model = _model(), _model()
  specs = jax.tree.map(lambda _: P(), nnx.state(ours_model))
  specs['layers'][0]['kernel'] = P(None, 'd')
  entry = {
    'state': specs,
    'state_sharding': nnx.StateSharding(specs),
    'filters': nnx.StateSharding({_first_kernel: P(None, 'd'), ...: P()}),
  }[form]
  x = jnp.ones((2, 4))
  ours = bnx.shard_map(forward, mesh=mesh, in_specs=(entry, P()), out_specs=P())(ours_model, x)
  flax_entry = nnx.StateSharding(specs) if form == 'state' else entry
  theirs = nnx.shard_map(forward, mesh=mesh, in_specs=(flax_entry, P()), out_specs=P())(theirs_model, x)
  np.testing.assert_allclose(ours, theirs, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(nnx.state(ours_model)), jax.tree.leaves(nnx.state(theirs_model))):
    np.testing.assert_array_equal(a, b)
    assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (a.sharding, b.sharding)
  assert ours_model.layers[0].kernel[...].sharding.spec == P(None, 'd')


def test_one_state_sharding_for_every_argument_lays_out_a_lone_model_as_flax():
  mesh = _typed_mesh(AxisType.Auto)
  sharding = nnx.StateSharding({_first_kernel: P(None, 'd'), ...: P()})
  total = lambda m: jax.lax.psum((m.layers[0].kernel[...] ** 2).sum(), 'd')  # noqa: E731
  ours_model, theirs_model = _model(), _model()
  ours = bnx.shard_map(total, mesh=mesh, in_specs=sharding, out_specs=P())(ours_model)
  theirs = nnx.shard_map(total, mesh=mesh, in_specs=(sharding,), out_specs=P())(theirs_model)
  np.testing.assert_allclose(ours, theirs, rtol=1e-6)
  assert ours_model.layers[0].kernel[...].sharding.spec == P(None, 'd')
  a, b = ours_model.layers[0].kernel[...], theirs_model.layers[0].kernel[...]
  assert a.sharding.is_equivalent_to(b.sharding, a.ndim)


def test_a_state_sharding_matching_no_entry_or_given_to_an_array_is_named():
  mesh = _typed_mesh(AxisType.Auto)
  model = _model()
  before = jax.tree.map(np.asarray, nnx.state(model))
  forward = lambda m, x: x @ m.layers[0].kernel[...]  # noqa: E731
  only_first = nnx.StateSharding({_first_kernel: P(None, 'd')})
  with pytest.raises(ValueError, match=r"StateSharding of argument 0 has no entry matching Param at \(0, 'layers', 1, 'kernel'\)"):
    bnx.shard_map(forward, mesh=mesh, in_specs=(only_first, P()), out_specs=P(None, 'd'))(model, jnp.ones((2, 4)))
  with pytest.raises(ValueError, match=r'in_specs\[1\] is an nnx.StateSharding.*not a graph node: give it a PartitionSpec'):
    bnx.shard_map(forward, mesh=mesh, in_specs=(None, only_first), out_specs=P(None, 'd'))(model, jnp.ones((2, 4)))
  with pytest.raises(ValueError, match=r'in_specs\[1\] is an nnx.StateSharding.*not a graph node'):  # one for all
    bnx.shard_map(forward, mesh=mesh, in_specs=only_first, out_specs=P(None, 'd'))(model, jnp.ones((2, 4)))
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, nnx.state(model)), before)


def test_shard_map_lays_out_the_state_it_reads_on_an_explicit_mesh():
  mesh = _typed_mesh(AxisType.Explicit)
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
  mesh = _typed_mesh(AxisType.Auto)
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
  mesh = _typed_mesh(AxisType.Auto)
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
  mesh = _typed_mesh(AxisType.Auto)
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


class _DotReluDot(nnx.Module):
  """flax's ``flax_gspmd`` guide's block: one kernel sharded by its metadata, one by a Param's."""

  def __init__(self, depth, rngs):
    init = nnx.initializers.lecun_normal()
    self.dot1 = nnx.Linear(depth, depth, kernel_init=nnx.with_partitioning(init, (None, 'model')), use_bias=False,
                           rngs=rngs)
    self.w2 = nnx.Param(init(rngs.params(), (depth, depth)), out_sharding=('model', None))

  def __call__(self, x):
    y = jax.lax.with_sharding_constraint(jax.nn.relu(self.dot1(x)), P('data', 'model'))
    return y @ self.w2[...]


def test_the_flax_gspmd_guide_with_stacked_layers_trains_as_flax():
  """The guide's train step, its blocks stacked and scanned, jitted, adamw, on a 2x2 mesh:
  brainnx (bnx.vmap, bnx.scan, bnx.jit) gives flax's losses (nnx.vmap + nnx.split_rngs,
  nnx.scan, nnx.jit) step by step, and the optimizer's moments are laid out as flax's."""
  mesh = jax.make_mesh((2, 2), ('data', 'model'), axis_types=(AxisType.Auto, AxisType.Auto))
  meta = {nnx.PARTITION_NAME: None}

  @nnx.split_rngs(splits=2)
  @nnx.vmap(in_axes=0, out_axes=0, transform_metadata=meta)
  def flax_stack(rngs):
    return _DotReluDot(8, rngs)

  def train(model, jit, layers):
    opt = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)

    @jit
    def step(model, opt, x, y):
      loss, grads = nnx.value_and_grad(lambda m: ((layers(m, x) - y) ** 2).mean())(model)
      opt.update(model, grads)
      return loss

    x, y = jax.random.normal(jax.random.key(1), (4, 8)), jax.random.normal(jax.random.key(2), (4, 8))
    return [float(step(model, opt, x, y)) for _ in range(4)], opt

  with jax.set_mesh(mesh):
    theirs = flax_stack(nnx.Rngs(0))
    rngs = nnx.Rngs(0)
    ours = bnx.vmap(lambda: _DotReluDot(8, rngs), axis_size=2, transform_metadata=meta)()
    want, their_opt = train(theirs, nnx.jit, lambda s, x: nnx.scan(lambda h, b: (b(h), None), in_axes=(nnx.Carry, 0))(x, s)[0])
    got, our_opt = train(ours, bnx.jit, lambda s, x: bnx.scan(lambda h, _: (s(h), None), x, None, state_in_axes={0: ...})[0])
  np.testing.assert_allclose(got, want, rtol=1e-6)
  for path in (('dot1', 'kernel'), ('w2',)):
    mine, theirs_mu = our_opt.opt_state[0].mu, their_opt.opt_state[0].mu
    for key in path:
      mine, theirs_mu = mine[key], theirs_mu[key]
    assert mine[...].sharding.spec == theirs_mu[...].sharding.spec, path


def test_the_partition_name_goes_where_out_axes_puts_the_stack_axis():
  """Stacked on axis 1 (state_out_axes), the kernel's sharding metadata names the new axis at
  position 1, as nnx.vmap(out_axes=1, transform_metadata=...) gives it."""
  mesh = jax.make_mesh((2, 2), ('data', 'model'), axis_types=(AxisType.Auto, AxisType.Auto))
  meta = {nnx.PARTITION_NAME: 'data'}
  with jax.set_mesh(mesh):
    theirs = nnx.split_rngs(splits=2)(
      nnx.vmap(lambda r: _ShardedBlock(r), in_axes=0, out_axes=1, transform_metadata=meta))(nnx.Rngs(0))
    rngs = nnx.Rngs(0)
    ours = bnx.vmap(lambda: _ShardedBlock(rngs), axis_size=2, state_out_axes={1: ...}, transform_metadata=meta)()
  assert ours.lin.kernel.shape == theirs.lin.kernel.shape == (8, 2, 8)
  assert ours.lin.kernel.get_metadata()['out_sharding'] == theirs.lin.kernel.get_metadata()['out_sharding'] \
    == (None, 'data', 'model')


# -- issue 55: one member's sharding metadata inside a mapped call ---------------------------------

class _Spread(nnx.Module):
  def __init__(self, shape, names):
    self.v = nnx.Variable(jnp.ones(shape), out_sharding=names)


@pytest.mark.parametrize('partition', ['b', None])
@pytest.mark.parametrize('axis', [0, 1, 2])
def test_inside_a_mapped_call_sharding_metadata_has_the_members_rank_as_in_nnx_vmap(axis, partition):
  names = [None, None, None]
  names[axis], names[(axis + 1) % 3] = partition, 'a'  # the mapped axis named as transform_metadata says
  names = tuple(names)
  shape = tuple(4 if k == axis else 2 for k in range(3))
  mesh = jax.make_mesh((2, 2), ('a', 'b'), axis_types=(AxisType.Auto, AxisType.Auto))
  seen, meta = {}, {nnx.PARTITION_NAME: partition}
  with jax.set_mesh(mesh):
    ours, theirs = _Spread(shape, names), _Spread(shape, names)

    def read(model, x, who):
      seen[who] = model.v.get_metadata()['out_sharding']
      return x * model.v[...].sum()

    bnx.vmap(lambda x: read(ours, x, 'brainnx'), in_axes=None, axis_size=4, state_in_axes={axis: nnx.Variable},
             transform_metadata=meta)(1.0)
    nnx.vmap(lambda m, x: read(m, x, 'flax'), in_axes=(nnx.StateAxes({...: axis}), None), axis_size=4,
             transform_metadata=meta)(theirs, 1.0)
  assert seen['brainnx'] == seen['flax'] and len(seen['flax']) == 2
  assert ours.v.get_metadata()['out_sharding'] == theirs.v.get_metadata()['out_sharding'] == names
