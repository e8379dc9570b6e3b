"""The program brainnx compiles is the one a JAX expert writes: for every transform family's
representative program in ``benchmarks/program_cost.py``, XLA's cost analysis (flops, bytes
accessed) and the compiled HLO's fusions, while loops, conditionals, custom-calls, sends and copies are at
most those of the pure-JAX program on ``nnx.split`` state (the independent oracle)."""

import importlib.util
import sys
from pathlib import Path

import jax
import pytest

_SPEC = importlib.util.spec_from_file_location('program_cost', Path(__file__).parents[1] / 'benchmarks' / 'program_cost.py')
program_cost = sys.modules['program_cost'] = importlib.util.module_from_spec(_SPEC)  # dataclasses look it up
_SPEC.loader.exec_module(program_cost)


def _needs_devices(program):
  few = len(jax.devices()) < program.devices
  return pytest.mark.skipif(few, reason=f'needs {program.devices} devices, {len(jax.devices())} here')


@pytest.mark.parametrize(
  'program', [pytest.param(p, id=p.family, marks=_needs_devices(p)) for p in program_cost.PROGRAMS])
def test_brainnx_program_costs_at_most_the_pure_program(program):
  ours, pure = program_cost.compare(program)
  assert not program_cost.excess(ours, pure), f'{program.name}: brainnx {ours} vs pure {pure}'
  assert ours['flops'] > 0 and pure['flops'] > 0  # the comparison saw a real program


def test_the_count_sees_what_it_counts():
  """The HLO counter finds a while loop, a conditional and a host call where jax.jit puts them
  (a callback is a custom-call on CPU and GPU, a send to the host on a TPU; a branch holding a
  loop stays a conditional on every backend)."""
  import jax.numpy as jnp

  def f(x):
    jax.debug.callback(lambda v: None, x)
    twice = lambda x: jax.lax.fori_loop(0, jnp.int32(x[0]), lambda i, y: y * 2, x)  # noqa: E731
    y = jax.lax.cond(x.sum() > 0, twice, lambda x: x - 1, x)
    return jax.lax.fori_loop(0, jnp.int32(x[1]), lambda i, y: y * 2, y)

  row = program_cost.cost(jax.jit(f).lower(jnp.ones(3)).compile())
  assert row['while'] >= 1 and row['conditional'] >= 1 and row['custom-call'] + row['send'] >= 1
