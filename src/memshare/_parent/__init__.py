"""The parent's side of a call: sessions, the dumps and objects they keep, adopted results, arrays held once.

Layer: under ``_frontends``, beside ``_worker`` (neither imports the
other). May import ``_payload``, ``_transport``, ``_lifetime`` and the base
modules. Runs in the process that submits tasks.
"""
