"""Notebook 05's resume recipe: ``nnx.merge(..., copy=True)`` keeps the restored state as saved,
so the "forgot the RNG state" run starts at the checkpoint's step (30), not the resumed run's.

The oracle for "as saved" is the state's own arrays before training; the notebook itself runs
by tests/test_notebooks.py (its assert cells check step 30 too), and its stored output is checked here.
"""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import brainnx as bnx

NOTEBOOK = pathlib.Path(__file__).resolve().parents[1] / 'notebooks' / '05_checkpointing.ipynb'


def _trained_state(steps):
  rngs = nnx.Rngs(0)
  ensemble = bnx.vmap(lambda: nnx.Linear(1, 1, rngs=rngs), axis_size=2)()
  optimizers = bnx.vmap(lambda m: nnx.Optimizer(m, optax.adam(1e-2), wrt=nnx.Param))(ensemble)
  step = _step(ensemble, optimizers)
  for _ in range(steps):
    step()
  return nnx.split((ensemble, optimizers))


def _step(ensemble, optimizers):
  x = jnp.linspace(-1, 1, 8)[:, None]

  @bnx.jit
  @bnx.vmap(in_axes=(0, 0))
  def step(model, opt):
    loss, grads = bnx.value_and_grad(lambda m: ((m(x) - x) ** 2).mean(), argnums=0)(model)
    opt.update(model, grads)
    return loss

  return lambda: step(ensemble, optimizers)


def _leaves(state):
  return [np.asarray(a) for a in jax.tree.leaves(state)]


def test_merge_with_copy_leaves_the_restored_state_as_saved():
  graphdef, restored = _trained_state(30)
  saved = _leaves(restored)
  for copy, moves in ((True, False), (False, True)):
    ensemble, optimizers = nnx.merge(graphdef, restored, copy=copy)
    assert list(optimizers.step[...]) == [30, 30]
    step = _step(ensemble, optimizers)
    for _ in range(30):
      step()
    assert list(optimizers.step[...]) == [60, 60]
    if not moves:  # a second run built from the restored state starts at step 30 again
      again = nnx.merge(graphdef, restored, copy=True)[1]
      assert list(again.step[...]) == [30, 30]
      for a, b in zip(_leaves(restored), saved, strict=True):
        np.testing.assert_array_equal(a, b)
    else:  # without copy, training the merged modules advanced the restored state itself
      assert list(nnx.merge(graphdef, restored, copy=True)[1].step[...]) == [60, 60]


def test_notebook_05_forgot_the_rng_run_starts_at_step_30():
  cells = json.loads(NOTEBOOK.read_text())['cells']
  code = [''.join(c['source']) for c in cells if c['cell_type'] == 'code']
  merges = [line for block in code for line in block.splitlines() if 'nnx.merge(' in line]
  assert merges and all('copy=True' in line for line in merges), merges
  (forgot,) = [c for c in cells if c['cell_type'] == 'code' and 'forgot = make_step' in ''.join(c['source'])]
  assert 'assert list(optimizers.step[...]) == [SAVE_AT] * MEMBERS' in ''.join(forgot['source'])
  text = ''.join(''.join(o.get('text', '')) for o in forgot['outputs'])
  assert text.startswith('started at step 30 ')
