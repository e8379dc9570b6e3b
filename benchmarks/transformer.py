"""The transformer of ``brainnx.examples.transformer`` trained sharded: brainnx vs flax vs raw jax.jit.

Run: ``python benchmarks/transformer.py`` (``--rounds N``; ``--quick`` for a short check). On CPU it
forces 4 host devices, a ``('data', 'model')`` 2 x 2 mesh. Model: 4 pre-norm blocks of width 128,
64-byte windows, batch 8, adamw; dropout off in every variant (``deterministic``), so that all
variants compute the same numbers and are checked equal (losses and parameters after two steps)
before anything is timed.

Variants, each with and without remat and with and without donation:

  brainnx   ``bnx.jit(step, donate_states=True, state_shardings=state_rules())``, bnx.vmap-built
            stack run by bnx.scan over bnx.remat
  flax      ``nnx.jit(step, donate_argnums=(0, 1))``, nnx.vmap + nnx.split_rngs, nnx.scan over nnx.remat
  jax.jit   the same model as pure functions of a parameter pytree (``jax.lax.scan`` over the
            stacked blocks, ``jax.checkpoint``), ``jax.jit(in_shardings, out_shardings, donate_argnums=0)``

Columns: the warm step (median over interleaved rounds of several steps each, async dispatch),
the first call split into trace (for brainnx: discovery and its trace), lower and compile, and
XLA's per-device memory analysis of the compiled step (arguments, outputs, temporaries, aliased).
Results go to ``benchmarks/results/transformer.md``.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=4')

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import flax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import _results as results  # noqa: E402
from _timing import block  # noqa: E402
from brainnx.examples import transformer as tf  # noqa: E402

from _results import RESULTS as _TABLES  # noqa: E402

RESULTS = _TABLES / 'transformer.md'
# The pure model's float32 ops are the same but fused in another order; adamw divides each
# gradient by its own running scale, so where the gradient is rounding noise (the key part of
# the qkv bias: softmax ignores it, its true gradient is 0) the noise moves the entry by up to
# lr per step. Hence: every entry within 2 lr per step of the reference, and under 2% of the
# entries of a Variable off by more than 1e-4 (observed: 22 of 1536 in qkv/bias, the rest < 2e-5).
PARAM_ATOL = 1e-4


# -- the pure-pytree model ------------------------------------------------------------


def _layer_norm(p, x, eps=1e-6):  # flax's LayerNorm: fast variance, epsilon 1e-6
  mean = x.mean(-1, keepdims=True)
  var = jnp.maximum((x * x).mean(-1, keepdims=True) - mean * mean, 0.0)
  return (x - mean) * jax.lax.rsqrt(var + eps) * p['scale'] + p['bias']


def _dense(p, x):
  return x @ p['kernel'] + p['bias']


def _block(cfg, p, x):
  b, s, w = x.shape
  h = cfg.heads
  q, k, v = (t.reshape(b, s, h, w // h) for t in jnp.split(_dense(p['qkv'], _layer_norm(p['ln1'], x)), 3, axis=-1))
  scores = jnp.einsum('bqhd,bkhd->bhqk', q, k) / np.sqrt(w // h)
  scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, jnp.finfo(scores.dtype).min)
  x = x + _dense(p['proj'], jnp.einsum('bhqk,bkhd->bqhd', jax.nn.softmax(scores, axis=-1), v).reshape(b, s, w))
  return x + _dense(p['mlp_out'], jax.nn.gelu(_dense(p['mlp_in'], _layer_norm(p['ln2'], x))))


def pure_loss(cfg, remat, params, x, y):
  h = params['token']['embedding'][x] + params['pos']['embedding'][jnp.arange(x.shape[1])]
  layer = jax.checkpoint(lambda p, h: _block(cfg, p, h)) if remat else (lambda p, h: _block(cfg, p, h))
  h = jax.lax.scan(lambda h, p: (layer(p, h), None), h, params['blocks'])[0]
  return tf.cross_entropy(_dense(params['head'], _layer_norm(params['ln_f'], h)), y)


def _pure_params(model) -> dict:
  return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _shardings(tree, mesh):
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  names = lambda path: tuple(getattr(k, 'key', getattr(k, 'idx', getattr(k, 'name', k))) for k in path)  # noqa: E731
  specs = [NamedSharding(mesh, tf.partition_spec(names(path)) or P()) for path, _ in flat]
  return jax.tree.unflatten(jax.tree.structure(tree), specs)


# -- the variants: each gives a fresh step closure and its first-call stages ------------------


@dataclasses.dataclass
class Variant:
  step: object  # () -> loss
  stages: object  # () -> (trace_s, lower_s, compile_s, compiled)
  params: object  # () -> {name: numpy array}


def brainnx_variant(cfg, mesh, data, donate) -> Variant:
  model, opt = tf.build(cfg, 0)
  with jax.set_mesh(mesh):
    step = tf.train_step(model, opt, sharded=True, donate=donate, deterministic=True)
  x, y = data

  def stages():
    with jax.set_mesh(mesh):
      t0 = time.perf_counter()
      traced = step.trace(x, y)  # discovery, layout and the stateful trace
      t1 = time.perf_counter()
      lowered = traced.lower()
      t2 = time.perf_counter()
      compiled = lowered.compile()
      return t1 - t0, t2 - t1, time.perf_counter() - t2, compiled

  def run():
    with jax.set_mesh(mesh):
      return step(x, y)

  return Variant(run, stages, lambda: _host(_pure_params(model)))


def flax_variant(cfg, mesh, data, donate) -> Variant:
  model, opt = tf.build_flax(cfg, 0, mesh)
  step = tf.flax_train_step(donate=donate, deterministic=True)
  x, y = data

  def stages():
    with jax.set_mesh(mesh):
      t0 = time.perf_counter()
      traced = step.trace(model, opt, x, y)
      t1 = time.perf_counter()
      lowered = traced.lower()
      t2 = time.perf_counter()
      compiled = lowered.compile()
      return t1 - t0, t2 - t1, time.perf_counter() - t2, compiled

  def run():
    with jax.set_mesh(mesh):
      return step(model, opt, x, y)

  return Variant(run, stages, lambda: _host(_pure_params(model)))


def pure_variant(cfg, mesh, data, donate) -> Variant:
  model, _ = tf.build(cfg, 0)
  params = _pure_params(model)
  tx = optax.adamw(cfg.lr)
  state = {'params': params, 'opt': tx.init(params)}
  shardings = {'params': _shardings(params, mesh), 'opt': None}
  state['params'] = jax.device_put(params, shardings['params'])
  shardings['opt'] = _shardings(tx.init(params), mesh)
  state['opt'] = jax.device_put(tx.init(params), shardings['opt'])
  data_sharding = NamedSharding(mesh, P('data'))

  def train(state, x, y):
    loss, grads = jax.value_and_grad(lambda p: pure_loss(cfg, cfg.remat, p, x, y))(state['params'])
    updates, opt = tx.update(grads, state['opt'], state['params'])
    return {'params': optax.apply_updates(state['params'], updates), 'opt': opt}, loss

  step = jax.jit(train, in_shardings=(shardings, data_sharding, data_sharding), out_shardings=(shardings, None),
                 donate_argnums=0 if donate else ())
  box = [state]
  x, y = data

  def stages():
    t0 = time.perf_counter()
    traced = step.trace(box[0], x, y)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    compiled = lowered.compile()
    return t1 - t0, t2 - t1, time.perf_counter() - t2, compiled

  def run():
    box[0], loss = step(box[0], x, y)
    return loss

  return Variant(run, stages, lambda: _host(box[0]['params']))


def _host(tree) -> dict:
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {jax.tree_util.keystr(path): np.asarray(v) for path, v in flat}


MAKERS = {'brainnx': brainnx_variant, 'flax': flax_variant, 'jax.jit': pure_variant}


def loss_atol() -> float:
  """How far two variants' losses may be: CPU programs agree to float32 rounding; an
  accelerator's matmuls (TPU bf16 passes under default precision) round differently per program."""
  return 1e-5 if jax.default_backend() == 'cpu' else 1e-3


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--rounds', type=int, default=15)
  parser.add_argument('--steps-per-round', type=int, default=5)
  parser.add_argument('--quick', action='store_true', help='2 rounds of 2 steps, only the remat + donated variants')
  parser.add_argument('--out', default=str(RESULTS))
  args = parser.parse_args(argv)
  if args.quick:
    args.rounds, args.steps_per_round = 2, 2
  base = tf.Config()
  mesh = tf.make_mesh()  # every device there is: 4 forced host devices on CPU, the chips elsewhere
  x, y = tf.batch(tf.text(), base, 0)
  data = tf.place_batch(mesh, x, y)
  args.mesh_shape = tuple(mesh.devices.shape)
  settings = [(True, True)] if args.quick else [(r, d) for r in (True, False) for d in (True, False)]
  variants, first, memory = {}, {}, {}
  # The first trace in a process pays one-time costs (imports, JAX's and flax's caches): every
  # idiom pays them here, on a one-block model, so the table times tracing this model only.
  for make in MAKERS.values():
    make(dataclasses.replace(base, layers=1), mesh, data, True).stages()
  for k, (remat, donate) in enumerate(settings):
    cfg = dataclasses.replace(base, remat=remat)
    order = list(MAKERS.items())
    for idiom, make in order[k % len(order):] + order[:k % len(order)]:  # each idiom leads a setting
      name = f'{idiom}, {"remat" if remat else "no remat"}, {"donated" if donate else "not donated"}'
      v = make(cfg, mesh, data, donate)
      trace_s, lower_s, compile_s, compiled = v.stages()
      first[name] = (trace_s, lower_s, compile_s)
      memory[name] = compiled.memory_analysis()
      variants[name] = v
  # equal values first: two steps of every variant from the same parameters
  losses = {name: [float(np.asarray(v.step())) for _ in range(2)] for name, v in variants.items()}
  reference_name = next(iter(variants))
  reference = variants[reference_name].params()
  for name, v in variants.items():
    np.testing.assert_allclose(losses[name], losses[reference_name], rtol=0, atol=loss_atol(), err_msg=name)
    got = v.params()
    for (k1, a), (k2, b) in zip(sorted(reference.items()), sorted(got.items())):
      off = np.abs(a - b)
      assert off.max() <= 2 * 2 * base.lr and (off > PARAM_ATOL).mean() < 0.02, (name, k2, off.max())
  # warm steps: interleaved rounds, each a few async steps then a block
  samples = {name: [] for name in variants}
  for _ in range(args.rounds):
    for name, v in variants.items():
      t0 = time.perf_counter()
      for _ in range(args.steps_per_round):
        out = v.step()
      block(out)
      samples[name].append((time.perf_counter() - t0) / args.steps_per_round * 1e3)
  write(args, base, first, memory, samples)


