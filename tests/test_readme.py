"""The README's Python snippets run (the side-by-side with a shared prelude)."""

import pathlib
import re

import jax

from helpers import needs_devices

README = pathlib.Path(__file__).resolve().parents[1] / 'README.md'
BLOCKS = re.findall(r'```python\n(.*?)```', README.read_text(), flags=re.S)


def setup_block() -> str:
  """The README's setup that both side-by-side columns start from."""
  (block,) = [b for b in BLOCKS if b.lstrip().startswith('import') and 'class MLP' in b]
  return block


def prelude() -> dict:
  """A namespace after the setup block (the comparison page's blocks start from it too)."""
  namespace = {}
  exec(setup_block(), namespace)
  return namespace


def test_every_block_but_the_columns_runs_alone():
  for block in BLOCKS:
    if 'state_shardings' in block or block.lstrip().startswith('@nnx') or 'MLP(rngs)' in block:
      continue  # the mesh snippet runs in its own test; the columns after the setup
    exec(block, {})


def test_quick_start_runs():
  namespace = {}
  exec(BLOCKS[0], namespace)
  assert int(namespace['optimizer'].step[...]) == 3


def test_side_by_side_columns_run_and_use_per_member_dropout():
  assert len(BLOCKS) >= 3
  columns = [b for b in BLOCKS if 'def train_step' in b and 'MLP(rngs)' in b]
  assert len(columns) == 2
  for block in columns:
    namespace = prelude()
    exec(block, namespace)
    loss = namespace['train_step'](namespace['model'], namespace['opt'], *(
      [namespace['dropout']] if 'rngs, x, y' in block else []), namespace['x'], namespace['y'])
    assert loss.shape == (8,)
    assert len(set(map(float, loss))) == 8


@needs_devices(4)
def test_mesh_snippet_runs_and_splits_the_members():
  (block,) = [b for b in BLOCKS if 'state_shardings' in b]
  namespace = {}
  exec(block, namespace)  # alone: it builds its own ensemble
  ensemble, optimizers = namespace['ensemble'], namespace['optimizers']
  kernel = ensemble.kernel.get_value()
  assert {s.data.shape[0] for s in kernel.addressable_shards} == {2}
  assert list(jax.device_get(optimizers.step.get_value())) == [1] * 8
