"""A call's object graph: what it creates, attaches, returns and shares, per call.

Each expected value comes from ``nnx.jit``, ``jax.jit`` or eager Python on the
same program; the guarantees that span transforms are in ``test_conformance.py``.
"""

import dataclasses
import gc
import types
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx, struct
from flax.training import train_state

import brainnx as bnx
from helpers import assert_program_equal, needs_capture, needs_devices


class MLP(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(1, 16, rngs=rngs)
    self.l2 = nnx.Linear(16, 1, rngs=rngs)

  def __call__(self, x):
    return self.l2(jax.nn.relu(self.l1(x)))


def _train(jitter, steps=30):
  """flax's FSDP toy example's pattern: model and optimizer created inside a jitted function."""

  @jitter
  def create():
    model = MLP(nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

  model, optimizer = create()

  @jitter
  def step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(lambda m: ((m(x) - y) ** 2).mean())(model)
    optimizer.update(model, grads)
    return loss

  x = jnp.linspace(-1, 1, 32)[:, None]
  return model, optimizer, [float(step(model, optimizer, x, x**2)) for _ in range(steps)]


def test_model_and_optimizer_created_inside_share_their_params_and_train_as_flax():
  model, optimizer, losses = _train(bnx.jit)
  want = _train(nnx.jit)[2]
  np.testing.assert_allclose(losses, want, rtol=1e-6)
  assert losses[-1] < losses[0] / 5


def test_returned_state_shares_the_returned_modules_variables():
  m, p = bnx.jit(lambda: (lambda m: (m, nnx.variables(m, nnx.Param)))(nnx.Linear(2, 3, rngs=nnx.Rngs(0))))()
  want_m, want_p = nnx.jit(lambda: (lambda m: (m, nnx.variables(m, nnx.Param)))(nnx.Linear(2, 3, rngs=nnx.Rngs(0))))()
  assert (p['kernel'] is m.kernel) and (want_p['kernel'] is want_m.kernel)


def test_two_returned_dicts_sharing_one_linear():
  def build():
    shared = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    return nnx.Dict(a=shared), nnx.Dict(b=shared)

  a, b = bnx.jit(build)()
  assert a['a'] is b['b']


def test_an_unregistered_object_holding_a_model_or_a_tracer_is_refused_as_jax_jit_does():
  m = nnx.Linear(1, 1, rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match='returns a SimpleNamespace holding arrays or graph nodes'):
    bnx.jit(lambda m: types.SimpleNamespace(m=m))(m)

  class Holder:
    pass

  def f(x):
    h = Holder()
    h.x = x * 2
    return h

  with pytest.raises(TypeError, match='returns a Holder holding arrays'):
    bnx.jit(f)(jnp.ones(2))
  with pytest.raises(TypeError, match='returns a Holder holding arrays'):
    bnx.vmap(f)(jnp.ones((2, 2)))
  with pytest.raises(TypeError, match='returns a Holder holding arrays'):
    bnx.scan(lambda c, x: (c, f(x)), 0.0, jnp.ones((2, 2)))
  with pytest.raises(TypeError, match='returns a Holder holding arrays'):
    bnx.for_loop(f, jnp.ones((2, 2)))
  with pytest.raises(TypeError, match='not a valid JAX type'):  # the oracle
    jax.jit(f)(jnp.ones(2))


@struct.dataclass
class Box:
  a: object
  b: object


def test_registered_dataclass_outputs_are_concrete_and_keep_the_callers_variable():
  v = nnx.Variable(jnp.ones(2))
  out = bnx.jit(lambda: Box(v, v[...] * 2))()
  assert out.a is v
  np.testing.assert_array_equal(np.asarray(out.b), np.asarray(jax.jit(lambda: v[...] * 2)()))
  new = bnx.jit(lambda x: Box(nnx.Param(x), x))(jnp.arange(2.0))
  assert isinstance(new.a, nnx.Param) and isinstance(new.a.get_value(), jax.Array)
  np.testing.assert_array_equal(np.asarray(new.a[...]), [0.0, 1.0])
  module = bnx.jit(lambda x: Box(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), x))(jnp.ones(2)).a
  want = nnx.jit(lambda x: Box(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), x))(jnp.ones(2)).a
  np.testing.assert_array_equal(np.asarray(module.kernel[...]), np.asarray(want.kernel[...]))


