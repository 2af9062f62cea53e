"""polars DataFrames and Series travel through Arrow: their large buffers out of band, rebuilt without a copy.

What a task sees is compared with what ``pickle`` gives (names, dtypes, values,
sorted flags), under ``memshare.Parallel`` and ``MemmappingPool``, for
arguments and for results; frames that Arrow cannot carry as polars has them
are pickled by polars, and so are small ones. memshare never imports polars.
"""

from __future__ import annotations

import datetime as dt
import decimal
import pickle
import sys

import numpy as np
import pytest
from conftest import mappings_of, memfds_held, memshare_entries, run_script

import memshare
from memshare import MemmappingPool, Parallel, delayed
from memshare._payload import _polars

pl = pytest.importorskip(
    "polars", reason="polars frames are tested only where polars is installed (pip install polars)"
)
pa = pytest.importorskip("pyarrow", reason="polars exports Arrow through pyarrow (pip install pyarrow)")

ROWS = 200_000  # 1.6 MB a column of 8-byte values: above the 1 MB threshold, for frames and for buffers
LIMIT = "1M"
TRANSPORTS = ["Parallel", "MemmappingPool"]

#: Whether this pyarrow has Arrow's view types, in which polars exports its strings without a copy.
VIEWS = hasattr(pa, "string_view")


