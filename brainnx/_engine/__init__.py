"""The engine: from a stateful call to a pure function a JAX primitive can take, and back.

Rooms, each importing only those before it: ``caches``, ``discovery``
(Variables a call can reach and the guard of a cached discovery),
``arguments`` (static, dynamic and reference arguments), ``filters``,
``errors``, ``outputs``, ``rng``, ``tracing`` (the state step, traces and
``StatefulFunction``), ``sharding``, ``jitted`` (compiled plans), ``eager``
(the one eager entry of every transform). Nothing here imports
``brainnx._transforms``.

The route of a call. A transform called outside any trace goes through
``eager.run``, which keeps one ``JittedFunction`` per owner (the transform
object or the user's function) and static configuration. A warm call of it
checks its plan (the reference arguments, the statics, the guard of the
discovery) and calls the compiled program with the values it kept. A cold
call discovers the Variables, traces the function once per abstract
signature (``StatefulFunction``), compiles, and writes back. Inside a trace
the transform's body runs directly: it enters one ``call.StatefulCall``,
applies its JAX primitive to the call's pure function, and writes back
once; a failure rolls everything back.

Who owns what:

- ``eager._PROGRAMS``: the compiled programs per owner (held weakly) and configuration.
- ``JittedFunction``: its plans (16, per reference arguments), compiled programs
  and traces (shared between functions of one code object and options).
- ``StatefulFunction``: its traces, one per abstract signature.
- ``state.TRACE_LOCK`` (reentrant): swapping values into Variables for a trace, and
  every write-back; ``state.STATE_CHANGES`` tells a lock-free reader that one is under way.
- ``_compat.KEPT_LOCK``: the value lists warm calls keep (``_compat.KEPT_VALUES``).
- ``_compat.PYTREE_EDITS``/``EDIT_LOG``: flax's edits of Pytrees and metadata, which
  the guard reads instead of comparing every attribute on every call.
"""
