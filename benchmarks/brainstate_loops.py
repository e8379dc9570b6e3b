"""brainnx's loops next to brainstate's: the checkpointed loop's memory and one bar under vmap.

Run: ``python benchmarks/brainstate_loops.py`` (needs the ``bench`` extra for brainstate; writes
``benchmarks/results/brainstate_loops.md``).

**Checkpointed loop.** The gradient of a spiking network's loss with respect to its input
weights: 256 leaky integrate-and-fire neurons driven by 64 fixed inputs for 2,000 steps, a
spike through a surrogate gradient (fast sigmoid), the loss the squared distance of the mean
firing rate from a target. The membrane potential is a state the loop body writes
(``brainstate.ShortTermState`` / ``nnx.Variable``), the weights a parameter it reads
(``brainstate.ParamState`` / ``nnx.Param``). Rows: ``jax.lax.scan`` on the pure arrays (every
step saved), and each library's ``checkpointed_for_loop`` with ``base=16``. "XLA temp" is the
compiled gradient program's temporary buffer size (``memory_analysis``), a property of the
program, not a timing; time is the median of interleaved rounds. Every row's gradient is checked
equal to ``jax.lax.scan``'s before anything is measured.

**Bars under vmap.** A 50-step ``for_loop`` with a ``ProgressBar`` inside a ``vmap`` over 4
elements: how many bars each library draws (brainnx's step counter is never batched).
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).parent))
from _peers import HAVE_BST, brainstate, notes, versions  # noqa: E402
from _results import write  # noqa: E402

import brainnx as bnx  # noqa: E402

N_IN, N, STEPS, BASE = 64, 256, 2000, 16
TAU, THRESHOLD, TARGET = 20.0, 1.0, 0.05


@jax.custom_jvp
def spike(v):
  return (v > 0).astype(v.dtype)


@spike.defjvp
def _spike_jvp(primals, tangents):
  (v,), (dv,) = primals, tangents
  return spike(v), dv / (1.0 + 10.0 * jnp.abs(v)) ** 2  # fast-sigmoid surrogate


def lif_step(v, w, x):
  """One step of the neurons: ``(v, s)`` after input ``x`` through weights ``w``."""
  v = v + (-v + x @ w) / TAU
  s = spike(v - THRESHOLD)
  return v * (1.0 - s), s


def inputs():
  key = jax.random.key(0)
  x = jax.random.uniform(key, (STEPS, N_IN)) * 4.0
  w = jax.random.normal(jax.random.key(1), (N_IN, N)) * 0.5
  return x, w


def rate_loss(spikes):
  return (spikes.mean() - TARGET) ** 2


def scan_grad(x, w0):
  def loss(w):
    _, s = jax.lax.scan(lambda v, xt: lif_step(v, w, xt), jnp.zeros(N), x)
    return rate_loss(s)

  return jax.jit(jax.grad(loss)), (w0,)


def brainnx_grad(x, w0):
  v, w = nnx.Variable(jnp.zeros(N)), nnx.Param(w0)

  def step(xt):
    v[...], s = lif_step(v[...], w[...], xt)
    return s

  def loss():
    v[...] = jnp.zeros(N)
    return rate_loss(bnx.checkpointed_for_loop(step, x, base=BASE))

  return bnx.jit(bnx.grad(loss, grad_states=w)), ()


def brainstate_grad(x, w0):
  T = brainstate.transform
  v, w = brainstate.ShortTermState(jnp.zeros(N)), brainstate.ParamState(w0)

  def step(xt):
    v.value, s = lif_step(v.value, w.value, xt)
    return s

  def loss():
    v.value = jnp.zeros(N)
    return rate_loss(T.checkpointed_for_loop(step, x, base=BASE))

  return T.jit(T.grad(loss, grad_states=w)), ()


def temp_bytes(variant: str, x, w0) -> int:
  """The compiled gradient program's temporary buffers."""
  if variant == 'jax.lax.scan':
    fn, args = scan_grad(x, w0)
    return fn.lower(*args).compile().memory_analysis().temp_size_in_bytes
  if variant == 'brainnx.checkpointed_for_loop':
    fn, _ = brainnx_grad(x, w0)
    return fn.lower().compile().memory_analysis().temp_size_in_bytes
  fn, _ = brainstate_grad(x, w0)
  return fn.lower().compile().memory_analysis().temp_size_in_bytes


