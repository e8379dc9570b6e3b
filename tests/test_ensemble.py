"""The ensemble-training recipe: members stay independent (oracle: each member alone)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import brainnx as bnx
from helpers import MLP

MEMBERS, STEPS = 8, 20
X = jax.random.normal(jax.random.key(0), (16, 3))
Y = jnp.sin(X[:, :2])


def loss_fn(model, x, y):
  return ((model(x) - y) ** 2).mean()


def make_ensemble():
  rngs = nnx.Rngs(0)
  return bnx.vmap(lambda: MLP(3, 8, 2, rngs=rngs), axis_size=MEMBERS)()


def member(ensemble, i):
  m = MLP(3, 8, 2, rngs=nnx.Rngs(99))
  for name in ('l1', 'l2'):
    getattr(m, name).kernel[...] = getattr(ensemble, name).kernel[i]
    getattr(m, name).bias[...] = getattr(ensemble, name).bias[i]
  return m


def train_alone(m):
  opt = nnx.Optimizer(m, optax.adam(1e-2), wrt=nnx.Param)
  for _ in range(STEPS):
    grads = nnx.grad(loss_fn)(m, X, Y)
    opt.update(m, grads)
  return m


def assert_members_match(ensemble, alone):
  for i, m in enumerate(alone):
    for name in ('l1', 'l2'):
      np.testing.assert_allclose(getattr(ensemble, name).kernel[i], getattr(m, name).kernel[...], rtol=2e-4, atol=1e-6)
      np.testing.assert_allclose(getattr(ensemble, name).bias[i], getattr(m, name).bias[...], rtol=2e-4, atol=1e-6)


def test_optimizer_per_member():
  ensemble = make_ensemble()
  alone = [train_alone(member(ensemble, i)) for i in range(MEMBERS)]
  optimizers = bnx.vmap(lambda m: nnx.Optimizer(m, optax.adam(1e-2), wrt=nnx.Param))(ensemble)

  @bnx.jit
  @bnx.vmap(in_axes=(0, 0, None, None))
  def train_step(model, opt, x, y):
    loss, grads = bnx.value_and_grad(loss_fn, argnums=0)(model, x, y)
    opt.update(model, grads)
    return loss

  for _ in range(STEPS):
    losses = train_step(ensemble, optimizers, X, Y)
  assert losses.shape == (MEMBERS,)
  assert_members_match(ensemble, alone)
  np.testing.assert_array_equal(optimizers.step[...], [STEPS] * MEMBERS)


def test_one_optimizer_over_the_stacked_model():
  ensemble = make_ensemble()
  alone = [train_alone(member(ensemble, i)) for i in range(MEMBERS)]
  optimizer = nnx.Optimizer(ensemble, optax.adam(1e-2), wrt=nnx.Param)  # adam is elementwise

  def total_loss(x, y):
    per_member = bnx.vmap(lambda x, y: loss_fn(ensemble, x, y), in_axes=None, state_in_axes={0: nnx.Param})
    return per_member(x, y).sum()

  @bnx.jit
  def train_step(x, y):
    grads = bnx.grad(total_loss, grad_states=ensemble)(x, y)
    optimizer.update(ensemble, grads)

  for _ in range(STEPS):
    train_step(X, Y)
  assert_members_match(ensemble, alone)
