"""memshare.Parallel(progress=True): the bar learns the total of a generator and ends at n/n."""

from __future__ import annotations

import contextlib
import io

import pytest
import tqdm.auto
from conftest import RETURN_AS

from memshare import Parallel, delayed


def double(x):
    return 2 * x


@pytest.fixture
def bars(monkeypatch):
    """Every bar made by tqdm.auto during the test."""
    made = []

    class RecordingBar(tqdm.auto.tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(tqdm.auto, "tqdm", RecordingBar)
    return made


def last_line(text: str) -> str:
    return [part for part in text.replace("\n", "\r").split("\r") if part.strip()][-1]


@pytest.mark.parametrize("return_as", RETURN_AS)
def test_generator_of_tasks_ends_at_total(bars, return_as):
    """50 tasks from a generator: the bar learns the total and ends at 50/50 (before: "50task")."""
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        out = Parallel(n_jobs=2, return_as=return_as, progress=True)(delayed(double)(i) for i in range(50))
        assert sorted(out) == [2 * i for i in range(50)]
    (bar,) = bars
    assert (bar.n, bar.total) == (50, 50)
    assert "50/50" in last_line(stderr.getvalue()) and "100%" in last_line(stderr.getvalue())


@pytest.mark.parametrize("n_jobs", [1, 2])
def test_generator_with_pre_dispatch_all_or_sequential(bars, n_jobs):
    """pre_dispatch="all" and the sequential fallback also end at the total."""
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        out = Parallel(n_jobs=n_jobs, pre_dispatch="all", progress=True)(delayed(double)(i) for i in range(30))
    assert out == [2 * i for i in range(30)]
    (bar,) = bars
    assert (bar.n, bar.total) == (30, 30)
    assert "30/30" in last_line(stderr.getvalue())


def test_failed_call_closes_its_bar(bars):
    """A call that raises closes its bar."""
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), pytest.raises(TypeError):
        Parallel(n_jobs=2, progress=True)(delayed(double)(None if i == 3 else i) for i in range(20))
    (bar,) = bars
    assert bar.disable  # tqdm sets it on close()
