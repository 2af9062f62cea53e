"""Out-of-band buffers: Arrow data (pyarrow, pandas' Arrow-backed columns) travels through shared memory.

Every large ``PickleBuffer`` an argument offers (pickle protocol 5) is written
once per call to a dump, and the worker rebuilds the object over a read-only
mapping of it; a task's large Arrow result comes back through result files.
Each container is checked against what joblib's own loky backend gives.
"""

from __future__ import annotations

import gc
import os
import pickle

import joblib
import numpy as np
import pytest
from conftest import mappings_of, memfds_held, memshare_entries

import memshare
from memshare import Parallel, delayed

pa = pytest.importorskip("pyarrow", reason="out-of-band buffers are tested on pyarrow's (pip install pyarrow)")
pd = pytest.importorskip("pandas", reason="Arrow-backed pandas columns need pandas (pip install pandas)")
pq = pytest.importorskip("pyarrow.parquet", reason="the Parquet round trip needs pyarrow's parquet module")

ROWS = 120_000  # about 4 MB of string data: well above the 1 MB threshold used below
LIMIT = "1M"


def strings(rows: int = ROWS) -> list:
    return [f"value-{i:08d}-{'x' * (i % 17)}" for i in range(rows)]


def arrow_frame():
    return pd.DataFrame({"s": pd.Series(strings(), dtype="string[pyarrow]"), "n": np.arange(ROWS)})


def default_string_frame():
    frame = pd.DataFrame({"s": strings()})
    dtype = frame["s"].dtype
    if getattr(dtype, "storage", None) != "pyarrow":
        pytest.skip(f"this pandas ({pd.__version__}) does not store strings in Arrow by default ({dtype!r})")
    return frame


def arrow_table():
    return pa.table({"s": pa.array(strings()), "n": pa.array(np.arange(ROWS))})


def chunked_array():
    half = ROWS // 2
    return pa.chunked_array([pa.array(strings()[:half]), pa.array(strings()[half:])])


def parquet_frame(tmp_path):
    path = tmp_path / "frame.parquet"
    pq.write_table(pa.table({"s": strings(), "f": np.linspace(0.0, 1.0, ROWS)}), path)
    if int(pd.__version__.split(".")[0]) >= 2:
        return pd.read_parquet(path, dtype_backend="pyarrow")
    return pq.read_table(path).to_pandas(types_mapper=pd.ArrowDtype)  # pandas 1.5: no dtype_backend yet


def large_bytearray():
    return bytearray(os.urandom(3 * 1024**2))


def object_frame():
    return pd.DataFrame({"o": pd.Series(strings(), dtype=object)})


MAKERS = {
    "string[pyarrow] column": lambda tmp_path: arrow_frame(),
    "default string column": lambda tmp_path: default_string_frame(),
    "pyarrow Table": lambda tmp_path: arrow_table(),
    "pyarrow ChunkedArray": lambda tmp_path: chunked_array(),
    "Parquet-read DataFrame": parquet_frame,
    "bytearray": lambda tmp_path: large_bytearray(),
    "object-dtype column": lambda tmp_path: object_frame(),
}


def fingerprint(x):
    """What the task saw: its type, its dtypes and array classes, and its full contents.

    Arrow objects are compared by type and values: their buffers are
    read-only mappings here (``Buffer.is_mutable`` is False) where joblib's
    are private copies, which pyarrow pickles differently.
    """
    if isinstance(x, pa.Table):
        return "Table", str(x.schema), pickle.dumps(x.to_pydict(), protocol=4)
    if isinstance(x, pa.ChunkedArray):
        return "ChunkedArray", str(x.type), x.num_chunks, pickle.dumps(x.to_pylist(), protocol=4)
    if isinstance(x, pd.DataFrame):
        columns = [(str(c), str(x[c].dtype), type(x[c].array).__name__, x[c].tolist()) for c in x.columns]
        return "DataFrame", pickle.dumps((columns, x.index.tolist()), protocol=4)
    return type(x).__name__, pickle.dumps(x, protocol=4)


def echo(x):
    return x


def assert_same(got, want):
    assert type(got) is type(want)
    if isinstance(want, pd.DataFrame):
        pd.testing.assert_frame_equal(got, want, check_dtype=True, check_exact=True)
        assert [str(t) for t in got.dtypes] == [str(t) for t in want.dtypes]
    elif isinstance(want, (pa.Table, pa.ChunkedArray)):
        assert got.type == want.type if isinstance(want, pa.ChunkedArray) else got.schema == want.schema
        assert got.equals(want)
    else:
        assert got == want


