"""The shared memory memshare holds, as ``last_call_stats`` and ``doctor`` report it.

Results come back as files the parent maps but has not touched: they add
nothing to its RSS or PSS, yet they hold memory that a container's limit
counts. ``bytes_in_shared_memory`` reports them, with everything else
memshare holds for the process, and ``doctor`` says what each live process
holds.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import array_fit_to_hold, without_location_settings

import memshare
from memshare import MemmappingPool, Parallel, delayed
from memshare._lifetime import _holdings, _memfd
from memshare._tools import doctor as _doctor

MIB = 1024**2
COUNT = 4
#: float64 elements of one result: 4 MiB, far above the default max_nbytes.
ELEMENTS = 4 * MIB // 8


@pytest.fixture
def mechanism(mechanism, default_location):
    """conftest's ``mechanism``, where memshare chooses the location itself."""
    return mechanism


def _result_mappings() -> dict:
    """How many mappings of this process are of memshare result memfds and of deleted named result files."""
    with open("/proc/self/maps") as maps:
        lines = [line.rstrip("\n") for line in maps if line.rstrip("\n").endswith("(deleted)")]
    return {
        "memfd": sum("/memfd:memshare-result-" in line for line in lines),
        "named": sum("/memshare-" in line and "/result-" in line for line in lines),
    }


def _held_after_an_empty_call() -> int:
    """``bytes_in_shared_memory`` of a call that shares nothing (``n_jobs=1``): what the process holds now."""
    Parallel(n_jobs=1)(delayed(len)(x) for x in ([1],))
    return memshare.last_call_stats()["bytes_in_shared_memory"]


def test_stats_count_results_the_parent_has_not_touched_until_they_are_freed(mechanism):
    before = _held_after_an_empty_call()
    mapped_before = _result_mappings()[mechanism]
    results = Parallel(n_jobs=2)(delayed(np.ones)(ELEMENTS) for _ in range(COUNT))
    stats = memshare.last_call_stats()
    assert stats["results_by_reference"] == COUNT
    # The results came back the way the fixture chose, and the parent has not read them.
    assert _result_mappings()[mechanism] == mapped_before + COUNT
    assert stats["bytes_in_shared_memory"] >= before + COUNT * ELEMENTS * 8
    assert "held in shared memory after the call" in memshare._stats.CallStats(**stats).summary()
    del results
    assert _held_after_an_empty_call() <= before


def test_stats_count_a_pools_results_and_a_shared_array(mechanism):
    before = _held_after_an_empty_call()
    shared = memshare.arrays.full(ELEMENTS, 2.0)
    with MemmappingPool(2) as pool:
        results = pool.map(np.ones, [ELEMENTS] * COUNT)
    held = memshare.last_call_stats()["bytes_in_shared_memory"]
    assert held >= before + (COUNT + 1) * ELEMENTS * 8
    del results
    after_results = _held_after_an_empty_call()
    assert after_results <= held - COUNT * ELEMENTS * 8
    assert after_results >= before + ELEMENTS * 8  # the shared array is still held
    del shared
    assert _held_after_an_empty_call() <= before


def test_an_array_held_once_counts_whole_though_its_file_grew_piece_by_piece():
    # A held file is made empty and grows as the array is copied in: its size is asked, never settled at 0.
    from memshare._parent import _held_memory

    if _held_memory.unsupported_reason() is not None or not _memfd.decision().in_memory:
        pytest.skip("arrays are not held once in memfds here")
    before = _holdings.held().memfds
    x = array_fit_to_hold(48 * MIB)
    assert Parallel(n_jobs=2, max_nbytes="1M")(delayed(np.sum)(x) for _ in range(2)) == [x.sum()] * 2
    assert memshare.last_call_stats()["arrays_held_once"] == 1
    assert _holdings.held().memfds >= before + x.nbytes
    del x


def test_a_file_held_and_mapped_counts_once():
    shared = memshare.arrays.full(ELEMENTS, 2.0)
    held = _holdings.held()
    assert held.total >= ELEMENTS * 8
    view = shared[: ELEMENTS // 2]  # a view maps nothing new
    assert _holdings.held() == held
    del view, shared


def test_what_many_broadcasts_hold_is_counted_without_a_system_call_each(monkeypatch):
    # A memfd reserved whole keeps its size and blocks: its stat from when it was made stays true.
    previous = _memfd.decision()
    if not previous.in_memory:
        pytest.skip(f"memfds are not usable here: {previous.reason}")
    shared = [memshare.broadcast(list(range(i, i + 2000))) for i in range(50)]
    truth = _holdings.held()
    asked = []
    real_fstat = os.fstat
    monkeypatch.setattr(os, "fstat", lambda fd: asked.append(fd) or real_fstat(fd))
    assert _holdings.held() == truth
    monkeypatch.undo()
    fds = {int(path.rsplit("/", 1)[1]) for path in _memfd.held_paths()}
    assert len(fds) >= 50 and not fds & set(asked), f"{len(fds & set(asked))} of {len(fds)} memfds stat'ed again"
    assert truth.memfds >= sum(os.fstat(fd).st_blocks * 512 for fd in fds)  # each counted, as its fstat says
    del shared


HOLDER = """
    import sys
    import numpy as np
    import memshare
    from memshare import Parallel, delayed
    if __name__ == "__main__":
        results = Parallel(n_jobs=2)(delayed(np.ones)({elements}) for _ in range({count}))
        shared = memshare.arrays.full({elements}, 1.0)
        print("ready", flush=True)
        sys.stdin.read()  # holds its results, untouched, and its shared array until the test closes stdin
"""


@pytest.mark.parametrize("memfds", ["1", "0"], ids=["memfd", "named"])
def test_doctor_says_what_this_and_another_live_process_hold(memfds):
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(HOLDER.format(elements=ELEMENTS, count=COUNT))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**without_location_settings(), "MEMSHARE_MEMFD": memfds},
    )
    try:
        assert holder.stdout.readline().strip() == "ready"
        shared = memshare.arrays.full(ELEMENTS, 2.0)
        lines: list = []
        _doctor.run_doctor(say=lines.append)
        del shared
    finally:
        holder.stdin.close()
        holder.wait(timeout=120)
    start = lines.index("Shared memory memshare holds")
    section = lines[
        start + 1 : start + 1 + next(i for i, line in enumerate(lines[start + 1 :]) if not line[:1].isspace())
    ]
    assert section[0].startswith("  memshare holds ") and "this process: " in section[0]
    assert "container's memory limit counts all of it" in section[0]
    mine = [line for line in section if line.startswith(f"  pid {os.getpid()} ") and "(this process)" in line]
    assert len(mine) == 1
    theirs = [line for line in section if line.startswith(f"  pid {holder.pid} ")]
    assert len(theirs) == 1
    # Its results are in no folder and no descriptor: only its mappings keep them. Its shared array is
    # a memfd it holds open, or a file in its folder in /dev/shm.
    results, shared = _doctor.format_bytes(COUNT * ELEMENTS * 8), _doctor.format_bytes(ELEMENTS * 8)
    assert f"{results} in deleted files only its mappings keep" in theirs[0]
    where = "in memfds it holds open" if memfds == "1" else f"in folders in {_doctor.SHM_ROOT}"
    assert f"{shared} {where}" in theirs[0]
