"""Python frames per warm call: what the interpreter runs around the compiled program.

Run: ``python benchmarks/frames.py`` (writes ``results/frames.md``; ``--no-write`` prints only).

A warm call of a transform runs some Python before and after the compiled program: the
check that the cached program still applies, the write-back. This script counts the Python
function calls (``sys.setprofile`` ``'call'`` events) one warm call makes, in total and in
brainnx's own files, for each brainnx transform on a small MLP, next to ``nnx.jit`` /
``nnx.vmap`` / ``nnx.grad`` and equinox's ``filter_jit`` / ``filter_vmap`` (when installed)
doing the same computation, and ``jax.jit`` on the pure pytree. Each count is exact; the table
gives the median over 5 warm calls (brainnx's counts are the same on every call; flax's move by
a few frames between runs). Every variant's output is checked equal to the pure-jax one first.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _peers  # noqa: E402
from _results import publish  # noqa: E402
from _models import MLP  # noqa: E402

import brainnx as bnx  # noqa: E402

BRAINNX = str(Path(bnx.__file__).resolve().parent)
CALLS = 5  # warm calls counted per variant (the table gives the median)


def frames(call) -> tuple[int, int]:
  """``(all Python frames, brainnx's frames)`` of one call of ``call`` (already warm)."""
  seen = collections.Counter()

  def profile(frame, event, arg):
    if event == 'call':
      seen[frame.f_code.co_filename.startswith(BRAINNX)] += 1

  sys.setprofile(profile)
  try:
    call()
  finally:
    sys.setprofile(None)
  return seen[True] + seen[False], seen[True]


def variants():
  """``{transform: [(variant, call, expected output)]}``: each call is a warm call of one variant."""
  model = MLP(4, 16, 1, rngs=nnx.Rngs(0), act=jnp.tanh)
  params = _peers.params_of([model.l1, model.l2])
  x = jnp.linspace(-1.0, 1.0, 32).reshape(8, 4)
  pure = lambda p, x: _peers.pure_mlp(p, x, jnp.tanh)  # noqa: E731
  loss = lambda p, x: (pure(p, x) ** 2).mean()  # noqa: E731
  nnx_loss = lambda m, x: (m(x) ** 2).mean()  # noqa: E731

  forward = jax.jit(pure)
  mapped = jax.jit(jax.vmap(pure, in_axes=(None, 0)))
  grads = jax.jit(jax.grad(loss))
  step = lambda c, row: (c, pure(params, row))  # noqa: E731
  scanned = jax.jit(lambda x: jax.lax.scan(step, 0.0, x)[1])

  bnx_forward = bnx.jit(lambda x: model(x))
  bnx_mapped = bnx.vmap(lambda row: model(row))
  bnx_grad = bnx.grad(lambda x: (model(x) ** 2).mean(), grad_states=model)
  bnx_step = lambda c, row: (c, model(row))  # noqa: E731 - made once: the eager cache knows it again
  bnx_remat = bnx.remat(lambda x: model(x))
  nnx_forward = nnx.jit(lambda m, x: m(x))
  nnx_mapped = nnx.jit(nnx.vmap(lambda m, row: m(row), in_axes=(None, 0)))
  nnx_grad = nnx.jit(nnx.grad(nnx_loss))

  rows = {
    'jit (a forward pass)': [
      ('jax.jit, pure pytree', lambda: forward(params, x), forward(params, x)),
      ('brainnx.jit', lambda: bnx_forward(x), None),
      ('nnx.jit', lambda: nnx_forward(model, x), None),
    ],
    'vmap (over the batch)': [
      ('jax.jit(jax.vmap), pure pytree', lambda: mapped(params, x), mapped(params, x)),
      ('brainnx.vmap', lambda: bnx_mapped(x), None),
      ('nnx.jit(nnx.vmap)', lambda: nnx_mapped(model, x), None),
    ],
    'grad (of a loss)': [
      ('jax.jit(jax.grad), pure pytree', lambda: grads(params, x), grads(params, x)),
      ('brainnx.grad', lambda: bnx_grad(x), None),
      ('nnx.jit(nnx.grad)', lambda: nnx_grad(model, x), None),
    ],
    'scan (over the rows)': [
      ('jax.jit(jax.lax.scan), pure pytree', lambda: scanned(x), scanned(x)),
      ('brainnx.scan', lambda: bnx.scan(bnx_step, 0.0, x)[1], None),
    ],
    'remat (a forward pass)': [
      ('brainnx.remat', lambda: bnx_remat(x), forward(params, x)),
    ],
  }
  if _peers.HAVE_EQX:
    eqx_model = _peers.eqx_model(params, jnp.tanh)
    eqx_forward = _peers.eqx.filter_jit(lambda m, x: m(x))
    eqx_mapped = _peers.eqx.filter_jit(_peers.eqx.filter_vmap(lambda m, row: m(row), in_axes=(None, 0)))
    rows['jit (a forward pass)'].append(('equinox.filter_jit', lambda: eqx_forward(eqx_model, x), None))
    rows['vmap (over the batch)'].append(('equinox.filter_jit(filter_vmap)', lambda: eqx_mapped(eqx_model, x), None))
  return rows


def _as_pairs(out):
  """Gradients as the pure rows give them (a list of ``(kernel, bias)``), from the ``nnx.State``
  that ``brainnx.grad`` and ``nnx.grad`` give; any other output as it is."""
  if isinstance(out, nnx.State):
    return [(out[n]['kernel'][...], out[n]['bias'][...]) for n in ('l1', 'l2')]
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--no-write', action='store_true', help='print the table only')
  args = parser.parse_args(argv)
  rows = variants()
  lines = ['## Python frames per warm call', '',
           '| variant | transform | frames | of them brainnx\'s |', '|---|---|---:|---:|']
  for transform, cases in rows.items():
    reference = None
    for variant, call, expected in cases:
      out = call()
      out = call()  # warm: every cache filled
      reference = expected if expected is not None else reference
      out = _as_pairs(out)
      assert jax.tree.structure(out) == jax.tree.structure(reference), (variant, out)
      for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(reference)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=variant)
      counts = sorted(frames(call) for _ in range(CALLS))
      total, ours = counts[CALLS // 2]
      lines.append(f'| {variant} | {transform} | {total} | {ours} |')
  if not _peers.HAVE_EQX:
    lines += ['', f'equinox rows left out: {_peers.EQX_WHY}']
  publish('\n'.join(lines), 'frames.py', dry_run=args.no_write, statistic='median of 5 warm calls, each an exact count')
  return 0


if __name__ == '__main__':
  raise SystemExit(main())
