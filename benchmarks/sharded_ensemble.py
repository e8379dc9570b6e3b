"""A 64-member ensemble adam step sharded over 1 and 4 devices: brainnx vs raw jax.jit vs nnx.jit.

Run: ``python benchmarks/sharded_ensemble.py`` (prints a markdown table and
writes it to ``benchmarks/results/sharded_ensemble.md``; ``--quick`` for a
smoke run). On CPU the script makes 4 host devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=4``, set before jax is
imported unless ``XLA_FLAGS`` is already set); on an accelerator it uses the
devices it finds and skips the device counts it does not have.

The step: the demo network's body 1 -> 64 (relu) -> 2 (the shared ``_models.MLP``), its
128 training points (``make_data``) shared by all members, optax.adam(1e-3),
one optimizer per member, the members stacked on axis 0 and laid out over a
1-D mesh ``'ens'`` of the first N devices (``P('ens')``: 64 / N members per
device). Variants, built from the same initial arrays:

  raw jax.jit       ``jax.jit(jax.vmap(pure_step, spmd_axis_name='ens'))`` on
                    stacked params / adam-state pytrees, a hand-written pure MLP,
                    ``in_shardings``/``out_shardings`` ``NamedSharding(mesh, P('ens'))``
                    for the state, the data replicated, ``donate_argnums`` for
                    the state: what a demanding user writes by hand
  brainnx           ``bnx.jit(bnx.vmap(step, in_axes=(0, 0, None, None), spmd_axis_name='ens'),
                    state_shardings={P('ens'): ...})`` under ``jax.set_mesh(mesh)``,
                    ``nnx.Optimizer`` per member (``bnx.vmap`` over its constructor)
  brainnx+donate    the same with ``donate_states=True`` (the state's buffers donated, as raw does)
  nnx.jit           ``nnx.jit(nnx.vmap(step, in_axes=(0, 0, None, None), spmd_axis_name='ens'))``,
                    the model and optimizer state put on ``P('ens')`` with
                    ``jax.device_put`` beforehand

Every variant first takes a few steps from the same start; the script checks
that all end with the same parameters (at every device count), that each
variable stays laid out over the mesh with 64 / N members per device, and
only then times. Warm per-step time: the minimum over interleaved rounds
(``_timing.best_of``: each round ~``--round-ms`` of back-to-back calls of one
variant, the variants of one device count taking turns), over ``--passes``
passes that alternate between the device counts; the minimum is what a busy,
shared machine disturbs least. Also the per-pass ratio to raw (each pass's
minimum over raw's of the same pass; median and range over the passes), the
steadier figure when the load changes from pass to pass, and the host time
until one call returns (the framework's share, where dispatch is asynchronous).
"""

from __future__ import annotations

import os

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=4')

import argparse
import datetime
import platform
import statistics
import sys
import time
from pathlib import Path

import flax
import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(Path(__file__).parent))
from _models import MLP  # noqa: E402
from _timing import best_of, block

import brainnx as bnx
from brainnx.examples.ensemble import make_data

MEMBERS, HIDDEN, POINTS = 64, 64, 128
DEVICE_COUNTS = (1, 4)
TX = optax.adam(1e-3)
CHECK_STEPS = 3
from _results import RESULTS  # noqa: E402

RAW = 'raw jax.jit(jax.vmap)'
BNX = 'brainnx jit(vmap) + state_shardings'
BNX_DONATE = 'brainnx, + donate_states=True'
NNX = 'nnx.jit(nnx.vmap) + device_put'
LAYERS = ('l1', 'l2')


# -- models and steps -----------------------------------------------------------------


def build(seed=0):
  """The stacked ensemble (``bnx.vmap`` over the constructor) and one adam ``nnx.Optimizer`` per member."""
  rngs = nnx.Rngs(seed)
  ensemble = bnx.vmap(lambda: MLP(1, HIDDEN, 2, rngs=rngs), axis_size=MEMBERS)()
  optimizers = bnx.vmap(lambda m: nnx.Optimizer(m, TX, wrt=nnx.Param))(ensemble)
  return ensemble, optimizers


