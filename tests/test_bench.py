"""The benchmark harness runs end to end, and its memory sampler measures what it should."""

from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import numpy as np
import psutil
import pytest
from conftest import wait_until

from memshare._tools.benchmarks import memory
from memshare._tools.benchmarks.memory import MemorySampler

# The harness runs whole benchmarks: its outcome does not depend on the versions of Python, numpy or
# joblib, which every other test covers; CI runs it in the whole-suite environment (main).
pytestmark = pytest.mark.version_independent

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MiB = 1 << 20


def _leftovers(pid: int) -> list:
    """Entries in /dev/shm and the temp folder that a benchmark process ``pid`` left behind."""
    import tempfile

    found = []
    for folder in ("/dev/shm", tempfile.gettempdir()):
        if os.path.isdir(folder):
            found += [os.path.join(folder, e) for e in os.listdir(folder) if re.search(rf"[-_]{pid}[-_]", e)]
    return found


#: Seconds a quick benchmark may take before the test stops it.
QUICK_LIMIT = 360


def _run_quick(command: list, tmp_path, workloads: str = "acdi") -> subprocess.CompletedProcess:
    """Run a quick benchmark; check that memshare left nothing behind, and remove what joblib left."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    args = command + ["--size", "8M", "--quick", "--workloads", workloads, "--no-progress"]
    # The picture and the report go to the temp folder unless named: here, to the test's own folder.
    args += [] if "--output" in command else ["--output", str(tmp_path / "report.md")]
    args += ["--picture", str(tmp_path / "picture.png")]
    with subprocess.Popen(
        args, cwd=str(tmp_path), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as proc:
        try:
            # Generous: a loaded CI machine (three suites on two cores) took 127 s where an idle one takes 30.
            stdout, stderr = proc.communicate(timeout=QUICK_LIMIT)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
            stderr = f"(the quick benchmark was stopped after {QUICK_LIMIT} s)\n{stderr[:2000]}\n...\n{stderr[-1000:]}"
    # The resource trackers of the finished run unlink their files shortly after it exits.
    wait_until(lambda: not [p for p in _leftovers(proc.pid) if "memshare" in os.path.basename(p)], 10)
    left = _leftovers(proc.pid)
    # The joblib contender's runs can leave joblib's own empty memmapping folders behind (not memshare's): tidy them.
    for path in [p for p in left if "joblib_memmapping_folder" in os.path.basename(p)]:
        shutil.rmtree(path, ignore_errors=True)
    assert not [p for p in left if "memshare" in os.path.basename(p)], left
    return subprocess.CompletedProcess(args, proc.returncode, stdout, stderr)


@pytest.mark.timeout(QUICK_LIMIT + 60)
def test_quick_benchmark_runs(tmp_path):
    """The quick benchmark exits 0 and its table compares memshare with joblib, all results correct."""
    output = tmp_path / "results.md"
    result = _run_quick([sys.executable, "-m", "benchmarks.run", "--output", str(output)], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    table = result.stdout
    assert "| (a) | memshare |" in table and "| (a) | joblib |" in table
    assert "**NO**" not in table
    assert "memshare against the limit" in table and "| (a) | 2 |" in table and "| (c) | 2 |" in table
    assert "Shared-array loop (i)" in table and "| memshare-plain | 2 |" in table
    report = output.read_text()
    assert "Command:" in report and "CPU:" in report and "memshare" in report


@pytest.mark.timeout(QUICK_LIMIT + 60)
def test_memshare_bench_entry_point(tmp_path):
    """``memshare._bench.main`` runs the harness shipped in the package."""
    code = "import sys, memshare._tools.bench as b; sys.exit(b.main(sys.argv[1:]))"
    # One workload is enough to show the entry point runs; test_quick_benchmark_runs covers the others.
    timeline = tmp_path / "timeline.png"
    result = _run_quick([sys.executable, "-c", code, "--timeline", str(timeline)], tmp_path, workloads="a")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| (a) | memshare |" in result.stdout and "| (a) | joblib |" in result.stdout
    assert f"timeline: {timeline}" in result.stdout
    assert timeline.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_limit_and_loop_rows_arithmetic():
    """limit = serial / workers (capped at the cores) + write + first touch; loop overhead = (time - serial) / 10."""
    from memshare._tools.benchmarks.results import Measurement, Report, limit_rows, loop_rows

    report = Report(size=1000, n_jobs=2, repeats=1)
    parts = [("serial", 1.0), ("shm-write", 0.3), ("first-touch", 0.1), ("memshare", 1.2), ("joblib", 2.0)]
    for name, seconds in parts:
        report.measurements.append(Measurement("a", name, 2, seconds, 0, True))
    for name, seconds, peak in [("serial", 1.0, 0), ("memshare", 1.05, 50), ("joblib", 3.0, 1000)]:
        report.measurements.append(Measurement("i", name, 2, seconds, peak, True))
    (row,) = limit_rows(report)
    assert row["limit"] == pytest.approx(1.0 / min(2, os.cpu_count() or 1) + 0.4)
    assert row["memshare_ratio"] == pytest.approx(1.2 / row["limit"])
    loops = {r["contender"]: r for r in loop_rows(report)}
    assert loops["memshare"]["overhead"] == pytest.approx(0.005)
    assert loops["joblib"]["overhead"] == pytest.approx(0.2)
    assert loops["memshare"]["overhead_ratio"] == pytest.approx(0.025)
    assert loops["memshare"]["memory_per_data"] == pytest.approx(0.05)
    assert loops["serial"]["overhead"] is None


def test_results_limit_is_the_workers_making_and_writing_their_share():
    """For results (c): limit = (serial + one write) / workers, with no first touch; memshare's ratio follows."""
    from memshare._tools.benchmarks.results import Measurement, Report, limit_rows

    report = Report(size=1000, n_jobs=2, repeats=1, limit_formulas={"c": "results"})
    for name, seconds in [("serial", 0.6), ("shm-write", 0.4), ("memshare", 0.55), ("joblib", 3.0)]:
        report.measurements.append(Measurement("c", name, 2, seconds, 0, True))
    (row,) = limit_rows(report)
    workers = min(2, os.cpu_count() or 1)
    assert row["formula"] == "results" and row["touch"] is None
    assert row["limit"] == pytest.approx((0.6 + 0.4) / workers)
    assert row["memshare_ratio"] == pytest.approx(0.55 / row["limit"])


