"""Where shared files live and when they go: locations, folders, memfds, owners, the sweep and the watchdog.

Layer: the bottom of the runtime. May import only the base modules
(``_errors``, ``_config``, ``_compat``, ``_stats``, ``_forksafe``).
"""
