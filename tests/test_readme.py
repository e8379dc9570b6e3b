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


def test_mesh_snippet_runs_and_splits_the_members():
  assert jax.device_count() >= 4, 'needs the 4 CPU devices that tests/conftest.py forces'
  import brainnx as bnx

  (block,) = [b for b in BLOCKS if 'state_shardings' in b]
  rngs = nnx.Rngs(0)
  ensemble = bnx.vmap(lambda: nnx.Linear(2, 2, rngs=rngs), axis_size=8)()
  optimizers = bnx.vmap(lambda m: nnx.Optimizer(m, optax.adam(1e-2), wrt=nnx.Param))(ensemble)

  def member_step(model, opt, x):
    loss, grads = bnx.value_and_grad(lambda m: (m(x) ** 2).mean(), argnums=0)(model)
    opt.update(model, grads)
    return loss

  namespace = dict(prelude(), member_step=member_step, ensemble=ensemble, optimizers=optimizers, x=jnp.ones((4, 2)))
  exec(block, namespace)
  kernel = ensemble.kernel.get_value()
  assert {s.data.shape[0] for s in kernel.addressable_shards} == {2}
  assert list(jax.device_get(optimizers.step.get_value())) == [1] * 8
