"""Host-bound calls at scale: thousands of Variables, a token-by-token decode step, and other code
touching the model between calls.

Run: ``python benchmarks/many_variables.py [--quick]`` (writes ``results/many_variables.md``).

Three tables, every variant checked equal to the others before it is timed:

1. **Per call against the number of Variables**: a model of ``L`` blocks of 8 Variables of shape
   ``(8, 8)`` whose step reads one row of each (80, 800 and 8,000 Variables), called as raw
   ``jax.jit`` over a flat list of the leaves (the hand-written floor), flax's split-once idiom
   (``jax.jit`` over an ``nnx.State``, merged inside), ``bnx.jit`` over the model it closes over,
   ``nnx.cached_partial`` and ``nnx.jit``.
2. **One decode step of the example transformer** (``brainnx.examples.transformer``, width 64,
   one sequence) at 4 and 32 layers, the same five ways; each step writes the key/value caches
   and the position, so every variant carries the new state to the next call.
3. **Other code between calls** (800 and 8,000 Variables): before each call, nothing, an
   ``nnx.jit`` evaluation of the model, ``set_value`` on one Variable, ``nnx.state(model)`` or
   ``nnx.update(model, state)``; raw ``jax.jit`` does the same and then reads what it needs
   (the new value after ``set_value``; after the evaluation, which writes its outputs back into
   the model, the new arrays, read before its timer starts). Each call blocks, as a loop that
   uses its result does.

Statistic: per-call time, the median over interleaved rounds (each variant's calls per round
calibrated to about 20 ms), on this machine's CPU. XLA's backend optimisation is off
(``--xla_backend_optimization_level=0``, set here before JAX starts): a program with 8,000
inputs otherwise takes minutes to compile on CPU; every variant runs the same program, so the
ratios are the cost of the call around it.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' --xla_backend_optimization_level=0').strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from _results import publish  # noqa: E402
from _timing import best_of  # noqa: E402

import brainnx as bnx  # noqa: E402
from brainnx.examples import transformer as tf  # noqa: E402


class Block(nnx.Module):
  def __init__(self, k: int):
    for i in range(8):
      setattr(self, f'w{i}', nnx.Param(jnp.full((8, 8), float(k + i))))


class Stack(nnx.Module):
  def __init__(self, blocks: int):
    self.blocks = nnx.List([Block(k) for k in range(blocks)])


def read_step(model: Stack, x):
  total = x
  for block in model.blocks:
    for i in range(8):
      total = total + getattr(block, f'w{i}')[0]
  return total


def _median(results: dict) -> dict:
  return {name: t.median for name, t in results.items()}


def many_variables_variants(model: Stack, x):
  """The five ways of calling ``read_step`` on ``model``."""
  graphdef, state = nnx.split(model)
  leaves = [v.get_value() for _, v in nnx.to_flat_state(nnx.state(model))]
  raw = jax.jit(lambda leaves, x: x + sum(leaf[0] for leaf in leaves))
  split_once = jax.jit(lambda state, x: read_step(nnx.merge(graphdef, state), x))
  by_bnx = bnx.jit(lambda x: read_step(model, x))
  # nnx's rows get their own copies (nnx.clone: new Variables, the same arrays). An nnx.jit call
  # writes its outputs back into the Variables it was given, so a copy made by nnx.merge(*nnx.split
  # (model)), which shares the Variables, would hand brainnx's row nnx.jit's freshly computed
  # arrays on every call while the raw row kept the originals; and it re-inserts the attributes of
  # every node it updates. The third table times that; this one the steady state.
  cached = nnx.cached_partial(nnx.jit(read_step), nnx.clone(model))
  by_nnx, nnx_model = nnx.jit(read_step), nnx.clone(model)
  return {
    'raw jax.jit, flat leaves': lambda: raw(leaves, x),
    'jax.jit over nnx.State (split once)': lambda: split_once(state, x),
    'bnx.jit': lambda: by_bnx(x),
    'nnx.cached_partial': lambda: cached(x),
    'nnx.jit': lambda: by_nnx(nnx_model, x),
  }


def decode_variants(cfg: tf.Config, seed: int = 0):
  """The five ways of one decode step (each on its own copy of the model, cache included)."""
  def step(model, token):
    logits = model.decode_step(token)
    model.cache_index[...] = model.cache_index[...] % cfg.seq  # decode forever: wrap the position
    return logits

  def fresh():
    model, _ = tf.build(cfg, seed)
    model.init_cache(1, cfg.seq)
    return model

  token = jnp.array([65], jnp.int32)
  raw_model = fresh()
  graphdef, params, cache = nnx.split(raw_model, nnx.Param, ...)
  param_leaves, param_def = jax.tree.flatten(params)
  cache_leaves, cache_def = jax.tree.flatten(cache)

  @jax.jit
  def raw(params, cache, token):  # the hand-written path: parameters in, the cache in and out
    model = nnx.merge(graphdef, jax.tree.unflatten(param_def, params), jax.tree.unflatten(cache_def, cache))
    logits = step(model, token)
    return jax.tree.leaves(nnx.state(model, nnx.Not(nnx.Param))), logits

  graphdef_all, state = nnx.split(fresh())

  @jax.jit
  def split_once(state, token):
    model = nnx.merge(graphdef_all, state)
    logits = step(model, token)
    return nnx.state(model), logits

  carried = {'raw': cache_leaves, 'split': state}

  def call_raw():
    carried['raw'], logits = raw(param_leaves, carried['raw'], token)
    return logits

  def call_split():
    carried['split'], logits = split_once(carried['split'], token)
    return logits

  bnx_model, cached_model, nnx_model = fresh(), fresh(), fresh()
  by_bnx = bnx.jit(lambda token: step(bnx_model, token))
  cached = nnx.cached_partial(nnx.jit(step), cached_model)
  by_nnx = nnx.jit(step)
  return {
    'raw jax.jit, flat leaves': call_raw,
    'jax.jit over nnx.State (split once)': call_split,
    'bnx.jit': lambda: by_bnx(token),
    'nnx.cached_partial': lambda: cached(token),
    'nnx.jit': lambda: by_nnx(nnx_model, token),
  }


def check_equal(variants: dict, calls: int = 3) -> None:
  """Every variant gives the first one's results, call after call (the state carried alike)."""
  outs = {name: [np.asarray(fn()) for _ in range(calls)] for name, fn in variants.items()}
  first = next(iter(outs.values()))
  for name, got in outs.items():
    for a, b in zip(first, got):
      np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5, err_msg=name)