def write(args, cfg, first, memory, samples) -> None:
  commit = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True,
                          cwd=Path(__file__).parent).stdout.strip() or 'unknown'
  mb = 1 / 2 ** 20
  lines = [
    f'## Sharded transformer step: `python benchmarks/transformer.py{" --quick" if args.quick else ""} '
    f'--rounds {args.rounds}`',
    '',
    f'commit {commit}, {datetime.date.today().isoformat()}, jax {jax.__version__}, flax {flax.__version__}, '
    f'{jax.devices()[0].platform} x {jax.device_count()} (a {" x ".join(map(str, args.mesh_shape))} (data, model) mesh), '
    f'{os.cpu_count()} CPU cores. '
    f'Model: {cfg.layers} blocks, width {cfg.width}, {cfg.heads} heads, seq {cfg.seq}, batch {cfg.batch}, adamw, '
    f'dropout off. Every variant was checked equal before timing: losses of two steps to {loss_atol():g}; parameters to 1e-4 except entries whose gradient is rounding noise (under 2%, within 2 lr per step).',
    '',
    f'Warm step: median (and min-max) over {args.rounds} interleaved rounds of {args.steps_per_round} async steps. '
    'First call: one trial each (trace, lower, compile), after every idiom traced a one-block model; '
    'the idiom that goes first changes from one setting to the next. Memory: XLA memory_analysis of the compiled step, per device.',
    '',
    '| variant | step ms (median) | min-max | trace ms | lower ms | compile ms | args MB | out MB | temp MB | aliased MB |',
    '|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|',
  ]
  for name, s in samples.items():
    t, lo, co = first[name]
    m = memory[name]
    lines.append(
      f'| {name} | {statistics.median(s):.1f} | {min(s):.1f}-{max(s):.1f} | {t * 1e3:.0f} | {lo * 1e3:.0f} | '
      f'{co * 1e3:.0f} | {m.argument_size_in_bytes * mb:.2f} | {m.output_size_in_bytes * mb:.2f} | '
      f'{m.temp_size_in_bytes * mb:.2f} | {m.alias_size_in_bytes * mb:.2f} |'
    )
  text = '\n'.join(lines) + '\n'
  print(text)
  out = Path(args.out)
  results.write(out.name, 'transformer.py', text, out=out.parent)


if __name__ == '__main__':
  main()
