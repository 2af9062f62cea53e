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
import tempfile

import pytest

from memshare._tools.benchmarks import harness, machine, memory
from memshare._tools.benchmarks.processes import ContenderProcess, describe_exit
from memshare._tools.benchmarks.report import markdown_table
from memshare._tools.benchmarks.results import Measurement, Report
from memshare._tools.benchmarks.runners import CONTENDERS

# Version-independent (the bench's messages and arguments): run in CI's whole-suite environment (main) only.
pytestmark = pytest.mark.version_independent

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


def test_every_contender_and_column_is_defined_once_after_the_tables():
    """After the tables: one line for each contender of any table, and under each table's heading its columns."""
    text = markdown_table(_report())
    tables = _tables(text)
    assert len(tables) == 3  # the main table, against the limit, the shared-array loop
    after = tables[-1][2]  # everything after the last table
    headings = {
        0: "Columns of the main table:",
        1: "Columns of the table against the limit:",
        2: "Columns of the shared-array loop's table (i):",
    }
    for n, (header, rows, _) in enumerate(tables):
        names = set()
        for row in rows:
            cells = [cell.strip() for cell in row.strip("|").split("|")]
            if "contender" in header:
                names.add(cells[header.index("contender")])
        names |= {name for name in ("memshare", "joblib") if name in header}
        for name in names:
            assert [line for line in after if line.startswith(f"- `{name}`: ")], (name, after)
        start = after.index(headings[n]) + 2
        columns = (after[start:] + [""])[: (after[start:] + [""]).index("")]
        for cell in header:
            if cell in ("workload", "contender", "n_jobs"):
                continue
            assert any(line[2:].split(": ", 1)[0].find(cell) >= 0 for line in columns), (cell, columns)
    defined = [line for line in text.splitlines() if line.startswith("- `")]
    assert len(defined) == len(set(defined))  # each contender once
    assert text.count("Contenders:") == 1
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


def _main(monkeypatch, tmp_path, capsys, *options, default=("--workloads", "a", "--contenders", "memshare,joblib")):
    """Run the harness's command line with made-up measurements, from ``tmp_path``, its temp folder ``tmp_path/tmp``."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tmp").mkdir(exist_ok=True)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    monkeypatch.setattr(harness, "ContenderProcess", FakeProcess)
    code = harness.main([*default, *options])
    return code, capsys.readouterr()


def _printed_path(out: str, what: str) -> str:
    """The path a ``what: PATH (...)`` line of the run's output names."""
    (line,) = [line for line in out.splitlines() if line.startswith(f"{what}: ")]
    return line[len(f"{what}: ") :].split(" (")[0]


def test_the_run_records_the_load_before_and_after(monkeypatch):
    monkeypatch.setattr(harness, "ContenderProcess", FakeProcess)
    report = harness.run_benchmark("a", ["memshare", "joblib"], size=MiB, repeats=1, quick=True, progress=False)
    assert report.load_before is not None and report.load_after is not None
    assert "Machine load" in markdown_table(report)


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib (the bench extra)")
def test_default_run_writes_its_picture_and_report_to_the_temp_folder_and_prints_where(monkeypatch, tmp_path, capsys):
    """Nothing lands in the current folder unless asked: the picture and the full report go to the temp folder."""
    code, out = _main(monkeypatch, tmp_path, capsys, "--size", "1M", "--no-progress")
    assert code == 0, out.err
    picture, report = _printed_path(out.out, "picture"), _printed_path(out.out, "report")
    assert os.path.dirname(picture) == os.path.dirname(report) == str(tmp_path / "tmp")
    assert picture.endswith(".png") and report.endswith(".md")
    with open(picture, "rb") as png:
        assert png.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(report, encoding="utf-8") as md:
        assert "Columns of the main table:" in md.read()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tmp"]


def test_a_chosen_picture_path_is_used(monkeypatch, tmp_path, capsys):
    code, out = _main(monkeypatch, tmp_path, capsys, "--size", "1M", "--picture", "here.png", "--output", "r.md")
    assert code == 0, out.err
    if importlib.util.find_spec("matplotlib") is not None:
        assert _printed_path(out.out, "picture") == str(tmp_path / "here.png") and (tmp_path / "here.png").exists()
    assert _printed_path(out.out, "report") == str(tmp_path / "r.md")
    assert not list((tmp_path / "tmp").iterdir())


def test_no_progress_bar_when_stderr_is_not_a_terminal(monkeypatch, tmp_path, capsys):
    """Without a terminal the bar would be one endless line of redraws: there is none, unasked."""
    code, out = _main(monkeypatch, tmp_path, capsys, "--size", "1M", "--no-picture")
    assert code == 0, out.err
    assert "\r" not in out.err and "run/s" not in out.err and "%|" not in out.err, out.err[:500]


def test_the_default_run_prints_about_a_screen_each_table_and_legend_once(monkeypatch, tmp_path, capsys):
    """``python -m memshare bench --quick`` (made-up measurements, every default workload whose packages are here)."""
    from memshare._tools import bench

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(harness, "ContenderProcess", FakeProcess)
    code = bench.main(["--quick", "--no-picture"])
    out = capsys.readouterr()
    assert code == 0, out.err
    lines = out.out.splitlines()
    assert len(lines) <= 80, "\n".join(lines)
    assert lines.count("Contenders:") == 1 and lines.count("Workloads:") == 1
    for table in ("| workload | contender | n_jobs |", "| workload | n_jobs | serial |", "| contender | n_jobs |"):
        assert sum(line.startswith(table) for line in lines) == 1, table
    # Each contender of the tables is defined once.
    defined = [line.split("`")[1] for line in lines if line.startswith("- `")]
    assert len(defined) == len(set(defined)) and "memshare" in defined and "joblib" in defined


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
    assert [p.name for p in tmp_path.iterdir()] == ["tmp"]
    assert not list((tmp_path / "tmp").glob("*.png"))


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


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib (the bench extra)")
def test_the_picture_draws_zero_extra_memory_and_names_the_workloads():
    """memshare's best (no extra memory: a ratio of 0) is a bar down to 0, not a bar a log axis cannot draw."""
    import matplotlib.pyplot as plt

    from memshare._tools.benchmarks.plots import workloads_figure

    report = _report()
    report.short_names.update(a="chunks", i="shared loop")
    for m in report.measurements:
        if m.contender == "memshare" and m.workload == "a":
            m.peak_extra_bytes = 0
    fig = workloads_figure(report)
    try:
        time_axis, memory_axis = fig.axes[:2]
        assert memory_axis.get_yscale() == "symlog" and memory_axis.get_ylim()[0] == 0
        (bars,) = [container for container in memory_axis.containers if container.get_label() == "memshare"]
        (zero,) = [patch for patch in bars.patches if patch.get_x() < 0.5]  # workload (a)'s bar
        assert zero.get_y() == 1 and zero.get_y() + zero.get_height() == 0  # from 1 (as joblib) down to 0
        ticks = [label.get_text() for label in time_axis.get_xticklabels()]
        assert ticks == ["chunks (a)", "shared loop (i)"]
        legends = fig.legends
        assert len(legends) == 1 and not time_axis.get_legend() and not memory_axis.get_legend()
        names = [text.get_text() for text in legends[0].get_texts()]
        assert len(names) == len(set(names)) and "memshare" in names and "joblib" not in names
    finally:
        plt.close(fig)