def interference_variants(model: Stack, x):
  """bnx.jit and raw jax.jit, each after one of the operations other code does between calls."""
  leaves = [v.get_value() for _, v in nnx.to_flat_state(nnx.state(model))]
  raw = jax.jit(lambda leaves, x: x + sum(leaf[0] for leaf in leaves))
  by_bnx = bnx.jit(lambda x: read_step(model, x))
  evaluate = nnx.jit(lambda m, x: read_step(m, x))
  target = model.blocks[0].w0
  state = nnx.state(model)
  counter = [0]

  def set_one():  # a value that changes every call, as a step counter or a learning rate does
    counter[0] += 1
    target.set_value(jnp.full((8, 8), float(counter[0] % 7)))

  variables = [v for _, v in nnx.to_flat_state(nnx.state(model))]

  def evaluate_then_read():
    jax.block_until_ready(evaluate(model, x))
    # nnx.jit writes its outputs back: the model now holds new arrays (equal values). The raw
    # loop reads them here, untimed, so both rows then pass the same arrays (fresh XLA outputs
    # are slower to consume than arrays used a thousand times: that is not brainnx's cost)
    leaves[:] = [v.get_raw_value() for v in variables]

  ops = {
    'nothing': (lambda: None, lambda: None),
    'an nnx.jit eval call on the model': (evaluate_then_read, lambda: None),
    'set_value on one Variable': (set_one, lambda: leaves.__setitem__(0, target.get_value())),
    'nnx.state(model)': (lambda: nnx.state(model), lambda: None),
    'nnx.update(model, state)': (lambda: nnx.update(model, state), lambda: None),
  }
  variants = {}
  for label, (op, refresh) in ops.items():
    def raw_call(refresh=refresh):
      refresh()  # what a hand-written loop does after set_value: read the new leaf
      return raw(leaves, x)

    variants[label] = (op, raw_call, lambda: by_bnx(x))
  return variants