def loss_fn(model, x, y):
  return ((model(x) - y) ** 2).mean()


def pure_forward(p, x):
  h = jax.nn.relu(x @ p['l1']['kernel'] + p['l1']['bias'])
  return h @ p['l2']['kernel'] + p['l2']['bias']


def pure_step(params, opt_state, x, y):
  loss, grads = jax.value_and_grad(lambda p: ((pure_forward(p, x) - y) ** 2).mean())(params)
  updates, opt_state = TX.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


class Raw:
  """The hand-written pure step on stacked pytrees, sharded and donated."""

  def __init__(self, mesh, seed=0):
    ensemble, _ = build(seed)
    members = NamedSharding(mesh, P('ens'))
    params = {n: {'kernel': getattr(ensemble, n).kernel[...], 'bias': getattr(ensemble, n).bias[...]} for n in LAYERS}
    self.params = jax.device_put(params, members)
    self.opt_state = jax.device_put(jax.vmap(TX.init)(params), members)
    replicated = NamedSharding(mesh, P())
    self.step = jax.jit(
      jax.vmap(pure_step, in_axes=(0, 0, None, None), spmd_axis_name='ens'),
      in_shardings=(members, members, replicated, replicated),
      out_shardings=(members, members, members),
      donate_argnums=(0, 1),
    )

  def __call__(self, x, y):
    self.params, self.opt_state, loss = self.step(self.params, self.opt_state, x, y)
    return loss

  def arrays(self):
    return self.params, self.opt_state

  def kernels(self):
    return {n: np.asarray(self.params[n]['kernel']) for n in LAYERS} | {
      n + '.bias': np.asarray(self.params[n]['bias']) for n in LAYERS}


class Stateful:
  """A step on an ensemble and its optimizers held as nnx objects (brainnx or nnx)."""

  def __init__(self, step, ensemble, optimizers):
    self.step, self.ensemble, self.optimizers = step, ensemble, optimizers

  def __call__(self, x, y):
    return self.step(self.ensemble, self.optimizers, x, y)

  def arrays(self):
    return nnx.state(self.ensemble), nnx.state(self.optimizers)

  def kernels(self):
    return {n: np.asarray(getattr(self.ensemble, n).kernel[...]) for n in LAYERS} | {
      n + '.bias': np.asarray(getattr(self.ensemble, n).bias[...]) for n in LAYERS}


def brainnx_trainer(mesh, seed=0, donate=False):
  del mesh  # the mesh comes from jax.set_mesh, which the caller holds around every call
  ensemble, optimizers = build(seed)

  @bnx.vmap(in_axes=(0, 0, None, None), spmd_axis_name='ens')
  def step(model, opt, x, y):
    loss, grads = bnx.value_and_grad(loss_fn, argnums=0)(model, x, y)
    opt.update(model, grads)
    return loss

  jitted = bnx.jit(step, state_shardings={P('ens'): ...}, donate_states=True if donate else None)
  return Stateful(jitted, ensemble, optimizers)


def nnx_trainer(mesh, seed=0):
  ensemble, optimizers = build(seed)
  members = NamedSharding(mesh, P('ens'))
  for node in (ensemble, optimizers):
    nnx.update(node, jax.device_put(nnx.state(node), members))

  @nnx.jit
  @nnx.vmap(in_axes=(0, 0, None, None), spmd_axis_name='ens')
  def step(model, opt, x, y):
    loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
    opt.update(model, grads)
    return loss

  return Stateful(step, ensemble, optimizers)


MAKERS = {
  RAW: Raw,
  BNX: brainnx_trainer,
  BNX_DONATE: lambda mesh: brainnx_trainer(mesh, donate=True),
  NNX: nnx_trainer,
}


# -- checks ---------------------------------------------------------------------------


