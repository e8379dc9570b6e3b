"""Shared timing helpers for the benchmark scripts (not a test, not a library)."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable

import jax


def block(x):
  return jax.block_until_ready(x)


class Timing(float):
  """A per-call median (µs) that also carries the 10th percentile (``.p10``)."""

  p10: float


def interleaved(variants: dict[str, Callable[[], object]], *, rounds: int = 30, calls: int = 200) -> dict[str, float]:
  """Per-call time (µs) of each variant: the median over ``rounds`` interleaved rounds.

  Each result also has ``.p10``, the 10th percentile, which a busy machine
  disturbs less than the median.
  """
  for fn in variants.values():  # warm
    for _ in range(5):
      block(fn())
  samples: dict[str, list[float]] = {name: [] for name in variants}
  order = list(variants.items())
  for r in range(rounds):
    for name, fn in order[r % len(order):] + order[:r % len(order)]:  # a different variant goes first each round
      t0 = time.perf_counter()
      for _ in range(calls):
        out = fn()
      block(out)
      samples[name].append((time.perf_counter() - t0) / calls * 1e6)
  results = {}
  for name, s in samples.items():
    t = Timing(statistics.median(s))
    t.p10 = sorted(s)[len(s) // 10]
    results[name] = t
  return results


class Best(float):
  """A per-call minimum (µs) over interleaved rounds that also carries the median (``.median``)."""

  median: float


def best_of(variants: dict[str, Callable[[], object]], *, rounds: int = 15, round_ms: float = 20.0) -> dict[str, Best]:
  """Per-call time (µs) of each variant: the minimum over ``rounds`` interleaved rounds.

  Each variant gets its own number of calls per round, calibrated so that one
  round takes about ``round_ms``; the variants take turns round by round, in a
  new (seeded) order each round, so a burst of load on a shared machine hits them
  all alike and no variant always follows the same one; the minimum keeps the
  round that the load disturbed least. Each result also has ``.median``.
  """
  calls = {}
  for name, fn in variants.items():  # warm, then calibrate
    for _ in range(3):
      block(fn())
    t0 = time.perf_counter()
    n = 0
    while n < 3 or time.perf_counter() - t0 < round_ms / 4e3:
      out = fn()
      n += 1
    block(out)
    per_call = (time.perf_counter() - t0) / n
    calls[name] = max(1, round(round_ms / 1e3 / per_call))
  samples: dict[str, list[float]] = {name: [] for name in variants}
  shuffle = random.Random(0).shuffle
  order = list(variants.items())
  for _ in range(rounds):
    # a new order each round (seeded): what runs just before a variant (an nnx.jit round leaves
    # the caches cold, another the arrays warm) is not always the same variant
    shuffle(order)
    for name, fn in order:
      t0 = time.perf_counter()
      for _ in range(calls[name]):
        out = fn()
      block(out)
      samples[name].append((time.perf_counter() - t0) / calls[name] * 1e6)
  results = {}
  for name, s in samples.items():
    t = Best(min(s))
    t.median = statistics.median(s)
    results[name] = t
  return results


def first_calls(
  makers: dict[str, Callable[[], Callable[[], object]]], *, trials: int = 5, reduce: Callable = statistics.median
) -> dict[str, float]:
  """``reduce`` (median, or e.g. ``min``) over ``trials`` of the first-call time (ms).

  ``maker()`` builds a fresh function (and fresh model) each trial, so every
  trial traces and compiles anew; the variants take turns trial by trial.
  """
  samples: dict[str, list[float]] = {name: [] for name in makers}
  order = list(makers.items())
  for t in range(trials):
    for name, make in order[t % len(order):] + order[:t % len(order)]:  # a different variant first each trial
      fn = make()
      t0 = time.perf_counter()
      block(fn())
      samples[name].append((time.perf_counter() - t0) * 1e3)
  return {name: reduce(s) for name, s in samples.items()}


def table(title: str, results: dict[str, float], unit: str, baseline: str, with_p10: bool = False) -> str:
  """A markdown table of per-call medians and their ratio to ``baseline`` (the one statistic the
  README quotes; ``with_p10`` adds the 10th percentile for diagnosis only)."""
  base = results[baseline]
  with_p10 = with_p10 and all(hasattr(v, 'p10') for v in results.values())
  head = f'| variant | {unit} (median) | ratio to {baseline} |'
  rule = '|---|---:|---:|'
  if with_p10:
    head += f' {unit} (p10) | p10 ratio |'
    rule += '---:|---:|'
  lines = [f'### {title}', '', head, rule]
  for name, value in results.items():
    line = f'| {name} | {value:.1f} | {value / base:.2f}x |'
    if with_p10:
      line += f' {value.p10:.1f} | {value.p10 / base.p10:.2f}x |'
    lines.append(line)
  return '\n'.join(lines)