class Count(nnx.Variable):
  pass


class CountingMLP(nnx.Module):
  def __init__(self, rngs):
    self.count = Count(jnp.array(0))
    self.w1 = nnx.Param(jax.random.uniform(rngs.params(), (1, 16)))
    self.w2 = nnx.Param(jax.random.uniform(rngs.params(), (16, 1)))

  def __call__(self, x):
    self.count[...] += 1
    return jax.nn.relu(x @ self.w1[...]) @ self.w2[...]


class TrainState(train_state.TrainState):
  counts: nnx.State
  graphdef: nnx.GraphDef


def _train_state_run(jitter, steps=5):
  """flax's train-state toy example (nnx.split into a TrainState, jax.jit steps) with ``jitter``."""
  graphdef, params, counts = nnx.split(CountingMLP(nnx.Rngs(0)), nnx.Param, Count)
  state = TrainState.create(apply_fn=None, graphdef=graphdef, params=params, tx=optax.sgd(0.1), counts=counts)

  @jitter
  def train_step(state, x, y):
    def loss_fn(params):  # copy=True: flax 0.12 refuses writing a Variable made outside jax.grad
      model = nnx.merge(state.graphdef, params, state.counts, copy=True)
      return jnp.mean((y - model(x)) ** 2), nnx.state(model, Count)

    grads, counts = jax.grad(loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads, counts=counts)

  x = np.linspace(0, 1, 16, dtype=np.float32)[:, None]
  for _ in range(steps):
    state = train_step(state, x, 0.8 * x**2 + 0.1)
  return state


def test_flax_train_state_example_is_a_drop_in_for_jax_jit():
  got, want = _train_state_run(bnx.jit), _train_state_run(jax.jit)
  assert int(got.step) == 5
  for g, w in zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params)):
    assert isinstance(g, jax.Array)
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6)
  model = nnx.merge(got.graphdef, got.params, got.counts)
  assert int(model.count[...]) == 5


class Sows(nnx.Module):
  def __init__(self):
    self.l = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

  def __call__(self, x):
    self.sow(nnx.Intermediate, 'h', x)
    return self.l(x)


@pytest.mark.filterwarnings('ignore:.*sow')
def test_sow_through_one_function_over_two_models():
  f = bnx.jit(lambda m, x: m(x))
  a, b = Sows(), Sows()
  f(a, jnp.ones(2))
  f(b, 2 * jnp.ones(2))
  assert a.h is not b.h
  np.testing.assert_array_equal(np.asarray(a.h.get_value()[0]), [1.0, 1.0])
  np.testing.assert_array_equal(np.asarray(b.h.get_value()[0]), [2.0, 2.0])


def test_a_head_attached_and_returned_is_the_attached_object_for_each_model():
  def add_head(m):
    m.head = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    return m.head

  f = bnx.jit(add_head)
  a, b = Sows(), Sows()
  ha, hb = f(a), f(b)
  assert a.head is ha and b.head is hb and ha is not hb
  want = nnx.Linear(2, 1, rngs=nnx.Rngs(0)).kernel[...]  # the same draws, made eagerly
  assert_program_equal(hb.kernel[...], want)


class Records(nnx.Module):
  def __init__(self):
    self.w = nnx.Param(jnp.ones(2))

  def __call__(self, x):
    self.y = nnx.Intermediate(x * self.w[...])
    return x * self.w[...]


def test_lowering_attaches_nothing_and_the_compiled_call_does():
  m = Records()
  compiled = bnx.jit(m).lower(jnp.ones(2)).compile()
  assert not hasattr(m, 'y')
  compiled(jnp.full(2, 3.0))
  np.testing.assert_array_equal(np.asarray(m.y[...]), [3.0, 3.0])