def bars_under_vmap(library: str) -> int:
  """Bars drawn by a 50-step for_loop with a ProgressBar, inside a vmap over 4 elements."""
  out = io.StringIO()
  if library == 'brainnx':
    total = nnx.Variable(jnp.zeros(4))

    def run(x):
      def step(i):
        total[...] += x
        return total[...]

      return bnx.for_loop(step, jnp.arange(50), pbar=bnx.ProgressBar(freq=10, file=out))

    jax.block_until_ready(bnx.vmap(run, state_in_axes={0: ...})(jnp.arange(4.0)))
  else:
    T = brainstate.transform
    total = brainstate.ShortTermState(jnp.zeros(()))

    def run(x):
      def step(i):
        total.value = total.value + x
        return total.value

      return T.for_loop(step, jnp.arange(50), pbar=T.ProgressBar(freq=10, file=out))

    jax.block_until_ready(T.vmap2(run, in_axes=0, state_out_axes={0: brainstate.ShortTermState},
                                  unexpected_out_state_mapping='auto')(jnp.arange(4.0)))
  jax.effects_barrier()
  return out.getvalue().count('| 0/50 [')


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--rounds', type=int, default=5)
  parser.add_argument('--out', type=Path, default=None, help='directory for the table (default: benchmarks/results)')
  args = parser.parse_args(argv)
  print(f'jax {jax.__version__}, {versions()}')
  if notes():
    print(notes())
  x, w0 = inputs()
  variants = {'jax.lax.scan': scan_grad, 'brainnx.checkpointed_for_loop': brainnx_grad}
  if HAVE_BST:
    variants['brainstate.checkpointed_for_loop'] = brainstate_grad
  fns = {name: make(x, w0) for name, make in variants.items()}
  want = np.asarray(fns['jax.lax.scan'][0](*fns['jax.lax.scan'][1]))
  assert np.abs(want).max() > 0, 'the oracle gradient is zero: the network does not spike'
  for name, (fn, fn_args) in fns.items():
    got = np.asarray(fn(*fn_args))
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=1e-9, err_msg=name)
  times = {name: [] for name in fns}
  for _ in range(args.rounds):
    for name, (fn, fn_args) in fns.items():
      start = time.perf_counter()
      jax.block_until_ready(fn(*fn_args))
      times[name].append(time.perf_counter() - start)
  temps = {name: temp_bytes(name, x, w0) for name in fns}
  base_time = statistics.median(times['jax.lax.scan'])
  rows = ['| variant | XLA temp | vs jax.lax.scan | gradient time | vs jax.lax.scan |', '|---|---|---|---|---|']
  for name in fns:
    t = statistics.median(times[name])
    rows.append(f'| {name} | {temps[name] / 2**20:.1f} MB | {temps[name] / temps["jax.lax.scan"]:.3f}× | '
                f'{t * 1e3:.1f} ms | {t / base_time:.2f}× |')
  bars = ['| library | bars drawn for a vmap over 4 elements |', '|---|---|', f'| brainnx | {bars_under_vmap("brainnx")} |']
  if HAVE_BST:
    bars.append(f'| brainstate | {bars_under_vmap("brainstate")} |')
  body = (f'{versions()}; {N} LIF neurons, {N_IN} inputs, {STEPS} steps, base {BASE}; every gradient checked '
          'equal to jax.lax.scan\'s\n\n## Gradient through a checkpointed loop\n\n' + '\n'.join(rows)
          + '\n\n## Progress bars under vmap\n\n' + '\n'.join(bars))
  print(body)
  path = write('brainstate_loops.md', 'brainstate_loops.py', body, out=args.out)
  print(f'wrote {path}')


if __name__ == '__main__':
  main()
