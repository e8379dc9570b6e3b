"""The engine: from a stateful call to a pure function a JAX primitive can take, and back.

Layers, each importing only those before it: ``caches``, ``discovery``
(Variables a call can reach and the guard of a cached discovery),
``arguments`` (static, dynamic and reference arguments), ``filters``,
``errors``, ``outputs``, ``rng``, ``tracing`` (the state step, traces and
``StatefulFunction``), ``sharding``, ``jitted`` (compiled plans), ``eager``
(the one eager entry of every transform). Nothing here imports
``brainnx._transforms``.
"""
