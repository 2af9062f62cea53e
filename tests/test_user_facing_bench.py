"""The bench report as a newcomer reads it, and a bench that refuses what the machine cannot hold.

No full benchmark runs here: reports are built from made-up measurements, and
the harness runs with a stand-in for the contender processes, except where a
real process must die.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal

import pytest

from memshare._tools.benchmarks import harness, machine, memory
from memshare._tools.benchmarks.processes import ContenderProcess, describe_exit
from memshare._tools.benchmarks.report import markdown_table
from memshare._tools.benchmarks.results import Measurement, Report
from memshare._tools.benchmarks.runners import CONTENDERS

MiB = 1 << 20
GiB = 1 << 30


def _report(**fields) -> Report:
    """A report with made-up measurements of workloads (a) and (i), every contender in them."""
    report = Report(size=64 * MiB, n_jobs=2, repeats=1, titles={"a": "chunks", "i": "loop"}, **fields)
    seconds = {"memshare": 1.0, "memshare-copy": 1.1, "joblib": 2.0, "joblib-nomemmap": 2.5, "mp.Pool": 3.0}
    for name, t in {**seconds, "serial": 1.5, "shm-write": 0.2, "first-touch": 0.1}.items():
        report.measurements.append(Measurement("a", name, 2, t, 10 * MiB, True, end_extra_bytes=MiB))
    for name in ("memshare", "memshare-plain", "memshare-copy", "joblib", "serial"):
        report.measurements.append(Measurement("i", name, 2, 2.0, 5 * MiB, True))
    return report


def _tables(text: str) -> list:
    """(header cells, row lines, the text under the table up to the next table) for each table of ``text``."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("|") and lines[i + 1].startswith("|---")]
    tables = []
    for n, start in enumerate(starts):
        end = start + 2
        while end < len(lines) and lines[end].startswith("|"):
            end += 1
        below = lines[end : starts[n + 1] if n + 1 < len(starts) else len(lines)]
        header = [cell.strip() for cell in lines[start].strip("|").split("|")]
        tables.append((header, lines[start + 2 : end], below))
    return tables


# -- 5. the report ---------------------------------------------------------------------------------------------


def test_every_contender_and_column_is_defined_under_its_table():
    """Under each table: a line for each contender of its rows and for each of its measured columns."""
    tables = _tables(markdown_table(_report()))
    assert len(tables) == 3  # the main table, against the limit, the shared-array loop
    for header, rows, below in tables:
        names = set()
        for row in rows:
            cells = [cell.strip() for cell in row.strip("|").split("|")]
            if "contender" in header:
                names.add(cells[header.index("contender")])
        names |= {name for name in ("memshare", "joblib") if name in header}
        for name in names:
            assert any(line.startswith(f"- `{name}`: ") for line in below), (name, below)
        columns = [line for line in below if line.startswith("- ") and not line.startswith("- `")]
        for cell in header:
            if cell in ("workload", "contender", "n_jobs"):
                continue
            assert any(line[2:].split(": ", 1)[0].find(cell) >= 0 for line in columns), (cell, below)
    text = markdown_table(_report())
    for name in ("memshare-copy", "memshare-plain", "joblib-nomemmap"):
        assert re.search(rf"- `{re.escape(name)}`: \S", text), name


def test_extra_after_return_says_it_waits_for_memory_to_settle():
    text = markdown_table(_report())
    (line,) = [line for line in text.splitlines() if line.startswith("- extra after return: ")]
    assert "settled" in line and "2 s" in line


def test_settling_waits_until_memory_stops_changing():
    """A release shortly after the return is not reported as held; a steady value is taken at once."""
    released = iter([256 * MiB] * 3 + [0] * 20)  # the dump goes three samples after the return
    samples = memory.settle(lambda: next(released), 256 * MiB, interval=0)
    assert samples[-1] == 0 and memory.settled(samples)
    steady = memory.settle(lambda: 5 * MiB, 5 * MiB, interval=0)
    assert steady[-1] == 5 * MiB and len(steady) == memory.SETTLE_SAMPLES


def test_load_average_is_reported_and_a_noisy_run_says_so():
    quiet = markdown_table(_report(cores=2, load_before=(0.2, 0.3, 0.4), load_after=(1.5, 1.0, 0.8)))
    assert "before the run 0.20 / 0.30 / 0.40, after it 1.50 / 1.00 / 0.80" in quiet
    assert "TOO NOISY" not in quiet
    busy = markdown_table(_report(cores=2, load_before=(3.5, 3.0, 2.0), load_after=(4.0, 3.5, 2.0)))
    assert "**TOO NOISY TO TRUST**" in busy and "3.50 before the run" in busy
    crowded = markdown_table(_report(cores=2, load_before=(0.5, 0.5, 0.5), load_after=(7.0, 4.0, 2.0)))
    assert "**TOO NOISY TO TRUST**" in crowded and "7.00 after the run" in crowded


