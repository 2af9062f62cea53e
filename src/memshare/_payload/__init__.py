"""What goes into a task's stream and how it comes out: the route of each value, the picklers and reductions.

Layer: under ``_parent`` and ``_worker``, both of which use it. May import
``_transport``, ``_lifetime`` and the base modules.
"""
