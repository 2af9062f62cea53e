"""Automatic batching bounds the bytes a call holds in files, and still batches tasks that dump nothing."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import threading

import numpy as np
import pytest
from conftest import memshare_entries

from memshare import Parallel, delayed
from memshare._lifetime._sweep import folder_size

MiB = 1 << 20


def first(a, i=0):
    return float(a[0]) + i


class _PeakSampler:
    """Samples the bytes allocated under ``base`` on a thread until stopped; keeps the peak."""

    def __init__(self, base: str) -> None:
        self.base, self.peak, self.samples = base, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            self.peak = max(self.peak, folder_size(self.base))
            self.samples += 1
            if self._stop.wait(0.002):
                return

    def __enter__(self) -> _PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture
def shm_base(monkeypatch):
    """A private folder in /dev/shm (tmpfs, as in real use) that memshare is pointed at."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("needs /dev/shm")
    base = tempfile.mkdtemp(dir="/dev/shm", prefix="test-batching-")
    monkeypatch.setenv("MEMSHARE_TEMP_FOLDER", base)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def test_distinct_arrays_at_default_settings_hold_a_few_tasks_worth(shm_base):
    """300 fast tasks, each with its own 8 MB array: at most 96 MiB of files at once (before: about 490 MiB)."""
    arrays = (np.full(MiB, float(i)) for i in range(300))  # 8 MiB each, made as joblib asks for them
    with _PeakSampler(shm_base) as sampler:
        out = Parallel(n_jobs=2)(delayed(first)(a) for a in arrays)
    assert out == [float(i) for i in range(300)]
    assert sampler.samples > 10
    assert 8 * MiB <= sampler.peak <= 96 * MiB, sampler.peak / MiB
    assert memshare_entries(shm_base) == []


def test_tasks_that_dump_nothing_new_are_still_batched(shm_base, capfd):
    """One 16 MiB array used by 3,000 tiny tasks is dumped once; the later batches dump nothing and grow."""
    shared = np.ones(2 * MiB)
    out = Parallel(n_jobs=2, verbose=10)(delayed(first)(shared, i) for i in range(3000))
    assert out == [1.0 + i for i in range(3000)]
    sizes = [int(n) for n in re.findall(r"Setting batch_size=(\d+)", capfd.readouterr().err)]
    assert sizes and max(sizes) >= 8, sizes
