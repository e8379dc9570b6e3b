"""The program brainnx compiles against the one a JAX expert writes for the same computation.

For each transform family, a representative program is lowered and compiled twice: through
brainnx (Variables found by tracing, written back) and as pure JAX on ``nnx.split`` state (the
transform's ``jax``/``jax.lax`` counterpart, donating what it overwrites where brainnx's call
donates). The table holds XLA's ``cost_analysis()`` (flops, bytes accessed) and the compiled
HLO's counts of fusions, while loops, conditionals, custom-calls, sends and copies; brainnx's must be at
most the pure program's (``tests/test_program_cost.py`` holds every program to it on CPU). Where
a difference is inherent, the program's note names it and the row compares against the expert's
program that does the same thing (a progress bar: its host callbacks).

Run: ``XLA_FLAGS=--xla_force_host_platform_device_count=4 python benchmarks/program_cost.py``
(pmap and shard_map use 4 devices); ``--quick`` writes to a temporary folder.
"""

from __future__ import annotations

import os
import sys

if 'jax' not in sys.modules and '--xla_force_host_platform_device_count' not in os.environ.get('XLA_FLAGS', ''):
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=4').strip()

import dataclasses
import re
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import io_callback
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(Path(__file__).parent))

import brainnx as bnx
from _models import MLP

# a host callback is a custom-call on CPU and GPU and sends to the host (one per operand) on a TPU
COUNTED = ('fusion', 'while', 'conditional', 'custom-call', 'send', 'copy')


@dataclasses.dataclass
class Program:
  name: str
  family: str
  build: Callable  # () -> (brainnx Compiled, pure Compiled)
  note: str = ''
  devices: int = 1


def cost(compiled) -> dict:
  """flops, bytes accessed and the counted HLO instructions of a compiled program (every
  computation of the module: loop bodies and branches included)."""
  analysis = compiled.cost_analysis()
  if isinstance(analysis, (list, tuple)):
    analysis = analysis[0]
  hlo = compiled.as_text()
  row = {'flops': float(analysis.get('flops', 0.0)), 'bytes': float(analysis.get('bytes accessed', 0.0))}
  for op in COUNTED:
    row[op] = len(re.findall(rf' {op}\(', hlo))
  return row


# -- models and their pure twins -------------------------------------------------


def ensemble(members: int = 8, sizes=(16, 64, 4), lr: float = 1e-3):
  """``members`` stacked MLPs and one adam optimizer each (one ``bnx.vmap`` over each constructor)."""
  rngs = nnx.Rngs(0)
  models = bnx.vmap(lambda: MLP(*sizes, rngs=rngs), axis_size=members)()
  opts = bnx.vmap(lambda m: nnx.Optimizer(m, optax.adam(lr), wrt=nnx.Param))(models)
  return models, opts


def mse(model, x, y):
  return jnp.mean((model(x) - y) ** 2)


def pure_adam_step(graphdef, tx):
  """One member's step on pure state, as an expert writes it over ``nnx.split``."""

  def step(params, opt_state, count, x, y):
    def loss(p):
      return mse(nnx.merge(graphdef, p), x, y)

    value, grads = jax.value_and_grad(loss)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, count + 1, value

  return step


def pure_values(tree):
  """``tree`` with every Variable replaced by its array (``nnx.as_pure``, which flax 0.12.4 lacks)."""
  is_variable = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
  return jax.tree.map(lambda v: v.get_value() if is_variable(v) else v, tree, is_leaf=is_variable)


def split_ensemble(models, opts):
  graphdef, params = nnx.split(models)
  return graphdef, pure_values(params), pure_values(opts.opt_state), opts.step[...]


# -- the programs ------------------------------------------------------------------


