"""How a payload with out-of-band buffers or argument objects is laid out in bytes.

An envelope starts with a magic string, then the length of the pickled
placeholders, the placeholders (one list for buffers, one for objects), and
the stream. A pickle of protocol 2 or more starts with PROTO (0x80), so no
plain stream starts like an envelope and a plain payload needs no header.
"""

from __future__ import annotations

import pickle
import struct
from typing import Any, List, Optional, Sequence, Tuple, Union

from .._numpy import np

#: Bytes of a payload: ``bytes``, or a view of a mapped file.
Buffer = Union[bytes, memoryview, "np.ndarray"]

_ENVELOPE = b"memshare-buffers\x00"
_HEADER_LENGTH = struct.Struct("<Q")


def seal(buffers: Sequence[Any], objects: Sequence[Any], stream: Union[bytes, memoryview]) -> bytes:
    """The envelope of ``stream`` with the placeholders of its out-of-band ``buffers`` and its ``objects``."""
    header = pickle.dumps((list(buffers), list(objects)), protocol=5)
    return b"".join((_ENVELOPE, _HEADER_LENGTH.pack(len(header)), header, stream))


def with_objects(payload: bytes, placeholders: Sequence[Any]) -> bytes:
    """``payload`` (packed with ``objects``) with the objects it names standing for ``placeholders`` instead.

    The stream names objects by index: only the envelope's list changes, so
    a payload measured with stand-ins can be sent without pickling it again.
    """
    header, body = open_envelope(payload)
    if header is None:
        raise ValueError("memshare: this payload names no objects")
    buffers, _ = header
    return seal(buffers, placeholders, body)


def open_envelope(stream: Buffer) -> Tuple[Optional[Tuple[List[Any], List[Any]]], Union[bytes, memoryview]]:
    """((buffer placeholders, object placeholders), stream) of a payload; None for a plain stream."""
    if type(stream) is bytes and not stream.startswith(_ENVELOPE):
        return None, stream  # most payloads: no view to make
    view = memoryview(stream).cast("B")
    if view[: len(_ENVELOPE)] != _ENVELOPE:
        return None, view
    start = len(_ENVELOPE) + _HEADER_LENGTH.size
    (length,) = _HEADER_LENGTH.unpack_from(view, len(_ENVELOPE))
    return pickle.loads(view[start : start + length]), view[start + length :]


__all__ = ["Buffer", "open_envelope", "seal", "with_objects"]
