"""Small models and comparison helpers shared by the tests."""

import functools
import logging
import os
import socket
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx


class MLP(nnx.Module):
  def __init__(self, din, dh, dout, *, rngs):
    self.l1 = nnx.Linear(din, dh, rngs=rngs)
    self.l2 = nnx.Linear(dh, dout, rngs=rngs)

  def __call__(self, x):
    return self.l2(jax.nn.relu(self.l1(x)))


ON_CPU = jax.default_backend() == 'cpu'


def assert_program_equal(got, want, ulps: int = 4) -> None:
  """The tolerance policy (tests/README.md) for one value computed by two programs (compiled
  and eager, or two different compiled programs): bit-exact on CPU; on an accelerator, where XLA
  fuses and rounds each program its own way, within ``ulps`` float32 ulps of the largest value."""
  got, want = np.asarray(got), np.asarray(want)
  if ON_CPU or not np.issubdtype(want.dtype, np.floating):
    np.testing.assert_array_equal(got, want)
  else:
    tol = ulps * np.finfo(want.dtype).eps
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * float(np.max(np.abs(want), initial=0.0)))


ACCELERATOR_RTOL = 2e-4


def assert_oracle_close(got, want, rtol: float = 1e-5) -> None:
  """The tolerance policy (tests/README.md) for a value against a NumPy oracle (a Python loop of
  NumPy ops): ``rtol`` on CPU; on an accelerator at least :data:`ACCELERATOR_RTOL`, the bound the
  TPU v5e needed (9.8e-5 measured: four tanh layers scanned, at the highest matmul precision)."""
  np.testing.assert_allclose(np.asarray(got), want, rtol=rtol if ON_CPU else max(rtol, ACCELERATOR_RTOL))


def reported_temp_bytes(lowered) -> int:
  """XLA's temporary bytes for a lowered program, as the backend reports them. A backend that
  reports none for a program that must hold temporaries (the TPU's analysis read 0 for whole
  loops) cannot judge a memory claim: the test skips, saying so."""
  n = lowered.compile().memory_analysis().temp_size_in_bytes
  if not n:
    pytest.skip(f'the {jax.default_backend()} backend reports no temporary bytes for this program')
  return n


def child_env(**extra) -> dict:
  """The environment of a process a test starts: this checkout first on ``PYTHONPATH`` (what
  is there already kept: the accelerator machine's jax lives there), and the CPU backend, so
  that the child never contends with this process for an accelerator chip."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  path = os.pathsep.join(p for p in (root, os.environ.get('PYTHONPATH', '')) if p)
  return dict(os.environ, PYTHONPATH=path, JAX_PLATFORMS='cpu', **extra)


def needs_devices(n: int):
  """Skip unless the default backend has ``n`` devices (one accelerator chip has 1; the CPU
  run of ``conftest.py`` has 4)."""
  have = jax.device_count()
  return pytest.mark.skipif(
    have < n,
    reason=f'needs {n} devices, the default backend ({jax.default_backend()}) has {have}; '
    'JAX_PLATFORMS=cpu runs it on the 4 CPU devices conftest.py forces',
  )


def mlp_pure(params, x):
  """The same MLP on a dict of arrays: the oracle."""
  h = jax.nn.relu(x @ params['l1']['kernel'] + params['l1']['bias'])
  return h @ params['l2']['kernel'] + params['l2']['bias']


def mlp_params(model):
  return {
    name: {'kernel': layer.kernel[...], 'bias': layer.bias[...]}
    for name, layer in (('l1', model.l1), ('l2', model.l2))
  }


def values_of(node):
  """A snapshot (numpy copies) of every Variable value under ``node``."""
  return {path: np.asarray(v.get_value()) if not _is_key(v) else np.asarray(jax.random.key_data(v.get_value()))
          for path, v in nnx.iter_graph(node) if isinstance(v, nnx.Variable)}


def _is_key(v):
  x = v.get_value()
  return hasattr(x, 'dtype') and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def assert_same_values(before, after):
  assert before.keys() == after.keys()
  for k in before:
    np.testing.assert_array_equal(before[k], after[k], err_msg=str(k))


def no_tracers(node):
  return not any(
    isinstance(leaf, jax.core.Tracer)
    for _, v in nnx.iter_graph(node)
    if isinstance(v, nnx.Variable)
    for leaf in jax.tree.leaves(v.get_raw_value())
  )


def run_in_threads(work, n: int) -> None:
  """Run ``work(i)`` for i in range(n) on n threads at once; re-raise the first failure."""
  errors = []

  def guarded(i):
    try:
      work(i)
    except Exception as e:  # reported below, in the calling thread
      errors.append(e)

  threads = [threading.Thread(target=guarded, args=(i,)) for i in range(n)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  if errors:
    raise errors[0]


def linear(din=3, dout=2, seed=0):
  return nnx.Linear(din, dout, rngs=nnx.Rngs(seed))


def concrete(variable):
  """The Variable's raw value, asserted to be a concrete jax.Array (no tracer)."""
  raw = variable.get_raw_value()
  assert isinstance(raw, jax.Array), type(raw)
  assert not isinstance(raw, jax.core.Tracer), raw
  return raw


def assert_same_tree(got, want):
  """Same tree, and per leaf the same shape, dtype and values."""
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    a, b = jnp.asarray(a), jnp.asarray(b)
    assert a.shape == b.shape, (a.shape, b.shape)
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    np.testing.assert_array_equal(np.asarray(a, np.float64), np.asarray(b, np.float64))


def nnx_split_draws(seed, n):
  """The oracle for one call: flax's own ``nnx.split_rngs`` + ``nnx.vmap`` drawing from Rngs(seed)."""
  @nnx.split_rngs(splits=n)
  @nnx.vmap(in_axes=0)
  def draw(rngs):
    return rngs.normal(())

  return draw(nnx.Rngs(seed))


