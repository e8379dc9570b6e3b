"""One adam training step of an 8-member MLP ensemble: brainnx vs raw jax vs nnx.

Run: ``python benchmarks/ensemble_train.py`` (prints markdown tables).

The step of the main job (``brainnx.demo``): its MLP 1 -> H -> H -> 1
(tanh), 8 members, its training points shared by all, optax.adam(1e-3),
one optimizer per member. Two sizes: the demo's (H=64, 128 points) and a
small one (H=16, 32 points) where per-call overhead, not arithmetic, sets the
step time. Variants, interleaved:
  raw jax.jit(jax.vmap(pure_step))   params and adam state as stacked pytrees
  brainnx jit(vmap(train_step))      bnx.value_and_grad + nnx.Optimizer.update
  nnx.jit(nnx.vmap(train_step))      nnx.value_and_grad + nnx.Optimizer.update
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
import brainnx as bnx  # noqa: E402
from _timing import first_calls, interleaved, table  # noqa: E402
from brainnx.demo import MLP, make_data  # noqa: E402

MEMBERS = 8
TX = optax.adam(1e-3)
SIZES = {'demo': (64, 128), 'small': (16, 32)}  # hidden width, training points
HIDDEN, POINTS = SIZES['demo']


def data():
  x, y, _ = make_data(0, POINTS)
  return x, y


def make_members(seed=0):
  rngs = nnx.Rngs(seed)
  ens = bnx.vmap(lambda: MLP(HIDDEN, rngs=rngs), axis_size=MEMBERS)()
  opt = bnx.vmap(lambda m: nnx.Optimizer(m, TX, wrt=nnx.Param))(ens)
  return ens, opt


def loss_fn(model, x, y):
  return ((model(x) - y) ** 2).mean()


def pure_forward(p, x):
  h = jnp.tanh(x @ p['l1']['kernel'] + p['l1']['bias'])
  h = jnp.tanh(h @ p['l2']['kernel'] + p['l2']['bias'])
  return h @ p['l3']['kernel'] + p['l3']['bias']


def pure_step(params, opt_state, x, y):
  loss, grads = jax.value_and_grad(lambda p: ((pure_forward(p, x) - y) ** 2).mean())(params)
  updates, opt_state = TX.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


def raw_setup(seed=0):
  ens, _ = make_members(seed)
  params = {n: {'kernel': getattr(ens, n).kernel[...], 'bias': getattr(ens, n).bias[...]} for n in ('l1', 'l2', 'l3')}
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


def variants():
  x, y = data()
  raw = jax.jit(jax.vmap(pure_step, in_axes=(0, 0, None, None)))
  state = {'raw': raw_setup()}
  ens, opt = make_members()
  nnx_ens, nnx_opt = make_members()
  b_step, n_step = brainnx_step(), nnx_step()

  def run_raw():
    params, opt_state = state['raw']
    params, opt_state, loss = raw(params, opt_state, x, y)
    state['raw'] = (params, opt_state)
    return loss

  # all three start from the same members and must agree step by step
  for _ in range(3):
    a, b, c = run_raw(), b_step(ens, opt, x, y), n_step(nnx_ens, nnx_opt, x, y)
    assert jnp.allclose(a, b, rtol=1e-5) and jnp.allclose(a, c, rtol=1e-5), (a, b, c)
  return {
    'raw jax.jit(jax.vmap)': run_raw,
    'brainnx jit(vmap)': lambda: b_step(ens, opt, x, y),
    'nnx.jit(nnx.vmap)': lambda: n_step(nnx_ens, nnx_opt, x, y),
  }


def first_call_makers():
  x, y = data()

  def raw():
    params, opt_state = raw_setup()
    f = jax.jit(jax.vmap(lambda *a: pure_step(*a), in_axes=(0, 0, None, None)))
    return lambda: f(params, opt_state, x, y)

  def brainnx():
    ens, opt = make_members()
    f = brainnx_step()
    return lambda: f(ens, opt, x, y)

  def flax_nnx():
    ens, opt = make_members()
    f = nnx_step()
    return lambda: f(ens, opt, x, y)

  return {'raw jax.jit(jax.vmap)': raw, 'brainnx jit(vmap)': brainnx, 'nnx.jit(nnx.vmap)': flax_nnx}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--rounds', type=int, default=30)
  parser.add_argument('--calls', type=int, default=100)
  parser.add_argument('--sizes', nargs='+', choices=sorted(SIZES), default=['demo', 'small'])
  args = parser.parse_args(argv)
  print(f'jax {jax.__version__} on {jax.devices()[0].platform}\n')
  global HIDDEN, POINTS
  for size in args.sizes:
    HIDDEN, POINTS = SIZES[size]
    label = f'{MEMBERS}-member adam step, {size} size (H={HIDDEN}, {POINTS} points)'
    steps = interleaved(variants(), rounds=args.rounds, calls=args.calls)
    print(table(f'{label}: per-step median', steps, 'us', 'raw jax.jit(jax.vmap)'))
    print(f"\nnnx path / brainnx: {steps['nnx.jit(nnx.vmap)'] / steps['brainnx jit(vmap)']:.1f}x\n")
    first = first_calls(first_call_makers())
    print(table(f'{label}: first call (trace + compile)', first, 'ms', 'raw jax.jit(jax.vmap)'))
    print()


if __name__ == '__main__':
  main()
