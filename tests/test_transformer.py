"""A small transformer trained sharded: brainnx on 4 devices = flax on 4 devices = brainnx on 1,
and 2 ``jax.distributed`` processes = 1 process (``brainnx.examples.transformer``).

Oracles: the same model written with flax's own idioms (``nnx.split_rngs`` + ``nnx.vmap``,
``nnx.scan`` + ``nnx.remat``, ``nnx.with_partitioning``, ``nnx.jit``) from the same seed; the
one-device run; the one-process run. Tolerance of the loss comparisons: the 4-device programs
split every matrix product's contraction over 'data' or 'model' and sum the partial products
across devices, so float32 sums are taken in another order than on one device (a relative
error of a few float32 epsilons, ~1e-7, per reduction over 64-512 terms); over 20 adamw steps
at the default sizes the losses measured differ by at most 5e-6 (losses about 3.4-6.1; at the
test's sizes, 12 steps, they happen to be equal). ``atol=5e-5`` is ten times that, and far below
the loss's change in one step (> 1e-2). brainnx and flax on the same mesh
lower to the same arithmetic and agree to ``1e-6``.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import brainnx as bnx
from brainnx.examples import transformer as tf
from helpers import run_processes

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason='needs 4 devices (tests/conftest.py forces them on CPU)')

CFG = tf.Config(width=64, seq=32)  # the smallest sizes that split every matrix both ways and learn in 12 steps
STEPS = 12
TIMEOUT_S = 400


@pytest.fixture(scope='module')
def runs():
  return {
    'brainnx-4': tf.train(CFG, STEPS, idiom='brainnx', devices=4),
    'flax-4': tf.train(CFG, STEPS, idiom='flax', devices=4),
    'brainnx-1': tf.train(CFG, STEPS, idiom='brainnx'),
  }


def _values(node) -> dict:
  return {k: tf.to_host(v.get_value()) for k, v in tf.flat_state(node).items()}


def test_brainnx_and_flax_train_alike_on_four_devices_and_on_one(runs):
  ours, flax_run, one = runs['brainnx-4'], runs['flax-4'], runs['brainnx-1']
  assert ours['losses'][-1] < ours['losses'][0] - 1.0  # it learns
  np.testing.assert_allclose(ours['losses'], flax_run['losses'], rtol=0, atol=1e-6)
  np.testing.assert_allclose(ours['losses'], one['losses'], rtol=0, atol=5e-5)
  theirs = _values(flax_run['model'])
  mine = _values(ours['model'])
  assert sorted(mine) == sorted(theirs) and 'blocks/qkv/kernel' in mine
  for name in mine:
    np.testing.assert_allclose(mine[name], theirs[name], rtol=0, atol=1e-6, err_msg=name)


@pytest.mark.parametrize('idiom', ['brainnx-4', 'flax-4'])
def test_parameters_and_optimizer_state_are_laid_out_as_intended(runs, idiom):
  run = runs[idiom]
  mesh = run['mesh']
  seen = 0
  for node in (run['model'], run['opt']):
    for name, var in tf.flat_state(node).items():
      x = var.get_value()
      want = tf.partition_spec(name.split('/')) or P()
      assert x.sharding.is_equivalent_to(NamedSharding(mesh, want), x.ndim), (name, x.sharding, want)
      seen += want != P()
  assert seen == 3 * 7  # 7 split matrices, each with its adamw mu and nu
  stacked = run['model'].blocks.qkv.kernel[...]
  assert stacked.shape == (CFG.layers, CFG.width, 3 * CFG.width)
  # each device holds one (layers, width/2, 3*width/2) block of the stacked kernel
  assert {s.data.shape for s in stacked.addressable_shards} == {(CFG.layers, CFG.width // 2, 3 * CFG.width // 2)}


def test_dropout_masks_differ_per_layer_and_step_and_eval_is_deterministic():
  cfg = tf.Config(layers=3, width=16, heads=2, seq=8, batch=2, dropout=0.5)
  model, opt = tf.build(cfg, seed=0)
  flax_model, _ = tf.build_flax(cfg, seed=0)
  ones = jnp.ones((cfg.batch, cfg.seq, cfg.width))

  def masks(blocks):  # each layer's dropout of ones, drawn from its own stacked stream
    return bnx.scan(lambda c, _: (c, blocks.dropout(ones) > 0), None, None, state_in_axes={0: ...})[1]

  first, second = np.asarray(masks(model.blocks)), np.asarray(masks(model.blocks))
  assert first.shape == (cfg.layers, cfg.batch, cfg.seq, cfg.width)
  assert all(not np.array_equal(first[i], first[j]) for i in range(3) for j in range(i))  # per layer
  assert not np.array_equal(first, second)  # per call: each draw advances the stream
  assert 0.35 < first.mean() < 0.65  # rate 0.5

  @nnx.scan(in_axes=(0, nnx.Carry), out_axes=(nnx.Carry, 0))
  def flax_masks(block, c):
    return c, block.dropout(ones) > 0

  np.testing.assert_array_equal(flax_masks(flax_model.blocks, None)[1], first)  # the same streams as flax's

  x, _ = tf.batch(tf.text(), cfg, 0)
  train_a, train_b = model(x), model(x)
  eval_a, eval_b = model(x, deterministic=True), model(x, deterministic=True)
  assert not np.allclose(train_a, train_b)
  np.testing.assert_array_equal(eval_a, eval_b)
  no_dropout, _ = tf.build(tf.Config(layers=3, width=16, heads=2, seq=8, batch=2, dropout=0.0), seed=0)
  np.testing.assert_allclose(eval_a, no_dropout(x), rtol=1e-6, atol=1e-6)
  del opt


def test_the_donated_step_lets_xla_reuse_the_state_buffers():
  cfg = tf.Config(layers=2, width=16, heads=2, seq=8, batch=2)
  x, y = tf.batch(tf.text(), cfg, 0)
  aliased = {}
  for donate in (False, True):
    model, opt = tf.build(cfg, seed=0)
    step = tf.train_step(model, opt, donate=donate)
    aliased[donate] = step.lower(x, y).compile().memory_analysis().alias_size_in_bytes
  params = sum(v.get_value().nbytes for v in tf.flat_state(nnx.state(model, nnx.Param)).values())
  assert aliased[False] == 0 and aliased[True] >= 3 * params  # parameters and both adamw moments


DISTRIBUTED_STEPS = 3  # the losses of steps 1-2 follow the updated, sharded state
SMALL = tf.Config(layers=2, width=32, heads=2, seq=16, batch=4)  # two processes compile it quickly


def test_two_processes_train_as_one_whether_built_inside_or_outside_the_mesh(tmp_path):
  out = tmp_path / 'many.npz'
  size = map(str, (SMALL.layers, SMALL.width, SMALL.seq, SMALL.batch))
  flags = ['--steps', str(DISTRIBUTED_STEPS), '--build', 'both', '--size', *size, '--save', str(out)]
  logs = run_processes('brainnx.examples.transformer', flags, tmp_path, timeout_s=TIMEOUT_S)
  assert 'on 4 device(s) in 2 process(es)' in logs[0]
  many = np.load(out)
  one_process = tf.train(SMALL, DISTRIBUTED_STEPS, idiom='brainnx', devices=4)
  one = one_process['losses']
  for order in ('inside', 'outside'):
    np.testing.assert_allclose(many[f'{order}/losses'], one, rtol=0, atol=1e-6, err_msg=order)
  names = [k.split('/', 1)[1] for k in many if k.startswith('inside/') and k != 'inside/losses']
  assert 'blocks/qkv/kernel' in names
  mine = _values(one_process['model'])
  for name in names:
    np.testing.assert_array_equal(many[f'outside/{name}'], many[f'inside/{name}'], err_msg=name)
    np.testing.assert_allclose(many[f'inside/{name}'], mine[name], rtol=0, atol=1e-6, err_msg=name)


# -- decoding -----------------------------------------------------------------------

DECODE_CFG = tf.Config(layers=2, width=32, heads=2, seq=24, batch=2)


def _pure_logits(params, tokens, cfg):
  """The decoder on its parameters as nested dicts of arrays, the whole sequence at once, no cache
  and no dropout: the oracle a cached decode must agree with."""
  def norm(p, x):
    mean = x.mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-6) * p['scale'] + p['bias']

  def dense(p, x):
    return x @ p['kernel'] + p['bias']

  b, s = tokens.shape
  w, h = cfg.width, cfg.heads
  x = params['token']['embedding'][tokens] + params['pos']['embedding'][:s]

  def layer(x, p):
    q, k, v = (t.reshape(b, s, h, w // h) for t in jnp.split(dense(p['qkv'], norm(p['ln1'], x)), 3, axis=-1))
    scores = jnp.einsum('bqhd,bkhd->bhqk', q, k) / np.sqrt(w // h)
    scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -jnp.inf)
    attended = jnp.einsum('bhqk,bkhd->bqhd', jax.nn.softmax(scores, axis=-1), v).reshape(b, s, w)
    x = x + dense(p['proj'], attended)
    return x + dense(p['mlp_out'], jax.nn.gelu(dense(p['mlp_in'], norm(p['ln2'], x)))), None

  x, _ = jax.lax.scan(layer, x, params['blocks'])
  return dense(params['head'], norm(params['ln_f'], x))


def _pure_generate(params, prompt, n, seed, temperature, cfg):
  """Byte by byte, the whole sequence recomputed each time; the ``sample`` stream's keys are
  ``fold_in(key(seed), count)``, as an ``nnx.Rngs(sample=seed)`` draws them."""
  p = prompt.shape[1]
  # one buffer of the final length: causal attention makes position t's logits independent of
  # what comes after it, so one compiled forward serves every step
  tokens = jnp.zeros((prompt.shape[0], p + n), jnp.int32).at[:, :p].set(prompt)
  forward = jax.jit(lambda params, tokens: _pure_logits(params, tokens, cfg))
  for i in range(n):
    logits = forward(params, tokens)[:, p + i - 1]
    key = jax.random.fold_in(jax.random.key(seed), i)
    nxt = jnp.argmax(logits, -1) if temperature == 0 else jax.random.categorical(key, logits / temperature)
    tokens = tokens.at[:, p + i].set(nxt.astype(jnp.int32))
  return np.asarray(tokens[:, p:])


@pytest.mark.parametrize('temperature', [0.0, 1.0])
def test_decoding_equals_flax_and_a_pure_jax_decode_without_a_cache(temperature):
  prompt = np.array([[10, 20, 30, 40, 50], [60, 70, 80, 90, 100]], np.int32)
  model, _ = tf.build(DECODE_CFG, seed=3)
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  expect = _pure_generate(params, prompt, 12, 7, temperature, DECODE_CFG)
  eager = tf.generate(model, prompt, 12, nnx.Rngs(sample=7), temperature=temperature)
  compiled = tf.generate(model, prompt, 12, nnx.Rngs(sample=7), temperature=temperature, compiled=True)
  flax_model, _ = tf.build_flax(DECODE_CFG, seed=3)
  by_flax = tf.generate_flax(flax_model, prompt, 12, nnx.Rngs(sample=7), temperature=temperature)
  np.testing.assert_array_equal(eager, expect)
  np.testing.assert_array_equal(compiled, expect)
  np.testing.assert_array_equal(by_flax, expect)
  assert int(model.cache_index[...]) == 5 + 12 - 1  # every position but the last sampled one fed


def test_the_cache_gives_the_full_forwards_logits_and_the_stream_advances_once_per_byte():
  model, _ = tf.build(DECODE_CFG, seed=1)
  tokens = jnp.asarray(tf.text()[None, :9].astype(np.int32).repeat(2, 0))
  full = _pure_logits(nnx.to_pure_dict(nnx.state(model, nnx.Param)), tokens, DECODE_CFG)
  model.init_cache(2, 9)
  step = bnx.jit(model.decode_step)
  for t in range(9):
    np.testing.assert_allclose(step(tokens[:, t]), full[:, t], rtol=1e-4, atol=1e-4)
  assert model.blocks.cache_k.shape == (2, 2, 9, 2, 16)  # layers, batch, positions, heads, head size
  rngs = nnx.Rngs(sample=0)
  tf.generate(model, np.zeros((2, 3), np.int32), 5, rngs, compiled=True)
  assert int(rngs.sample.count[...]) == 5
  with pytest.raises(ValueError, match='position embeddings for 24'):
    tf.generate(model, np.zeros((2, 20), np.int32), 5, rngs)


def test_generate_command_prints_text(capsys):
  tf.main(['--steps', '30', '--size', '2', '32', '32', '4', '--generate', '16', '--deterministic'])
  out = capsys.readouterr().out
  assert 'generated after 30 steps' in out
