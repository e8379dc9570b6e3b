"""A population: one ``vmap`` over members, each with its own learning rate and weight decay.

``optax.inject_hyperparams`` keeps the hyperparameters in the optimizer state, so a stacked
optimizer holds one value per member. Oracle: each setting trained alone in a Python loop with
plain ``optax.adamw`` on a pure-jax copy of the network.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import brainnx as bnx

LRS = jnp.array([1e-3, 1e-2, 3e-2, 1e-2])
WDS = jnp.array([0.0, 1e-4, 1e-4, 0.3])
STEPS = 60


class Net(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(2, 16, rngs=rngs)
    self.l2 = nnx.Linear(16, 1, rngs=rngs)

  def __call__(self, x):
    return self.l2(jnp.tanh(self.l1(x)))


def _data():
  x = jax.random.normal(jax.random.key(0), (32, 2))
  return x, jnp.sin(x[:, :1]) * x[:, 1:]


def _plain_loss(params, x, y):
  h = jnp.tanh(x @ params['l1']['kernel'] + params['l1']['bias'])
  return ((h @ params['l2']['kernel'] + params['l2']['bias'] - y) ** 2).mean()


def _population():
  rngs = nnx.Rngs(3)
  population = bnx.vmap(lambda: Net(rngs), axis_size=len(LRS))()
  tx = optax.inject_hyperparams(optax.adamw)(learning_rate=0.0, weight_decay=0.0)
  optimizers = bnx.vmap(lambda m: nnx.Optimizer(m, tx, wrt=nnx.Param))(population)
  optimizers.opt_state.hyperparams['learning_rate'].set_value(LRS)
  optimizers.opt_state.hyperparams['weight_decay'].set_value(WDS)
  return population, optimizers


def test_population_equals_each_setting_trained_alone_with_plain_optax():
  x, y = _data()
  population, optimizers = _population()
  initial = nnx.to_pure_dict(nnx.state(population, nnx.Param))

  @bnx.vmap(in_axes=(0, 0, None, None))
  def step(model, opt, x, y):
    loss, grads = bnx.value_and_grad(lambda m: ((m(x) - y) ** 2).mean(), argnums=0)(model)
    opt.update(model, grads)
    return loss

  losses = bnx.jit(lambda: bnx.for_loop(lambda _: step(population, optimizers, x, y), jnp.arange(STEPS)))()
  final = nnx.to_pure_dict(nnx.state(population, nnx.Param))
  plain_losses = []
  for k in range(len(LRS)):
    alone = optax.adamw(float(LRS[k]), weight_decay=float(WDS[k]))
    params = jax.tree.map(lambda a: a[k], initial)
    state = alone.init(params)
    per_step = []
    for _ in range(STEPS):
      loss, grads = jax.value_and_grad(_plain_loss)(params, x, y)
      updates, state = alone.update(grads, state, params)
      params = optax.apply_updates(params, updates)
      per_step.append(loss)
    plain_losses.append(per_step)
    for got, expect in zip(jax.tree.leaves(jax.tree.map(lambda a: a[k], final)), jax.tree.leaves(params), strict=True):
      np.testing.assert_allclose(got, expect, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(losses, np.array(plain_losses).T, rtol=1e-4, atol=1e-5)
  # the settings really differ: every member ends somewhere else, and the optimizer state says why
  assert len({round(float(v), 6) for v in losses[-1]}) == len(LRS)
  np.testing.assert_array_equal(optimizers.opt_state.hyperparams['learning_rate'].get_value(), LRS)


def test_pick_the_best_member_into_a_plain_model():
  x, y = _data()
  population, optimizers = _population()

  @bnx.jit
  @bnx.vmap(in_axes=(0, 0))
  def step(model, opt):
    loss, grads = bnx.value_and_grad(lambda m: ((m(x) - y) ** 2).mean(), argnums=0)(model)
    opt.update(model, grads)
    return loss

  for _ in range(STEPS):
    losses = step(population, optimizers)
  best = int(jnp.argmin(losses))
  model = Net(nnx.Rngs(0))
  nnx.update(model, jax.tree.map(lambda a: a[best], nnx.state(population)))
  member = bnx.vmap(lambda m: ((m(x) - y) ** 2).mean())(population)
  np.testing.assert_allclose(((model(x) - y) ** 2).mean(), member[best], rtol=1e-6)
  assert float(member[best]) == float(member.min())
