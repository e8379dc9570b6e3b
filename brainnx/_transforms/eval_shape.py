"""``eval_shape``: a stateful call's output shapes, computed by tracing only.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> import brainnx as bnx
  >>> rngs = nnx.Rngs(0)
  >>> abstract = bnx.eval_shape(lambda: nnx.Linear(1024, 1024, rngs=rngs))
  >>> abstract.kernel.shape, type(abstract.kernel.get_value()).__name__, int(rngs.default.count[...])
  ((1024, 1024), 'ShapeDtypeStruct', 0)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from brainnx._engine.caches import WeakCache
from brainnx._engine.config import Config
from brainnx._engine.errors import check_callable
from brainnx._engine.weak import weak_ref
from brainnx._engine.stateful_function import StatefulFunction


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalShapeConfig(Config):
  """``eval_shape`` has no settings: it traces (as :func:`make_jaxpr`) and runs nothing."""

  name: str = 'eval_shape'


def eval_shape(fun: Callable, *args, **kwargs) -> Any:
  """The output of ``fun(*args, **kwargs)`` with ``jax.ShapeDtypeStruct`` leaves, without computing.

  ``fun`` is traced (as by :func:`make_jaxpr`), nothing runs on a device, and no Variable
  changes: writes, RNG draws and Variables the function attaches to existing modules are all
  undone. Modules created inside come back with abstract Variables (their values are
  ``ShapeDtypeStruct``s), as ``nnx.eval_shape`` gives them: the way to build a large or
  sharded model's structure without allocating it.

  Args:
    fun: the function; it may read and write any Variable it can reach.
    *args, **kwargs: its arguments (arrays or ``jax.ShapeDtypeStruct``s).

  Returns:
    The output's structure with ``jax.ShapeDtypeStruct`` leaves.

  Raises:
    TypeError: ``fun`` is not callable, or a Variable holds a non-array value.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import brainnx as bnx
    >>> bnx.eval_shape(lambda x: x @ x.T, jax.ShapeDtypeStruct((3, 5), jnp.float32)).shape
    (3, 3)
  """
  check_callable(fun, 'eval_shape')
  shaper = _SHAPERS.get([fun])
  if shaper is None:  # one per function, so a second call with the same signature does not trace again
    config = EvalShapeConfig()
    shaper = StatefulFunction(_Weak(fun), name=getattr(fun, '__name__', None) or config.name)
    _SHAPERS.set([fun], None, shaper)
  return shaper.get_out_shapes(*args, **kwargs)


_SHAPERS = WeakCache(256)


class _Weak:
  """``fun`` held weakly (a cached StatefulFunction must not keep it alive); discovery follows
  ``__wrapped__`` to it."""

  def __init__(self, fun):
    self._ref = weak_ref(fun)

  @property
  def __wrapped__(self):
    return self._ref()

  def __call__(self, *args, **kwargs):
    return self._ref()(*args, **kwargs)
