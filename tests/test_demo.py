"""python -m brainnx.demo: Figure 1 of Deep Ensembles, flags, checkpoints, Ctrl-C.

Oracles: the paper's loss and the members' training written in plain jax + optax on their
arrays (``helpers.demo_training_in_plain_jax``); beside it, an uninterrupted run for resumed ones.
"""

import os
import pathlib
import re
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from brainnx import demo
from brainnx.examples import ensemble as problem
from brainnx.examples.ensemble_output import have_matplotlib
from helpers import child_env, demo_training_in_plain_jax, needs_devices

ENV = child_env()


def test_demo_draws_the_four_panels_of_figure_1(tmp_path, capsys):
  result = demo.main(['--steps', '300', '--seed', '1', '--out', str(tmp_path)])
  assert result['png'] == tmp_path / 'ensemble.png' and result['png'].stat().st_size > 10_000
  assert result['losses'].shape == (300, 12)  # 5 + 1 + 1 + 5 networks, the paper's panels
  assert np.all(result['losses'][-1] < result['losses'][0])
  assert [p.size for p in result['panels']] == [5, 1, 1, 5]
  text = capsys.readouterr().out
  assert 'trained 12 networks (the four panels of Figure 1)' in text and 'wrote' in text
  for panel, report in zip(result['panels'], result['reports']):
    row = next(line for line in text.splitlines() if line.startswith(panel.title))
    assert f'{report["ratio_left"]:.1f}x' in row and f'{report["covered"]:.0%}' in row
  from PIL import Image  # matplotlib's own dependency

  width, height = Image.open(result['png']).size
  assert width > 3.5 * height  # four panels side by side


@pytest.mark.parametrize('seed', [0, 1, 2])
def test_the_ensemble_widens_outside_the_data_on_both_sides(seed):
  """Panel (iv) at the default flags: the predictive std outside the data, on each side alone,
  is well above the std inside it, for every seed tried (benchmarks/figure1_seeds.py: 20 seeds)."""
  run = demo.train(seed=seed, progress=False)
  ensemble_iv = run['reports'][3]
  assert ensemble_iv['ratio_left'] > 1.5 and ensemble_iv['ratio_right'] > 1.5, ensemble_iv
  assert ensemble_iv['covered'] > 0.6  # x^3 within ± 3 std on most of [-6, 6]
  # the mixture is the members' Gaussians pooled: recompute it from the networks' outputs
  members = run['predictions'][run['panels'][3].rows]
  mean = members[..., 0].mean(0)
  var = (members[..., 1] + members[..., 0] ** 2).mean(0) - mean**2
  g = np.asarray(run['data'][2])[:, 0]
  inside = np.sqrt(var)[np.abs(g) <= 4].mean()
  np.testing.assert_allclose(np.sqrt(var)[g < -4].mean() / inside, ensemble_iv['ratio_left'], rtol=1e-5)
  # panel (i) is the spread of the squared-error networks' means, not a mixture of variances
  means_i = run['predictions'][run['panels'][0].rows][..., 0]
  np.testing.assert_allclose(means_i.std(0)[np.abs(g) <= 4].mean(), run['reports'][0]['std_inside'], rtol=1e-5)


def test_data_and_predictive_mixture_follow_the_paper():
  x, y, grid = problem.make_data(0)
  assert x.shape == y.shape == (20, 1) and float(jnp.abs(x).max()) <= 4.0
  assert 1.5 < float(jnp.std(y - x**3)) < 4.5  # eps ~ N(0, 3^2)
  assert float(grid.min()) == -6.0 and float(grid.max()) == 6.0
  # mixture of two Gaussians N(0, 1) and N(2, 1): mean 1, variance 1 + 1 = 2
  preds = np.array([[[0.0, 1.0]], [[2.0, 1.0]]])
  mean, std = problem.mixture(preds)
  np.testing.assert_allclose([mean[0], std[0]], [1.0, np.sqrt(2.0)])
  panels = problem.figure_panels(3)
  assert [(p.size, p.nll, p.adversarial) for p in panels] == [
    (3, False, False), (1, True, False), (1, True, True), (3, True, True)]
  nll, adversarial = problem.roles(panels)
  assert nll.tolist() == [False] * 3 + [True] * 5 and adversarial.tolist() == [False] * 4 + [True] * 4


