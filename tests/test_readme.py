"""The README's Python snippets run (the side-by-side with a shared prelude)."""

import pathlib
import re

import jax
import jax.numpy as jnp
import optax
from flax import nnx

README = pathlib.Path(__file__).resolve().parents[1] / 'README.md'
BLOCKS = re.findall(r'```python\n(.*?)```', README.read_text(), flags=re.S)


class MLP(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(1, 32, rngs=rngs)
    self.drop = nnx.Dropout(0.1)
    self.l2 = nnx.Linear(32, 1, rngs=rngs)

  def __call__(self, x, rngs):
    return self.l2(self.drop(jax.nn.relu(self.l1(x)), rngs=rngs))


def prelude():
  import brainnx as bnx

  return {
    'jax': jax, 'jnp': jnp, 'nnx': nnx, 'optax': optax, 'bnx': bnx, 'MLP': MLP,
    'tx': optax.adam(1e-3), 'x': jnp.linspace(-1, 1, 16)[:, None], 'y': jnp.zeros((16, 1)),
  }


def test_quick_start_runs():
  namespace = {}
  exec(BLOCKS[0], namespace)
  assert int(namespace['optimizer'].step[...]) == 3


def test_side_by_side_columns_run_and_use_per_member_dropout():
  assert len(BLOCKS) >= 3
  for block in BLOCKS[1:3]:
    namespace = prelude()
    exec(block, namespace)
    loss = namespace['train_step'](namespace['model'], namespace['opt'], *(
      [namespace['dropout']] if 'rngs, x, y' in block else []), namespace['x'], namespace['y'])
    assert loss.shape == (8,)
    assert len(set(map(float, loss))) == 8
