"""The front ends' machinery in the parent: the loky executor, the task feeds, the pool's worker watch.

Layer: the top of the runtime, under the public modules (``backend``,
``pool``, ``parallel``). May import ``_parent``, ``_worker`` (whose functions
it hands to worker processes), ``_payload``, ``_transport``, ``_lifetime``
and the base modules (``_errors``, ``_config``, ``_compat``, ``_stats``,
``_forksafe``).
"""