@pytest.mark.parametrize('fraction', [None, '0.05', '0'])
def test_first_step_losses_are_the_papers_losses_in_plain_jax(fraction):
  """Every panel's loss (squared error, NLL, NLL + fast gradient sign) at the first step, network
  by network, against the same loss written in plain jax on the demo's initial parameters."""
  members, seed = 2, 2
  x, y, _ = problem.make_data(seed)
  ensemble, _ = demo.build(2 * members + 2, seed)
  stacked = nnx.to_pure_dict(nnx.state(ensemble, nnx.Param))
  flags = [] if fraction is None else ['--adversarial', fraction]
  result = demo.main(['--members', str(members), '--steps', '2', '--seed', str(seed), '--no-plot'] + flags)
  eps = float(fraction or 0.01) * float(x.max() - x.min())

  def loss(params, x, nll):
    out = jax.nn.relu(x @ params['l1']['kernel'] + params['l1']['bias']) @ params['l2']['kernel']
    mean, var = out[:, :1] + params['l2']['bias'][0], jax.nn.softplus(out[:, 1:] + params['l2']['bias'][1]) + 1e-6
    return jnp.mean(0.5 * jnp.log(var) + 0.5 * (y - mean) ** 2 / var) if nll else jnp.mean((y - mean) ** 2)

  kinds = [(False, False)] * members + [(True, False), (True, True)] + [(True, True)] * members
  for k, (nll, adversarial) in enumerate(kinds):
    params = jax.tree.map(lambda a: a[k], stacked)
    expect = loss(params, x, nll)
    if adversarial and eps:  # fast gradient sign: the loss again at x + eps * sign(d loss / d x)
      expect = expect + loss(params, x + eps * jnp.sign(jax.grad(loss, argnums=1)(params, x, nll)), nll)
    np.testing.assert_allclose(result['losses'][0, k], expect, rtol=1e-5)


def test_demo_module_entry_point(tmp_path):
  out = subprocess.run(
    [sys.executable, '-m', 'brainnx.demo', '--members', '2', '--steps', '5', '--out', str(tmp_path)],
    capture_output=True, text=True, timeout=300, env=ENV,
  )
  assert out.returncode == 0, out.stderr
  assert (tmp_path / 'ensemble.png').exists() and '(iv) Ensemble of 2 (NLL + adversarial)' in out.stdout


