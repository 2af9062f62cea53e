"""The bench's workloads on data that is not an array (j-m) and on pools (p): they run, and report their rows.

Each runs in quick mode at a tiny size, through the real harness (each contender in a process of its own);
no timing is checked, only that every row is there, correct, and that nothing is left running.
"""

from __future__ import annotations

import importlib.util
import os
import re

import psutil
import pytest
from conftest import wait_until

from memshare._tools.benchmarks import harness, machine
from memshare._tools.benchmarks.harness import run_benchmark
from memshare._tools.benchmarks.report import markdown_table
from memshare._tools.benchmarks.results import Measurement, Report, pool_rows, summarize
from memshare._tools.benchmarks.runners import CONTENDERS
from memshare._tools.benchmarks.workloads import make_workloads
from memshare._tools.benchmarks.workloads_pool import POOL_OPERATIONS

# The harness runs whole benchmarks: its outcome does not depend on the versions of Python, numpy or
# joblib, which every other test covers; CI runs it in the whole-suite environment (main).
pytestmark = pytest.mark.version_independent

MiB = 1 << 20
needs_arrow = pytest.mark.skipif(
    importlib.util.find_spec("pandas") is None or importlib.util.find_spec("pyarrow") is None,
    reason="needs pandas and pyarrow",
)


def _children() -> set:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _memshare_files_of(pids: set) -> list:
    """Files in /dev/shm that memshare made for one of ``pids`` (their names carry the pid)."""
    if not os.path.isdir("/dev/shm"):
        return []
    return [
        name
        for name in os.listdir("/dev/shm")
        if "memshare" in name and any(re.search(rf"[-_]{pid}[-_]", name) for pid in pids)
    ]


def _run(keys: str) -> Report:
    """Run ``keys`` quickly with every contender; check that no process or memshare file is left behind."""
    before = _children()
    report = run_benchmark(keys, CONTENDERS, size=2 * MiB, repeats=1, quick=True, progress=False)
    assert wait_until(lambda: _children() <= before, 30), _children() - before
    pids = {m.pid for m in report.measurements}
    assert wait_until(lambda: not _memshare_files_of(pids), 10), _memshare_files_of(pids)
    return report


@needs_arrow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("key", ["j", "k", "l", "m", "n"])
def test_data_that_is_not_an_array_has_its_rows(key):
    """Every contender of (j)-(m) has a correct row, and memshare's rows report the bytes pickled per call."""
    report = _run(key)
    table = markdown_table(report)
    workload = make_workloads()[key]
    for contender in workload.contenders:
        assert f"| ({key}) | {contender} |" in table, table
    assert {m.contender for m in report.measurements} == set(workload.contenders)
    assert all(m.correct for m in report.measurements), report.notes
    for m in report.measurements:
        if m.contender.startswith("memshare"):
            assert m.stats["bytes_pickled"] > 0 and m.stats["tasks"] > 0, m.stats
            assert re.search(rf"- \({key}\) {m.contender} n_jobs=2: tasks=\d+, bytes_pickled=", table)
    if key == "l":
        assert "memshare-broadcast" in {m.contender for m in report.measurements}


@needs_arrow
@pytest.mark.timeout(300)
def test_a_second_call_over_arrow_data_sends_what_the_first_wrote_and_each_repeat_starts_cold():
    """(n) times a second call, which reuses every buffer; (j) builds its frame anew at each repeat, so no repeat
    finds the buffers an earlier one kept."""
    before = _children()
    report = run_benchmark("jn", ("memshare",), size=4 * MiB, repeats=2, quick=True, progress=False)
    assert wait_until(lambda: _children() <= before, 30), _children() - before
    by_key = {key: [m for m in report.measurements if m.workload == key] for key in "jn"}
    assert len(by_key["j"]) == len(by_key["n"]) == 2, report.measurements
    for m in by_key["j"]:
        assert m.correct and m.stats["buffers_dumped"] >= 1 and m.stats["buffers_reused"] == 0, m.stats
    for m in by_key["n"]:
        assert m.correct and m.stats["buffers_dumped"] == 0 and m.stats["buffers_reused"] >= 1, m.stats


@pytest.mark.timeout(300)
def test_pool_workload_times_each_operation_and_starts_in_a_fresh_process():
    """(p): a row per pool and operation, all correct; "start" in a new process per repeat, the others not."""
    report = _run("p")
    contenders = make_workloads()["p"].contenders
    assert {"memshare-pool", "joblib-pool", "mp.Pool-fork"} <= set(contenders)
    seen = {(m.operation, m.contender) for m in report.measurements}
    assert seen == {(op, c) for op in POOL_OPERATIONS for c in contenders}
    assert all(m.correct for m in report.measurements), report.notes
    for contender in contenders:
        pids = {m.operation: m.pid for m in report.measurements if m.contender == contender}
        assert pids["start"] not in {pids["map"], pids["imap"], pids["apply"]}
        assert pids["map"] == pids["imap"] == pids["apply"]
    table = markdown_table(report)
    assert "| (p) start | memshare-pool |" in table and "| (p) apply | mp.Pool-fork |" in table
    assert "Pools on small items (p)" in table
    assert "| start | memshare-pool | forkserver | 2 |" in table or "| start | memshare-pool | fork |" in table