@pytest.mark.parametrize(
    "options, package",
    [(["--workloads", "g"], "scikit-learn"), (["--workloads", "a", "--plot", "sweep.png"], "matplotlib")],
)
def test_missing_bench_extra_fails_before_running(monkeypatch, capsys, options, package):
    """Without the bench extra, --plot and workload g stop at once with exit 2, naming the package and the fix."""
    import importlib.util

    from memshare._tools.benchmarks import harness

    real_find_spec = importlib.util.find_spec
    absent = ("sklearn", "matplotlib")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in absent else real_find_spec(name))
    monkeypatch.setattr(harness, "run_benchmark", lambda *a, **k: pytest.fail("must not run"))
    assert harness.main(options + ["--quick"]) == 2
    err = capsys.readouterr().err
    assert f"needs {package}, which is not installed" in err and "pip install 'memshare[bench]'" in err


@pytest.mark.timeout(QUICK_LIMIT + 60)
def test_each_contender_runs_in_a_process_of_its_own():
    """Every contender gets its own process, not the harness's; joblib's and serial's never import memshare."""
    from memshare._tools.benchmarks.harness import run_benchmark

    report = run_benchmark("a", ["memshare", "joblib", "serial"], size=8 * MiB, repeats=2, quick=True, progress=False)
    pids = {m.contender: {m.pid} for m in report.measurements}
    for m in report.measurements:
        pids[m.contender].add(m.pid)
        assert m.correct
    assert set(pids) >= {"memshare", "joblib", "serial", "shm-write", "first-touch"}
    assert all(len(p) == 1 for p in pids.values()), pids  # one process per contender for the workload
    assert len({p for ps in pids.values() for p in ps} | {os.getpid()}) == len(pids) + 1
    imported = {m.contender: m.imported_memshare for m in report.measurements}
    assert imported["memshare"] and not imported["joblib"] and not imported["serial"]


