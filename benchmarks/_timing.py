"""Shared timing helpers for the benchmark scripts (not a test, not a library)."""

from __future__ import annotations

import gc
import statistics
import time
from typing import Callable

import jax


def block(x):
  return jax.block_until_ready(x)


def interleaved(variants: dict[str, Callable[[], object]], *, rounds: int = 30, calls: int = 200) -> dict[str, float]:
  """Median over ``rounds`` of the per-call time (µs) of each variant, variants interleaved."""
  for fn in variants.values():  # warm
    for _ in range(5):
      block(fn())
  samples: dict[str, list[float]] = {name: [] for name in variants}
  gc.disable()
  try:
    for _ in range(rounds):
      for name, fn in variants.items():
        t0 = time.perf_counter()
        for _ in range(calls):
          out = fn()
        block(out)
        samples[name].append((time.perf_counter() - t0) / calls * 1e6)
  finally:
    gc.enable()
  return {name: statistics.median(s) for name, s in samples.items()}


def first_calls(makers: dict[str, Callable[[], Callable[[], object]]], *, trials: int = 5) -> dict[str, float]:
  """Median over ``trials`` of the first-call time (ms): ``maker()`` builds a fresh function."""
  samples: dict[str, list[float]] = {name: [] for name in makers}
  for _ in range(trials):
    for name, make in makers.items():
      fn = make()
      t0 = time.perf_counter()
      block(fn())
      samples[name].append((time.perf_counter() - t0) * 1e3)
  return {name: statistics.median(s) for name, s in samples.items()}


def table(title: str, results: dict[str, float], unit: str, baseline: str) -> str:
  base = results[baseline]
  lines = [f'### {title}', '', f'| variant | {unit} | ratio to {baseline} |', '|---|---:|---:|']
  for name, value in results.items():
    lines.append(f'| {name} | {value:.1f} | {value / base:.2f}x |')
  return '\n'.join(lines)
