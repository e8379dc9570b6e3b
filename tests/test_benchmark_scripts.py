"""Every benchmark script runs: each one's quick mode (``benchmarks/run_all.py`` holds its
arguments) exits 0 and leaves its table, written into a temporary folder or printed, so no
script breaks silently between the runs that regenerate the committed tables."""

import importlib.util
import pathlib
import subprocess
import sys

import pytest

from helpers import child_env

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / 'benchmarks'
_spec = importlib.util.spec_from_file_location('run_all', BENCHMARKS / 'run_all.py')
run_all = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run_all)
NOT_BENCHMARKS = {'run_all', 'check_readme', 'readme_figures'}  # the runner and the README's checks


def test_every_script_has_a_quick_mode_in_the_runner():
  scripts = {p.stem for p in BENCHMARKS.glob('*.py') if not p.stem.startswith('_')} - NOT_BENCHMARKS
  assert scripts == set(run_all.SCRIPTS), f'add {sorted(scripts - set(run_all.SCRIPTS))} to run_all.SCRIPTS'


@pytest.mark.scripts  # minutes of processes: .ci/run runs them after the suite (pytest -m scripts)
@pytest.mark.parametrize('name', sorted(run_all.SCRIPTS))
def test_a_benchmark_script_runs_in_its_quick_mode(name, tmp_path):
  _, quick, writes = run_all.SCRIPTS[name]
  env = child_env(BRAINNX_RESULTS_DIR=str(tmp_path))
  env.pop('XLA_FLAGS', None)  # each script sets the devices it needs
  done = subprocess.run([sys.executable, str(BENCHMARKS / f'{name}.py'), *quick], capture_output=True, text=True,
                        env=env, timeout=600, cwd=tmp_path)
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
  tables = list(tmp_path.glob('*.md'))
  if writes:
    assert tables or '|---' in done.stdout, f'{name} wrote no table into {tmp_path}'
  else:
    assert '|---' in done.stdout, f'{name} printed no table'
  assert not any(p.read_text().strip() == '' for p in tables)