def test_make_jaxpr_before_the_call_then_the_call_attaches():
  m = Records()
  sf = bnx.StatefulFunction(m)
  sf.make_jaxpr(jnp.ones(2))
  sf.get_states(jnp.ones(2))
  assert not hasattr(m, 'y')
  sf(jnp.full(2, 2.0))
  np.testing.assert_array_equal(np.asarray(m.y[...]), [2.0, 2.0])


def test_a_rebound_closure_model_gets_its_own_attribute():
  holder = Records()
  f = bnx.jit(lambda x: holder(x))
  f(jnp.ones(2))
  first = holder
  holder = Records()  # noqa: F841 - rebinds the closure cell
  f(jnp.ones(2))
  assert hasattr(holder, 'y') and holder.y is not first.y


def test_a_key_set_inside_a_dict_value_is_a_write():
  v = nnx.Variable({})
  bnx.jit(lambda x: v.__setitem__('k', x) or x)(jnp.ones(2))
  want = nnx.Variable({})
  nnx.jit(lambda x: want.__setitem__('k', x) or x)(jnp.ones(2))
  assert set(v.get_value()) == set(want.get_value()) == {'k'}


MESH1 = jax.make_mesh((1,), ('d',), devices=jax.devices()[:1])
CAPTURED = {
  'jit': lambda f: bnx.jit(f),
  'remat': lambda f: bnx.remat(f),
  'grad': lambda f: (lambda m, x: (bnx.grad(lambda m, x: f(m, x).sum(), argnums=1)(m, x), None)[1]),
  'cond': lambda f: (lambda m, x: bnx.cond(True, f, f, m, x)),
  'switch': lambda f: (lambda m, x: bnx.switch(1, [f, f], m, x)),
  'shard_map': lambda f: (lambda m, x: bnx.shard_map(
    f, mesh=MESH1, in_specs=(None, jax.sharding.PartitionSpec()), out_specs=jax.sharding.PartitionSpec())(m, x)),
}


@pytest.mark.filterwarnings('ignore:.*sow')
@pytest.mark.parametrize('name', list(CAPTURED))
@needs_capture
def test_nnx_capture_around_a_transform(name):
  _, want = nnx.capture(lambda m, x: m(x), nnx.Intermediate)(Sows(), jnp.ones(2))  # the oracle: eager
  _, got = nnx.capture(CAPTURED[name](lambda m, x: m(x)), nnx.Intermediate)(Sows(), jnp.ones(2))
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.filterwarnings('ignore:.*sow')
@needs_capture
def test_nnx_capture_around_vmap_takes_the_batch_axis_state_out_axes_gives():
  batched = bnx.vmap(lambda m, x: m(x), in_axes=(None, 0), state_out_axes={0: nnx.Intermediate})
  _, per_element = nnx.capture(batched, nnx.Intermediate)(Sows(), jnp.arange(6.0).reshape(3, 2))
  np.testing.assert_array_equal(np.asarray(jax.tree.leaves(per_element)[0]), np.arange(6.0).reshape(3, 2))


@pytest.mark.filterwarnings('ignore:.*sow')
@needs_capture
def test_nnx_capture_around_a_loop_is_refused_naming_the_buffer():
  looped = lambda m, x: bnx.for_loop(lambda y: m(y), jnp.stack([x, x]))  # noqa: E731
  with pytest.raises(ValueError, match=r"for_loop: Intermediate at \('m', '__captures__', 0\) changes its value"):
    nnx.capture(looped, nnx.Intermediate)(Sows(), jnp.ones(2))


def test_a_module_attached_inside_dies_with_its_holder():
  class Holder(nnx.Module):
    def __init__(self):
      self.w = nnx.Param(jnp.ones(2))

  holder = Holder()

  def attach(x):
    holder.extra = nnx.Linear(2, 2, rngs=nnx.Rngs(0))  # noqa: F821 - bound until the del below
    return x

  f = bnx.jit(attach)
  f(jnp.ones(2))
  extra = weakref.ref(holder.extra)
  f.clear_cache()
  del f, holder, attach
  gc.collect()
  assert extra() is None