def expert_demo_loop(graphdef, tx, panels, eps: float, steps: int, progress: bool = False):
  """The demo's loop as an expert writes it: ``jax.jit(lax.scan)`` of ``jax.vmap`` of one network's
  adam step on its ``nnx.split`` state, donated; with ``progress``, the bar's chunks and host calls.
  Called as ``loop(params, opt_state, count, x, y, nll, adversarial) -> ((params, opt_state,
  count), losses)``."""
  from brainnx.examples.ensemble import gaussian_nll, squared_error

  def network_loss(p, x, y, nll):
    out = nnx.merge(graphdef, p)(x)
    return jnp.where(nll, gaussian_nll(out, y), squared_error(out, y))

  def member(p, o, c, nll, adv, x, y):
    def loss(p):
      dx = jax.grad(network_loss, argnums=1)(p, x, y, nll)
      return network_loss(p, x, y, nll) + jnp.where(adv, network_loss(p, x + eps * jnp.sign(dx), y, nll), 0.0)

    value, grads = jax.value_and_grad(loss)(p)
    updates, o = tx.update(grads, o, p)
    return optax.apply_updates(p, updates), o, c + 1, value

  networks = sum(p.size for p in panels)
  mse_mean, nll_mean = (np.zeros(networks, np.float32) for _ in range(2))
  mse_mean[panels[0].rows], nll_mean[panels[-1].rows] = 1 / panels[0].size, 1 / panels[-1].size

  def loop(p, o, c, x, y, nll, adv):
    def one(carry, _):
      p, o, c = carry
      p, o, c, value = jax.vmap(member, in_axes=(0, 0, 0, 0, 0, None, None))(p, o, c, nll, adv, x, y)
      return (p, o, c), value

    if not progress:
      return jax.lax.scan(one, (p, o, c), None, length=steps)
    # the expert's bar: chunks of steps // 20 steps, one host call after each with the means
    freq = steps // 20
    start = io_callback(lambda: np.int32(1), jax.ShapeDtypeStruct((), jnp.int32), ordered=False)

    def chunk(carry, _):
      carry, k = carry
      carry, values = jax.lax.scan(one, carry, None, length=freq)
      last = values[-1]
      jax.debug.callback(lambda *a: None, start, k, (last * mse_mean).sum(), (last * nll_mean).sum())
      return (carry, k + 1), values

    (carry, _), values = jax.lax.scan(chunk, ((p, o, c), jnp.int32(0)), None, length=steps // freq)
    return carry, values.reshape(steps, -1)

  return jax.jit(loop, donate_argnums=(0, 1, 2))


def demo_loop(progress: bool):
  def build():
    from brainnx import demo
    from brainnx.examples.ensemble import figure_panels, make_data, roles

    steps = 40
    x, y, _ = make_data(0)
    panels = figure_panels(2)
    eps = demo.adversarial_epsilon(x)
    models, opts = demo.build(6, 0, hidden=32)
    ours = demo.make_trainer(models, opts, panels, eps, progress=progress).lower(steps, x, y).compile()
    graphdef, params, opt_state, count = split_ensemble(models, opts)
    loop = expert_demo_loop(graphdef, opts.tx, panels, eps, steps, progress)
    nll, adv = (jnp.asarray(r) for r in roles(panels))
    return ours, loop.lower(params, opt_state, count, x, y, nll, adv).compile()

  return build


def ensemble_step():
  models, opts = ensemble()
  x, y = jnp.ones((32, 16)), jnp.zeros((32, 4))

  @bnx.jit(donate_states=True)
  @bnx.vmap(in_axes=(0, 0, None, None))
  def step(model, opt, x, y):
    value, grads = bnx.value_and_grad(mse)(model, x, y)
    opt.update(model, grads)
    return value

  graphdef, params, opt_state, count = split_ensemble(models, opts)
  member = pure_adam_step(nnx.graphdef(MLP(16, 64, 4, rngs=nnx.Rngs(0))), opts.tx)
  pure = jax.jit(jax.vmap(member, in_axes=(0, 0, 0, None, None)), donate_argnums=(0, 1, 2))
  return step.lower(models, opts, x, y).compile(), pure.lower(params, opt_state, count, x, y).compile()


def scan_layers():
  class Block(nnx.Module):
    def __init__(self, rngs):
      self.linear = nnx.Linear(32, 32, rngs=rngs)

    def __call__(self, h):
      return jax.nn.gelu(self.linear(h)) + h

  rngs = nnx.Rngs(0)
  stack = bnx.vmap(lambda: Block(rngs), axis_size=6)()
  x = jnp.ones((8, 32))
  ours = bnx.jit(lambda x: bnx.scan(lambda h, layer: (layer(h), None), x, stack)[0])
  graphdef, state = nnx.split(stack)
  one = nnx.graphdef(Block(nnx.Rngs(0)))

  def pure(state, x):
    return jax.lax.scan(lambda h, s: (nnx.merge(one, s)(h), None), x, state)[0]

  return ours.lower(x).compile(), jax.jit(pure).lower(pure_values(state), x).compile()


def grad_of_vmapped_loss():
  model = MLP(16, 64, 4, rngs=nnx.Rngs(0))
  x, y = jnp.ones((8, 32, 16)), jnp.zeros((8, 32, 4))

  @bnx.jit
  def ours(x, y):
    return bnx.grad(lambda: bnx.vmap(lambda x, y: mse(model, x, y))(x, y).mean(), grad_states=model)()

  graphdef, params = nnx.split(model)

  def pure(params, x, y):
    return jax.grad(lambda p: jax.vmap(lambda x, y: mse(nnx.merge(graphdef, p), x, y))(x, y).mean())(params)

  return ours.lower(x, y).compile(), jax.jit(pure).lower(pure_values(params), x, y).compile()


def cond_and_while_in_scan():
  total = nnx.BatchStat(jnp.zeros(4))
  xs = jnp.linspace(-1.0, 1.0, 24).reshape(6, 4)

  def body(c, x):
    bnx.cond(x.sum() > 0, lambda: total.set_value(total[...] + x), lambda: total.set_value(total[...] - x))
    n = bnx.while_loop(lambda n: n < 3, lambda n: (total.set_value(total[...] * 0.5), n + 1)[1], 0)
    return c + n, total[...].sum()

  ours = bnx.jit(lambda xs: bnx.scan(body, 0, xs))

  def pure(t, xs):
    def step(carry, x):
      c, t = carry
      t = jax.lax.cond(x.sum() > 0, lambda t: t + x, lambda t: t - x, t)
      n, t = jax.lax.while_loop(lambda s: s[0] < 3, lambda s: (s[0] + 1, s[1] * 0.5), (0, t))
      return (c + n, t), t.sum()

    (c, t), ys = jax.lax.scan(step, (0, t), xs)
    return t, (c, ys)

  return ours.lower(xs).compile(), jax.jit(pure).lower(total[...], xs).compile()


def remat_grad():
  model = MLP(32, 128, 32, rngs=nnx.Rngs(0))
  x = jnp.ones((16, 32))
  deep = bnx.remat(lambda x: model(jnp.tanh(model(x))))
  ours = bnx.jit(lambda x: bnx.grad(lambda: jnp.sum(deep(x) ** 2), grad_states=model)())
  graphdef, params = nnx.split(model)

  def pure(params, x):
    f = jax.checkpoint(lambda p, x: nnx.merge(graphdef, p)(jnp.tanh(nnx.merge(graphdef, p)(x))))
    return jax.grad(lambda p: jnp.sum(f(p, x) ** 2))(params)

  return ours.lower(x).compile(), jax.jit(pure).lower(pure_values(params), x).compile()


def batched_map():
  model = MLP(16, 32, 4, rngs=nnx.Rngs(0))
  xs = jnp.ones((12, 5, 16))
  ours = bnx.jit(lambda xs: bnx.map(lambda x: model(x), xs, batch_size=4))
  graphdef, params = nnx.split(model)

  def pure(params, xs):
    return jax.lax.map(lambda x: nnx.merge(graphdef, params)(x), xs, batch_size=4)

  return ours.lower(xs).compile(), jax.jit(pure).lower(pure_values(params), xs).compile()


def stateful_shard_map():
  mesh = jax.make_mesh((4,), ('x',), devices=jax.devices()[:4])
  model = MLP(16, 32, 4, rngs=nnx.Rngs(0))
  seen = nnx.BatchStat(jnp.zeros(()))
  x = jax.device_put(jnp.ones((16, 16)), jax.NamedSharding(mesh, P('x')))

  def shard(x):
    out = model(x)
    seen[...] = seen[...] + jax.lax.psum(out.sum(), 'x')
    return out

  ours = bnx.jit(bnx.shard_map(shard, mesh=mesh, in_specs=P('x'), out_specs=P('x')))
  graphdef, params = nnx.split(model)

  def pure(params, seen, x):
    def f(params, seen, x):
      out = nnx.merge(graphdef, params)(x)
      return out, seen + jax.lax.psum(out.sum(), 'x')

    out, seen = jax.shard_map(f, mesh=mesh, in_specs=(P(), P(), P('x')), out_specs=(P('x'), P()))(params, seen, x)
    return seen, out

  return ours.lower(x).compile(), jax.jit(pure).lower(pure_values(params), seen[...], x).compile()


def pmapped_forward():
  model = MLP(16, 32, 4, rngs=nnx.Rngs(0))
  x = jnp.ones((4, 8, 16))
  ours = bnx.jit(lambda x: bnx.pmap(lambda x: model(x), axis_name='d')(x))
  graphdef, params = nnx.split(model)

  def pure(params, x):
    return jax.pmap(lambda p, x: nnx.merge(graphdef, p)(x), axis_name='d', in_axes=(None, 0))(params, x)

  return ours.lower(x).compile(), jax.jit(pure).lower(pure_values(params), x).compile()


PROGRAMS = [
  Program('the demo\'s training loop (40 steps, 6 networks)', 'jit · for_loop · vmap · value_and_grad', demo_loop(False)),
  Program('the demo\'s loop with its progress bar', 'for_loop + ProgressBar', demo_loop(True),
          note='the bar: an outer loop over chunks of steps, one host call per chunk and one to open it '
               '(the expert\'s program does the same)'),
  Program('ensemble adam step (8 x 16-64-4)', 'jit(vmap) · donate_states', ensemble_step),
  Program('scan over 6 stacked layers', 'scan over a stacked model', scan_layers),
  Program('grad of a vmapped loss', 'grad · vmap', grad_of_vmapped_loss),
  Program('cond and while_loop inside scan', 'scan · cond · while_loop', cond_and_while_in_scan),
  Program('grad through remat', 'remat · grad', remat_grad),
  Program('map with batch_size', 'map', batched_map),
  Program('shard_map with a psum into a Variable', 'shard_map', stateful_shard_map, devices=4),
  Program('pmap forward', 'pmap', pmapped_forward, devices=4),
]


def compare(program: Program) -> tuple[dict, dict]:
  ours, pure = program.build()
  return cost(ours), cost(pure)


def excess(ours: dict, pure: dict) -> list[str]:
  """The measures in which brainnx's program exceeds the pure one."""
  return [k for k in ours if ours[k] > pure[k]]


def table(rows) -> str:
  head = '| program | transforms | ' + ' | '.join(f'{k} (brainnx / pure)' for k in ('flops', 'bytes', *COUNTED)) + ' |'
  lines = [head, '|' + '---|' * (2 + 2 + len(COUNTED))]
  for program, ours, pure in rows:
    cells = [f'{ours[k]:.0f} / {pure[k]:.0f}' for k in ('flops', 'bytes', *COUNTED)]
    lines.append(f'| {program.name} | {program.family} | ' + ' | '.join(cells) + ' |')
  notes = [f'- {p.name}: {p.note}' for p, _, _ in rows if p.note]
  return '\n'.join(lines) + ('\n\n' + '\n'.join(notes) if notes else '')


def main(argv=None) -> int:
  import argparse
  import tempfile

  sys.path.insert(0, str(Path(__file__).parent))
  import _results

  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--quick', action='store_true', help='write the table to a temporary folder')
  args = parser.parse_args(argv)
  rows = []
  for program in PROGRAMS:
    if len(jax.devices()) < program.devices:
      print(f'skipped (needs {program.devices} devices): {program.name}')
      continue
    rows.append((program, *compare(program)))
  body = ('brainnx\'s compiled program against the pure-JAX program an expert writes for the same '
          'computation (XLA cost analysis; HLO instruction counts over every computation).\n\n' + table(rows))
  out = Path(tempfile.mkdtemp()) if args.quick else None
  print(body)
  print('wrote', _results.write('program_cost.md', 'program_cost.py', body, statistic='counts (deterministic)', out=out))
  worse = [(p.name, excess(o, q)) for p, o, q in rows if excess(o, q)]
  for name, keys in worse:
    print(f'brainnx exceeds the pure program: {name}: {keys}')
  return 1 if worse else 0


if __name__ == '__main__':
  raise SystemExit(main())
