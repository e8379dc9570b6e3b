"""brainnx: brainstate-style stateful transforms for Flax NNX."""

from brainnx._jit import jit
from brainnx._tracing import StatefulFunction, make_jaxpr

__version__ = '0.1.0'

__all__ = ['StatefulFunction', 'jit', 'make_jaxpr']
