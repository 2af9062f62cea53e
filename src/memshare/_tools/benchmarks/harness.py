"""Run workloads x contenders with repeats and report medians, ranges, peak memory and ratios.

Contenders are interleaved within each repeat (and their order rotated from
one repeat to the next) because the machines this runs on are shared and
noisy: a slow minute then hurts every contender alike, and the ratio
memshare/joblib from the same run is the figure to trust, not absolute times.
The report records the load average before and after, and says when the run
was too noisy to trust (:func:`noise_reason`); it defines every contender and
column under the table it appears in; the run writes a picture of each
contender against joblib (:func:`write_picture`, with matplotlib).

Before any process or data exists, a size whose peak (every contender process
of a workload holding the data, plus the copies of the one being timed) would
exceed the memory available is refused (:func:`check_fits`); a contender
process that dies is reported by name and signal, and the run goes on.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import re
import shlex
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .processes import ContenderDied, ContenderProcess
from .workloads import CONTENDERS, LIMIT_PARTS, PICKLING, POOL_CONTENDERS, Workload, make_workloads, pool_start_method

GiB = 1 << 30
MiB = 1 << 20
QUICK_SIZE = 8 * MiB
DEFAULT_WORKLOADS = "abcdefghijklmp"
LOOP_WORKLOAD = "i"  # the shared-array loop: per-call overheads and memory per call against the data size
POOL_WORKLOAD = "p"  # the pools on small items: ratios to mp.Pool with the same start method

#: What each contender is: the report defines, under each table, every contender that appears in it.
CONTENDER_MEANINGS: Dict[str, str] = {
    "memshare": "memshare.Parallel with its defaults (arrays above 1 MiB go to shared memory once; a large "
    "ordinary array is held once: its own memory becomes the shared file); in (f) and (i) it gets a "
    "memshare.share() array",
    "memshare-plain": "memshare.Parallel handed the plain np.ndarray where `memshare` gets a shared array",
    "memshare-copy": "memshare.Parallel with MemshareBackend(promote=False): the array is copied (dumped) to shared "
    "memory for the call instead of held once",
    "memshare-broadcast": "memshare.Parallel handed memshare.broadcast(obj), made in the timed call: the object is "
    "pickled once and unpickled once per worker",
    "joblib": "joblib.Parallel with its defaults (loky; arrays above 1 MB dumped to a memmapped file per call)",
    "joblib-nomemmap": "joblib.Parallel(max_nbytes=None): no memmapping, every argument is pickled to the workers",
    "mp.Pool": "multiprocessing.Pool (spawn), starmap: every argument is pickled",
    "serial": "a plain loop in one process: the work itself, with no parallel machinery (n_jobs=1)",
    "memshare-pool": "memshare.MemmappingPool(n_jobs) (forkserver, its default where it exists)",
    "joblib-pool": "joblib.pool.MemmappingPool(n_jobs) (the platform's default start method)",
    "mp.Pool-forkserver": "multiprocessing.get_context('forkserver').Pool(n_jobs)",
    "mp.Pool-fork": "multiprocessing.get_context('fork').Pool(n_jobs)",
}
#: The columns of the main table.
COLUMN_MEANINGS: Tuple[Tuple[str, str], ...] = (
    ("median time", "median wall time of one timed call over the repeats (workers already started)"),
    ("min-max", "the fastest and slowest repeat"),
    (
        "peak extra memory",
        "the highest memory of the contender's process tree during the call, above what it held just before",
    ),
    (
        "extra after return",
        "memory the tree still held once the call returned and memory settled (sampled every 20 ms until 8 samples "
        "in a row agree within 2 MiB, at most 2 s), the returned values still referenced: what the call keeps, not "
        "what it frees a moment after returning",
    ),
    (
        "time / joblib, memory / joblib",
        "this contender's median time or memory divided by joblib's (in (p): joblib's pool's; < 1 is better)",
    ),
    ("correct", "the result equals the serial loop's"),
)


def parse_size(text: str) -> int:
    """``"256M"``, ``"1G"``, ``"1.5GiB"``, ``"1000000"`` -> bytes (binary units)."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([kKmMgGtT]?)(i?[bB])?\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 256M, 1G)")
    number, unit = float(match.group(1)), match.group(2).upper()
    return int(number * {"": 1, "K": 1 << 10, "M": MiB, "G": GiB, "T": 1 << 40}[unit])


def format_size(nbytes: float) -> str:
    """Bytes as MiB or GiB, for tables."""
    if nbytes >= GiB:
        return f"{nbytes / GiB:.2f} GiB"
    return f"{nbytes / MiB:.0f} MiB"