def numeric_frame(rows: int = ROWS):
    rng = np.random.default_rng(0)
    return pl.DataFrame(
        {
            "f": rng.random(rows),
            "i": pl.Series([1, None, 3, 4] * (rows // 4), dtype=pl.Int64),
            "b": rng.random(rows) > 0.5,
            "sorted": np.arange(rows, dtype=np.int64),
        }
    ).with_columns(pl.col("sorted").set_sorted())


def sorted_series():
    return numeric_frame()["sorted"]


def string_frame(rows: int = ROWS):
    words = [f"value number {i:08d}" if i % 7 else None for i in range(rows)]
    return pl.DataFrame({"s": words, "f": np.linspace(0.0, 1.0, rows)})


LEVELS = ["low", "mid", "high"]


def every_kind_frame(rows: int = ROWS):
    """A column of each kind polars users keep in a frame."""
    paris = [dt.datetime(2020, 1, 1) + dt.timedelta(minutes=i) if i % 5 else None for i in range(rows)]
    return pl.DataFrame(
        {
            "f": np.arange(rows, dtype=np.float64) / 3,
            "nullable": pl.Series([None if i % 3 == 0 else i for i in range(rows)], dtype=pl.Int64),
            "s": [f"text {i}" * (i % 4) if i % 11 else None for i in range(rows)],
            "cat": pl.Series([f"c{i % 50}" for i in range(rows)], dtype=pl.Categorical),
            "enum": pl.Series(
                [["low", "mid", "high"][i % 3] for i in range(rows)], dtype=pl.Enum(["low", "mid", "high"])
            ),
            "when": pl.Series(paris, dtype=pl.Datetime("us"))
            .dt.replace_time_zone("UTC")
            .dt.convert_time_zone("Europe/Paris"),
            "day": pl.Series([dt.date(2000, 1, 1) + dt.timedelta(days=i % 9000) for i in range(rows)]),
            "money": pl.Series([decimal.Decimal(i) / 100 for i in range(rows)], dtype=pl.Decimal(12, 2)),
            "list": [[i, i + 1] if i % 9 else [] for i in range(rows)],
            "struct": [{"a": i, "b": f"b{i}"} for i in range(rows)],
        }
    )


def summary(obj) -> tuple:
    """What a receiver can see of a polars object: its kind, names, dtypes and sorted flags."""
    frame = obj.to_frame() if isinstance(obj, pl.Series) else obj
    columns = tuple((c.name, repr(c.dtype), c.flags.get("SORTED_ASC"), c.flags.get("SORTED_DESC")) for c in frame)
    return type(obj).__name__, columns, frame.height


#: Nulls compare equal (``DataFrame.equals`` does so already; ``Series.equals`` needs telling).
EQUALS = {"null_equal": True} if "null_equal" in pl.Series.equals.__code__.co_varnames else {}


def same_as_pickled(obj, pickled: bytes) -> tuple:
    """In the task: ``obj`` against the sender's own ``pickle`` of it (the summary, and whether values are equal)."""
    want = pickle.loads(pickled)
    return summary(obj), summary(want), obj.equals(want, **EQUALS)


def run(transport: str, func, items, max_nbytes=LIMIT) -> list:
    """``func(*item)`` for each item, in 2 workers, with memshare's ``transport``."""
    if transport == "Parallel":
        return Parallel(n_jobs=2, max_nbytes=max_nbytes, batch_size=1)(delayed(func)(*item) for item in items)
    with MemmappingPool(2, max_nbytes=max_nbytes) as pool:
        return pool.starmap(func, items, chunksize=1)


def leaks(shm_dir) -> list:
    return memshare_entries(shm_dir) + memfds_held()


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(
    "make",
    [
        numeric_frame,
        string_frame,
        every_kind_frame,
        lambda: every_kind_frame()["when"],
        lambda: numeric_frame()["sorted"],
    ],
    ids=["numeric", "strings", "every kind", "Series with a time zone", "sorted Series"],
)
def test_a_task_sees_what_pickle_gives(shm_dir, transport, make):
    data = make()
    pickled = pickle.dumps(data, protocol=5)
    seen = run(transport, same_as_pickled, [(data, pickled)] * 3)
    for got, want, equal in seen:
        assert got == want and equal
    assert got == summary(data)
    assert leaks(shm_dir) == []


def column_sum(frame) -> float:
    return float(frame["f"].sum())


def large_buffers(frame) -> int:
    """How many buffers of at least 1 MB ``frame``'s Arrow export has (at polars' newest level, as memshare exports)."""
    table = frame.to_arrow(compat_level=pl.CompatLevel.newest())
    sizes = [b.size for column in table.columns for chunk in column.chunks for b in chunk.buffers() if b is not None]
    return sum(size >= 1024**2 for size in sizes)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("make", [numeric_frame, string_frame], ids=["numeric", "strings"])
def test_a_large_frame_goes_out_of_band(shm_dir, transport, make):
    data = make()
    size = len(pickle.dumps(data, protocol=5))
    out = run(transport, column_sum, [(data,)] * 8)
    assert out == [column_sum(data)] * 8
    stats = memshare.last_call_stats()
    assert stats["tasks"] == 8
    if not hasattr(pl, "CompatLevel") or (make is string_frame and not VIEWS):
        # Without view types, polars' strings would be copied into large_string for every task: polars pickles
        # the frame, once per call.
        assert stats["buffers_dumped"] == 0 and stats["objects_dumped"] == 1, stats
    else:
        # Each large buffer went to shared memory; what else each task carries (the frame's skeleton, the small
        # buffers) is small, in the task or in one object dump for the call. A buffer is written once per call,
        # even when its first task is done before the next one is packed.
        assert stats["buffers_dumped"] == large_buffers(data) >= 2, stats
        assert stats["bytes_buffers_dumped"] > size // 2, stats
        assert stats["bytes_pickled"] + stats["bytes_objects_dumped"] < size // 2, stats
    assert leaks(shm_dir) == []


def large_buffer_mappings(frame) -> list:
    """In the task: (path, permissions) of the mapping that holds each large Arrow buffer of ``frame``."""
    addresses = [
        buffer.address
        for column in frame.to_arrow().columns
        for chunk in column.chunks
        for buffer in chunk.buffers()
        if buffer is not None and buffer.size >= 1024**2
    ]
    return mappings_of(addresses)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_task_reads_the_frame_in_place_from_a_read_only_mapping(shm_dir, transport):
    data = numeric_frame()
    (seen,) = run(transport, large_buffer_mappings, [(data,)])
    assert len(seen) == 3, seen  # the values of "f", "i" and "sorted"; bits ("b", the nulls of "i") are small
    for path, permissions in seen:
        assert "memshare-dump-" in path or "/dump-" in path, seen
        assert permissions.startswith("r-"), seen


def change_it(frame) -> tuple:
    """In the task: every way polars offers to change a frame; none may write into the shared buffers."""
    doubled = frame.with_columns(pl.col("f") * 2)
    frame[0, "f"] = -1.0  # in place, for this task's frame object only
    series = frame["sorted"]
    series.scatter([0, 1], [7, 7])
    series.append(pl.Series("sorted", [1]))
    grown = frame.extend(frame.head(3))
    return float(doubled["f"].sum()), float(frame["f"][0]), int(series[0]), grown.height


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_changes_in_the_task_reach_neither_the_shared_buffers_nor_the_parent(shm_dir, transport):
    data = numeric_frame()
    before = pickle.dumps(data, protocol=5)
    out = run(transport, change_it, [(data,)] * 4)
    want = (2 * float(data["f"].sum()), -1.0, 7, ROWS + 3)
    assert out == [want] * 4  # each task changed its own copy: none saw another's change
    assert data.equals(pickle.loads(before))


def build(rows: int, seed: int):
    frame = pl.DataFrame({"f": np.random.default_rng(seed).random(rows), "s": [f"row {i}" for i in range(rows)]})
    return frame.with_columns(pl.col("f").alias("g"))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_large_frame_returned_by_a_task_comes_back_equal(shm_dir, transport):
    frames = run(transport, build, [(ROWS * 2, seed) for seed in range(3)])
    for seed, frame in enumerate(frames):
        want = build(ROWS * 2, seed)
        assert summary(frame) == summary(want) and frame.equals(want)
    by_reference = memshare.last_call_stats()["results_by_reference"]
    assert by_reference >= 3 if VIEWS else by_reference == 0  # without view types, polars pickles frames of strings
    assert leaks(shm_dir) == []


def test_a_large_series_returned_by_a_task_comes_back_equal(shm_dir):
    (series,) = Parallel(n_jobs=2, max_nbytes=LIMIT)(delayed(sorted_series)() for _ in range(1))
    assert summary(series) == summary(sorted_series()) and series.equals(sorted_series())
    assert memshare.last_call_stats()["results_by_reference"] >= 1


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_small_frame_is_pickled_by_polars(shm_dir, transport):
    data = numeric_frame(1000)
    assert data.estimated_size() < _polars.SMALL
    assert _polars.reduction(data) is None
    seen = run(transport, same_as_pickled, [(data, pickle.dumps(data, protocol=5))] * 2)
    assert all(got == want and equal for got, want, equal in seen)
    assert memshare.last_call_stats()["buffers_dumped"] == 0


def test_without_a_threshold_polars_pickles_the_frame(shm_dir):
    data = numeric_frame()
    out = Parallel(n_jobs=2, max_nbytes=None)(delayed(column_sum)(data) for _ in range(2))
    assert out == [column_sum(data)] * 2
    stats = memshare.last_call_stats()
    assert stats["buffers_dumped"] == 0 and stats["bytes_pickled"] >= 2 * data.estimated_size()


def test_what_arrow_cannot_carry_as_polars_has_it_is_pickled_by_polars():
    assert _polars.reduction(numeric_frame()) is not None
    objects = pl.DataFrame({"f": np.arange(ROWS, dtype=np.float64), "o": pl.Series([object()] * ROWS, dtype=pl.Object)})
    assert _polars.reduction(objects) is None  # Arrow would carry the objects' addresses
    if hasattr(pl, "Int128"):
        wide = pl.DataFrame({"f": np.arange(ROWS, dtype=np.float64), "w": pl.Series(range(ROWS), dtype=pl.Int128)})
        assert _polars.reduction(wide) is None


@pytest.mark.skipif(not hasattr(pl, "Int128"), reason="this polars has no Int128, which Arrow lacks")
def test_a_frame_arrow_cannot_carry_still_travels(shm_dir):
    data = pl.DataFrame({"f": np.arange(ROWS, dtype=np.float64), "w": pl.Series(range(ROWS), dtype=pl.Int128)})
    (got, want, equal), *_ = run("Parallel", same_as_pickled, [(data, pickle.dumps(data, protocol=5))] * 2)
    assert got == want == summary(data) and equal
    assert memshare.last_call_stats()["buffers_dumped"] == 0


def test_memshare_never_imports_polars():
    result = run_script(
        """
        import sys
        import numpy as np
        import pandas as pd
        import memshare

        def polars_here(frame):
            return "polars" in sys.modules, len(frame)

        frame = pd.DataFrame({"x": np.arange(300_000.0)})
        out = memshare.Parallel(n_jobs=2, max_nbytes="1M")(memshare.delayed(polars_here)(frame) for _ in range(2))
        with memshare.MemmappingPool(2) as pool:
            out += pool.map(polars_here, [frame])
        print(out, "polars" in sys.modules)
        """
    )
    assert result.stdout.split() == ["[(False,", "300000),", "(False,", "300000),", "(False,", "300000)]", "False"]


def test_the_reduction_is_on_once_polars_is_imported():
    assert "polars" in sys.modules  # imported by this module: the reducer is in use
    assert _polars.classes() == (pl.DataFrame, pl.Series)