def time_after(pairs: dict, rounds: int, calls: int = 20) -> dict:
  """Per label and caller, the time of the call alone (µs, blocking) right after the operation:
  the median over rounds of the mean over ``calls`` (operation, then timed call). The callers
  alternate call by call (which goes first alternates too), and each label's calls start after
  a garbage collection, so that neither pays for what the other's operations left."""
  samples = {}
  for r in range(rounds):
    for label, (op, *callers) in pairs.items():
      turns = list(zip(('raw', 'bnx'), callers))
      totals = dict.fromkeys(('raw', 'bnx'), 0.0)
      gc.collect()
      for k in range(calls):
        for who, call in turns if (r + k) % 2 == 0 else turns[::-1]:
          op()
          t0 = time.perf_counter()
          jax.block_until_ready(call())
          totals[who] += time.perf_counter() - t0
      for who, total in totals.items():
        samples.setdefault((label, who), []).append(total / calls * 1e6)
  return {key: float(np.median(v)) for key, v in samples.items()}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--quick', action='store_true', help='fewer rounds, 80 and 800 Variables only (a smoke run)')
  parser.add_argument('--no-write', action='store_true', help='print only')
  args = parser.parse_args(argv)
  rounds = 5 if args.quick else 15
  sizes = (10, 100) if args.quick else (10, 100, 1000)
  x = jnp.zeros(8)
  sections = []

  rows = []
  for blocks in sizes:
    model = Stack(blocks)
    variants = many_variables_variants(model, x)
    check_equal(variants)
    t = _median(best_of(variants, rounds=rounds))
    base = t['raw jax.jit, flat leaves']
    rows.append(f'| {8 * blocks:,} | ' + ' | '.join(f'{v:.0f} µs ({v / base:.2f}x)' for v in t.values()) + ' |')
    print(rows[-1], flush=True)
  names = list(many_variables_variants(Stack(1), x))
  sections.append('\n'.join([
    '### Per call against the number of Variables (read one row of each)', '',
    '| Variables | ' + ' | '.join(names) + ' |', '|---|' + '---|' * len(names), *rows]))

  rows = []
  for layers in ((4,) if args.quick else (4, 32)):
    cfg = tf.Config(layers=layers, width=64, heads=4, seq=32, batch=1)
    variants = decode_variants(cfg)
    check_equal(variants)
    t = _median(best_of(variants, rounds=rounds))
    base = t['raw jax.jit, flat leaves']
    n_vars = len(nnx.to_flat_state(nnx.state(tf.build(cfg)[0])))
    rows.append(f'| {layers} ({n_vars + 3} Variables) | '
                + ' | '.join(f'{v:.0f} µs ({v / base:.2f}x)' for v in t.values()) + ' |')
    print(rows[-1], flush=True)
  sections.append('\n'.join([
    '### One decode step of the example transformer (width 64, one sequence, cache of 32)', '',
    '| layers | ' + ' | '.join(names) + ' |', '|---|' + '---|' * len(names), *rows]))

  for blocks in sizes[1:]:
    model = Stack(blocks)
    pairs = interference_variants(model, x)
    for op, raw_call, bnx_call in pairs.values():  # warm every path
      for _ in range(3):
        op()
        jax.block_until_ready((raw_call(), bnx_call()))
    t = time_after(pairs, rounds, calls=5 if blocks >= 1000 else 20)
    plain_raw, plain_bnx = t[('nothing', 'raw')], t[('nothing', 'bnx')]
    rows = []
    for label in pairs:
      raw_t, bnx_t = t[(label, 'raw')], t[(label, 'bnx')]
      rows.append(f'| {label} | {raw_t:.0f} µs ({raw_t / plain_raw:.2f}x) | {bnx_t:.0f} µs ({bnx_t / plain_bnx:.2f}x) '
                  f'| {bnx_t / raw_t:.2f}x |')
      print(rows[-1], flush=True)
    sections.append('\n'.join([
      f'### Other code between calls, {8 * blocks:,} Variables', '',
      'Each call timed alone (blocking) right after the operation; in brackets, against the same '
      'call with nothing before it.', '',
      '| before each call | raw jax.jit call | bnx.jit call | bnx / raw |',
      '|---|---|---|---|', *rows]))

  publish('\n\n'.join(sections), 'many_variables.py', dry_run=args.no_write)


if __name__ == '__main__':
  t0 = time.perf_counter()
  main()
  print(f'{time.perf_counter() - t0:.0f} s')
