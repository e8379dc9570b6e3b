"""Many hosts: the demo as 2 processes under ``jax.distributed`` equals one process.

Both processes run on 127.0.0.1 (a free port, gloo collectives, 2 CPU devices each) and are
bounded by a timeout; the oracles are the same training in this process on its 4 devices, and
the networks trained one by one in plain jax + optax.
"""

import numpy as np

from brainnx import demo
from helpers import demo_training_in_plain_jax, needs_devices, run_processes

TIMEOUT_S = 240
FLAGS = ['--members', '5', '--steps', '5', '--no-plot']  # 12 networks over 4 devices


@needs_devices(4)  # the one-process oracle
def test_two_processes_train_the_sharded_ensemble_as_one_process_does(tmp_path):
  logs = run_processes('brainnx.demo', [*FLAGS, '--save', str(tmp_path / 'many.npz')], tmp_path, timeout_s=TIMEOUT_S)
  assert 'on 4 device(s) in 2 process(es)' in logs[0]

  demo.main([*FLAGS, '--devices', '4', '--save', str(tmp_path / 'one.npz')])
  many, one = np.load(tmp_path / 'many.npz'), np.load(tmp_path / 'one.npz')
  assert sorted(many) == sorted(one) and 'l1/kernel' in one
  for name in one:
    np.testing.assert_allclose(many[name], one[name], rtol=1e-6, atol=1e-7, err_msg=name)
  # and the one-process run is the networks trained one by one in plain jax + optax
  _, params = demo_training_in_plain_jax(5, 0, 5)
  for layer in ('l1', 'l2'):
    for leaf in ('kernel', 'bias'):
      np.testing.assert_allclose(one[f'{layer}/{leaf}'], params[layer][leaf], rtol=1e-5, atol=1e-6)
