"""python -m brainnx.demo: runs, writes the plot, the loss falls, flags are checked."""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from brainnx import demo


def test_demo_trains_and_writes_png(tmp_path, capsys):
  result = demo.main(['--members', '3', '--steps', '100', '--seed', '1', '--out', str(tmp_path)])
  assert result['png'].exists() and result['png'].stat().st_size > 10_000
  losses = result['losses']
  assert losses.shape == (100, 3)
  assert np.all(losses[-1] < 0.6 * losses[0]), losses[[0, -1]]
  text = capsys.readouterr().out
  assert 'member 2: final train loss' in text and 'ensemble-mean RMSE' in text


def test_demo_module_entry_point(tmp_path):
  out = subprocess.run(
    [sys.executable, '-m', 'brainnx.demo', '--members', '2', '--steps', '5', '--out', str(tmp_path)],
    capture_output=True, text=True, timeout=300,
  )
  assert out.returncode == 0, out.stderr
  assert (tmp_path / 'ensemble.png').exists()


@pytest.mark.parametrize('flags', [
  ['--members', '0'], ['--steps', 'many'], ['--bogus'], ['--checkpoint-every', '0'], ['--devices', '0'],
  ['--devices', '64'], ['--members', '6', '--devices', '4'], ['--process-id', '0'],
  ['--distributed', '127.0.0.1:1'],
])
def test_bad_flags_are_argparse_errors(flags, capsys):
  with pytest.raises(SystemExit, match='^2$') as exc:  # argparse's exit status
    demo.main(flags)
  assert exc.value.code == 2
  assert 'usage:' in capsys.readouterr().err


def test_out_accepts_an_image_path(tmp_path, capsys):
  png = tmp_path / 'figs' / 'e4.png'
  result = demo.main(['--members', '2', '--steps', '5', '--out', str(png)])
  assert result['png'] == png and png.is_file() and png.stat().st_size > 10_000
  assert not (png / 'ensemble.png').exists()
  text = capsys.readouterr().out
  assert f'wrote {png}' in text
  # the held-out truth outside the ensemble's band is reported, as the plot shows it
  assert 0.0 < result['outside_band'] <= 1.0 and result['outside_intervals']
  assert 'outside the ensemble mean ± 2 std' in text


def _state_leaves(result):
  import jax
  from flax import nnx

  leaves = jax.tree.leaves(nnx.state((result['ensemble'], result['optimizers'])))
  return [np.asarray(x) for x in leaves]


def test_checkpoint_resume_equals_uninterrupted(tmp_path, capsys):
  flags = ['--members', '2', '--steps', '30', '--checkpoint-every', '10', '--no-plot']
  whole = demo.main(flags + ['--checkpoint-dir', str(tmp_path / 'a')])
  assert whole['step'] == 30 and whole['losses'].shape == (30, 2)
  # interrupted after the checkpoint at step 10, then the same command again
  demo.main(['--members', '2', '--steps', '10', '--checkpoint-every', '10', '--no-plot',
             '--checkpoint-dir', str(tmp_path / 'b')])
  capsys.readouterr()
  resumed = demo.main(flags + ['--checkpoint-dir', str(tmp_path / 'b')])
  assert 'resumed from' in capsys.readouterr().out and resumed['step'] == 30
  np.testing.assert_array_equal(resumed['losses'], whole['losses'])
  for a, b in zip(_state_leaves(resumed), _state_leaves(whole), strict=True):
    np.testing.assert_array_equal(a, b)
  # a run without checkpoints trains in one loop: equal up to float rounding
  plain = demo.main(['--members', '2', '--steps', '30', '--no-plot'])
  np.testing.assert_allclose(plain['losses'], whole['losses'], rtol=1e-4, atol=1e-6)
  # a finished run resumes to itself; other settings are refused
  again = demo.main(flags + ['--checkpoint-dir', str(tmp_path / 'a')])
  assert 'nothing left to train' in capsys.readouterr().out
  np.testing.assert_array_equal(again['losses'], whole['losses'])
  with pytest.raises(SystemExit, match='^2$') as exc:
    demo.main(['--members', '3', '--steps', '30', '--no-plot', '--checkpoint-dir', str(tmp_path / 'a')])
  assert exc.value.code == 2 and 'another run' in capsys.readouterr().err


def test_runs_without_matplotlib(tmp_path):
  code = (
    'import sys; sys.modules["matplotlib"] = None\n'  # makes `import matplotlib` fail
    'from brainnx import demo\n'
    f'demo.main(["--members", "2", "--steps", "5", "--out", {str(tmp_path)!r}])\n'
  )
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr
  assert 'matplotlib is not installed' in out.stderr and 'member 1: final train loss' in out.stdout
  assert not list(tmp_path.iterdir())


@pytest.mark.skipif(not os.environ.get('BRAINNX_TEST_INSTALL'), reason='set BRAINNX_TEST_INSTALL=1: builds a venv (downloads jax, flax)')
def test_plain_install_in_a_fresh_venv_runs_the_demo(tmp_path):
  """``pip install .`` without extras, in an empty venv, runs the demo (and skips the plot)."""
  import venv

  root = pathlib.Path(__file__).resolve().parents[1]
  venv.create(tmp_path / 'venv', with_pip=True)
  python = tmp_path / 'venv' / 'bin' / 'python'
  subprocess.run([str(python), '-m', 'pip', 'install', '-q', str(root)], check=True, timeout=1800)
  out = subprocess.run(
    [str(python), '-m', 'brainnx.demo', '--members', '2', '--steps', '5', '--out', str(tmp_path / 'e4.png'),
     '--checkpoint-dir', str(tmp_path / 'ckpt')],
    capture_output=True, text=True, timeout=600, cwd=tmp_path,
  )
  assert out.returncode == 0, out.stderr
  assert 'matplotlib is not installed' in out.stderr and (tmp_path / 'ckpt' / '5').is_dir()


def test_devices_split_the_members_and_equal_one_device(tmp_path, capsys):
  flags = ['--members', '4', '--steps', '20', '--no-plot']
  one = demo.main(flags)
  two = demo.main(flags + ['--devices', '2'])
  assert 'on 2 device(s) in 1 process(es)' in capsys.readouterr().out
  kernel = two['ensemble'].l1.kernel.get_value()
  assert {s.data.shape[0] for s in kernel.addressable_shards} == {2}
  np.testing.assert_allclose(two['losses'], one['losses'], rtol=1e-5, atol=1e-6)