@pytest.mark.parametrize('flags,message', [
  (['--members', '0'], '--members must be at least 1'), (['--steps', 'many'], 'invalid int'),
  (['--bogus'], 'unrecognized'), (['--checkpoint-every', '0'], '--checkpoint-every must be'),
  (['--devices', '0'], '--devices must be'), (['--devices', '64'], 'only'),
  pytest.param(['--members', '6', '--devices', '4'], r'14 networks \(2 \* members \+ 2\).*--members 7 does', marks=needs_devices(4)),
  (['--adversarial', '-0.1'], '0 or more'), (['--process-id', '0'], 'go with --distributed'),
  (['--distributed', '127.0.0.1:1'], 'needs --num-processes'),
  (['--out', 'x.gif'], r"'\.gif' is not an image type"),
])
def test_bad_flags_are_argparse_errors(flags, message, capsys, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  with pytest.raises(SystemExit, match="^2$") as exc:  # argparse's exit status
    demo.main(flags)
  assert exc.value.code == 2
  err = capsys.readouterr().err
  assert 'usage:' in err
  assert re.search(message, err), err
  assert not list(tmp_path.iterdir())  # nothing made: no x.gif directory


def test_out_accepts_an_image_path_or_a_directory(tmp_path, capsys):
  png = tmp_path / 'figs' / 'e4.png'
  result = demo.main(['--members', '2', '--steps', '5', '--out', str(png)])
  assert result['png'] == png and png.is_file() and png.stat().st_size > 10_000
  assert f'wrote {png}' in capsys.readouterr().out
  assert demo.resolve_out(str(tmp_path / 'figs.v2') + '/') == tmp_path / 'figs.v2' / 'ensemble.png'
  assert demo.resolve_out(str(tmp_path / 'plots')) == tmp_path / 'plots' / 'ensemble.png'
  assert demo.resolve_out('fig1.PDF') == pathlib.Path('fig1.PDF')


def _state_leaves(result):
  leaves = jax.tree.leaves(nnx.state((result['ensemble'], result['optimizers'])))
  return [np.asarray(x) for x in leaves]


def _record_shapes(directory: pathlib.Path, step: int):
  import orbax.checkpoint as ocp

  meta = ocp.StandardCheckpointer().metadata(directory / str(step) / 'state')
  return jax.tree.map(lambda a: a.shape, meta.item_metadata.tree)


def test_checkpoint_resume_equals_uninterrupted(tmp_path, capsys):
  flags = ['--members', '2', '--steps', '30', '--checkpoint-every', '10', '--no-plot']
  whole = demo.main(flags + ['--checkpoint-dir', str(tmp_path / 'a')])
  assert whole['step'] == 30 and whole['losses'].shape == (30, 6) and whole['trained'] == 30
  # every checkpoint holds the same fixed-size arrays (no growing loss history)
  assert _record_shapes(tmp_path / 'a', 20) == _record_shapes(tmp_path / 'a', 30)
  assert _record_shapes(tmp_path / 'a', 30)['record'] == {'first': (6,), 'last': (6,)}
  # interrupted after the checkpoint at step 10, then the same command again
  demo.main(['--members', '2', '--steps', '10', '--checkpoint-every', '10', '--no-plot',
             '--checkpoint-dir', str(tmp_path / 'b')])
  capsys.readouterr()
  resumed = demo.main(flags + ['--checkpoint-dir', str(tmp_path / 'b')])
  text = capsys.readouterr().out
  assert 'resumed from' in text and 'steps 11-30' in text and resumed['step'] == 30 and resumed['trained'] == 20
  np.testing.assert_array_equal(resumed['losses'], whole['losses'])
  for a, b in zip(_state_leaves(resumed), _state_leaves(whole), strict=True):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_allclose(whole['losses'], demo_training_in_plain_jax(2, 0, 30)[0], rtol=1e-4, atol=1e-6)
  # a run without checkpoints trains in one loop: equal up to float rounding
  plain = demo.main(['--members', '2', '--steps', '30', '--no-plot'])
  np.testing.assert_allclose(plain['losses'], whole['losses'], rtol=1e-4, atol=1e-6)
  capsys.readouterr()
  # a finished run resumes to itself and says it trained nothing; other settings are refused
  for steps, word in (('30', 'is at step 30'), ('20', 'is past step 30')):
    again = demo.main(['--members', '2', '--steps', steps, '--checkpoint-every', '10', '--no-plot',
                       '--checkpoint-dir', str(tmp_path / 'a')])
    text = capsys.readouterr().out
    assert f'nothing to train: the checkpoint in {tmp_path / "a"} {word}' in text and 'trained 6' not in text
    assert again['trained'] == 0 and again['step'] == 30
    np.testing.assert_array_equal(again['losses'], whole['losses'])
  with pytest.raises(SystemExit, match="^2$") as exc:  # argparse's exit status
    demo.main(['--members', '3', '--steps', '30', '--no-plot', '--checkpoint-dir', str(tmp_path / 'a')])
  assert exc.value.code == 2 and 'another run' in capsys.readouterr().err


def test_ctrl_c_during_a_save_prints_one_message_and_the_run_resumes(tmp_path, capsys, monkeypatch):
  saves = []
  real_save = demo.Checkpoints.save

  def save_then_ctrl_c(self, step, *args):
    if step == 20:  # Ctrl-C arrives while the second checkpoint is written
      os.kill(os.getpid(), signal.SIGINT)
    real_save(self, step, *args)
    saves.append(step)

  monkeypatch.setattr(demo.Checkpoints, 'save', save_then_ctrl_c)
  flags = ['--members', '2', '--steps', '40', '--checkpoint-every', '10', '--no-plot',
           '--checkpoint-dir', str(tmp_path / 'c')]
  with pytest.raises(SystemExit, match="^130$") as exc:  # the exit status of a Ctrl-C
    demo.main(flags)
  err = capsys.readouterr().err
  assert exc.value.code == 130 and saves == [10, 20]  # the save in progress was completed
  assert err.count('interrupted') == 1 and 'after step 20, which is saved' in err and 'Traceback' not in err
  monkeypatch.setattr(demo.Checkpoints, 'save', real_save)
  resumed = demo.main(flags)
  whole = demo.main(flags[:-1] + [str(tmp_path / 'd')])
  assert resumed['trained'] == 20
  np.testing.assert_array_equal(resumed['losses'], whole['losses'])


def test_ctrl_c_of_the_command_is_one_clean_message(tmp_path):
  proc = subprocess.Popen(
    [sys.executable, '-m', 'brainnx.demo', '--members', '2', '--steps', '100000', '--checkpoint-every', '1',
     '--no-plot', '--checkpoint-dir', str(tmp_path / 'ck')],
    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=tmp_path,
    # Ctrl-C as a terminal delivers it, even where this process was started in the background
    # by a shell, which ignores SIGINT there and in every process started from it
    preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
  )
  try:
    for line in proc.stdout:
      if line.startswith('steps 5-5'):
        break
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.communicate()
  assert proc.returncode == 130, err[-2000:]
  assert 'Traceback' not in err and 'ERROR' not in err and err.count('interrupted') == 1, err[-2000:]
  assert 'which is saved: run the same command to resume' in err


def test_runs_without_matplotlib(tmp_path):
  code = (
    'import sys; sys.modules["matplotlib"] = None\n'  # makes `import matplotlib` fail
    'from brainnx import demo\n'
    f'demo.main(["--members", "2", "--steps", "5", "--out", {str(tmp_path)!r}])\n'
  )
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=300, env=ENV)
  assert out.returncode == 0, out.stderr
  assert 'matplotlib is not installed' in out.stderr and '(i) Ensemble of 2 (MSE)' in out.stdout
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