def demo_training_in_plain_jax(members: int, seed: int, steps: int):
  """The demo's training, network by network, in plain jax + optax on dicts of arrays: the oracle.

  The demo's four panels (``2 * members + 2`` networks): squared error for panel (i), the Gaussian
  NLL for the rest, the fast-gradient-sign term for (iii) and (iv). Starts from the demo's
  initial parameters (``demo.build``); returns the losses ``(steps, networks)`` and the trained
  parameters stacked as ``{'l1': {'kernel', 'bias'}, 'l2': ...}``.
  """
  import optax

  from brainnx import demo
  from brainnx.examples import ensemble as problem

  x, y, _ = problem.make_data(seed)
  ensemble, _ = demo.build(2 * members + 2, seed)
  stacked = nnx.to_pure_dict(nnx.state(ensemble, nnx.Param))
  tx = optax.adam(problem.LEARNING_RATE)
  eps = problem.ADVERSARIAL_FRACTION * float(x.max() - x.min())

  def loss(params, x, nll):
    out = mlp_pure(params, x)
    mean, var = out[:, :1], jax.nn.softplus(out[:, 1:]) + problem.MIN_VARIANCE
    if nll:
      return jnp.mean(0.5 * jnp.log(var) + 0.5 * (y - mean) ** 2 / var)
    return jnp.mean((y - mean) ** 2)

  def total(params, nll, adversarial):
    value = loss(params, x, nll)
    if adversarial:
      x_adv = x + eps * jnp.sign(jax.grad(loss, argnums=1)(params, x, nll))
      value = value + loss(params, x_adv, nll)
    return value

  @functools.partial(jax.jit, static_argnums=(2, 3))
  def step(params, opt_state, nll, adversarial):
    value, grads = jax.value_and_grad(total)(params, nll, adversarial)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  nll_rows, adversarial_rows = problem.roles(problem.figure_panels(members))
  losses, trained = [], []
  for k in range(2 * members + 2):
    params = jax.tree.map(lambda a: a[k], stacked)
    opt_state, network_losses = tx.init(params), []
    for _ in range(steps):
      params, opt_state, value = step(params, opt_state, bool(nll_rows[k]), bool(adversarial_rows[k]))
      network_losses.append(float(value))
    losses.append(network_losses)
    trained.append(params)
  return np.array(losses).T, jax.tree.map(lambda *a: np.stack(a), *trained)


class SideBySidePage:
  """A docs page of ``# <side>: <row>`` python blocks, the two sides of each row; ``run(row,
  side)`` executes one block alone and returns its namespace (the tests' oracle compares them)."""

  def __init__(self, path, sides: tuple[str, str]):
    import re

    self.path, self.found = path, {}
    for block in re.findall(r'```python\n(.*?)```', path.read_text(), flags=re.S):
      head = re.match(rf'# ({"|".join(sides)}): ([\w-]+)\n', block)
      assert head, f'a block of docs/{path.name} does not name its side and row: {block[:60]!r}'
      self.found[head.group(2), head.group(1)] = block

  def __iter__(self):
    return iter(self.found)

  def __contains__(self, key) -> bool:
    return key in self.found

  def run(self, row: str, side: str) -> dict:
    namespace = {'__name__': f'{self.path.stem}_{row}_{side}'.replace('-', '_')}
    exec(compile(self.found[row, side], f'docs/{self.path.name} [{side}: {row}]', 'exec'), namespace)
    return namespace


def run_processes(module: str, flags: list, cwd, *, processes: int = 2, devices_each: int = 2,
                  timeout_s: float = 240) -> list[str]:
  """``python -m module *flags`` as ``processes`` ``jax.distributed`` processes on 127.0.0.1 (a
  free port, gloo collectives, ``devices_each`` CPU devices each), bounded by ``timeout_s``:
  every process must exit 0; returns their logs, process 0's first."""
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    port = s.getsockname()[1]
  env = child_env(XLA_FLAGS=f'--xla_force_host_platform_device_count={devices_each}')
  procs = [
    subprocess.Popen(
      [sys.executable, '-m', module, *flags, '--distributed', f'127.0.0.1:{port}',
       '--num-processes', str(processes), '--process-id', str(i)],
      env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    for i in range(processes)
  ]
  logs = []
  try:
    for p in procs:
      logs.append(p.communicate(timeout=timeout_s)[0])
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.communicate()
  for p, log in zip(procs, logs):
    assert p.returncode == 0, log[-3000:]
  return logs


#: Tests of ``nnx.capture``, which flax brings in 0.12.6 (brainnx supports flax from 0.12.4).
needs_capture = pytest.mark.skipif(not hasattr(nnx, 'capture'), reason='nnx.capture arrives in flax 0.12.6')


class Compiles:
  """The names of the programs XLA compiles while the block runs (from ``jax.log_compiles``)."""

  def __enter__(self):
    self.names, self._handler = [], logging.Handler()
    self._handler.emit = lambda record: self.names.append(record.getMessage())
    self._logger = logging.getLogger('jax')
    self._logger.addHandler(self._handler)
    self._level = self._logger.level
    self._logger.setLevel(logging.WARNING)
    self._log = jax.log_compiles(True)
    self._log.__enter__()
    return self

  def __exit__(self, *exc):
    self._log.__exit__(*exc)
    self._logger.removeHandler(self._handler)
    self._logger.setLevel(self._level)

  def whole_programs(self) -> int:
    return sum('_body' in m for m in self.names)

  def compiled_programs(self) -> int:
    return sum(m.startswith('Compiling jit(_body)') for m in self.names)
