"""Test configuration: 4 CPU devices for the multi-device tests, hypothesis profiles.

``BRAINNX_TEST_DEVICES=1`` forces one CPU device instead: the suite then runs as on one
accelerator chip, and the tests that need several devices skip, saying how many they need
(``helpers.needs_devices``). The device count is forced whatever ``XLA_FLAGS`` already holds: another
``--xla_force_host_platform_device_count`` in it is replaced, other flags are
kept. If JAX was imported before this file ran, the flag can no longer take
effect, and the session stops with a message instead of skipping the
multi-device tests.
"""

import os
import re
import sys

DEVICES = int(os.environ.get('BRAINNX_TEST_DEVICES', '4'))
_FLAG = '--xla_force_host_platform_device_count'


def forced_xla_flags(flags: str, devices: int = DEVICES) -> str:
  """``flags`` with the host device count set to ``devices`` (replaced if present)."""
  kept = re.sub(rf'{_FLAG}=\S*', '', flags).split()
  return ' '.join([*kept, f'{_FLAG}={devices}'])


if 'jax' in sys.modules and os.environ.get('XLA_FLAGS') != forced_xla_flags(os.environ.get('XLA_FLAGS', '')):
  raise RuntimeError(f'jax was imported before tests/conftest.py could set {_FLAG}={DEVICES} in XLA_FLAGS')
os.environ['XLA_FLAGS'] = forced_xla_flags(os.environ.get('XLA_FLAGS', ''))
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
# float32 matmuls at full precision on an accelerator too (the CPU's only precision), so oracles
# computed another way agree to float32 rounding there as well
os.environ.setdefault('JAX_DEFAULT_MATMUL_PRECISION', 'highest')

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# 40 examples per property keep tests/test_properties.py and test_state_faithful.py near a
# minute on 2 cores (each example compiles its own programs); `long` is the thorough run
settings.register_profile(
  'default', max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
  'long', max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile('dev', max_examples=10, deadline=None)
settings.load_profile(os.environ.get('HYPOTHESIS_PROFILE', 'default'))


def pytest_sessionstart(session):
  import jax

  if jax.default_backend() == 'cpu' and jax.local_device_count() != DEVICES:
    raise pytest.UsageError(f'expected {DEVICES} CPU devices from XLA_FLAGS, got {jax.local_device_count()}')


def _names_pmap(value) -> bool:
  """A transform name (``'pmap'``, a nest ``'jit(pmap)'``), alone or first in a tuple."""
  values = value if isinstance(value, tuple) else (value,)
  return any(isinstance(v, str) and re.search(r'(^|[^\w.])pmap($|[^\w.])', v) for v in values)


def pytest_collection_modifyitems(config, items):
  """With one device (an accelerator chip), the cases of parametrized tests that run ``pmap``
  over a batch of 2 or more skip, saying why; the CPU run keeps them all."""
  import jax

  if jax.device_count() >= 2:
    return
  skip = pytest.mark.skip(
    reason=f'pmap maps one element per device and this case maps 2; the default backend '
    f'({jax.default_backend()}) has 1 device: JAX_PLATFORMS=cpu runs it on 4 CPU devices'
  )
  for item in items:
    spec = getattr(item, 'callspec', None)
    if spec is not None and any(_names_pmap(v) for v in spec.params.values()):
      item.add_marker(skip)


@pytest.fixture(autouse=True)
def consume_pending_callback_errors():
  """Consume a run-time fault's error left in JAX's per-device runtime tokens.

  A ``pmap`` whose ``jax.debug.callback`` raised (``test_safety``'s run-time
  faults) keeps the failed token of each device, as plain ``jax.pmap`` does;
  JAX re-raises it at interpreter exit as "Exception ignored in atexit
  callback" tracebacks after a green run. ``jax.effects_barrier()`` re-raises
  it without forgetting it, so a clean effectful ``pmap`` over every device
  replaces those tokens, and then the barrier passes.
  """
  yield
  import jax
  import jax.numpy as jnp

  try:
    jax.effects_barrier()
  except jax.errors.JaxRuntimeError:
    n = jax.local_device_count()
    jax.block_until_ready(jax.pmap(lambda x: (jax.debug.callback(lambda _: None, x), x)[1])(jnp.zeros(n)))
    jax.effects_barrier()