def check_layout(name, trainer, loss, mesh):
  """Every array of the state (and the loss) is split over the mesh, 64 / N members per device."""
  n = mesh.size
  want_devices = sorted(d.id for d in mesh.devices.flat)
  leaves = jax.tree.leaves(trainer.arrays()) + [loss]
  for leaf in leaves:
    shards = leaf.addressable_shards
    assert sorted(s.device.id for s in shards) == want_devices, (name, leaf.sharding)
    assert {s.data.shape[0] for s in shards} == {MEMBERS // n}, (name, leaf.shape, leaf.sharding)
  return len(leaves)


def setup(mesh, x, y, reference=None):
  """Fresh trainers of every variant, each stepped ``CHECK_STEPS`` times and checked; ``reference``: the
  parameters that all must match (another device count's), else the raw variant's."""
  trainers = {name: make(mesh) for name, make in MAKERS.items()}
  losses = {}
  for _ in range(CHECK_STEPS):
    for name, trainer in trainers.items():
      losses[name] = block(trainer(x, y))
  counts = {name: check_layout(name, t, losses[name], mesh) for name, t in trainers.items()}
  expect = reference or trainers[RAW].kernels()
  for name, trainer in trainers.items():
    got = trainer.kernels()
    for path in expect:
      np.testing.assert_allclose(got[path], expect[path], rtol=2e-5, atol=2e-6, err_msg=f'{name}: {path}')
    np.testing.assert_allclose(losses[name], losses[RAW], rtol=2e-5, atol=2e-6, err_msg=name)
  print(f'  {mesh.size} device(s): all {len(trainers)} variants equal after {CHECK_STEPS} steps '
        f'(params, losses{", and the 1-device params" if reference else ""}); '
        f'each array over {mesh.size} device(s), {MEMBERS // mesh.size} members per device '
        f'({"/".join(f"{c}" for c in counts.values())} arrays: {", ".join(counts)})', flush=True)
  return trainers


# -- timing ---------------------------------------------------------------------------


def dispatch_us(fn, calls: int) -> float:
  """Median host time (µs) until one call returns, the devices idle before it: where the runtime dispatches
  asynchronously (one CPU device, accelerators) the framework's share of a step (flattening, cache look-up,
  launch), apart from the arithmetic that runs after the call has returned."""
  out = block(fn())
  samples = []
  for _ in range(calls):
    block(out)
    t0 = time.perf_counter()
    out = fn()
    samples.append(time.perf_counter() - t0)
  block(out)
  return statistics.median(samples) * 1e6


# -- output ---------------------------------------------------------------------------


def header() -> str:
  kinds = sorted({d.device_kind for d in jax.devices()})
  return (
    f'jax {jax.__version__}, flax {flax.__version__}, optax {optax.__version__}; {jax.device_count()} '
    f'{jax.devices()[0].platform} device(s) ({", ".join(kinds)}), {os.cpu_count()} cores, '
    f'Python {platform.python_version()}; {datetime.date.today().isoformat()}'
  )


def markdown(best, ratios, dispatch, note: str) -> str:
  lines = [
    f'## {MEMBERS}-member ensemble adam step, sharded over {" vs ".join(map(str, best))} device(s)', '', note, '',
    '| devices | variant | µs/step (min) | ratio of mins | per-pass ratio: median [range] | host µs/call |',
    '|---:|---|---:|---:|---:|---:|',
  ]
  for n, result in best.items():
    for name, t in result.items():
      r = ratios[n][name]
      lines.append(f'| {n} | {name} | {t:.0f} | {t / result[RAW]:.2f}x | '
                   f'{statistics.median(r):.2f}x [{min(r):.2f}, {max(r):.2f}] | {dispatch[n][name]:.0f} |')
  return '\n'.join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--quick', action='store_true', help='a smoke run: few rounds and passes')
  parser.add_argument('--passes', type=int, default=7, help='passes over the device counts (default 7)')
  parser.add_argument('--rounds', type=int, default=8, help='interleaved rounds per pass (default 8)')
  parser.add_argument('--round-ms', type=float, default=30.0, help='length of one round (default 30 ms)')
  parser.add_argument('--dispatch-calls', type=int, default=100, help='calls timed for the host µs/call column (default 100)')
  parser.add_argument('--out', type=Path, default=RESULTS / 'sharded_ensemble.md',
                      help='where the table goes (default benchmarks/results/sharded_ensemble.md); "-" for nowhere')
  args = parser.parse_args(argv)
  passes, rounds, dispatch_calls = (2, 3, 10) if args.quick else (args.passes, args.rounds, args.dispatch_calls)
  print(header(), flush=True)

  counts = [n for n in DEVICE_COUNTS if n <= jax.device_count()]
  skipped = [n for n in DEVICE_COUNTS if n > jax.device_count()]
  if skipped:
    print(f'note: skipping {skipped} device(s): only {jax.device_count()} here', flush=True)
  x, y, _ = make_data(0, POINTS)
  meshes, data, trainers = {}, {}, {}
  reference = None
  for n in counts:
    mesh = jax.make_mesh((n,), ('ens',), devices=jax.devices()[:n])
    meshes[n] = mesh
    data[n] = jax.device_put((x, y), NamedSharding(mesh, P()))
    with jax.set_mesh(mesh):
      trainers[n] = setup(mesh, *data[n], reference)
    reference = reference or trainers[n][RAW].kernels()

  best: dict[int, dict] = {n: {} for n in counts}
  ratios: dict[int, dict] = {n: {name: [] for name in MAKERS} for n in counts}
  dispatch: dict[int, dict] = {n: {} for n in counts}
  for r in range(passes):
    for n in counts:
      xs, ys = data[n]
      calls = {name: (lambda t=t, xs=xs, ys=ys: t(xs, ys)) for name, t in trainers[n].items()}
      with jax.set_mesh(meshes[n]):
        got = best_of(calls, rounds=rounds, round_ms=args.round_ms)
        if r == passes - 1:
          dispatch[n] = {name: dispatch_us(fn, dispatch_calls) for name, fn in calls.items()}
      for name, t in got.items():
        best[n][name] = min(t, best[n].get(name, float('inf')))
        ratios[n][name].append(t / got[RAW])
      print(f'  pass {r + 1}, {n} device(s): ' + ', '.join(
        f'{name} {t:.0f} us ({t / got[RAW]:.2f}x)' for name, t in got.items()), flush=True)

  note = (
    f'The demo network body 1 -> {HIDDEN} (relu) -> 2, {POINTS} training points shared, optax.adam(1e-3), '
    f'one optimizer per member; the members split over a 1-D mesh `ens` of the first N devices (`P("ens")`, '
    f'{" / ".join(str(MEMBERS // n) for n in counts)} members per device). All variants checked equal '
    f'(parameters, losses, layout) before timing. Per-step time, µs, calls back to back, `block_until_ready` '
    f'at the end of each round; {passes} passes, alternating between the device counts, each of {rounds} '
    f'interleaved rounds of ~{args.round_ms:.0f} ms (`_timing.best_of`). "µs/step (min)": the minimum over all '
    f'rounds; "ratio of mins": that over raw\'s; "per-pass ratio": each pass\'s minimum over raw\'s minimum of '
    f'the same pass, the median and range over the passes (the steadier figure on a loaded machine). '
    f'"host µs/call": median time until one call returns, the devices idle before it: on one CPU device the '
    f'arithmetic runs after the call returns, so this is the framework\'s share of the step plus the launch; '
    f'on several CPU devices the call returns only once most of the arithmetic is done, so there it is close '
    f'to the step time. Regenerate: `python benchmarks/sharded_ensemble.py`. '
    f'{header()}.'
  )
  text = markdown(best, ratios, dispatch, note)
  print('\n' + text)
  for n in counts:
    ratio = statistics.median(ratios[n][BNX])
    print(f'\n{n} device(s): brainnx / raw {best[n][BNX] / best[n][RAW]:.2f}x (ratio of mins), {ratio:.2f}x '
          f'(median per-pass ratio; target <= 1.10x: {"met" if ratio <= 1.1 else "NOT met"}); '
          f'with donate_states {statistics.median(ratios[n][BNX_DONATE]):.2f}x; '
          f'nnx {statistics.median(ratios[n][NNX]):.2f}x; host µs/call: '
          + ', '.join(f'{name} {d:.0f}' for name, d in dispatch[n].items()))
  if str(args.out) != '-':
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + '\n')
    print(f'\nwrote {args.out}')


if __name__ == '__main__':
  main()
