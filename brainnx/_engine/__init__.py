"""The engine: from a stateful call to a pure function a JAX primitive can take, and back.

Rooms, each importing only those before it: ``sentinels``, ``config``
(the base of every transform's config), ``weak`` (weak references),
``host_calls`` (host callbacks that never fail a program),
``caches``, ``nodes`` (what a value is: graph node, plain object,
reference, static), ``arguments`` (static, dynamic and reference
arguments), ``filters``, ``errors``, ``guard`` (the cheap check that a
cached discovery still holds), ``roots`` (what a callable captures),
``discovery`` (the Variables a call can reach), ``rng``, ``structure``,
``outputs``, ``state`` (the state step and write-back), ``call`` (the one
stateful call), ``tracing`` (traces), ``stateful_function``, ``sharding``,
``plan`` and ``jitted`` (compiled plans and the jitted function), ``eager``
(the one eager entry of every transform) and ``loop_body`` (a body traced
once and evaluated inside a loop or branch). Nothing here imports
``brainnx._transforms``.

The route of a call. Every transform parses its keywords once into a frozen
``config.Config`` and calls ``eager.call(impl, config, roots, args, kwargs)``.
Outside any trace that keeps one ``JittedFunction`` per root (the user's
function, a progress bar) and config; transform objects (``vmap``'s and
``grad``'s) keep theirs on themselves (``eager.program``). A warm call of it
checks its plan (the reference arguments, the statics, the guard of the
discovery) and calls the compiled program with the values it kept. A cold
call discovers the Variables, traces the function once per abstract
signature (``StatefulFunction``), compiles, and writes back. Inside a trace
the transform's body runs directly: it enters one ``call.StatefulCall``,
applies its JAX primitive to the call's pure function, and writes back
once; a failure rolls everything back.

Who owns what:

- ``eager._PROGRAMS``: the compiled programs per root (held weakly) and config;
  ``MappedFunction``/``GradFunction``: their own one program.
- ``JittedFunction``: its plans (16, per reference arguments), compiled programs
  and traces (shared between functions of one code object and options).
- ``StatefulFunction``: its traces, one per abstract signature.
- ``state.TRACE_LOCK`` (reentrant): swapping values into Variables for a trace, and
  every write-back; ``state.STATE_CHANGES`` tells a lock-free reader that one is under way.
- ``_compat.KEPT_LOCK``: the value lists warm calls keep (``_compat.KEPT_VALUES``).
- ``_compat.TRACE_LOCK`` (``state.TRACE_LOCK``): also taken by every flax write of a Variable.
- ``_compat.PYTREE_EDITS``/``EDIT_LOG``: flax's edits of Pytrees and metadata, which
  the guard reads instead of comparing every attribute on every call.
"""
