"""A task that writes into an array memshare mapped read-only gets an error that names the fixes.

NumPy's bare ``ValueError: assignment destination is read-only`` says nothing
of ``mmap_mode``; memshare knows which arrays it mapped read-only for the
task, and adds a note (``add_note`` on Python 3.11+, the message itself
before) naming the three fixes. A read-only array the user made themselves
gets no note.
"""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest

import memshare
from memshare import MemmappingPool
from memshare._worker import _run as _worker

BIG = 300_000  # float64: 2.4 MB, above the default max_nbytes of 1 MiB


def _text(exc: BaseException) -> str:
    """The exception as the user sees it: its message and its notes."""
    return "\n".join([str(exc)] + list(getattr(exc, "__notes__", ())))


def write_first(X):
    X[0] = 1.0
    return 0


def add_in_place(X):
    np.add(X, 1.0, out=X)
    return 0


def write_own_read_only(X):
    own = np.zeros(4)
    own.flags.writeable = False
    own[0] = 1.0  # the user's own read-only array: not memshare's business
    return 0


def write_user_memmap(X):
    X[0] = 1.0
    return 0


@pytest.mark.parametrize("task", [write_first, add_in_place])
def test_parallel_read_only_write_names_the_fixes(shm_dir, task):
    """memshare.Parallel: the error keeps its type and message, and gains the note with the three fixes."""
    X = np.ones(BIG)
    with pytest.raises(ValueError, match="is read-only") as info:
        memshare.Parallel(n_jobs=2)(memshare.delayed(task)(X) for _ in range(2))
    text = _text(info.value)
    assert "mmap_mode='c'" in text and "memshare.empty" in text and ".copy()" in text, text
    if sys.version_info >= (3, 11):
        assert _worker.READ_ONLY_NOTE in info.value.__notes__


def test_pool_read_only_write_names_the_fixes(shm_dir):
    """MemmappingPool: the same note."""
    X = np.ones(BIG)
    with MemmappingPool(2) as pool:
        with pytest.raises(ValueError, match="assignment destination is read-only") as info:
            pool.map(write_first, [X, X])
    text = _text(info.value)
    assert "mmap_mode='c'" in text and "memshare.empty" in text and ".copy()" in text, text


def test_copy_on_write_has_no_error(shm_dir):
    """The first fix works: with mmap_mode='c' the same task runs."""
    X = np.ones(BIG)
    assert memshare.Parallel(n_jobs=2, mmap_mode="c")(memshare.delayed(write_first)(X) for _ in range(2)) == [0, 0]


def test_users_own_read_only_array_gets_no_note(shm_dir):
    """A read-only array the task made itself: NumPy's error, untouched (pool and Parallel)."""
    small = np.ones(10)  # pickled: memshare maps nothing for this task
    with pytest.raises(ValueError, match="assignment destination is read-only") as info:
        memshare.Parallel(n_jobs=2)(memshare.delayed(write_own_read_only)(small) for _ in range(2))
    assert "mmap_mode" not in _text(info.value)
    assert not getattr(info.value, "__notes__", None)
    with MemmappingPool(2) as pool:
        with pytest.raises(ValueError, match="assignment destination is read-only") as info:
            pool.map(write_own_read_only, [small])
    assert "mmap_mode" not in _text(info.value)


def test_users_own_read_only_memmap_gets_no_note(shm_dir, tmp_path):
    """The user's own np.memmap opened with mode 'r' is read-only by the user's choice: no note."""
    path = tmp_path / "data.bin"
    np.ones(BIG).tofile(path)
    X = np.memmap(path, dtype=np.float64, mode="r")
    with pytest.raises(ValueError, match="is read-only") as info:
        memshare.Parallel(n_jobs=2)(memshare.delayed(write_user_memmap)(X) for _ in range(2))
    assert "mmap_mode" not in _text(info.value)
    del X


@pytest.mark.parametrize(
    "message, expected",
    [
        ("assignment destination is read-only", True),  # X[i] = v, X.fill, np.copyto
        ("output array is read-only", True),  # ufunc out=, X += 1
        ("sort array is read-only", True),
        ("put: output array is read-only", True),
        ("underlying array is read-only", True),  # X.flat[i] = v
        ("buffer source array is read-only", True),  # Cython typed memoryviews (scikit-learn)
        ("cannot set WRITEABLE flag to True of this array", True),
        ("invalid literal for int()", False),
    ],
)
def test_read_only_messages_are_recognised(message, expected):
    """NumPy's wordings (1.21 to 2.x: ``<what> is read-only``), Cython's, and nothing else."""
    assert _worker.is_read_only_error(ValueError(message)) is expected
    assert _worker.is_read_only_error(KeyError(message)) is False


def test_before_notes_the_message_carries_the_note(monkeypatch):
    """Without ``add_note`` (Python < 3.11) the note goes into the message; the type stays ValueError."""
    monkeypatch.setattr(_worker, "HAS_NOTES", False)
    exc = ValueError("assignment destination is read-only")
    _worker.add_note(exc, _worker.READ_ONLY_NOTE)
    assert type(exc) is ValueError and not getattr(exc, "__notes__", None)
    assert str(exc).startswith("assignment destination is read-only\n") and "mmap_mode='c'" in str(exc)
    assert _worker.is_read_only_error(exc)  # its first line is still NumPy's


def takes(value):
    return 0


def test_an_unpicklable_argument_names_the_fix_of_its_front_end():
    """Parallel's error suggests threads through its backend; a pool's, a thread pool: it has no backend."""
    lock = threading.Lock()
    with pytest.raises(memshare.UnpicklableArgumentError) as parallel:
        memshare.Parallel(n_jobs=2)(memshare.delayed(takes)(lock) for _ in range(2))
    assert "backend='threading'" in str(parallel.value), str(parallel.value)
    with MemmappingPool(2) as pool, pytest.raises(memshare.UnpicklableArgumentError) as pooled:
        pool.map(takes, [lock])
    message = str(pooled.value)
    assert "backend" not in message and "multiprocessing.pool.ThreadPool" in message, message
