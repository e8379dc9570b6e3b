"""Test configuration: 4 CPU devices for pmap tests, hypothesis profiles."""

import os

# Must happen before jax is imported anywhere.
os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=4')
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
  'default', max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
  'long', max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile('dev', max_examples=30, deadline=None)
settings.load_profile(os.environ.get('HYPOTHESIS_PROFILE', 'default'))


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
