"""Files, references and mappings: the wire format, array references, writing and mapping shared files.

Layer: under ``_payload``; used by both sides. May import ``_lifetime`` and
the base modules; no policy of what to share.
"""
