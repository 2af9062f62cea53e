"""Code run by worker processes: running a task, its results' files, handing results over.

Layer: under ``_frontends``, beside ``_parent`` (neither imports the
other). May import ``_payload``, ``_transport``, ``_lifetime`` and the base
modules. Runs in worker processes only.
"""
