"""Test configuration: 4 CPU devices for pmap tests, hypothesis profiles."""

import os

# Must happen before jax is imported anywhere.
os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=4')
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
  'default', max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
  'long', max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile('dev', max_examples=30, deadline=None)
settings.load_profile(os.environ.get('HYPOTHESIS_PROFILE', 'default'))