@needs_devices(2)
def test_devices_split_the_networks_and_equal_one_device(tmp_path, capsys):
  flags = ['--members', '3', '--steps', '20', '--no-plot']
  one = demo.main(flags)
  two = demo.main(flags + ['--devices', '2'])
  assert 'on 2 device(s) in 1 process(es)' in capsys.readouterr().out
  kernel = two['ensemble'].l1.kernel.get_value()
  assert {s.data.shape[0] for s in kernel.addressable_shards} == {4}  # 8 networks over 2 devices
  np.testing.assert_allclose(two['losses'], one['losses'], rtol=1e-5, atol=1e-6)
  # and both are the members trained one by one in plain jax + optax
  losses, params = demo_training_in_plain_jax(3, 0, 20)
  np.testing.assert_allclose(one['losses'], losses, rtol=1e-5, atol=1e-6)
  trained = nnx.to_pure_dict(nnx.state(two['ensemble'], nnx.Param))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), trained, params)


@pytest.mark.parametrize('flags, said', [
  (['--out', '/proc/nope/x.png'], '--out /proc/nope/x.png: cannot create the directory /proc/nope'),
  (['--out', '/proc/fig.png'], '--out /proc/fig.png: cannot write /proc/fig.png'),  # refused to root too
  (['--no-plot', '--save', '/proc/params.npz'], '--save /proc/params.npz: cannot write /proc/params.npz'),
  (['--no-plot', '--save', '/proc/params'], '--save /proc/params: cannot write /proc/params.npz'),
  (['--no-plot', '--checkpoint-dir', '/proc/ckpt'], '--checkpoint-dir /proc/ckpt: cannot create the directory'),
], ids=['out-directory', 'out-file', 'save', 'save-without-suffix', 'checkpoint-dir'])
def test_a_path_that_cannot_be_written_is_refused_in_one_line_before_training(flags, said, capsys, monkeypatch):
  trained = []
  monkeypatch.setattr(demo, 'make_trainer', lambda *a, **k: trained.append(1))
  with pytest.raises(SystemExit, match='^2$'):  # argparse's exit status, and nothing trained
    demo.main(['--members', '2', '--steps', '5', *flags])
  err = capsys.readouterr().err
  assert err.splitlines() == [f'python -m brainnx.demo: error: {err.split("error: ", 1)[1].strip()}']
  assert said in err and 'Traceback' not in err
  assert trained == []


