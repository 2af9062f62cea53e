"""A copy-on-write memmap the parent never wrote to travels as a reference to its file.

Its private pages are the only way it can differ from its file, and
``/proc/self/pagemap`` tells which pages are private: with none, the file is
the array's content, so workers map the file (copy-on-write, as joblib does)
instead of receiving a copy; with any, it is copied as before.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
from conftest import memfds_held, memshare_entries

import memshare
from memshare import Parallel, delayed
from memshare._payload._routes import DUMP_ARRAY, REFERENCE, input_route

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/pagemap is Linux's")

N = 2 * 1024**2 // 8  # 2 MB of float64


@pytest.fixture
def cow_file(tmp_path):
    path = tmp_path / "data.f8"
    np.arange(N, dtype=np.float64).tofile(path)
    return path


def file_mode_and_write(x):
    """The worker's view of the memmap: its file, mode, a value, and whether its own write stays private."""
    before = float(x[5])
    writable = bool(x.flags.writeable)
    if writable:
        x[5] = -1.0  # copy-on-write: private to this task
    return str(getattr(x, "filename", None)), getattr(x, "mode", None), before, writable


def test_a_fresh_copy_on_write_memmap_travels_by_reference(shm_dir, cow_file):
    cow = np.memmap(cow_file, dtype=np.float64, mode="c")
    assert float(cow[: N // 2].sum()) > 0  # read pages are still the file's
    seen = Parallel(n_jobs=2, max_nbytes="1M")(delayed(file_mode_and_write)(cow) for _ in range(3))
    assert seen == [(str(cow_file), "c", 5.0, True)] * 3
    stats = memshare.last_call_stats()
    assert stats["arrays_dumped"] == 0 and stats["arrays_referenced"] == 1
    assert cow[5] == 5.0 and np.fromfile(cow_file)[5] == 5.0  # the tasks' writes stayed theirs
    assert memshare_entries(shm_dir) == [] and memfds_held() == []
    del cow


def test_a_read_only_view_of_a_fresh_one_is_mapped_read_only(shm_dir, cow_file):
    cow = np.memmap(cow_file, dtype=np.float64, mode="c")
    view = cow[10:]
    view.flags.writeable = False
    (seen,) = Parallel(n_jobs=2, max_nbytes="1M")(delayed(file_mode_and_write)(view) for _ in range(1))
    assert seen[2:] == (15.0, False)
    assert memshare.last_call_stats()["arrays_dumped"] == 0
    del cow, view


def test_one_the_parent_wrote_to_is_copied_with_the_parents_values(shm_dir, cow_file):
    cow = np.memmap(cow_file, dtype=np.float64, mode="c")
    cow[5] = 123.0  # a private page: the file still holds 5.0
    seen = Parallel(n_jobs=2, max_nbytes="1M")(delayed(file_mode_and_write)(cow) for _ in range(2))
    assert [s[2] for s in seen] == [123.0, 123.0]
    assert all(s[0] != str(cow_file) for s in seen)  # a copy, not the file
    assert memshare.last_call_stats()["arrays_dumped"] == 1
    assert memshare_entries(shm_dir) == []
    del cow


def test_a_write_far_from_a_view_still_copies_it(shm_dir, cow_file):
    # The whole mapping is asked, not just the view's pages: conservative and simple.
    cow = np.memmap(cow_file, dtype=np.float64, mode="c")
    cow[-1] = 7.0
    Parallel(n_jobs=2, max_nbytes="1M")(delayed(file_mode_and_write)(cow[: N * 3 // 4]) for _ in range(1))
    assert memshare.last_call_stats()["arrays_dumped"] == 1
    del cow


def test_the_decision_takes_the_page_state_as_given(cow_file):
    cow = np.memmap(cow_file, dtype=np.float64, mode="c")
    route = input_route(cow, 1024, (), copy_on_write_unwritten=lambda array: True)
    assert route.kind == REFERENCE and str(route.ref.path) == str(cow_file) and route.ref.mode == "c"
    assert input_route(cow, 1024, (), copy_on_write_unwritten=lambda array: False).kind == DUMP_ARRAY
    assert input_route(cow, 1024, ()).kind == DUMP_ARRAY  # nothing known: copied
    del cow, route