def test_bench_help_states_the_real_defaults():
    """``bench --help`` names the workloads and size a plain ``bench`` runs, and names the command as invoked."""
    from memshare._tools.bench import DEFAULT_WORKLOADS
    from memshare._tools.benchmarks.harness import DEFAULT_WORKLOADS as ALL
    from memshare._tools.benchmarks.machine import default_size, format_size

    result = subprocess.run(
        [sys.executable, "-m", "memshare", "bench", "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert result.stdout.startswith("usage: python -m memshare bench")
    left_out = "".join(k for k in ALL if k not in DEFAULT_WORKLOADS)
    assert ALL.startswith("abcdefghi")
    assert f"default {DEFAULT_WORKLOADS}: all but {left_out}: pass {ALL} for all" in text
    assert f"default {format_size(min(256 * MiB, default_size()))}" in text


def _write_shm(path: str, mib: int) -> None:
    block = b"\1" * MiB
    with open(path, "wb") as f:
        for _ in range(mib):
            f.write(block)


def _wait_for_samples(count: int = 3, timeout: float = 60) -> None:
    """Wait until the running sampler has taken ``count`` whole samples that began after this call did.

    The sampler sleeps in ``select`` between two samples, and each sleep is one voluntary context switch of its
    process: ``count + 1`` more switches hold at least ``count`` samples begun after the first of them.
    """
    script = os.path.abspath(memory.__file__)
    (sampler,) = [child for child in psutil.Process().children() if script in _command_line(child)]
    start = sampler.num_ctx_switches().voluntary
    assert wait_until(lambda: sampler.num_ctx_switches().voluntary >= start + count + 1, timeout, 0.005)


def _command_line(process: psutil.Process) -> list:
    try:
        return process.cmdline()
    except psutil.Error:
        return []  # exited meanwhile


class _OthersShmem:
    """The machine's ``Shmem`` less the bytes of this test's own file, watched from a thread: what others did.

    In "machine" mode the sampler adds the whole machine's ``Shmem``, which other programs move too; the
    range they moved it over while the test ran bounds their share in the sampler's peak.
    """

    def __init__(self, own_path: str) -> None:
        self.own_path = own_path
        self.low = self.high = self._sample()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _sample(self) -> int:
        try:
            own = os.stat(self.own_path).st_blocks * 512
        except FileNotFoundError:
            own = 0
        return memory.read_shmem() - own

    def _watch(self) -> None:
        while not self._stop.wait(0.005):
            value = self._sample()
            self.low, self.high = min(self.low, value), max(self.high, value)

    @property
    def spread(self) -> int:
        return self.high - self.low

    def __enter__(self) -> _OthersShmem:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
@pytest.mark.parametrize("mode", ["tree", "machine"])
def test_sampler_counts_shm_file(mode):
    """A 200 MiB file written to /dev/shm, named after this process, shows up as about 200 MiB."""
    path = f"/dev/shm/bench-sampler-test-{os.getpid()}-{uuid.uuid4().hex}"
    try:
        with _OthersShmem(path) as others, MemorySampler(os.getpid(), mode=mode) as sampler:
            _write_shm(path, 200)
            _wait_for_samples()
    finally:
        os.unlink(path)
    # "tree" mode sees only the tree's files; "machine" mode also what other programs did to Shmem meanwhile
    # (a write racing the thread's look at the file's size may show as up to one block of theirs).
    slack = others.spread + MiB if mode == "machine" else 0
    assert 190 * MiB - slack <= sampler.peak_extra_bytes <= 400 * MiB + slack, (sampler.peak_extra_bytes, slack)
    assert sampler.samples >= 3


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="memfds are Linux-only")
def test_tree_mode_counts_memfds_held_open_or_mapped():
    """memfds live in no folder: an open one and one only mapped (its descriptor closed) both count."""
    import mmap

    with MemorySampler(os.getpid()) as sampler:
        held = os.memfd_create("bench-sampler-test-open")
        _fill_descriptor(held, 100)
        mapped_fd = os.memfd_create("bench-sampler-test-mapped")
        _fill_descriptor(mapped_fd, 100)
        mapping = mmap.mmap(mapped_fd, 100 * MiB)
        os.close(mapped_fd)
        _wait_for_samples()
        os.close(held)
        mapping.close()
    assert 190 * MiB <= sampler.peak_extra_bytes <= 300 * MiB, sampler.peak_extra_bytes


def _fill_descriptor(fd: int, mib: int) -> None:
    block = b"\1" * MiB
    for _ in range(mib):
        os.write(fd, block)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_tree_mode_ignores_files_of_others_and_of_the_past():
    """ "tree" mode ignores files of others, and a file deleted during the run does not offset a new one."""
    foreign = f"/dev/shm/bench-sampler-test-foreign-{uuid.uuid4().hex}"
    old = f"/dev/shm/bench-sampler-test-{os.getpid()}-{uuid.uuid4().hex}"
    new = f"/dev/shm/bench-sampler-test-{os.getpid()}-{uuid.uuid4().hex}"
    try:
        _write_shm(old, 100)
        with MemorySampler(os.getpid()) as sampler:
            # Written by an orphaned process (its parent shell exits at once): outside this process tree,
            # like another session's files on a shared machine.
            subprocess.run(["sh", "-c", f"(head -c {200 * MiB} /dev/zero > {foreign}) >/dev/null 2>&1 &"], check=True)
            wait_until(lambda: os.path.exists(foreign) and os.path.getsize(foreign) >= 200 * MiB, 30)
            os.unlink(old)
            _write_shm(new, 100)
            _wait_for_samples()
    finally:
        for path in (foreign, old, new):
            if os.path.exists(path):
                os.unlink(path)
    assert 95 * MiB <= sampler.peak_extra_bytes <= 150 * MiB, sampler.peak_extra_bytes


def _hold_ones(nbytes: int, holding, release) -> None:
    a = np.ones(nbytes // 8)
    holding.set()
    release.wait(60)
    del a


def test_sampler_counts_child_process_memory():
    """200 MiB allocated in a child process count: the whole process tree is sampled."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    holding, release = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_hold_ones, args=(200 * MiB, holding, release))
    with MemorySampler(os.getpid()) as sampler:
        child.start()
        try:
            assert holding.wait(60), "the child never allocated its array"
            _wait_for_samples()
        finally:
            release.set()
            child.join(60)
    assert child.exitcode == 0
    # The child's interpreter and numpy add some tens of MiB on top of the array.
    assert 190 * MiB <= sampler.peak_extra_bytes <= 400 * MiB, sampler.peak_extra_bytes


def test_sampler_leaves_no_process():
    """The sampler process is gone after the block."""
    import psutil

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with MemorySampler(os.getpid()):
        pass
    after = {p.pid for p in psutil.Process().children(recursive=True)}
    assert after <= before


def test_a_failing_contender_process_reports_its_traceback():
    """An error in a contender's process reaches the harness as ContenderError with the process's traceback."""
    from memshare._tools.benchmarks.processes import ContenderError, ContenderProcess

    process = ContenderProcess("joblib")
    try:
        with pytest.raises(ContenderError, match="KeyError: 'no-such-workload'"):
            process.prepare("no-such-workload", MiB, True)
    finally:
        process.close()


def test_sampler_trace_is_every_sample_in_time():
    """The trace holds every sample, from the baseline (time 0, nothing extra) on; its highest is the peak."""
    with MemorySampler(os.getpid()) as sampler:
        held = np.ones(64 * MiB // 8)
        _wait_for_samples()
        del held
    times = [seconds for seconds, _ in sampler.trace]
    assert sampler.trace[0] == (0.0, 0)
    assert times == sorted(times) and len(sampler.trace) == sampler.samples
    assert max(extra for _, extra in sampler.trace) == sampler.peak_extra_bytes >= 60 * MiB


def _timeline_report(contenders):
    from memshare._tools.benchmarks.results import Measurement, Report

    report = Report(size=64 * MiB, n_jobs=2, repeats=3)
    report.titles["b"] = "whole scans"
    for contender, peak in contenders:
        for scale in (1.0, 2.0, 3.0):
            trace = [(0.0, 0), (0.1, int(peak * scale)), (0.2, 0)]
            report.measurements.append(Measurement("b", contender, 2, 0.15, int(peak * scale), True, trace=trace))
    return report


def test_timeline_draws_the_median_peak_call_of_memshare_and_joblib(tmp_path):
    from memshare._tools.benchmarks.plots import plot_timeline, timeline_runs

    report = _timeline_report([("memshare", MiB), ("joblib", 8 * MiB)])
    runs = timeline_runs(report)
    assert set(runs) == {"memshare", "joblib"} and runs["joblib"].peak_extra_bytes == 16 * MiB
    path = tmp_path / "timeline.png"
    assert plot_timeline(report, str(path)) and path.read_bytes()[:4] == b"\x89PNG"


def test_timeline_needs_memshare_and_joblib(tmp_path):
    from memshare._tools.benchmarks.plots import plot_timeline

    path = tmp_path / "timeline.png"
    assert not plot_timeline(_timeline_report([("memshare", MiB)]), str(path)) and not path.exists()


def memshare_names_used(text: str) -> list:
    """Every ``memshare`` name ``text`` imports, and every attribute it reads of a memshare module it imported.

    Scripts run in child interpreters are strings inside the benchmarks' files, so this reads the text.
    """
    names = []
    for module, imported in re.findall(r"^\s*from (memshare[\w.]*) import ([\w, ]+)$", text, re.MULTILINE):
        for name in (part.strip() for part in imported.split(",")):
            names.append((module, name))
            names += [(f"{module}.{name}", attr) for attr in sorted(set(re.findall(rf"\b{name}\.(\w+)", text)))]
    return names


def test_the_benchmark_scripts_name_only_what_memshare_has():
    """A module or function the scripts of benchmarks/ use by name still exists (they run in no other test)."""
    missing, seen = [], 0
    for path in sorted(Path(ROOT, "benchmarks").glob("*.py")):
        for module, name in memshare_names_used(path.read_text(encoding="utf-8")):
            seen += 1
            if not hasattr(importlib.import_module(module), name):
                try:
                    importlib.import_module(f"{module}.{name}")
                except ImportError:
                    missing.append(f"benchmarks/{path.name}: {module}.{name}")
    assert seen > 10 and not missing, missing


def test_the_benchmark_scripts_check_finds_a_name_gone():
    text = "RUN = '''\nfrom memshare._lifetime import _memfd\nprint(_memfd.descriptors_of())\n'''\n"
    assert ("memshare._lifetime._memfd", "descriptors_of") in memshare_names_used(text)
