"""Large buffers of live Arrow objects are written once and sent again by later calls, until the object goes.

A repeated call over the same Arrow data writes nothing: it compares each
buffer with the file an earlier call wrote and sends that file again. The
file goes when the last Arrow object holding the buffer is collected; bytes
changed under a live owner (Arrow over writable NumPy memory) are written
again, never sent stale.
"""

from __future__ import annotations

import gc
import os
import weakref

import numpy as np
import pytest
from conftest import memfds_held, memshare_entries, wait_until

import memshare
from memshare import MemmappingPool, Parallel, delayed
from memshare._lifetime._location import choose_location
from memshare._parent import _kept_buffers
from memshare._parent._kept_buffers import KeptBuffers, store

pa = pytest.importorskip("pyarrow", reason="kept buffers are Arrow's (pip install pyarrow)")
pd = pytest.importorskip("pandas", reason="Arrow-backed pandas columns need pandas (pip install pandas)")

ROWS = 200_000
LIMIT = "1M"


def string_frame(rows: int = ROWS):
    return pd.DataFrame({"s": pd.Series([f"value-{i:08d}" for i in range(rows)], dtype="string[pyarrow]")})


def total_length(frame) -> int:
    return int(frame["s"].str.len().sum())


def column_sum(data) -> float:
    column = data.column(0) if isinstance(data, pa.Table) else data
    return (
        float(pa.chunked_array([column]).to_numpy().sum())
        if isinstance(column, pa.Array)
        else float(column.to_numpy().sum())
    )


def leaks(shm_dir) -> list:
    return memshare_entries(shm_dir) + memfds_held()


def kept_now() -> list:
    return store().paths()


@pytest.mark.parametrize("files", ["memfds", "named files"])
def test_a_second_call_over_a_live_frame_writes_nothing(request, caplog, files):
    shm_dir = request.getfixturevalue("shm_dir") if files == "named files" else None
    frame = string_frame()
    want = [total_length(frame)] * 4
    assert Parallel(n_jobs=2, max_nbytes=LIMIT)(delayed(total_length)(frame) for _ in range(4)) == want
    first = memshare.last_call_stats()
    assert first["buffers_dumped"] >= 1 and first["buffers_reused"] == 0, first
    with caplog.at_level("DEBUG", logger="memshare"):
        assert Parallel(n_jobs=2, max_nbytes=LIMIT)(delayed(total_length)(frame) for _ in range(4)) == want
    second = memshare.last_call_stats()
    reused = [r.getMessage() for r in caplog.records if r.getMessage().startswith("reused buffer of pyarrow")]
    assert len(reused) == second["buffers_reused"] and all("written by an earlier call" in m for m in reused), reused
    assert second["buffers_dumped"] == 0, second
    assert second["buffers_reused"] == first["buffers_dumped"], second
    assert second["bytes_buffers_reused"] == first["bytes_buffers_dumped"], second
    del frame
    gc.collect()
    assert kept_now() == []
    if shm_dir is not None:
        assert memshare_entries(shm_dir) == []
    assert memfds_held() == []


def test_the_same_memory_reached_through_another_object_is_reused(shm_dir):
    frame = string_frame()
    Parallel(n_jobs=2, max_nbytes=LIMIT)(delayed(total_length)(frame) for _ in range(2))
    dumped = memshare.last_call_stats()["bytes_buffers_dumped"]
    table = pa.table({"s": frame["s"].array.__arrow_array__()})  # no copy: the frame's own chunked array
    out = Parallel(n_jobs=2, max_nbytes=LIMIT)(delayed(len)(table.column(0)) for _ in range(2))
    assert out == [ROWS] * 2
    stats = memshare.last_call_stats()
    assert stats["buffers_dumped"] == 0 and stats["bytes_buffers_reused"] == dumped, stats
    del frame, table
    gc.collect()
    assert leaks(shm_dir) == []


def test_bytes_changed_under_a_live_owner_are_written_again(shm_dir):
    values = np.arange(1_000_000, dtype=np.float64)  # 8 MB
    array = pa.array(values)  # no copy: Arrow over NumPy's writable memory
    assert array.buffers()[1].address == values.ctypes.data
    assert Parallel(n_jobs=2, max_nbytes=LIMIT)(delayed(column_sum)(array) for _ in range(2)) == [values.sum()] * 2
    values += 1.0  # the Arrow array now holds other values, at the same address
    out = Parallel(n_jobs=2, max_nbytes=LIMIT)(delayed(column_sum)(array) for _ in range(2))
    assert out == [values.sum()] * 2
    stats = memshare.last_call_stats()
    assert stats["buffers_reused"] == 0 and stats["buffers_dumped"] == 1, stats
    assert len(kept_now()) == 1  # the stale file went with the call that found it stale
    del array
    gc.collect()
    assert leaks(shm_dir) == []


