"""The data and tasks of the workloads on objects that are not arrays: Arrow-backed DataFrames (j, k, m), a dict (l).

:func:`string_frame` and :func:`arrow_dtype_frame` build the DataFrames
(pandas and pyarrow are imported only here, and the workloads are skipped
without them: :func:`arrow_skip`); :func:`dict_run` runs the dict's lookups,
with ``memshare.broadcast`` made inside the timed call for the contender that
uses it. The workloads themselves are declared in ``workloads.make_workloads``.
"""

from __future__ import annotations

from typing import Any, List, Optional

import numpy as np

if __package__:
    from .runners import Runner, Task
else:  # imported as a top-level module by _contender.py, which must not import memshare (see there)
    from runners import Runner, Task

MiB = 1 << 20


def arrow_strings(nbytes: int, seed: int = 0) -> Any:
    """A ``pyarrow`` string array of random strings of 24 to 40 letters, about ``nbytes`` with its offsets.

    Built from its buffers directly (fast at any size). 32-bit offsets while they fit, as older pandas
    (before 2.2) take only those into ``string[pyarrow]``; newer pandas widens them to 64 bits, copying
    the offsets only.
    """
    import pyarrow as pa

    rng = np.random.default_rng(seed)
    rows = max(1, nbytes // 36)  # 32 letters on average + a 4-byte offset
    offsets = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(rng.integers(24, 41, size=rows, dtype=np.int64), out=offsets[1:])
    # 1 MiB of random letters repeated: strings at random offsets into it, as unlike each other as needed here,
    # at the speed of a copy.
    letters = np.resize(rng.integers(97, 123, size=min(int(offsets[-1]), MiB), dtype=np.uint8), int(offsets[-1]))
    if offsets[-1] < 2**31:
        return pa.StringArray.from_buffers(rows, pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(letters))
    return pa.LargeStringArray.from_buffers(rows, pa.py_buffer(offsets), pa.py_buffer(letters))


def string_frame(nbytes: int, seed: int = 0) -> Any:
    """A DataFrame with one ``string[pyarrow]`` column of about ``nbytes``."""
    import pandas as pd
    import pyarrow as pa

    table = pa.table({"s": arrow_strings(nbytes, seed)})
    string = pd.StringDtype("pyarrow")
    return table.to_pandas(types_mapper={pa.string(): string, pa.large_string(): string}.get)


def frame_statistic(frame: Any, k: int) -> Any:
    """One cheap statistic of ``frame`` (which one depends on ``k``): the transport is what gets measured."""
    column = frame[frame.columns[k % len(frame.columns)]]
    which = k % 4
    if which == 0:
        return int(column.count())
    if which == 1:
        return str(column.iloc[(k * 1000) % len(column)])
    if which == 2:
        return int(column.isna().sum())
    return len(frame)


def lookup(table: Any, k: int) -> int:
    """Sum of 100 entries of a dict of ``key-<i>`` -> i (or of a ``memshare.Broadcast`` of one)."""
    table = table.value if type(table).__name__ == "Broadcast" else table
    return sum(table[f"key-{(k * 7919 + j) % len(table)}"] for j in range(100))


def arrow_skip() -> Optional[str]:
    import importlib.util

    missing = [m for m in ("pandas", "pyarrow") if importlib.util.find_spec(m) is None]
    if missing:
        return f"needs {' and '.join(missing)}, not installed here (pip install pandas pyarrow)"
    return None


FRAME_TASKS = 8


def arrow_dtype_frame(size: int, quick: bool) -> Any:
    """A string and a float column (4/5 and 1/6 of ``size``) through Parquet and back, with Arrow dtypes.

    Written to an in-memory Parquet file and read back as ``pd.read_parquet(..., dtype_backend="pyarrow")``
    would (``types_mapper=pd.ArrowDtype``): the chunked columns with validity bitmaps a frame read from a
    file has. Uncompressed and without dictionaries, so that building it stays quick.
    """
    import pandas as pd
    import pyarrow as pa
    import pyarrow.parquet as pq

    strings = arrow_strings(size * 4 // 5)
    floats = np.random.default_rng(1).random(len(strings))
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({"s": strings, "f": floats}), sink, compression="none", use_dictionary=False)
    del strings, floats
    return pq.read_table(pa.BufferReader(sink.getvalue())).to_pandas(types_mapper=pd.ArrowDtype)


def frame_tasks(frame: Any, pickles: bool) -> List[Task]:
    return [(frame_statistic, (frame, k)) for k in range(FRAME_TASKS)]


def warm_strings(n_jobs: int) -> List[Task]:
    return [(frame_statistic, (string_frame(4000, k), k)) for k in range(2 * n_jobs)]


def warm_arrow_dtypes(n_jobs: int) -> List[Task]:
    return [(frame_statistic, (arrow_dtype_frame(4000, True), k)) for k in range(2 * n_jobs)]


def warm_results(n_jobs: int) -> List[Task]:
    return [(string_frame, (4000, k)) for k in range(2 * n_jobs)]


def frames_equal(result: Any, expected: Any) -> bool:
    return len(result) == len(expected) and all(
        a.equals(b) and list(a.dtypes) == list(b.dtypes) for a, b in zip(result, expected)
    )


# The dict of (l): its pickle weighs about size / DICT_SHARE (a str -> int entry pickles to about 17 bytes, and
# takes about 7 times that in memory); 40 tasks, 8 with --quick.
DICT_SHARE = 64
DICT_TASKS = 40
DICT_TASKS_QUICK = 8


def dict_data(size: int, quick: bool) -> tuple:
    entries = max(1000, size // DICT_SHARE // 17)
    return {f"key-{i}": i for i in range(entries)}, DICT_TASKS_QUICK if quick else DICT_TASKS


def dict_run(data: tuple, contender: str, n_jobs: int) -> List[int]:
    """The lookups of (l); memshare-broadcast broadcasts the dict inside the timed call, as a user would."""
    table, n_tasks = data
    if contender == "serial":
        return [lookup(table, k) for k in range(n_tasks)]
    argument = table
    if contender == "memshare-broadcast":
        import memshare

        argument = memshare.broadcast(table)
    return Runner(contender, n_jobs).run([(lookup, (argument, k)) for k in range(n_tasks)])