def leaks(shm_dir) -> list:
    """memshare's files left, once the garbage is collected: the buffers of Arrow data still alive are kept for
    later calls (see test_kept_buffers), so a test drops its data first."""
    gc.collect()
    return memshare_entries(shm_dir) + memfds_held()


@pytest.mark.parametrize("name", list(MAKERS))
def test_arguments_and_results_match_joblibs(shm_dir, tmp_path, name):
    data = MAKERS[name](tmp_path)
    want = joblib.Parallel(n_jobs=2, backend="loky")(delayed(fingerprint)(data) for _ in range(3))
    got = Parallel(n_jobs=2, max_nbytes=LIMIT)(delayed(fingerprint)(data) for _ in range(3))
    assert got == want
    back_joblib = joblib.Parallel(n_jobs=2, backend="loky")(delayed(echo)(data) for _ in range(2))
    back = Parallel(n_jobs=2, max_nbytes=LIMIT)(delayed(echo)(data) for _ in range(2))
    for mine, theirs in zip(back, back_joblib):
        assert_same(mine, theirs)
        assert_same(mine, data)
    del data, back, mine
    assert leaks(shm_dir) == []


@pytest.mark.parametrize("name", ["string[pyarrow] column", "pyarrow Table", "Parquet-read DataFrame"])
def test_large_arrow_buffers_travel_out_of_band(shm_dir, tmp_path, name):
    data = MAKERS[name](tmp_path)
    size = len(pickle.dumps(data, protocol=5))
    # Every buffer of these frames is above 64 KB: only the object's skeleton stays in the stream.
    Parallel(n_jobs=2, max_nbytes="64K", batch_size=1)(delayed(fingerprint)(data) for _ in range(4))
    stats = memshare.last_call_stats()
    assert stats["buffers_dumped"] >= 1 and stats["bytes_buffers_dumped"] > size // 2
    assert stats["bytes_pickled"] < size // 10, stats  # four tasks, but the data went once, by reference


def buffer_sizes(x) -> list:
    """The sizes of the buffers pickle offers for ``x`` (protocol 5), largest first."""
    found = []
    pickle.dumps(x, protocol=5, buffer_callback=lambda b: found.append(memoryview(b).nbytes))
    return sorted(found, reverse=True)


def int_table():
    return pa.table({"n": pa.array(np.arange(2_000_000, dtype=np.int64))})  # one 16 MB buffer


def string_frame():
    return pd.DataFrame({"s": pd.Series(strings(400_000), dtype="string[pyarrow]")})


def task_statistic(data) -> int:
    if isinstance(data, pa.Table):
        return int(data.column(0).to_numpy().sum())
    return int(data["s"].str.len().sum())


@pytest.mark.parametrize("make", [int_table, string_frame], ids=["pyarrow Table", "string[pyarrow] column"])
def test_a_buffer_used_by_eight_tasks_is_written_once(shm_dir, make):
    # pandas pickles an Arrow column through a new combined copy each time:
    # memshare pickles the column's own buffers, which stay the same.
    data = make()
    large = [n for n in buffer_sizes(data) if n > 1024**2]
    out = Parallel(n_jobs=2, max_nbytes=LIMIT, batch_size=1)(delayed(task_statistic)(data) for _ in range(8))
    assert out == [task_statistic(data)] * 8
    stats = memshare.last_call_stats()
    assert stats["tasks"] == 8
    assert stats["buffers_dumped"] == len(large) and stats["bytes_buffers_dumped"] == sum(large)
    assert stats["bytes_pickled"] < sum(large) // 20, stats  # 8 tasks: the small buffers and the skeleton
    del data
    assert leaks(shm_dir) == []


def column_sum(table) -> int:
    return int(table.column(0).to_numpy().sum())


def test_buffers_below_max_nbytes_are_pickled_in_band(shm_dir):
    frame = arrow_frame()
    size = sum(buffer_sizes(frame))
    Parallel(n_jobs=2, max_nbytes="100M")(delayed(fingerprint)(frame) for _ in range(2))
    stats = memshare.last_call_stats()
    assert stats["buffers_dumped"] == 0 and stats["buffers_pickled"] >= 1
    assert stats["bytes_buffers_pickled"] >= size // 2 and stats["bytes_pickled"] >= size
    assert memshare_entries(shm_dir) == []


