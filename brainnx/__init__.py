"""brainnx: brainstate-style stateful transforms for Flax NNX."""

import os as _os

from brainnx import _compat

# an error raised in user code under a brainnx transform shows the user's frames, not brainnx's
_compat.hide_frames_under(_os.path.dirname(__file__) + _os.sep)

from brainnx._engine.errors import BatchAxisError
from brainnx._engine.stateful_function import StatefulFunction, make_jaxpr
from brainnx._transforms.bounded_while import bounded_while_loop
from brainnx._transforms.checkpointed import checkpointed_for_loop, checkpointed_scan
from brainnx._transforms.control import cond, ifelse, switch
from brainnx._transforms.eval_shape import eval_shape
from brainnx._transforms.grad import grad, hessian, jacfwd, jacrev, jvp, value_and_grad, vjp
from brainnx._transforms.jit import jit
from brainnx._transforms.map import map
from brainnx._transforms.pmap import pmap
from brainnx._transforms.progress import ProgressBar
from brainnx._transforms.remat import checkpoint, remat
from brainnx._transforms.scan import for_loop, scan
from brainnx._transforms.shard_map import shard_map
from brainnx._transforms.vmap import vmap, vmap_new_states
from brainnx._transforms.while_loops import fori_loop, while_loop


def _version() -> str:
  """The installed distribution's version; the source tree's when brainnx is not installed."""
  from importlib.metadata import PackageNotFoundError, version

  try:
    return version('brainnx')
  except PackageNotFoundError:
    return '0.1.0'


__version__ = _version()
del _version

__all__ = [
  'BatchAxisError',
  'ProgressBar',
  'StatefulFunction',
  'bounded_while_loop',
  'checkpoint',
  'checkpointed_for_loop',
  'checkpointed_scan',
  'cond',
  'eval_shape',
  'for_loop',
  'fori_loop',
  'grad',
  'hessian',
  'ifelse',
  'jacfwd',
  'jacrev',
  'jit',
  'jvp',
  'make_jaxpr',
  'map',
  'pmap',
  'remat',
  'scan',
  'shard_map',
  'switch',
  'vjp',
  'vmap',
  'value_and_grad',
  'vmap_new_states',
  'while_loop',
]