def test_writable_mappings_keep_nothing(shm_dir):
    frame = string_frame()
    Parallel(n_jobs=2, max_nbytes=LIMIT, mmap_mode="r+")(delayed(total_length)(frame) for _ in range(2))
    assert memshare.last_call_stats()["buffers_dumped"] >= 1
    assert kept_now() == [] and leaks(shm_dir) == []


def test_frames_made_anew_for_each_task_are_not_kept_past_their_task(shm_dir):
    # Each frame is collected once its task is packed, while the call still uses its file:
    # the file goes when the call lets go of it, and nothing accumulates.
    want = total_length(string_frame())
    out = Parallel(n_jobs=2, max_nbytes=LIMIT, batch_size=1)(delayed(total_length)(string_frame()) for _ in range(6))
    assert out == [want] * 6
    assert memshare.last_call_stats()["buffers_dumped"] >= 6
    gc.collect()
    assert kept_now() == [] and leaks(shm_dir) == []


def fail(frame):
    raise ValueError("task failed")


def die(frame):
    os.kill(os.getpid(), 9)


def test_after_a_task_error_and_a_killed_worker_the_kept_files_go_with_the_frame(shm_dir):
    frame = string_frame()
    with pytest.raises(ValueError, match="task failed"):
        Parallel(n_jobs=2, max_nbytes=LIMIT)(delayed(fail)(frame) for _ in range(4))
    with pytest.raises(memshare.WorkerDiedError):
        Parallel(n_jobs=2, max_nbytes=LIMIT)(delayed(die)(frame) for _ in range(2))
    assert kept_now(), "the frame is alive: its buffers are kept"
    out = Parallel(n_jobs=2, max_nbytes=LIMIT)(delayed(total_length)(frame) for _ in range(2))
    assert out == [total_length(frame)] * 2
    assert memshare.last_call_stats()["buffers_dumped"] == 0
    alive = weakref.ref(frame)
    del frame
    gc.collect()
    # Two properties, failing apart: nothing keeps the frame (with joblib 1.3 the failed calls' queued tasks
    # did, through the feed), and its files go with it.
    assert alive() is None, "something still holds the frame"
    assert leaks(shm_dir) == []


def test_pools_reuse_them_too(shm_dir):
    frame = string_frame()
    with MemmappingPool(2, max_nbytes=LIMIT) as pool:
        assert pool.map(total_length, [frame] * 2) == [total_length(frame)] * 2
    with MemmappingPool(2, max_nbytes=LIMIT) as pool:
        assert pool.map(total_length, [frame] * 2) == [total_length(frame)] * 2
    stats = memshare.last_call_stats()
    assert stats["buffers_dumped"] == 0 and stats["buffers_reused"] >= 1, stats
    del frame
    gc.collect()
    assert leaks(shm_dir) == []


def test_a_forked_child_leaves_its_parents_kept_files_alone(shm_dir):
    frame = string_frame()
    Parallel(n_jobs=2, max_nbytes=LIMIT)(delayed(total_length)(frame) for _ in range(2))
    kept = kept_now()
    assert kept
    pid = os.fork()
    if pid == 0:  # the child drops its copy of the frame and exits
        try:
            del frame
            gc.collect()
        finally:
            os._exit(0)
    assert wait_until(lambda: os.waitpid(pid, os.WNOHANG)[0] == pid, 30)
    assert kept_now() == kept
    Parallel(n_jobs=2, max_nbytes=LIMIT)(delayed(total_length)(frame) for _ in range(2))
    assert memshare.last_call_stats()["buffers_dumped"] == 0
    del frame
    gc.collect()
    assert leaks(shm_dir) == []


def test_a_comparison_that_fails_lets_go_of_the_file(shm_dir, monkeypatch):
    kept = KeptBuffers()
    array = pa.array(np.arange(300_000, dtype=np.int64))  # one 2.4 MB buffer
    kept.note_owner(array, 1024**2)
    buffer = array.buffers()[1]
    key, raw, location = (buffer.address, buffer.size), np.frombuffer(buffer, np.uint8), choose_location()
    ref, _, _ = kept.keep(key, raw, location)
    kept.release(ref.path)  # the call that wrote it is over: kept while the array lives
    assert kept.paths() == [ref.path]

    def broken(*args):
        raise OSError("no mapping")

    monkeypatch.setattr(_kept_buffers, "same_bytes", broken)
    with pytest.raises(OSError, match="no mapping"):
        kept.reuse(key, raw, location)
    del array, buffer, raw
    gc.collect()
    assert kept.paths() == [] and leaks(shm_dir) == []
