"""Unpickling a payload that is a view of shared memory reads it in place, without copying it first."""

from __future__ import annotations

import io
import mmap
import os
import pickle
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memshare._payload._reducers import by_value, pack
from memshare._payload._unpacking import unpack
from memshare._payload._view_reader import ViewReader


@settings(max_examples=200, deadline=None, database=None)
@given(
    data=st.binary(max_size=300),
    sizes=st.lists(st.one_of(st.none(), st.integers(-2, 40)), max_size=30),
    kinds=st.lists(st.sampled_from(["read", "readinto", "readline"]), max_size=30),
)
def test_reads_like_bytesio(data, sizes, kinds):
    ours, theirs = ViewReader(memoryview(data)), io.BytesIO(data)
    for size, kind in zip(sizes, kinds):
        if kind == "readinto":
            if size is None or size < 0:
                continue
            mine, expected = bytearray(size), bytearray(size)
            assert ours.readinto(mine) == theirs.readinto(expected)
            assert mine == expected
        else:
            assert getattr(ours, kind)(size) == getattr(theirs, kind)(size)


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_every_protocol_unpickles_through_it(protocol):
    # Protocol 0 reads text lines (readline); 4 and 5 read frames and large bytes (readinto).
    value = {"text": "x" * 100, "numbers": list(range(300)), "blob": b"\n" * 70000, (1, 2): [1.5, None, True]}
    assert pickle.Unpickler(ViewReader(pickle.dumps(value, protocol=protocol))).load() == value


def _envelope(value):
    """``value`` packed as an envelope (a payload that names argument objects), as object dumps are."""
    payload = pack(value, by_value, objects=[(object(), pickle.dumps(0))])
    assert payload.startswith(b"memshare-")
    return payload


def test_an_envelope_in_shared_memory_is_not_copied_to_unpickle():
    # A 32 MB bytes object: unpickling it makes one 32 MB object; copying the stream first made two.
    blob = os.urandom(1024) * (32 * 1024)
    payload = _envelope([blob])
    fd = os.memfd_create("memshare-test-view-reader")
    try:
        os.write(fd, payload)
        with mmap.mmap(fd, len(payload), prot=mmap.PROT_READ) as mapping:
            view = memoryview(mapping)
            tracemalloc.start()
            try:
                (loaded,) = unpack(view)
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            view.release()
    finally:
        os.close(fd)
    assert loaded == blob
    assert peak < 1.5 * len(blob), f"unpickling allocated {peak} bytes for a {len(blob)}-byte object"