def test_x64_retraces_a_function_without_arguments_as_jax_jit_does():
  f = bnx.jit(lambda: jnp.array(1.0) * 2)
  assert f().dtype == jnp.float32
  with jax.enable_x64(True):
    got, want = f(), jax.jit(lambda: jnp.array(1.0) * 2)()
  assert got.dtype == want.dtype == jnp.float64
  assert f().dtype == jnp.float32


class Momentum(nnx.Variable):
  pass


class SGD(nnx.Pytree):
  """An optimizer holding the model's own Params (flax's FSDP toy example's pattern)."""

  def __init__(self, params, lr, decay=0.9):
    self.lr, self.decay = lr, decay
    self.params = nnx.data(params)
    self.momentum = nnx.data(jax.tree.map(
      lambda v: Momentum(jnp.zeros_like(v[...]), **v.get_metadata()), params,
      is_leaf=lambda x: isinstance(x, nnx.Variable),
    ))

  def update(self, grads):
    def one(param, momentum, grad):
      momentum[...] = self.decay * momentum[...] + (1 - self.decay) * grad[...]
      param[...] -= self.lr * momentum[...]

    jax.tree.map(one, self.params, self.momentum, grads, is_leaf=lambda x: isinstance(x, nnx.Variable))


class ShardedMLP(nnx.Module):
  def __init__(self, rngs):
    init = nnx.initializers.lecun_normal()
    self.w1 = nnx.Param(init(rngs.params(), (1, 32)), sharding_metadata=(None, 'model'))
    self.b1 = nnx.Param(jnp.zeros((32,)), sharding_metadata=('model',))
    self.w2 = nnx.Param(init(rngs.params(), (32, 1)), sharding_metadata=('model', None))

  def __call__(self, x):
    return nnx.relu(x @ self.w1 + self.b1) @ self.w2


def _fsdp_losses(jitter, steps=40):
  @jitter
  def create():
    model = ShardedMLP(nnx.Rngs(0))
    return model, SGD(nnx.variables(model, nnx.Param), 0.05)

  @jitter
  def train_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((y - m(x)) ** 2))(model)
    optimizer.update(grads)
    return loss

  mesh = jax.make_mesh((1, 2), ('data', 'model'), devices=jax.devices()[:2])
  x = np.linspace(-2, 2, 64)[:, None].astype(np.float32)
  y = 0.8 * x**2 + 0.1
  with jax.set_mesh(mesh):
    model, optimizer = create()
    assert optimizer.params['w1'] is model.w1  # the optimizer holds the model's own Params
    return [float(train_step(model, optimizer, x, y)) for _ in range(steps)]


@needs_devices(2)
def test_flax_fsdp_example_trains_as_with_nnx_jit():
  got, want = _fsdp_losses(bnx.jit), _fsdp_losses(nnx.jit)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  assert got[-1] < got[0] / 3


class Holder(nnx.Module):
  def __init__(self, scale):
    self.scale = nnx.Param(jnp.full((2,), scale))


def test_vmap_new_states_over_two_holders():
  def init(holder):
    holder.state = nnx.BatchStat(holder.scale[...] * 3)

  f = bnx.vmap_new_states(init, in_axes=None, axis_size=2)
  a, b = Holder(1.0), Holder(2.0)
  f(a)
  f(b)
  assert a.state is not b.state
  np.testing.assert_array_equal(np.asarray(a.state[...]), np.full((2, 2), 3.0))
  np.testing.assert_array_equal(np.asarray(b.state[...]), np.full((2, 2), 6.0))


class Layer(nnx.Module):
  def __init__(self, rngs):
    self.w = nnx.Param(jax.random.normal(rngs.params(), (2,)))

  def __call__(self, x):
    self.out = nnx.Intermediate(x * self.w[...])
    return x