@pytest.mark.skipif(os.geteuid() == 0, reason='root ignores permissions: the /proc cases above cover root')
def test_a_read_only_directory_is_refused_before_training(tmp_path, capsys, monkeypatch):
  trained = []
  monkeypatch.setattr(demo, 'make_trainer', lambda *a, **k: trained.append(1))
  locked = tmp_path / 'locked'
  locked.mkdir()
  locked.chmod(0o500)
  try:
    for flags in (['--out', str(locked / 'x.png')], ['--no-plot', '--save', str(locked / 'p.npz')],
                  ['--no-plot', '--checkpoint-dir', str(locked)]):
      with pytest.raises(SystemExit, match='^2$'):
        demo.main(['--members', '2', '--steps', '5', *flags])
      assert 'cannot write' in capsys.readouterr().err and trained == []
  finally:
    locked.chmod(0o700)


def test_a_writable_path_is_probed_without_a_trace(tmp_path, monkeypatch):
  """The probe leaves nothing behind: no file where the plot or the checkpoints will go, and an
  existing file unchanged."""
  class Stop(Exception):
    pass

  def stop(*args, **kwargs):
    raise Stop

  monkeypatch.setattr(demo, 'make_trainer', stop)
  existing = tmp_path / 'params.npz'
  existing.write_bytes(b'kept')
  with pytest.raises(Stop, match='^$'):
    demo.main(['--members', '2', '--steps', '5', '--out', str(tmp_path / 'fig.png'), '--save', str(existing)])
  assert sorted(p.name for p in tmp_path.iterdir()) == ['params.npz'] and existing.read_bytes() == b'kept'


@pytest.mark.skipif(not have_matplotlib(), reason='the plot needs matplotlib (the dev extra installs it)')
def test_the_spread_inset_draws_its_labels_inside_its_own_box():
  """Panel (i)'s inset: its tick labels and title overlapped the panel's curves; now every
  artist of the inset lies inside the inset's own box (checked on the drawn figure)."""
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  from brainnx.examples.ensemble_output import _spread_inset

  g = np.linspace(-6.0, 6.0, 241)
  means = np.stack([g ** 3 + k * 0.1 * g for k in range(5)])
  mean, std = means.mean(0), np.full_like(g, 0.5)
  fig, ax = plt.subplots(figsize=(4, 3.6))
  ax.plot(g, mean)
  inset = _spread_inset(ax, g, means, mean, std)
  fig.canvas.draw()
  renderer = fig.canvas.get_renderer()
  box, drawn = inset.get_window_extent(renderer), inset.get_tightbbox(renderer)
  plt.close(fig)
  edge = 2  # pixels: the spines' own width
  assert box.x0 - edge <= drawn.x0 and drawn.x1 <= box.x1 + edge, (box.extents, drawn.extents)
  assert box.y0 - edge <= drawn.y0 and drawn.y1 <= box.y1 + edge, (box.extents, drawn.extents)
