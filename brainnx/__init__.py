"""brainnx: brainstate-style stateful transforms for Flax NNX."""

from brainnx._filters import BatchAxisError
from brainnx._grad import grad, value_and_grad
from brainnx._jit import jit
from brainnx._progress import ProgressBar
from brainnx._loops import checkpointed_for_loop, checkpointed_scan, for_loop, fori_loop, scan, while_loop
from brainnx._map import map
from brainnx._mapping import vmap, vmap_new_states
from brainnx._pmap import pmap
from brainnx._tracing import StatefulFunction, make_jaxpr

__version__ = '0.1.0'

__all__ = [
  'BatchAxisError',
  'ProgressBar',
  'StatefulFunction',
  'checkpointed_for_loop',
  'checkpointed_scan',
  'for_loop',
  'fori_loop',
  'grad',
  'jit',
  'make_jaxpr',
  'map',
  'pmap',
  'scan',
  'vmap',
  'value_and_grad',
  'vmap_new_states',
  'while_loop',
]