@pytest.mark.filterwarnings('ignore:.*all members are identical')
def test_one_for_loop_body_over_two_stacks():
  stack = bnx.vmap(lambda key: Layer(nnx.Rngs(key)))
  s1, s2 = stack(jax.random.split(jax.random.key(0), 3)), stack(jax.random.split(jax.random.key(1), 3))
  body = lambda layer: layer(jnp.ones(2))  # noqa: E731
  bnx.for_loop(body, s1)
  bnx.for_loop(body, s2)
  assert s1.out is not s2.out
  for s in (s1, s2):  # the oracle: a Python loop over the layers gives out = w per layer
    np.testing.assert_allclose(np.asarray(s.out[...]), np.asarray(s.w[...]))


LAZY = None


def test_lazy_initialisation_into_a_global_and_a_nonlocal():
  @bnx.jit
  def forward(x):
    global LAZY
    if LAZY is None:
      LAZY = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    return LAZY(x)

  out = forward(jnp.ones(2))
  assert isinstance(LAZY.kernel.get_value(), jax.Array)  # not a ShapeDtypeStruct
  want = nnx.Linear(2, 2, rngs=nnx.Rngs(0))(jnp.ones(2))  # the oracle: eager Python
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(forward(jnp.ones(2))), np.asarray(want), rtol=1e-6)

  def make():
    model = None

    @bnx.jit
    def forward(x):
      nonlocal model
      if model is None:
        model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
      return model(x)

    forward(jnp.ones(2))
    return model

  assert isinstance(make().kernel.get_value(), jax.Array)


def test_metadata_set_between_calls_is_seen_as_nnx_jit_sees_it():
  def run(jitter):
    m = nnx.Dict(w=nnx.Param(jnp.ones(2), scale=2.0))
    f = jitter(lambda m, x: x * m['w'].get_metadata()['scale'])
    first = f(m, jnp.ones(2))
    m['w'].set_metadata(scale=5.0)
    return first, f(m, jnp.ones(2))

  (a1, a2), (b1, b2) = run(bnx.jit), run(nnx.jit)
  np.testing.assert_array_equal(np.asarray(a2), [5.0, 5.0])
  np.testing.assert_array_equal(np.asarray(a2), np.asarray(b2))
  np.testing.assert_array_equal(np.asarray(a1), np.asarray(b1))


class Trainer:
  traces = 0

  def __init__(self):
    self.model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    self.steps = 0

  @bnx.jit
  def step(self, x):
    Trainer.traces += 1
    self.steps += 1  # a Python side effect: it runs when the method is traced, as under jax.jit
    return self.model(x)


def test_a_counter_on_a_plain_object_is_traced_once_like_one_in_a_global():
  Trainer.traces = 0
  trainer = Trainer()
  outs = [trainer.step(jnp.ones(2)) for _ in range(4)]
  assert (Trainer.traces, trainer.steps) == (1, 1)
  np.testing.assert_array_equal(np.asarray(outs[-1]), np.asarray(trainer.model(jnp.ones(2))))
  trainer.steps = 10  # changed from outside: a new signature, as a global changed from outside
  trainer.step(jnp.ones(2))
  assert Trainer.traces == 2


def test_a_new_wrapper_each_call_traces_once_as_jax_jit_does():
  traces = []

  def double(x):
    traces.append(1)
    return x * 2

  for _ in range(3):
    out = bnx.jit(double)(jnp.ones(2))
  assert len(traces) == 1
  np.testing.assert_array_equal(np.asarray(out), np.asarray(jax.jit(double)(jnp.ones(2))))
  function = weakref.ref(double)
  del double
  gc.collect()
  assert function() is None  # the shared cache holds the function weakly


@dataclasses.dataclass(slots=True)
class Slotted:
  model: nnx.Module
  scale: float = 2.0


