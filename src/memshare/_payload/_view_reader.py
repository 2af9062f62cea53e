"""A pickle stream read in place: the file object an unpickler reads a mapped dump through, without a copy.

``io.BytesIO(view)`` copies its whole initial buffer (it shares only a
``bytes`` object). An argument object's dump is a mapping of shared memory
that every task of a call unpickles; copying it first would give each
worker a private copy of the whole pickle on top of the object it builds:
140 MB more per worker for a 356 MB object-dtype column. The unpickler
reads a protocol-5 stream a frame (about 64 KiB) at a time, and large
``bytes`` through ``readinto``, so only those small pieces are copied.
"""

from __future__ import annotations

from typing import Union

#: How far ``readline`` looks ahead per step (only text opcodes of protocol 0 read lines).
_LINE_STEP = 4096


class ViewReader:
    """A read-only binary file over ``view`` (any buffer): ``read``, ``readinto`` and ``readline``."""

    __slots__ = ("_view", "_position")

    def __init__(self, view: Union[bytes, bytearray, memoryview]) -> None:
        self._view = memoryview(view).cast("B")
        self._position = 0

    def _take(self, size: int) -> memoryview:
        start = self._position
        remaining = len(self._view) - start
        end = start + (remaining if size is None or size < 0 else min(size, remaining))
        self._position = end
        return self._view[start:end]

    def read(self, size: int = -1) -> bytes:
        return self._take(size).tobytes()

    def readinto(self, buffer) -> int:
        target = memoryview(buffer).cast("B")
        piece = self._take(len(target))
        target[: len(piece)] = piece
        return len(piece)

    def readline(self, size: int = -1) -> bytes:
        limit = len(self._view) if size is None or size < 0 else min(len(self._view), self._position + size)
        end = self._position
        while end < limit:
            step = min(limit, end + _LINE_STEP)
            found = bytes(self._view[end:step]).find(b"\n")
            if found >= 0:
                end += found + 1
                break
            end = step
        return self._take(end - self._position).tobytes()