def test_pool_ratios_are_to_the_same_start_method_and_to_joblibs_pool():
    """memshare's pool is divided by mp.Pool with its start method, joblib's by mp.Pool with the default one."""
    from memshare._tools.benchmarks.workloads_pool import pool_start_method

    report = Report(size=MiB, n_jobs=2, repeats=1, references={"p": "joblib-pool"})
    times = {"memshare-pool": 0.6, "joblib-pool": 0.3, "mp.Pool-forkserver": 0.2, "mp.Pool-fork": 0.1}
    for name, seconds in times.items():
        report.measurements.append(Measurement("p", name, 2, seconds, 0, True, operation="start"))
    rows = {r["contender"]: r for r in pool_rows(report)}
    for name, row in rows.items():
        same = times[f"mp.Pool-{pool_start_method(name)}"]
        assert row["same_method"] == pytest.approx(times[name] / same)
        assert row["joblib_pool"] == pytest.approx(times[name] / 0.3)
    assert rows["mp.Pool-fork"]["same_method"] == pytest.approx(1.0)
    main = {r["contender"]: r for r in summarize(report)}
    assert main["memshare-pool"]["time_ratio"] == pytest.approx(2.0)  # the main table's reference: joblib's pool
    assert "| (p) start | memshare-pool |" in markdown_table(report)


def test_arrow_workloads_are_skipped_with_a_reason_without_pandas(monkeypatch):
    """Without pandas, (j), (k) and (m) are skipped with the reason in the notes; (l) needs no pandas."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pandas" else real(name))
    workloads = make_workloads()
    for key in "jkm":
        assert "needs pandas" in workloads[key].skip_reason()
    assert workloads["l"].skip_reason() is None
    monkeypatch.setattr(harness, "ContenderProcess", lambda name: pytest.fail("must not start a process"))
    report = run_benchmark("j", CONTENDERS, size=MiB, repeats=1, quick=True, progress=False)
    assert report.measurements == []
    assert any(n.startswith("(j) skipped: needs pandas") for n in report.notes), report.notes


def test_memory_guard_counts_the_new_workloads():
    """The guard's estimate: (j) holds the frame in each of its 3 processes plus joblib's copies; (p) nothing."""
    size = 64 * MiB
    assert machine.estimate_peak("j", CONTENDERS, size) == (size * (3 + 4), "j", 3)
    assert machine.estimate_peak("l", CONTENDERS, size)[0] == int(size * (4 * 0.25 + 0.5))
    assert machine.estimate_peak("p", CONTENDERS, size)[0] == 0
    with pytest.raises(machine.TooLargeError, match=r"workload \(j\)"):
        machine.check_fits("jp", CONTENDERS, size, available=6 * size)


def test_a_workload_with_none_of_the_chosen_contenders_says_so():
    report = run_benchmark("p", ["memshare", "joblib"], size=MiB, repeats=1, quick=True, progress=False)
    assert report.measurements == []
    assert any(n.startswith("(p) not run: none of its contenders") for n in report.notes), report.notes


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "key",
    [
        "q",
        pytest.param(
            "r",
            marks=pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="(r) needs torch"),
        ),
    ],
)
def test_tasks_returning_their_input_have_their_rows_and_memshare_maps_the_inputs_file(key):
    """(q), (r): every contender has a correct row; memshare's results are its input's file, never a result file."""
    report = _run(key)
    table = markdown_table(report)
    workload = make_workloads()[key]
    assert {"memshare", "memshare-copy", "joblib", "mp.Pool"} <= set(workload.contenders)
    for contender in workload.contenders:
        assert f"| ({key}) | {contender} |" in table, table
    assert {m.contender for m in report.measurements} == set(workload.contenders)
    assert all(m.correct for m in report.measurements), report.notes
    for m in report.measurements:
        if m.contender.startswith("memshare"):
            # Tasks of one joblib batch returning the same X send it once: a result slot per batch, not per task.
            assert m.stats["results_of_inputs"] >= 1 and m.stats["results_by_reference"] == 0, m.stats
            assert re.search(rf"- \({key}\) {m.contender} n_jobs=2: .*results_of_inputs=\d+", table)


def test_the_torch_workload_is_skipped_with_a_reason_without_torch(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name))
    assert "needs torch" in make_workloads()["r"].skip_reason()
    assert make_workloads()["q"].skip_reason() is None
    monkeypatch.setattr(harness, "ContenderProcess", lambda name: pytest.fail("must not start a process"))
    report = run_benchmark("r", CONTENDERS, size=MiB, repeats=1, quick=True, progress=False)
    assert report.measurements == []
    assert any(n.startswith("(r) skipped: needs torch") for n in report.notes), report.notes


def test_memory_guard_counts_every_returned_copy():
    """(q), (r): each contender process holds X; joblib and mp.Pool get each of the 8 results back whole."""
    size = 64 * MiB
    contenders = make_workloads()["q"].contenders
    for key in "qr":
        assert machine.estimate_peak(key, CONTENDERS, size) == (size * (len(contenders) + 10), key, len(contenders))
    only_memshare = machine.estimate_peak("q", ["memshare", "memshare-copy"], size)
    assert only_memshare == (size * 3, "q", 2)
    with pytest.raises(machine.TooLargeError, match=r"workload \(q\)"):
        machine.check_fits("q", CONTENDERS, size, available=10 * size)
