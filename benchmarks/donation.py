"""Donated training steps: XLA's buffer aliasing of brainnx ``jit(donate_states=...)`` vs the pure step.

Run: ``python benchmarks/donation.py`` (about a minute on 2 CPU cores; ``--width`` to change the model).

Model: an MLP of two ``Linear(width, width)`` layers (default width 2048: 32 MB of float32
parameters), trained with ``optax.adam`` through ``nnx.Optimizer`` (64 MB of moments). Variants,
compiled side by side in one process from the same arrays:

  pure jax.jit                    ``jax.jit(step)`` on ``(params, opt_state)`` pytrees
  pure jax.jit, donate_argnums=0  the same, the state donated
  brainnx jit                     ``bnx.jit(step)`` with the model and optimizer as closures
  brainnx jit, donate_states=True every Variable the step writes donated

For each: ``compiled.memory_analysis()`` (bytes XLA aliases between inputs and outputs, and its
temporary, argument and output sizes), and the warm step time. Values are checked equal first.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, str(Path(__file__).parent))
import brainnx as bnx  # noqa: E402
from _results import write  # noqa: E402
from _models import MLP  # noqa: E402
from _timing import interleaved  # noqa: E402


def _loss(model, x):
  return (model(x) ** 2).mean()


def brainnx_step(width, donate):
  model = MLP(width, width, width, rngs=nnx.Rngs(0), act=jnp.tanh)
  opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

  def step(x):
    loss, grads = bnx.value_and_grad(lambda: _loss(model, x), grad_states=model)()
    opt.update(model, grads)
    return loss

  return bnx.jit(step, donate_states=True if donate else None), model


def pure_step(width, donate):
  model = MLP(width, width, width, rngs=nnx.Rngs(0), act=jnp.tanh)
  graphdef, params = nnx.split(model, nnx.Param)
  tx = optax.adam(1e-3)
  state = {'params': params, 'opt': tx.init(params)}

  def step(state, x):
    def loss_fn(p):
      return _loss(nnx.merge(graphdef, p), x)

    loss, grads = jax.value_and_grad(loss_fn)(state['params'])
    updates, opt = tx.update(grads, state['opt'], state['params'])
    return {'params': optax.apply_updates(state['params'], updates), 'opt': opt}, loss

  return jax.jit(step, donate_argnums=0 if donate else ()), state


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--width', type=int, default=2048)
  parser.add_argument('--rounds', type=int, default=10)
  parser.add_argument('--no-write', dest='write', action='store_false', help='print only')
  args = parser.parse_args(argv)
  x = jax.random.normal(jax.random.key(1), (64, args.width))
  rows, calls, results = {}, {}, {}
  for donate in (False, True):
    fn, state = pure_step(args.width, donate)
    name = 'pure jax.jit' + (', donate_argnums=0' if donate else '')
    rows[name] = fn.lower(state, x).compile().memory_analysis()
    box = [state]

    def run_pure(fn=fn, box=box):
      box[0], loss = fn(box[0], x)
      return loss

    calls[name] = run_pure
    run_pure()
    results[name] = jax.tree.map(np.asarray, box[0]['params'])

    fn, model = brainnx_step(args.width, donate)
    name = 'brainnx jit' + (', donate_states=True' if donate else '')
    rows[name] = fn.lower(x).compile().memory_analysis()
    calls[name] = lambda fn=fn: fn(x)
    fn(x)
    results[name] = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
  reference = jax.tree.leaves(results['pure jax.jit'])
  for name, params in results.items():
    for a, b in zip(reference, jax.tree.leaves(params)):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=name)
  times = interleaved(calls, rounds=args.rounds, calls=3)  # per-call µs, median over rounds

  mb = 1 / 2 ** 20
  lines = [f'## Donated training step: MLP 2 x Linear({args.width}, {args.width}), adam, batch 64', '',
           'Sizes from `compile().memory_analysis()` (exact); step time per call.', '',
           '| variant | aliased (MB) | temp (MB) | arguments (MB) | outputs (MB) | step (ms) |',
           '|---|---:|---:|---:|---:|---:|']
  for name, m in rows.items():
    lines.append(f'| {name} | {m.alias_size_in_bytes * mb:.1f} | {m.temp_size_in_bytes * mb:.1f} | '
                 f'{m.argument_size_in_bytes * mb:.1f} | {m.output_size_in_bytes * mb:.1f} | {times[name] / 1e3:.1f} |')
  text = '\n'.join(lines)
  print(text)
  if args.write:
    print('wrote', write('donation.md', 'donation.py', text))


if __name__ == '__main__':
  main()