def test_a_slots_dataclass_holding_a_model_is_walked_in_a_closure_and_as_an_argument():
  box = Slotted(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
  forward = bnx.jit(lambda x: box.model(x) * box.scale)
  forward(jnp.ones(2))
  box.model.kernel[...] = jnp.eye(2)  # a write between calls must be seen, not baked in
  np.testing.assert_allclose(np.asarray(forward(jnp.ones(2))), np.asarray(box.model(jnp.ones(2)) * 2.0), rtol=1e-6)
  box.model = nnx.Linear(2, 2, rngs=nnx.Rngs(1))  # a rebound slot is seen too
  np.testing.assert_allclose(np.asarray(forward(jnp.ones(2))), np.asarray(box.model(jnp.ones(2)) * 2.0), rtol=1e-6)

  def step(box, x):
    box.model.bias[...] += 1.0
    return box.model(x)

  out = bnx.jit(step)(box, jnp.ones(2))
  np.testing.assert_allclose(np.asarray(box.model.bias[...]), [1.0, 1.0])
  np.testing.assert_allclose(np.asarray(out), np.asarray(box.model(jnp.ones(2))), rtol=1e-6)


def test_an_attribute_replaced_on_every_call_holds_each_calls_value():
  m = Records()
  f = bnx.jit(lambda m, x: m(x))
  seen = []
  for k in range(4):
    f(m, jnp.full(2, float(k)))
    seen.append(m.y)
    np.testing.assert_array_equal(np.asarray(m.y[...]), [float(k)] * 2)
  assert len({id(v) for v in seen}) == 4  # a fresh Intermediate per call, as nnx.jit gives
  np.testing.assert_array_equal(np.asarray(seen[1][...]), [1.0, 1.0])  # earlier ones keep their values
  m.w[...] = jnp.full(2, 3.0)  # the followed plan still sees writes from outside
  f(m, jnp.ones(2))
  np.testing.assert_array_equal(np.asarray(m.y[...]), [3.0, 3.0])


# -- programs written outside the suite (the oracle: eager Python, nnx.jit) -----------------


class _SowsTwice(nnx.Module):
  def __init__(self):
    self.l = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

  def __call__(self, x):
    self.sow(nnx.Intermediate, 'h', x)
    self.sow(nnx.Intermediate, 'h', x * 2)  # the value becomes a tuple of two
    return self.l(x)


def _forward_and_pop(m, x):
  return m(x), nnx.pop(m, nnx.Intermediate)


@pytest.mark.filterwarnings('ignore:.*sow')
@pytest.mark.parametrize('jitter', [bnx.jit, nnx.jit], ids=['bnx.jit', 'nnx.jit'])
def test_popped_intermediates_come_back_whole(jitter):
  """``nnx.pop`` after two ``sow``s returns both values (one came back)."""
  want = nnx.to_pure_dict(_forward_and_pop(_SowsTwice(), jnp.ones(2))[1])
  m = _SowsTwice()
  f = jitter(_forward_and_pop)
  for _ in range(2):
    got = nnx.to_pure_dict(f(m, jnp.ones(2))[1])
    assert jax.tree.structure(got) == jax.tree.structure(want)
    jax.tree.map(np.testing.assert_allclose, got, want)
    assert not hasattr(m, 'h')


@pytest.mark.filterwarnings('ignore:.*sow')
@needs_capture
def test_nnx_capture_inside_jit_captures_every_sown_value():
  """flax's intermediates guide: ``nnx.capture`` called inside the jitted step (with
  ``method_outputs`` too) gives what it gives eagerly."""
  def step(m, x):
    return nnx.capture(m, nnx.Intermediate, method_outputs=nnx.Intermediate)(x)

  want_y, want = step(_SowsTwice(), jnp.ones(2))
  m = _SowsTwice()
  got_y, got = bnx.jit(step)(m, jnp.ones(2))
  np.testing.assert_allclose(got_y, want_y, rtol=1e-6)
  want, got = nnx.to_pure_dict(want), nnx.to_pure_dict(got)
  assert jax.tree.structure(got) == jax.tree.structure(want), (got, want)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), got, want)


class _LazyCache(nnx.Module):
  """A cache dict filled on first use (``nnx.data``: a plain dict flax treats as data)."""

  def __init__(self, holder):
    self.cache = nnx.data(holder)

  def __call__(self, x):
    if 'k' not in self.cache:
      self.cache['k'] = nnx.Cache(jnp.zeros(()))
    self.cache['k'][...] += x
    return self.cache['k'][...]


