"""python -m brainnx.demo: runs, writes the plot, the loss falls, flags are checked."""

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


@pytest.mark.parametrize('flags', [['--members', '0'], ['--steps', 'many'], ['--bogus']])
def test_bad_flags_are_argparse_errors(flags, capsys):
  with pytest.raises(SystemExit) as exc:
    demo.main(flags)
  assert exc.value.code == 2
  assert 'usage:' in capsys.readouterr().err