class FakeProcess:
    """Stands in for a contender's process: measurements made up, nothing started."""

    started: list = []

    def __init__(self, name: str) -> None:
        self.name, self.pid = name, os.getpid()
        self.last_trace = [(0.0, 0), (0.1, MiB), (0.2, 0)]  # the memory over time of the last measure
        FakeProcess.started.append(name)

    def prepare(self, key, size, quick) -> int:
        return 0

    def measure(self, n_jobs, memory_mode, operation=""):
        t = {"memshare": 0.5, "joblib": 1.0}.get(self.name, 0.8)
        return t, 3 * MiB if self.name == "joblib" else MiB, 0, True, {}, self.name.startswith("memshare")

    def close(self) -> None:
        pass


def _main(monkeypatch, tmp_path, capsys, *options):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(harness, "ContenderProcess", FakeProcess)
    code = harness.main(["--workloads", "a", "--contenders", "memshare,joblib", "--no-progress", *options])
    return code, capsys.readouterr()


def test_the_run_records_the_load_before_and_after(monkeypatch):
    monkeypatch.setattr(harness, "ContenderProcess", FakeProcess)
    report = harness.run_benchmark("a", ["memshare", "joblib"], size=MiB, repeats=1, quick=True, progress=False)
    assert report.load_before is not None and report.load_after is not None
    assert "Machine load" in markdown_table(report)


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib (the bench extra)")
def test_default_run_writes_a_picture_and_prints_its_path(monkeypatch, tmp_path, capsys):
    code, out = _main(monkeypatch, tmp_path, capsys, "--size", "1M")
    assert code == 0, out.err
    (line,) = [line for line in out.out.splitlines() if line.startswith("picture: ")]
    path = line[len("picture: ") :].split(" (")[0]
    assert os.path.dirname(path) == str(tmp_path) and path.endswith(".png")
    with open(path, "rb") as picture:
        assert picture.read(8) == b"\x89PNG\r\n\x1a\n"


def test_timeline_writes_memory_over_time_and_prints_its_path(monkeypatch, tmp_path, capsys):
    code, out = _main(monkeypatch, tmp_path, capsys, "--size", "1M", "--no-picture", "--timeline", "t.png")
    assert code == 0, out.err
    assert f"timeline: {tmp_path / 't.png'} (memory over time" in out.out
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_matplotlib_the_run_says_how_to_get_the_picture(monkeypatch, tmp_path, capsys):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a)
    )
    code, out = _main(monkeypatch, tmp_path, capsys, "--size", "1M")
    assert code == 0, out.err
    assert "matplotlib is not installed" in out.out and "pip install 'memshare[bench]'" in out.out
    assert not list(tmp_path.iterdir())


# -- 6. a size the machine cannot hold ---------------------------------------------------------------------------


def test_a_size_larger_than_the_machine_is_refused_before_any_data_is_made(monkeypatch, tmp_path, capsys):
    FakeProcess.started = []
    total = machine._meminfo("MemTotal")
    size = f"{2 * total // GiB + 1}G"
    code, out = _main(monkeypatch, tmp_path, capsys, "--size", size)
    assert code == 2 and FakeProcess.started == [], out
    assert "The largest size that fits is" in out.err and "--contenders" in out.err and "MemAvailable" in out.err


def test_the_estimate_counts_each_contender_process_and_the_copies_of_the_one_timed():
    """(a) with memshare and joblib: 4 processes (with the limit's 2 parts) hold the data, one copy on top."""
    peak, key, processes = machine.estimate_peak("a", ["memshare", "joblib"], GiB)
    assert (peak, key, processes) == (5 * GiB, "a", 4)
    machine.check_fits("a", ["memshare", "joblib"], 4 * GiB, available=24 * GiB)  # 20 GiB: fits
    with pytest.raises(machine.TooLargeError, match=r"largest size that fits is") as refused:
        machine.check_fits("a", list(CONTENDERS), 4 * GiB, available=24 * GiB)
    largest = int(re.search(r"--size (\d+)M", str(refused.value)).group(1)) * MiB
    machine.check_fits("a", list(CONTENDERS), largest, available=24 * GiB)  # the size it names fits


def test_exit_statuses_in_words():
    assert "SIGKILL" in describe_exit(-signal.SIGKILL) and "OOM killer" in describe_exit(-signal.SIGKILL)
    assert describe_exit(-signal.SIGSEGV) == "was killed by SIGSEGV"
    assert describe_exit(3) == "exited with status 3"


@pytest.mark.timeout(150)
def test_a_contender_process_that_dies_is_reported_and_the_run_goes_on(monkeypatch):
    """joblib's process is killed (SIGKILL, as the OOM killer does): a note names it; serial still runs."""
    real_measure = ContenderProcess.measure

    def measure(self, n_jobs, memory_mode, operation=""):
        if self.name == "joblib":
            os.kill(self.pid, signal.SIGKILL)
        return real_measure(self, n_jobs, memory_mode, operation)

    monkeypatch.setattr(ContenderProcess, "measure", measure)
    report = harness.run_benchmark("a", ["joblib", "serial"], size=8 * MiB, repeats=2, quick=True, progress=False)
    (note,) = [note for note in report.notes if "joblib" in note]
    assert "(a) joblib" in note and "SIGKILL" in note, report.notes
    assert [m.contender for m in report.measurements] == ["serial", "serial"]
    assert "SIGKILL" in markdown_table(report)