def test_nothing_goes_out_of_band_without_a_threshold(shm_dir):
    frame = arrow_frame()
    size = sum(buffer_sizes(frame))
    got = Parallel(n_jobs=2, max_nbytes=None)(delayed(fingerprint)(frame) for _ in range(2))
    assert got == [fingerprint(frame)] * 2
    stats = memshare.last_call_stats()
    assert stats["buffers_dumped"] == 0 and stats["bytes_pickled"] >= 2 * size


def large_buffer_mappings(table):
    """Where the worker's large Arrow buffers of ``table`` live: their mappings."""
    addresses = [
        buffer.address
        for column in table.columns
        for chunk in column.chunks
        for buffer in chunk.buffers()
        if buffer is not None and buffer.size > 1024**2
    ]
    return mappings_of(addresses)


def frame_buffer_mappings(frame):
    return large_buffer_mappings(pa.table({"s": frame["s"].array.__arrow_array__()}))


def is_memshare_file(path: str) -> bool:
    return path.startswith("/memfd:memshare-dump-") or ("/memshare-" in path and "/dump-" in path)


@pytest.mark.parametrize("files", ["memfds", "named files"])
def test_the_worker_reads_shared_memory_through_a_read_only_mapping(request, files):
    if files == "named files":
        request.getfixturevalue("shm_dir")
    frame = arrow_frame()
    (seen,) = Parallel(n_jobs=2, max_nbytes=LIMIT)(delayed(frame_buffer_mappings)(frame) for _ in range(1))
    assert seen, "the frame has no large buffer"
    for path, permissions in seen:
        assert is_memshare_file(path), seen
        assert permissions.startswith("r-"), seen
    del frame
    gc.collect()
    assert memfds_held() == []


def frame_of_strings(rows):
    return pd.DataFrame({"s": pd.Series(strings(rows), dtype="string[pyarrow]")})


def test_large_arrow_results_come_back_through_shared_memory(shm_dir):
    (frame,) = Parallel(n_jobs=2, max_nbytes=LIMIT)(delayed(frame_of_strings)(ROWS) for _ in range(1))
    pd.testing.assert_frame_equal(frame, frame_of_strings(ROWS))
    stats = memshare.last_call_stats()
    assert stats["results_by_reference"] >= 1 and stats["bytes_results_by_reference"] > 2 * 1024**2
    paths = [path for path, _ in frame_buffer_mappings(frame)]
    assert paths and all("result-" in path and "(deleted)" in path for path in paths), paths
    assert memshare_entries(shm_dir) == []


def fail_with(table):
    raise ValueError(f"task failed with {table.num_rows} rows")


def test_nothing_is_left_after_a_task_error(shm_dir):
    table = arrow_table()
    with pytest.raises(ValueError, match="task failed"):
        Parallel(n_jobs=2, max_nbytes=LIMIT)(delayed(fail_with)(table) for _ in range(4))
    del table
    assert leaks(shm_dir) == []


def test_nothing_is_left_as_a_memfd_once_the_data_goes():
    table = arrow_table()
    out = Parallel(n_jobs=2, max_nbytes=LIMIT)(delayed(column_sum_s)(table) for _ in range(3))
    assert out == [ROWS] * 3
    assert memshare.last_call_stats()["buffers_dumped"] >= 1
    del table
    gc.collect()
    assert memfds_held() == []


def column_sum_s(table) -> int:
    return len(table.column("s"))


def die_with(table):
    os.kill(os.getpid(), 9)


def test_nothing_is_left_after_a_worker_is_killed(shm_dir):
    table = arrow_table()
    with pytest.raises(memshare.WorkerDiedError, match="SIGKILL"):
        Parallel(n_jobs=2, max_nbytes=LIMIT)(delayed(die_with)(table) for _ in range(2))
    del table
    assert leaks(shm_dir) == []


def test_the_decision_log_names_each_buffer_once(shm_dir, caplog):
    table = arrow_table()
    with caplog.at_level("DEBUG", logger="memshare"):
        Parallel(n_jobs=2, max_nbytes=LIMIT, batch_size=1)(delayed(column_sum_s)(table) for _ in range(4))
    dumped = [r.getMessage() for r in caplog.records if r.getMessage().startswith("dumped buffer of pyarrow")]
    pickled = [r.getMessage() for r in caplog.records if r.getMessage().startswith("pickled buffer of pyarrow")]
    assert len(dumped) == memshare.last_call_stats()["buffers_dumped"] >= 1, dumped
    assert len(pickled) == memshare.last_call_stats()["buffers_pickled"] >= 1, pickled