def _meminfo(key: str) -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def default_size() -> int:
    """min(1 GiB, 1/16 of RAM, 1/4 of free /dev/shm): large enough to matter, small enough to be safe."""
    candidates = [GiB, _meminfo("MemTotal") // 16]
    if os.path.isdir("/dev/shm"):
        candidates.append(shutil.disk_usage("/dev/shm").free // 4)
    return max(MiB, min(candidates))


def machine_description(argv: Sequence[str]) -> List[str]:
    """Lines describing the machine, versions, date and command line, for the report header."""
    import joblib
    import numpy
    from joblib.externals import loky

    import memshare

    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    shm = shutil.disk_usage("/dev/shm").total if os.path.isdir("/dev/shm") else 0
    command = " ".join([argv[0]] + [shlex.quote(a) for a in argv[1:]]) if argv else ""
    return [
        f"- CPU: {cpu}, {os.cpu_count()} cores",
        f"- RAM: {format_size(_meminfo('MemTotal'))}, /dev/shm: {format_size(shm)}",
        f"- Python {platform.python_version()}, numpy {numpy.__version__}, joblib {joblib.__version__}, "
        f"loky {loky.__version__} (bundled), memshare {memshare.__version__}",
        f"- Date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
        f"- Command: `{command}`",
    ]


@dataclass
class Measurement:
    """One timed run of one workload by one contender."""

    workload: str
    contender: str
    n_jobs: int
    seconds: float
    peak_extra_bytes: int
    correct: bool
    stats: Dict[str, Any] = field(default_factory=dict)
    pid: int = 0  # the contender's own process
    imported_memshare: bool = False  # whether that process had imported memshare
    end_extra_bytes: int = 0  # extra memory still held once the call returned
    operation: str = ""  # for a workload timed operation by operation (the pools of (p)): which one


@dataclass
class Report:
    """All measurements of a benchmark run, plus the notes (skips, failures) met on the way."""

    size: int
    n_jobs: int
    repeats: int
    measurements: List[Measurement] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    titles: Dict[str, str] = field(default_factory=dict)
    memory_mode: str = "tree"
    limit_formulas: Dict[str, str] = field(default_factory=dict)  # workload -> Workload.limit_formula
    references: Dict[str, str] = field(default_factory=dict)  # workload -> Workload.reference, if not joblib
    cores: int = field(default_factory=lambda: os.cpu_count() or 1)
    load_before: Optional[Tuple[float, float, float]] = None  # os.getloadavg() before the first process started
    load_after: Optional[Tuple[float, float, float]] = None  # ... and after the last one ended


def load_average() -> Optional[Tuple[float, float, float]]:
    """The machine's 1, 5 and 15-minute load averages; None where the system does not say."""
    try:
        return os.getloadavg()
    except OSError:
        return None


def noise_reason(report: Report) -> Optional[str]:
    """Why the run was too noisy to trust, or None.

    The rule: the 1-minute load average before the run (other processes'
    load: the run has not started) above half the cores, or the one after it
    above the cores plus the run's own n_jobs workers and its parent. Either
    means other processes competed for the cores while contenders were timed.
    """
    cores = report.cores
    if report.load_before is not None and report.load_before[0] > cores / 2:
        return (
            f"the 1-minute load average was {report.load_before[0]:.2f} before the run, above half of the {cores} "
            "cores: other processes were busy"
        )
    own = report.n_jobs + 1
    if report.load_after is not None and report.load_after[0] > cores + own:
        return (
            f"the 1-minute load average was {report.load_after[0]:.2f} after the run, above the {cores} cores plus "
            f"the run's own {own} processes: other processes competed with it"
        )
    return None


def load_line(report: Report) -> str:
    """The load averages before and after, and the verdict on noise, for the report."""

    def show(load: Optional[Tuple[float, float, float]]) -> str:
        return "unknown" if load is None else " / ".join(f"{x:.2f}" for x in load)

    line = (
        f"Machine load (1 / 5 / 15-minute load average, {report.cores} cores): "
        f"before the run {show(report.load_before)}, after it {show(report.load_after)}."
    )
    reason = noise_reason(report)
    if reason is not None:
        return (
            line + f" **TOO NOISY TO TRUST**: {reason}. Run again on a quiet machine; even then, compare ratios "
            "from one run, not times across runs."
        )
    return line + " Quiet enough: rule: noisy when the load before exceeds half the cores, or the load after exceeds "
    "the cores plus the run's own processes."


class TooLargeError(ValueError):
    """The benchmark would need more memory than the machine has available."""


#: The share of MemAvailable a run may plan to use: the rest is left to the system and other processes.
MEMORY_SHARE = 0.9


def data_factor(key: str) -> float:
    """How many times ``size`` the prepared data of workload ``key`` holds in each contender's process.

    (l)'s dict pickles to size/64 and takes about 7 times that in memory: 1/4 leaves room.
    """
    if key in ("c", "d", "m", "p"):
        return 0
    return 0.25 if key == "l" else 1


def copies_factor(key: str, contender: str) -> float:
    """How many times ``size`` a contender makes while it is timed on workload ``key``, on top of its data.

    A fresh copy of the input before each repeat (then the old one is freed),
    a dump or the pickled pieces during the call; for (c) the results, once in
    the worker and, when pickled or dumped, once more in the parent; for (m)
    the results and, after the first run, the expected ones. joblib pickles a
    DataFrame (j, k) into every task, and each worker unpickles its own copy:
    a few times the frame at once. In (l) each worker unpickles its own dict.
    """
    if key in ("d", "p"):
        return 0
    if key == "c":
        return 2 if contender in PICKLING + ("joblib",) else 1
    if key == "m":
        return 3 if contender == "joblib" else 2
    if key in ("j", "k"):
        return 4 if contender == "joblib" else 1
    if key == "l":
        return 0.5
    return 1


def estimate_peak(workloads: str, contenders: Sequence[str], size: int) -> Tuple[int, str, int]:
    """The most memory a run needs at once: (bytes, the workload that needs it, its contender processes).

    Every contender of a workload lives in a process of its own, each holding
    its own data, for the whole workload; contenders are timed one at a time,
    so the copies of one timed contender come on top. Pickling contenders are
    counted even where the pickle budget would skip them.
    """
    best = (0, "", 0)
    for key, workload in make_workloads().items():
        if key not in workloads:
            continue
        names = [c for c in workload.contenders if c in contenders]
        if workload.limit_bytes is not None and "memshare" in names:
            names += [p for p in LIMIT_PARTS if workload.limit_formula == "inputs" or p != "first-touch"]
        if not names:
            continue
        peak = int(size * (len(names) * data_factor(key) + max(copies_factor(key, n) for n in names)))
        if peak > best[0]:
            best = (peak, key, len(names))
    return best


def check_fits(workloads: str, contenders: Sequence[str], size: int, available: Optional[int] = None) -> None:
    """Refuse, before any process or data exists, a run whose peak exceeds the memory available.

    A run past it would meet the kernel's OOM killer, which may end any
    process of the user, not only the benchmark's.
    """
    available = _meminfo("MemAvailable") if available is None else available
    if available <= 0:
        return  # unknown (no /proc/meminfo): nothing to judge by
    peak, key, processes = estimate_peak(workloads, contenders, size)
    budget = int(MEMORY_SHARE * available)
    if peak <= budget:
        return
    factor = peak / size
    largest = int(budget / factor) // MiB * MiB
    fits = f"--size {largest // MiB}M" if largest >= MiB else "no size (free some memory first)"
    raise TooLargeError(
        f"--size {format_size(size)} needs about {format_size(peak)} at its peak (workload ({key}): {processes} "
        f"contender processes each hold the data, plus the copies of the one being timed), more than "
        f"{int(MEMORY_SHARE * 100)}% of the {format_size(available)} available (MemAvailable). The largest size "
        f"that fits is {format_size(largest)}: pass {fits}, or trim the contenders with --contenders (e.g. "
        "--contenders memshare,joblib) or the workloads with --workloads."
    )


def run_benchmark(
    workloads: str = DEFAULT_WORKLOADS,
    contenders: Sequence[str] = CONTENDERS,
    size: Optional[int] = None,
    repeats: int = 3,
    n_jobs: int = 2,
    quick: bool = False,
    pickle_budget: int = 4 * GiB,
    progress: bool = True,
    memory_mode: str = "tree",
) -> Report:
    """Run the chosen workloads (keys ``a``-``m``, ``p``) for each contender ``repeats`` times, interleaved.

    Each contender runs each workload in a process of its own (:class:`ContenderProcess`), started before the
    workload's first run and ended after its last, so that no contender can bias another; memory is sampled
    over that process's tree only. Workloads with ``limit_bytes`` also time the parts of memshare's limit
    (:data:`LIMIT_PARTS`: one write of the data to /dev/shm, one first touch of it in a worker) in the same
    rotation as the contenders. A workload with ``operations`` is timed operation by operation; those in its
    ``fresh_process`` get a new contender process at each repeat.
    """
    from tqdm import tqdm

    size = size or (QUICK_SIZE if quick else default_size())
    report = Report(size=size, n_jobs=n_jobs, repeats=repeats, memory_mode=memory_mode)
    all_workloads = make_workloads()
    chosen = [all_workloads[k] for k in workloads if k in all_workloads]
    unknown = [k for k in workloads if k not in all_workloads and k not in ", "]
    if unknown:
        raise ValueError(f"unknown workloads {unknown}: choose among {''.join(all_workloads)}")
    check_fits(workloads, contenders, size)
    report.load_before = load_average()

    plans = []
    for workload in chosen:
        report.titles[workload.key] = workload.title
        if workload.reference != "joblib":
            report.references[workload.key] = workload.reference
        reason = workload.skip_reason()
        if reason:
            report.notes.append(f"({workload.key}) skipped: {reason}")
            print(f"note: workload ({workload.key}) skipped: {reason}", file=sys.stderr)
            continue
        names = [c for c in workload.contenders if c in contenders]
        if not names:
            its = ", ".join(workload.contenders)
            report.notes.append(f"({workload.key}) not run: none of its contenders ({its}) was chosen")
            continue
        if workload.limit_bytes is not None and "memshare" in names:
            # The results' limit has no first touch: the parent maps the result files without reading them.
            names += [part for part in LIMIT_PARTS if workload.limit_formula == "inputs" or part != "first-touch"]
            report.limit_formulas[workload.key] = workload.limit_formula
        # Pickling contenders last: the pickled size, learnt from the first prepared process, may skip them.
        names.sort(key=lambda name: name in PICKLING)
        jobs_values = workload.n_jobs_values or (n_jobs,)
        if quick:
            jobs_values = tuple(j for j in jobs_values if j <= 2) or (1,)
        plans.append((workload, names, jobs_values))
    total = sum(len(names) * len(jv) * repeats * len(w.operations or ("",)) for w, names, jv in plans)

    bar = tqdm(total=total, file=sys.stderr, disable=not progress, unit="run")
    try:
        for workload, names, jobs_values in plans:
            bar.set_description(f"({workload.key}) preparing")
            processes: Dict[str, ContenderProcess] = {}
            try:
                pickled = None
                for name in names:
                    if name in PICKLING and pickled is not None and pickled > pickle_budget:
                        bar.update(repeats * len(jobs_values) * len(workload.operations or ("",)))
                        report.notes.append(
                            f"({workload.key}) {name} skipped: it would pickle {format_size(pickled)} per call "
                            f"(budget {format_size(pickle_budget)})"
                        )
                        continue
                    processes[name] = ContenderProcess(name)
                    try:
                        prepared = processes[name].prepare(workload.key, size, quick)
                    except ContenderDied as died:
                        _note_death(report, workload.key, died, "preparing its data")
                        processes.pop(name).close()
                        bar.update(repeats * len(jobs_values) * len(workload.operations or ("",)))
                        continue
                    pickled = prepared if pickled is None else pickled
                _run_rotation(report, workload, processes, jobs_values, repeats, bar, (size, quick))
            finally:
                for process in processes.values():
                    process.close()
    finally:
        bar.close()
        report.load_after = load_average()
    return report


def _note_death(report: Report, key: str, died: ContenderDied, when: str) -> None:
    """Report a contender whose process died, by name and signal; the run goes on with the others."""
    note = f"({key}) {died.name}: its process died while {when}: {died}; its remaining runs of ({key}) are left out"
    report.notes.append(note)
    print(f"note: {note}", file=sys.stderr)


def _run_rotation(
    report: Report,
    workload: Workload,
    processes: Dict[str, Any],
    jobs_values,
    repeats: int,
    bar,
    prepare_args: Tuple[int, bool],
) -> None:
    """Every contender of one workload, ``repeats`` times per n_jobs (and operation), in an order rotated at each
    repeat. An operation of ``workload.fresh_process`` is timed in a new process, prepared and closed around it."""
    key = workload.key
    active = list(processes)
    for jobs in jobs_values:
        for operation in workload.operations or ("",):
            what = f" {operation}" if operation else ""
            for repeat in range(repeats):
                if not active:
                    return
                shift = repeat % len(active)
                for name in active[shift:] + active[:shift]:
                    bar.set_description(f"({key}){what} {name} n_jobs={jobs} #{repeat + 1}")
                    fresh = operation in workload.fresh_process
                    try:
                        process = ContenderProcess(name) if fresh else processes[name]
                        try:
                            if fresh:
                                process.prepare(key, *prepare_args)
                            seconds, peak, end, correct, stats, imported = process.measure(
                                jobs if name != "serial" else 1, report.memory_mode, operation
                            )
                        finally:
                            if fresh:
                                process.close()
                    except ContenderDied as died:
                        _note_death(report, key, died, f"timed at n_jobs={jobs}{what}")
                        active.remove(name)
                        continue
                    if not correct:
                        report.notes.append(f"({key}){what} {name} n_jobs={jobs}: WRONG RESULT")
                    report.measurements.append(
                        Measurement(
                            key,
                            name,
                            jobs,
                            seconds,
                            peak,
                            correct,
                            stats,
                            process.pid,
                            imported,
                            end_extra_bytes=end,
                            operation=operation,
                        )
                    )
                    bar.update(1)


def _groups(report: Report) -> Dict[tuple, List[Measurement]]:
    """Measurements by (workload, operation, n_jobs, contender)."""
    groups: Dict[tuple, List[Measurement]] = {}
    for m in report.measurements:
        groups.setdefault((m.workload, m.operation, m.n_jobs, m.contender), []).append(m)
    return groups


def row_label(workload: str, operation: str = "") -> str:
    """How a table names a workload, or one operation of it: ``(a)``, ``(p) start``."""
    return f"({workload}) {operation}" if operation else f"({workload})"


def summarize(report: Report) -> List[Dict[str, Any]]:
    """One row per (workload, operation, n_jobs, contender): medians, ranges and ratios against joblib (or the
    workload's own reference: joblib's pool in (p))."""
    groups = _groups(report)
    medians = {key: statistics.median(m.seconds for m in ms) for key, ms in groups.items()}
    memories = {key: statistics.median(m.peak_extra_bytes for m in ms) for key, ms in groups.items()}
    after = {key: statistics.median(m.end_extra_bytes for m in ms) for key, ms in groups.items()}
    rows = []
    for key, ms in groups.items():
        workload, operation, jobs, contender = key
        if contender in LIMIT_PARTS:
            continue
        ref = (workload, operation, jobs, report.references.get(workload, "joblib"))
        rows.append(
            {
                "workload": workload,
                "operation": operation,
                "label": row_label(workload, operation),
                "n_jobs": jobs,
                "contender": contender,
                "median": medians[key],
                "min": min(m.seconds for m in ms),
                "max": max(m.seconds for m in ms),
                "memory": memories[key],
                "after": after[key],
                "time_ratio": medians[key] / medians[ref] if ref in medians and medians[ref] > 0 else None,
                "memory_ratio": memories[key] / memories[ref] if ref in memories and memories[ref] > 0 else None,
                "correct": all(m.correct for m in ms),
                "stats": ms[-1].stats,
            }
        )
    order = {c: i for i, c in enumerate(CONTENDERS)}
    operations = {op: i for i, op in enumerate(dict.fromkeys(m.operation for m in report.measurements))}
    rows.sort(key=lambda r: (r["workload"], r["n_jobs"], operations[r["operation"]], order.get(r["contender"], 99)))
    return rows


def _median(report: Report, workload: str, jobs: int, contender: str, operation: str = "") -> Optional[float]:
    times = [
        m.seconds
        for m in report.measurements
        if (m.workload, m.n_jobs, m.contender, m.operation) == (workload, jobs, contender, operation)
    ]
    return statistics.median(times) if times else None


def pool_rows(report: Report) -> List[Dict[str, Any]]:
    """Workload (p): each pool's median per operation, against ``multiprocessing.Pool`` with the same start
    method (the row's own when it is such a pool) and against joblib's pool."""
    rows = []
    for r in summarize(report):
        if r["workload"] != POOL_WORKLOAD or r["contender"] not in POOL_CONTENDERS:
            continue
        jobs, op = r["n_jobs"], r["operation"]
        same = _median(report, POOL_WORKLOAD, jobs, f"mp.Pool-{pool_start_method(r['contender'])}", op)
        joblib_pool = _median(report, POOL_WORKLOAD, jobs, "joblib-pool", op)
        rows.append(
            dict(
                r,
                same_method=r["median"] / same if same else None,
                joblib_pool=r["median"] / joblib_pool if joblib_pool else None,
                method=pool_start_method(r["contender"]),
            )
        )
    return rows


def limit_rows(report: Report) -> List[Dict[str, Any]]:
    """memshare against its limit, the fastest a call could be given the work that cannot be avoided.

    For inputs (the data goes to the workers): serial / workers + one write of the data to /dev/shm + one
    first touch of it by a worker. For results (``Workload.limit_formula == "results"``: each worker makes
    its share of the results and writes it once to /dev/shm; the parent maps the files and reads nothing
    during the call): (serial + one write of the results) / workers. Each part is the median of its own
    measurements in this run. Workers are capped at the core count (8 workers on 2 cores cannot divide the
    serial time by 8). The n_jobs sweep (h) reuses the parts timed for (a), the same workload; at n_jobs=1
    the limit is the serial time (nothing to send).
    """
    cores = os.cpu_count() or 1
    rows = []
    keys = sorted({(m.workload, m.n_jobs) for m in report.measurements if m.contender in LIMIT_PARTS})
    if any(m.workload == "h" for m in report.measurements) and any(w == "a" for w, _ in keys):
        keys += sorted({("h", m.n_jobs) for m in report.measurements if m.workload == "h"})
    for workload, jobs in keys:
        # The sweep (h) is workload (a) at several n_jobs: its parts are those timed for (a).
        source, source_jobs = (workload, jobs) if workload != "h" else ("a", next(j for w, j in keys if w == "a"))
        serial = _median(report, source, source_jobs, "serial")
        write = _median(report, source, source_jobs, "shm-write")
        touch = _median(report, source, source_jobs, "first-touch")
        formula = report.limit_formulas.get(source, "inputs")
        if serial is None or write is None or (touch is None and formula == "inputs"):
            continue
        workers = min(jobs, cores)
        if jobs == 1:
            limit = serial
        elif formula == "results":
            limit = (serial + write) / workers
        else:
            limit = serial / workers + write + touch
        row = {
            "workload": workload,
            "n_jobs": jobs,
            "workers": workers,
            "serial": serial,
            "write": write,
            "touch": touch,
            "formula": formula,
            "limit": limit,
        }
        for contender in ("memshare", "joblib"):
            t = _median(report, workload, jobs, contender)
            row[contender] = t
            row[contender + "_ratio"] = t / limit if t is not None and limit > 0 else None
        rows.append(row)
    return rows


def loop_rows(report: Report) -> List[Dict[str, Any]]:
    """Workload (i): per-call overhead (time - serial time of the same calls) / calls, and memory / data."""
    calls = 10
    serial = _median(report, LOOP_WORKLOAD, report.n_jobs, "serial")
    groups = {k: v for k, v in _groups(report).items() if k[0] == LOOP_WORKLOAD}
    rows = []
    for (_, _, jobs, contender), ms in groups.items():
        median = statistics.median(m.seconds for m in ms)
        memory = statistics.median(m.peak_extra_bytes for m in ms)
        overhead = None if serial is None or contender == "serial" else (median - serial) / calls
        rows.append(
            {
                "contender": contender,
                "n_jobs": jobs,
                "median": median,
                "overhead": overhead,
                "memory": memory,
                "memory_per_data": memory / report.size if report.size else None,
            }
        )
    joblib_overhead = next((r["overhead"] for r in rows if r["contender"] == "joblib"), None)
    for r in rows:
        r["overhead_ratio"] = r["overhead"] / joblib_overhead if r["overhead"] is not None and joblib_overhead else None
    order = {c: i for i, c in enumerate(CONTENDERS)}
    rows.sort(key=lambda r: order.get(r["contender"], 99))
    return rows


def _fmt(value: Optional[float], spec: str = ".3f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


#: The columns of the table against the limit.
LIMIT_COLUMN_MEANINGS: Tuple[Tuple[str, str], ...] = (
    ("serial", "median time of the serial loop"),
    ("write", "median time of one write of the data (or the results) to a new file in /dev/shm"),
    ("first touch", "median time for a started worker to map such a file and read every page once"),
    ("limit", "the fastest a call could be, from the parts as described above"),
    ("memshare, memshare / limit, joblib / limit", "memshare's median time, and each one's median time / limit"),
)
#: The columns of the shared-array loop's table.
LOOP_COLUMN_MEANINGS: Tuple[Tuple[str, str], ...] = (
    ("median time (10 calls)", "median wall time of the 10 calls together"),
    ("per-call overhead", "(median time - the serial median of the same 10 passes) / 10"),
    ("overhead / joblib's", "this contender's per-call overhead / joblib's (< 1 is better)"),
    ("peak extra memory", "as in the first table, over the 10 calls"),
    ("memory / data", "peak extra memory / the array's size"),
)


def _legend(contenders: Sequence[str], columns: Sequence[Tuple[str, str]]) -> List[str]:
    """Lines defining the contenders of a table (each once, in the order of :data:`CONTENDERS`) and its columns."""
    named = [c for c in CONTENDER_MEANINGS if c in contenders]
    lines = ["", "Contenders:", ""] + [f"- `{c}`: {CONTENDER_MEANINGS[c]}" for c in named]
    lines += ["", "Columns:", ""] + [f"- {name}: {meaning}" for name, meaning in columns]
    return lines


def _stat_bytes(nbytes: float) -> str:
    """Bytes for memshare's figures, where a few KiB of task payloads matter: KiB below 1 MiB."""
    if 0 < nbytes < 1024:
        return f"{nbytes:.0f} B"
    if 0 < nbytes < MiB:
        return f"{nbytes / 1024:.1f} KiB"
    return format_size(nbytes)


def markdown_table(report: Report) -> str:
    """The results as markdown: a table, the workload legend, memshare's figures and the notes."""
    rows = summarize(report)
    lines = [
        f"Array size {format_size(report.size)}, n_jobs={report.n_jobs} (sweep: as listed), "
        f"{report.repeats} repeat(s), contenders interleaved. Memory: peak extra RssAnon of the process tree + "
        + (
            "the machine's Shmem"
            if report.memory_mode == "machine"
            else "the tree's new /dev/shm files and memfds (named after a tree pid, or mapped or open in the tree)"
        )
        + ", median over repeats. Ratios: this contender / joblib (< 1 is better).",
        "",
        load_line(report),
        "",
        "| workload | contender | n_jobs | median time | min-max | peak extra memory | extra after return "
        "| time / joblib | memory / joblib | correct |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        tr = f"{r['time_ratio']:.2f}" if r["time_ratio"] is not None else "-"
        mr = f"{r['memory_ratio']:.2f}" if r["memory_ratio"] is not None else "-"
        jobs = "1 (in-process)" if r["contender"] == "serial" else r["n_jobs"]
        lines.append(
            f"| {r['label']} | {r['contender']} | {jobs} | {r['median']:.3f} s "
            f"| {r['min']:.3f}-{r['max']:.3f} s | {format_size(r['memory'])} | {format_size(r['after'])} | {tr} | {mr} "
            f"| {'yes' if r['correct'] else '**NO**'} |"
        )
    lines += _legend([r["contender"] for r in rows], COLUMN_MEANINGS)
    limits = limit_rows(report)
    if limits:
        lines += [
            "",
            "memshare against the limit: the fastest a call could be, given the work it cannot avoid. "
            "Inputs (all but (c)): serial time / workers + one write of the data to /dev/shm + one first touch "
            "(map a freshly written file of the data's size in a started worker, read every page once). "
            "Results ((c)): (serial time + one write of the results to /dev/shm) / workers, since each worker "
            "makes and writes its own share and the parent maps the files without reading them; no touch. "
            "Each part is the median of its own runs, interleaved with the contenders above; workers are "
            "capped at the core count; (h) uses the parts timed for (a); at n_jobs=1 the limit is the serial "
            "time. A ratio below 1 means the limit's parts were measured slower than memshare did the same work "
            "(noise, or page faults a part pays and memshare avoids).",
            "",
            "| workload | n_jobs | serial | write | first touch | limit | memshare | memshare / limit "
            "| joblib / limit |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in limits:
            lines.append(
                f"| ({r['workload']}) | {r['n_jobs']} | {r['serial']:.3f} s | {r['write']:.3f} s "
                f"| {_fmt(r['touch'], '.3f', ' s')} "
                f"| {r['limit']:.3f} s | {_fmt(r['memshare'], '.3f', ' s')} | {_fmt(r['memshare_ratio'], '.2f')} "
                f"| {_fmt(r['joblib_ratio'], '.2f')} |"
            )
        lines += _legend(["memshare", "joblib"], LIMIT_COLUMN_MEANINGS)
    loops = loop_rows(report)
    if loops:
        lines += [
            "",
            f"Shared-array loop ({LOOP_WORKLOAD}): 10 separate calls. Per-call overhead = (median time - serial "
            "median of the same 10 passes) / 10. Memory: peak extra over the 10 calls (the shared array existed "
            "before the baseline and does not count) / the data size.",
            "",
            "| contender | n_jobs | median time (10 calls) | per-call overhead | overhead / joblib's "
            "| peak extra memory | memory / data |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in loops:
            jobs = "1 (in-process)" if r["contender"] == "serial" else r["n_jobs"]
            lines.append(
                f"| {r['contender']} | {jobs} | {r['median']:.3f} s | {_fmt(r['overhead'], '.4f', ' s')} "
                f"| {_fmt(r['overhead_ratio'], '.3f')} | {format_size(r['memory'])} "
                f"| {_fmt(r['memory_per_data'], '.2f')} |"
            )
        lines += _legend([r["contender"] for r in loops], LOOP_COLUMN_MEANINGS)
    pools = pool_rows(report)
    if pools:
        lines += [
            "",
            f"Pools on small items ({POOL_WORKLOAD}): each operation against multiprocessing.Pool with the same start "
            "method as the row's pool, and against joblib's pool (< 1 is better).",
            "",
            "| operation | contender | start method | n_jobs | median time | / mp.Pool, same start method "
            "| / joblib's pool |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in pools:
            lines.append(
                f"| {r['operation']} | {r['contender']} | {r['method']} | {r['n_jobs']} | {r['median']:.3f} s "
                f"| {_fmt(r['same_method'], '.2f')} | {_fmt(r['joblib_pool'], '.2f')} |"
            )
    lines += ["", "Workloads:", ""]
    lines += [f"- ({k}) {t}" for k, t in report.titles.items()]
    stats_rows = [r for r in rows if r["contender"].startswith("memshare") and r["stats"]]
    if stats_rows:
        lines += ["", "memshare.last_call_stats() after the last repeat:", ""]
        for r in stats_rows:
            figures = ", ".join(
                f"{k}={_stat_bytes(v) if k.startswith('bytes') else (f'{v:.3f}' if isinstance(v, float) else v)}"
                for k, v in r["stats"].items()
            )
            lines.append(f"- {r['label']} {r['contender']} n_jobs={r['n_jobs']}: {figures}")
    if report.notes:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in report.notes]
    return "\n".join(lines) + "\n"


def plot_sweep(report: Report, path: str) -> bool:
    """PNG of time and peak memory against n_jobs (workload h); False if there is no sweep to plot."""
    rows = [r for r in summarize(report) if r["workload"] == "h"]
    if not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(10, 4))
    for contender in sorted({r["contender"] for r in rows}):
        mine = sorted((r for r in rows if r["contender"] == contender), key=lambda r: r["n_jobs"])
        jobs = [r["n_jobs"] for r in mine]
        ax_time.plot(jobs, [r["median"] for r in mine], marker="o", label=contender)
        ax_mem.plot(jobs, [r["memory"] / MiB for r in mine], marker="o", label=contender)
    ax_time.set(xlabel="n_jobs", ylabel="median time (s)", title="time, workload (a)")
    ax_mem.set(xlabel="n_jobs", ylabel="peak extra memory (MiB)", title="memory, workload (a)")
    for ax in (ax_time, ax_mem):
        ax.set_xscale("log", base=2)
        ax.legend()
    fig.suptitle(f"n_jobs sweep, array of {format_size(report.size)}")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def plot_workloads(report: Report, path: str) -> bool:
    """PNG of each contender's time and peak memory against joblib's, per workload; False if nothing to plot.

    The picture people look at first: one bar per contender and workload
    (ratio to joblib, log scale, 1 = as joblib), at the run's n_jobs.
    """
    rows = [
        r
        for r in summarize(report)
        if r["n_jobs"] == report.n_jobs and r["contender"] != report.references.get(r["workload"], "joblib")
    ]
    rows = [r for r in rows if r["time_ratio"] is not None or r["memory_ratio"] is not None]
    if not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(dict.fromkeys(r["label"] for r in rows))
    names = [c for c in CONTENDERS if any(r["contender"] == c for r in rows)]
    width = 0.8 / len(names)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, column, title in zip(axes, ("time_ratio", "memory_ratio"), ("time / joblib", "peak extra memory / joblib")):
        for i, name in enumerate(names):
            mine = {r["label"]: r[column] for r in rows if r["contender"] == name and r[column]}
            xs = [k for k, key in enumerate(keys) if key in mine]
            ax.bar([x + (i - (len(names) - 1) / 2) * width for x in xs], [mine[keys[x]] for x in xs], width, label=name)
        ax.axhline(1.0, color="black", linewidth=1)
        ax.set_yscale("log")
        tilted = len(keys) > 8  # many labels ("(p) start" and the like) side by side would overlap
        ax.set_xticks(range(len(keys)), keys, rotation=45 if tilted else 0, ha="right" if tilted else "center")
        ax.set(xlabel="workload (see the report)", ylabel=f"{title} (log; < 1 is better)", title=title)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(names), fontsize="small")
    noisy = " - TOO NOISY TO TRUST" if noise_reason(report) else ""
    fig.suptitle(f"memshare bench: array of {format_size(report.size)}, n_jobs={report.n_jobs}{noisy}")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path)
    plt.close(fig)
    return True


def default_picture_path() -> str:
    """Where the default run puts its picture: a new file in the current folder, named by the time."""
    return os.path.abspath(f"memshare-bench-{time.strftime('%Y%m%d-%H%M%S')}.png")


def write_picture(report: Report, path: Optional[str]) -> str:
    """Write the picture of ``report`` to ``path`` (default: :func:`default_picture_path`); say what happened."""
    if importlib.util.find_spec("matplotlib") is None:
        return (
            "picture: none: matplotlib is not installed. pip install 'memshare[bench]' (or pip install "
            "matplotlib) to get a picture of time and memory per workload against joblib."
        )
    path = os.path.abspath(path or default_picture_path())
    if not plot_workloads(report, path):
        return "picture: none: no workload with both a contender and joblib to compare"
    return f"picture: {path} (time and memory per workload against joblib)"


def build_parser(
    prog: str = "python -m benchmarks.run",
    default_workloads: str = DEFAULT_WORKLOADS,
    default_size: Optional[int] = None,
) -> argparse.ArgumentParser:
    """Command-line options of ``python -m benchmarks.run`` and ``python -m memshare bench``, with their defaults."""
    parser = argparse.ArgumentParser(prog=prog, description="Benchmark memshare against joblib and others.")
    size_default = (
        "default " + (format_size(default_size) if default_size else "min(1 GiB, RAM / 16, free /dev/shm / 4)")
    ) + f"; {format_size(QUICK_SIZE)} with --quick"
    left_out = "".join(k for k in DEFAULT_WORKLOADS if k not in default_workloads)
    every = "all of them" if not left_out else f"all but {left_out}: pass {DEFAULT_WORKLOADS} for all"
    parser.add_argument("--size", type=parse_size, default=None, help=f"array size, e.g. 256M or 1G ({size_default})")
    parser.add_argument("--quick", action="store_true", help="small sizes and 1 repeat (for tests)")
    parser.add_argument("--repeats", type=int, default=None, help="repeats per contender (default 3, quick 1)")
    parser.add_argument(
        "--workloads",
        default=default_workloads,
        help=f"workload keys among {DEFAULT_WORKLOADS}, listed with the results (default {default_workloads}: "
        f"{every}; g needs scikit-learn; j, k and m need pandas and pyarrow, and are skipped without them)",
    )
    parser.add_argument(
        "--contenders",
        default=",".join(CONTENDERS),
        help=f"comma-separated, among {', '.join(CONTENDERS)} (default: all; each workload runs those of its own "
        "contenders that are listed, as its table shows)",
    )
    parser.add_argument("--n-jobs", type=int, default=2, help="workers (default 2)")
    parser.add_argument("--pickle-budget", type=parse_size, default=4 * GiB, help="skip pickling beyond this")
    parser.add_argument(
        "--plot", metavar="FILE", help="PNG of time and memory against n_jobs (workload h; needs matplotlib)"
    )
    parser.add_argument("--output", metavar="FILE", help="write the markdown report with a machine header")
    parser.add_argument(
        "--picture",
        metavar="FILE",
        help="PNG of time and memory per workload against joblib (default: memshare-bench-<date>-<time>.png in the "
        "current folder; needs matplotlib, else the run says how to get it)",
    )
    parser.add_argument("--no-picture", action="store_true", help="write no picture")
    parser.add_argument(
        "--memory-mode",
        choices=("tree", "machine"),
        default="tree",
        help="shared memory counted: the tree's new /dev/shm files and memfds (default) or the machine's Shmem",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return parser


# Optional dependencies (the "bench" extra): module, what needs it, when it is needed.
_OPTIONAL = (
    ("matplotlib", "--plot", lambda args: bool(args.plot)),
    ("sklearn", "workload g (GridSearchCV)", lambda args: "g" in args.workloads),
)


def missing_dependencies(args: argparse.Namespace) -> List[str]:
    """A message for each optional package the chosen options need and that is not installed."""
    messages = []
    for module, what, needed in _OPTIONAL:
        if needed(args) and importlib.util.find_spec(module) is None:
            package = {"sklearn": "scikit-learn"}.get(module, module)
            messages.append(
                f"{what} needs {package}, which is not installed: pip install 'memshare[bench]' "
                f"(or pip install {package}), or leave out {what}"
            )
    return messages


def main(
    argv: Optional[Sequence[str]] = None,
    prog: str = "python -m benchmarks.run",
    command: Optional[str] = None,
    default_workloads: str = DEFAULT_WORKLOADS,
    default_size: Optional[int] = None,
) -> int:
    """Parse options, run, print the table, write the report and plot. Returns the exit code."""
    args = build_parser(prog, default_workloads, default_size).parse_args(argv)
    missing = missing_dependencies(args)
    if missing:
        for message in missing:
            print(f"error: {message}", file=sys.stderr)
        return 2
    contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    bad = [c for c in contenders if c not in CONTENDERS]
    if bad:
        print(f"unknown contenders {bad}; choose among {', '.join(CONTENDERS)}", file=sys.stderr)
        return 2
    repeats = args.repeats or (1 if args.quick else 3)
    try:
        report = run_benchmark(
            args.workloads,
            contenders,
            size=args.size or (None if args.quick else default_size),
            repeats=repeats,
            n_jobs=args.n_jobs,
            quick=args.quick,
            pickle_budget=args.pickle_budget,
            progress=not args.no_progress,
            memory_mode=args.memory_mode,
        )
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    table = markdown_table(report)
    print(table)
    if not args.no_picture:
        print(write_picture(report, args.picture))
    if args.output:
        argv_used = [command or prog] + list(sys.argv[1:] if argv is None else argv)
        header = ["# memshare benchmark results", "", "Machine (shared and noisy: compare ratios, not times):", ""]
        with open(args.output, "w", encoding="utf-8") as out:
            out.write("\n".join(header + machine_description(argv_used)) + "\n\n" + table)
    if args.plot and not plot_sweep(report, args.plot):
        print("note: --plot needs workload h (the n_jobs sweep); no plot written", file=sys.stderr)
    wrong = [m for m in report.measurements if not m.correct]
    return 1 if wrong else 0