class _LazyList(nnx.Module):
  """A Module appended to an empty list on first use."""

  def __init__(self):
    self.layers = nnx.data([])

  def __call__(self, x):
    if not self.layers:
      self.layers.append(_Counter())
    return self.layers[0](x)


class _Counter(nnx.Module):
  def __init__(self):
    self.n = nnx.Variable(jnp.zeros(()))

  def __call__(self, x):
    self.n[...] += x
    return self.n[...]


class _Trainer:
  """A plain object whose empty list gets a Module on first use."""

  def __init__(self):
    self.parts = []

  def step(self, x):
    if not self.parts:
      self.parts.append(_Counter())
    return self.parts[0](x)


@pytest.mark.parametrize('program', ['nnx.data dict', 'nnx.data list', 'plain object list'])
@pytest.mark.parametrize('form', ['closure', 'argument'])
def test_a_container_filled_on_first_use_keeps_counting(program, form):
  """A container that held no state at the first trace gains its state in that call: every
  later call updates it (bnx.jit gave [1, 1, 1, 1]; eager and nnx.jit give [1, 2, 3, 4])."""
  make = {'nnx.data dict': lambda: _LazyCache({}), 'nnx.data list': _LazyList,
          'plain object list': _Trainer}[program]
  call = (lambda o, x: o.step(x)) if program == 'plain object list' else (lambda o, x: o(x))
  eager, ours = make(), make()
  if form == 'closure':
    f = bnx.jit(lambda x: call(ours, x))
    got = [float(f(1.0)) for _ in range(4)]
  else:
    f = bnx.jit(call)
    got = [float(f(ours, 1.0)) for _ in range(4)]
  assert got == [float(call(eager, 1.0)) for _ in range(4)] == [1.0, 2.0, 3.0, 4.0]


_LAZY_GLOBAL: dict = {}


def _fill_global_on_first_use(x):
  if 'n' not in _LAZY_GLOBAL:
    _LAZY_GLOBAL['n'] = nnx.Variable(jnp.zeros(()))
  _LAZY_GLOBAL['n'][...] += x
  return _LAZY_GLOBAL['n'][...]


def test_a_global_dict_filled_on_first_use_keeps_counting():
  _LAZY_GLOBAL.clear()
  f = bnx.jit(_fill_global_on_first_use)
  assert [float(f(1.0)) for _ in range(4)] == [1.0, 2.0, 3.0, 4.0]


class _Foo(nnx.Pytree):
  def __init__(self):
    self.a = nnx.data([jnp.array(1.0), jnp.array(2.0)])  # arrays in a list: data, as in nnx.split


@pytest.mark.parametrize('form', ['argument', 'closure'])
def test_flax_pytree_guide_list_of_arrays_replaced_per_call(form):
  """flax's pytree guide: ``foo.a = [x * 2 for x in foo.a]`` jitted three times gives
  [8, 16] (it gave [1, 2] under brainnx)."""
  def double(foo):
    foo.a = [x * 2 for x in foo.a]

  want, foo = _Foo(), _Foo()
  f = bnx.jit(double) if form == 'argument' else bnx.jit(lambda: double(foo))
  for _ in range(3):
    nnx.jit(double)(want)
    f(foo) if form == 'argument' else f()
  assert [float(x) for x in want.a] == [8.0, 16.0]
  assert [float(x) for x in foo.a] == [8.0, 16.0]


def test_a_function_writes_a_variable_on_an_object_of_an_exec_made_class():
  namespace = {'nnx': nnx, 'jnp': jnp}
  exec('class Counter:\n  def __init__(self):\n    self.n = nnx.Variable(jnp.zeros(()))\n', namespace)
  counter = namespace['Counter']()  # its class says __module__ == 'builtins'
  step = bnx.jit(lambda x: counter.n.set_value(counter.n[...] + x))
  expected = 0.0
  for x in (1.0, 2.0, 4.0):  # the oracle: the same additions in Python
    step(jnp.float32(x))
    expected += x
    assert float(counter.n[...]) == expected
