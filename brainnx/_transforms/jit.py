"""``jit``: compile a stateful function; Python runs once per abstract signature.

The engine's :class:`~brainnx._engine.jitted.JittedFunction` does the work;
this module is the public entry: argument checks and the options record.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> import brainnx as bnx
  >>> model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
  >>> forward = bnx.jit(lambda x: model(x))
  >>> forward(jnp.ones(2)).shape
  (2,)
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

from brainnx._engine.arguments import StaticArgs
from brainnx._engine.jitted import JitOptions, JittedFunction
from brainnx._engine.sentinels import NOT_GIVEN
from brainnx._engine.sharding import Rules
from brainnx._engine.errors import check_callable


def jit(
  fun: Callable | None = None,
  *,
  static_argnums: int | Sequence[int] = (),
  static_argnames: str | Sequence[str] = (),
  donate_argnums: int | Sequence[int] = (),
  donate_argnames: str | Sequence[str] = (),
  donate_states: Any = None,
  in_shardings: Any = NOT_GIVEN,
  out_shardings: Any = NOT_GIVEN,
  state_shardings: dict | None = None,
  **jax_jit_kwargs: Any,
) -> Callable:
  """Compile ``fun``, reading and writing the Variables it can reach.

  Works as ``jit(f)``, ``@jit`` and ``@jit(static_argnums=...)``. Variables
  come from arguments, ``self``, ``functools.partial``s, closures, globals
  and the attributes of plain objects (a ``Trainer`` holding a model and an
  optimizer); writes are visible afterwards on the same Variable objects.
  Graph nodes passed as arguments travel by reference. Static arguments are
  compared by type and value and must be hashable; ``static_argnames`` also
  covers those arguments passed by position and ``static_argnums`` those
  passed by keyword, as in ``jax.jit``. Other keyword arguments go to
  ``jax.jit``.

  ``donate_states`` (a filter, or ``True`` for every written Variable) donates the
  buffers of the matched Variables that the call writes, so XLA updates them in place
  (parameters and optimizer state of a training step), as ``jax.jit(donate_argnums=...)``
  does for the pure equivalent. Values are identical; an array read from such a Variable
  before the call (``old = v[...]``) is deleted by it, and using it afterwards raises JAX's
  deleted-buffer ``RuntimeError``: read the Variable again instead.

  ``in_shardings`` and ``out_shardings`` mean what they mean to ``jax.jit``, for the
  function's own arguments (one entry per positional argument that is not static, or one
  for all) and its output; a graph node passed as an argument gets ``None`` there, its
  Variables follow ``state_shardings``. ``state_shardings`` is a dict
  ``{sharding_or_PartitionSpec: filter}``: each Variable matched by a filter (the first
  that matches) is moved to that layout at the first call and keeps it after every call,
  without resharding per step. A bare ``PartitionSpec`` refers to the mesh set with
  ``jax.set_mesh``. Variables that flax creates with sharding metadata
  (``nnx.with_partitioning``, ``out_sharding``) inside the call under ``jax.set_mesh``
  come out laid out as flax lays them out.

  The returned function has ``.lower(*args)`` (whose ``.compile()`` is
  callable with the same arguments and writes back), ``.clear_cache()`` and
  ``.stateful_fun`` (the underlying :class:`StatefulFunction`).

  When a cached call is reused, what makes it retrace, and the rules for threads are in
  ``docs/api/rules.md``; writes that bypass flax
  (``vars(module)[name] = x``) are not noticed: call ``.clear_cache()`` after them.

  Args:
    fun: the function to compile. Default ``None``: return a decorator.
    static_argnums: an int or ints: positions of hashable arguments
      compared by type and value and baked into the trace. Default ``()``.
    static_argnames: a name or names of such arguments. Default ``()``.
    donate_argnums: an int or ints: positions of arguments whose buffers
      the compiled call may reuse: an array argument's own buffers, as in
      ``jax.jit``; for a graph node (a model, an optimizer), the buffers of
      the Variables the call writes, as ``donate_states`` donates them
      (``nnx.jit``'s meaning). Default ``()``.
    donate_argnames: a name or names of such arguments (as ``jax.jit``
      resolves them against ``fun``'s signature). Default ``()``.
    donate_states: a filter, or ``True`` for every written Variable: the
      written Variables whose buffers are donated. Default ``None``: none.
    in_shardings: shardings (or PartitionSpecs) of the positional arguments
      that are not static, as in ``jax.jit``. Default: chosen by JAX.
    out_shardings: shardings of the output, as in ``jax.jit``. Default:
      chosen by JAX.
    state_shardings: ``{sharding_or_PartitionSpec: filter}``: the layout
      matched Variables get and keep. Default ``None``: as they are.
    **jax_jit_kwargs: other keywords for ``jax.jit`` (``device``,
      ``inline``, ...).

  Returns:
    A ``JittedFunction`` taking ``fun``'s arguments and returning its
    output (with ``.lower``, ``.clear_cache`` and ``.stateful_fun``), or,
    when ``fun`` is ``None``, a decorator that makes one.

  Raises:
    TypeError: if ``fun`` is not callable, an argnum is not an int, or
      ``state_shardings`` is not a dict of shardings to filters; when
      called, if a static argument is not hashable or a Variable the
      function uses holds something other than arrays.
    ValueError: if an argnum is negative, ``static_argnums`` is beyond
      ``fun``'s positional parameters, a ``static_argnames`` entry is not
      one of its parameters, or an argument is both static and donated;
      when called, if ``in_shardings`` has the wrong length or gives a
      graph node a sharding, a ``state_shardings`` spec does not divide a
      Variable's shape (naming it) or is a PartitionSpec with no mesh set,
      or ``out_shardings`` is given for an output holding graph nodes.
    RuntimeError: when called, if a Variable holds a tracer leaked by a JAX
      transform brainnx did not manage, or the function writes a Variable
      inside a raw ``jax.jit``/``jax.vmap``/... where the new value would leak.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import brainnx as bnx
    >>> rngs = nnx.Rngs(0)
    >>> draw = bnx.jit(lambda: rngs.normal(()))
    >>> bool(draw() != draw())
    True
  """
  if fun is None:
    return functools.partial(
      jit,
      static_argnums=static_argnums,
      static_argnames=static_argnames,
      donate_argnums=donate_argnums,
      donate_argnames=donate_argnames,
      donate_states=donate_states,
      in_shardings=in_shardings,
      out_shardings=out_shardings,
      state_shardings=state_shardings,
      **jax_jit_kwargs,
    )
  check_callable(fun, 'jit')
  donated = StaticArgs.resolve(fun, donate_argnums, donate_argnames, role='donate')
  options = JitOptions(
    statics=StaticArgs.resolve(fun, static_argnums, static_argnames),
    donate_argnums=donated.argnums,
    donate_argnames=donated.argnames,
    donate_states=donate_states,
    jax_kwargs=tuple(jax_jit_kwargs.items()),
    in_shardings=in_shardings,
    out_shardings=out_shardings,
    state_shardings=Rules.parse(state_shardings, 'state_shardings'),
  )
  return JittedFunction(fun, options)
