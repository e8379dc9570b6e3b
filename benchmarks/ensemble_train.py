"""One adam training step of an 8-member MLP ensemble: brainnx vs raw jax, nnx, equinox and brainstate.

Run: ``python benchmarks/ensemble_train.py`` (prints markdown tables).

The step of the main job (``brainnx.demo``): its network's body, 1 -> H (relu) -> 2 (the
shared ``_models.MLP``; the demo's variance head is left out so every peer runs the same
arithmetic), 8 members, its training points shared by all, optax.adam(1e-3),
one optimizer per member. Two sizes: the demo's (H=64, 128 points) and a
small one (H=16, 32 points) where per-call overhead, not arithmetic, sets the
step time. Variants, interleaved:
  raw jax.jit(jax.vmap(pure_step))   params and adam state as stacked pytrees
  brainnx jit(vmap(train_step))      bnx.value_and_grad + nnx.Optimizer.update
  nnx.jit(nnx.vmap(train_step))      nnx.value_and_grad + nnx.Optimizer.update
  eqx.filter_jit(eqx.filter_vmap)    eqx.filter_value_and_grad + optax, model and state returned (bench extra)
  brainstate jit(vmap2)              brainstate.transform.grad + optax, states written back (bench extra)
The first call (trace + compile) is timed on fresh models.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
from flax import nnx

sys.path.insert(0, str(Path(__file__).parent))
import _peers  # noqa: E402
from _models import MLP  # noqa: E402
from _timing import first_calls, interleaved, table  # noqa: E402

import brainnx as bnx  # noqa: E402
from brainnx.examples.ensemble import make_data  # noqa: E402

MEMBERS = 8
TX = optax.adam(1e-3)
SIZES = {'demo': (64, 128), 'small': (16, 32)}  # hidden width, training points


def data(points):
  x, y, _ = make_data(0, points)
  return x, y


def make_members(hidden, members=MEMBERS, seed=0):
  rngs = nnx.Rngs(seed)
  ens = bnx.vmap(lambda: MLP(1, hidden, 2, rngs=rngs), axis_size=members)()
  opt = bnx.vmap(lambda m: nnx.Optimizer(m, TX, wrt=nnx.Param))(ens)
  return ens, opt


def loss_fn(model, x, y):
  return ((model(x) - y) ** 2).mean()


LAYERS = ('l1', 'l2')


def pure_forward(p, x):
  h = jax.nn.relu(x @ p['l1']['kernel'] + p['l1']['bias'])
  return h @ p['l2']['kernel'] + p['l2']['bias']


def pure_step(params, opt_state, x, y):
  loss, grads = jax.value_and_grad(lambda p: ((pure_forward(p, x) - y) ** 2).mean())(params)
  updates, opt_state = TX.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


def member_arrays(hidden, members=MEMBERS, seed=0):
  """The stacked ``(kernel, bias)`` arrays of the members every variant starts from."""
  ens, _ = make_members(hidden, members, seed)
  return [(getattr(ens, n).kernel[...], getattr(ens, n).bias[...]) for n in LAYERS]


def raw_setup(hidden, members=MEMBERS, seed=0):
  pairs = member_arrays(hidden, members, seed)
  params = {n: {'kernel': k, 'bias': b} for n, (k, b) in zip(LAYERS, pairs)}
  opt_state = jax.vmap(TX.init)(params)
  return params, opt_state


def brainnx_step():
  @bnx.jit
  @bnx.vmap(in_axes=(0, 0, None, None))
  def step(model, opt, x, y):
    loss, grads = bnx.value_and_grad(loss_fn, argnums=0)(model, x, y)
    opt.update(model, grads)
    return loss

  return step


def nnx_step():
  @nnx.jit
  @nnx.vmap(in_axes=(0, 0, None, None))
  def step(model, opt, x, y):
    loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
    opt.update(model, grads)
    return loss

  return step


class RawTrainer:
  """raw ``jax.jit(jax.vmap(pure_step))``, its params and adam state carried from step to step."""

  def __init__(self, hidden, members=MEMBERS, seed=0):
    self.params, self.opt_state = raw_setup(hidden, members, seed)
    self.step = jax.jit(jax.vmap(lambda *a: pure_step(*a), in_axes=(0, 0, None, None)))

  def __call__(self, x, y):
    self.params, self.opt_state, loss = self.step(self.params, self.opt_state, x, y)
    return loss


RAW = 'raw jax.jit(jax.vmap)'
BNX = 'brainnx jit(vmap)'
NNX = 'nnx.jit(nnx.vmap)'
EQX = 'eqx.filter_jit(eqx.filter_vmap)'
BST = 'brainstate jit(vmap2)'


def trainers(hidden, members=MEMBERS, seed=0):
  """Makers of one-argument-free step calls, a fresh model (and fresh function) per maker call."""

  def raw():
    return RawTrainer(hidden, members, seed)

  def brainnx():
    ens, opt = make_members(hidden, members, seed)
    f = brainnx_step()
    return lambda x, y: f(ens, opt, x, y)

  def flax_nnx():
    ens, opt = make_members(hidden, members, seed)
    f = nnx_step()
    return lambda x, y: f(ens, opt, x, y)

  def equinox():
    return _peers.EqxTrainer(TX, member_arrays(hidden, members, seed), jax.nn.relu)

  def brainstate():
    return _peers.bst_ensemble_step(TX, _peers.bst_model(member_arrays(hidden, members, seed), jax.nn.relu), members)

  found = {RAW: raw, BNX: brainnx, NNX: flax_nnx}
  if _peers.HAVE_EQX:
    found[EQX] = equinox
  if _peers.HAVE_BST:
    found[BST] = brainstate
  return found


def variants(hidden, points, members=MEMBERS):
  """Warm step calls; all start from the same members and must agree step by step."""
  x, y = data(points)
  steps = {name: make() for name, make in trainers(hidden, members).items()}
  for _ in range(3):
    losses = {name: step(x, y) for name, step in steps.items()}
    for name, loss in losses.items():
      assert jnp.allclose(loss, losses[RAW], rtol=1e-4, atol=1e-6), (name, loss, losses[RAW])
  return {name: (lambda step=step: step(x, y)) for name, step in steps.items()}


def first_call_makers(hidden, points, members=MEMBERS):
  x, y = data(points)

  def first(make):
    def maker():
      step = make()
      return lambda: step(x, y)

    return maker

  return {name: first(make) for name, make in trainers(hidden, members).items()}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--rounds', type=int, default=30)
  parser.add_argument('--calls', type=int, default=100)
  parser.add_argument('--sizes', nargs='+', choices=sorted(SIZES), default=['demo', 'small'])
  args = parser.parse_args(argv)
  print(f'jax {jax.__version__}, {_peers.versions()} on {jax.devices()[0].platform}')
  print(_peers.notes() + '\n')
  for size in args.sizes:
    hidden, points = SIZES[size]
    label = f'{MEMBERS}-member adam step, {size} size (H={hidden}, {points} points)'
    steps = interleaved(variants(hidden, points), rounds=args.rounds, calls=args.calls)
    print(table(f'{label}: per-step median', steps, 'us', RAW))
    print(f'\nnnx path / brainnx: {steps[NNX] / steps[BNX]:.1f}x\n')
    first = first_calls(first_call_makers(hidden, points))
    print(table(f'{label}: first call (trace + compile)', first, 'ms', RAW))
    print()


if __name__ == '__main__':
  main()
