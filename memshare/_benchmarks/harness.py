"""Run workloads x contenders with repeats and report medians, ranges, peak memory and ratios.

Contenders are interleaved within each repeat (and their order rotated from
one repeat to the next) because the machines this runs on are shared and
noisy: a slow minute then hurts every contender alike, and the ratio
memshare/joblib from the same run is the figure to trust, not absolute times.
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
from typing import Any, Dict, List, Optional, Sequence

from .processes import ContenderProcess
from .workloads import CONTENDERS, LIMIT_PARTS, PICKLING, make_workloads

GiB = 1 << 30
MiB = 1 << 20
QUICK_SIZE = 8 * MiB
DEFAULT_WORKLOADS = "abcdefghi"
LOOP_WORKLOAD = "i"  # the shared-array loop: per-call overheads and memory per call against the data size


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
    """Run the chosen workloads (keys ``a``-``i``) for each contender ``repeats`` times, interleaved.

    Each contender runs each workload in a process of its own (:class:`ContenderProcess`), started before the
    workload's first run and ended after its last, so that no contender can bias another; memory is sampled
    over that process's tree only. Workloads with ``limit_bytes`` also time the parts of memshare's limit
    (:data:`LIMIT_PARTS`: one write of the data to /dev/shm, one first touch of it in a worker) in the same
    rotation as the contenders.
    """
    from tqdm import tqdm

    size = size or (QUICK_SIZE if quick else default_size())
    report = Report(size=size, n_jobs=n_jobs, repeats=repeats, memory_mode=memory_mode)
    all_workloads = make_workloads()
    chosen = [all_workloads[k] for k in workloads if k in all_workloads]
    unknown = [k for k in workloads if k not in all_workloads and k not in ", "]
    if unknown:
        raise ValueError(f"unknown workloads {unknown}: choose among {''.join(all_workloads)}")

    plans = []
    for workload in chosen:
        report.titles[workload.key] = workload.title
        reason = workload.skip_reason()
        if reason:
            report.notes.append(f"({workload.key}) skipped: {reason}")
            print(f"note: workload ({workload.key}) skipped: {reason}", file=sys.stderr)
            continue
        names = [c for c in workload.contenders if c in contenders]
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
    total = sum(len(names) * len(jv) * repeats for _, names, jv in plans)

    bar = tqdm(total=total, file=sys.stderr, disable=not progress, unit="run")
    try:
        for workload, names, jobs_values in plans:
            bar.set_description(f"({workload.key}) preparing")
            processes: Dict[str, ContenderProcess] = {}
            try:
                pickled = None
                for name in names:
                    if name in PICKLING and pickled is not None and pickled > pickle_budget:
                        bar.update(repeats * len(jobs_values))
                        report.notes.append(
                            f"({workload.key}) {name} skipped: it would pickle {format_size(pickled)} per call "
                            f"(budget {format_size(pickle_budget)})"
                        )
                        continue
                    processes[name] = ContenderProcess(name)
                    prepared = processes[name].prepare(workload.key, size, quick)
                    pickled = prepared if pickled is None else pickled
                _run_rotation(report, workload.key, processes, jobs_values, repeats, bar)
            finally:
                for process in processes.values():
                    process.close()
    finally:
        bar.close()
    return report


def _run_rotation(report: Report, key: str, processes: Dict[str, Any], jobs_values, repeats: int, bar) -> None:
    """Every contender of one workload, ``repeats`` times per n_jobs, in an order rotated at each repeat."""
    active = list(processes)
    for jobs in jobs_values:
        for repeat in range(repeats):
            shift = repeat % len(active)
            for name in active[shift:] + active[:shift]:
                bar.set_description(f"({key}) {name} n_jobs={jobs} #{repeat + 1}")
                process = processes[name]
                seconds, peak, end, correct, stats, imported = process.measure(
                    jobs if name != "serial" else 1, report.memory_mode
                )
                if not correct:
                    report.notes.append(f"({key}) {name} n_jobs={jobs}: WRONG RESULT")
                report.measurements.append(
                    Measurement(
                        key, name, jobs, seconds, peak, correct, stats, process.pid, imported, end_extra_bytes=end
                    )
                )
                bar.update(1)


def _groups(report: Report) -> Dict[tuple, List[Measurement]]:
    groups: Dict[tuple, List[Measurement]] = {}
    for m in report.measurements:
        groups.setdefault((m.workload, m.n_jobs, m.contender), []).append(m)
    return groups


def summarize(report: Report) -> List[Dict[str, Any]]:
    """One row per (workload, n_jobs, contender): medians, ranges and ratios against joblib."""
    groups = _groups(report)
    medians = {key: statistics.median(m.seconds for m in ms) for key, ms in groups.items()}
    memories = {key: statistics.median(m.peak_extra_bytes for m in ms) for key, ms in groups.items()}
    after = {key: statistics.median(m.end_extra_bytes for m in ms) for key, ms in groups.items()}
    rows = []
    for key, ms in groups.items():
        workload, jobs, contender = key
        if contender in LIMIT_PARTS:
            continue
        ref = (workload, jobs, "joblib")
        rows.append(
            {
                "workload": workload,
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
    rows.sort(key=lambda r: (r["workload"], r["n_jobs"], order.get(r["contender"], 99)))
    return rows


def _median(report: Report, workload: str, jobs: int, contender: str) -> Optional[float]:
    times = [
        m.seconds for m in report.measurements if (m.workload, m.n_jobs, m.contender) == (workload, jobs, contender)
    ]
    return statistics.median(times) if times else None


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
    for (_, jobs, contender), ms in groups.items():
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
        "| workload | contender | n_jobs | median time | min-max | peak extra memory | extra after return "
        "| time / joblib | memory / joblib | correct |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        tr = f"{r['time_ratio']:.2f}" if r["time_ratio"] is not None else "-"
        mr = f"{r['memory_ratio']:.2f}" if r["memory_ratio"] is not None else "-"
        jobs = "1 (in-process)" if r["contender"] == "serial" else r["n_jobs"]
        lines.append(
            f"| ({r['workload']}) | {r['contender']} | {jobs} | {r['median']:.3f} s "
            f"| {r['min']:.3f}-{r['max']:.3f} s | {format_size(r['memory'])} | {format_size(r['after'])} | {tr} | {mr} "
            f"| {'yes' if r['correct'] else '**NO**'} |"
        )
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
    lines += ["", "Workloads:", ""]
    lines += [f"- ({k}) {t}" for k, t in report.titles.items()]
    stats_rows = [r for r in rows if r["contender"].startswith("memshare") and r["stats"]]
    if stats_rows:
        lines += ["", "memshare.last_call_stats() after the last repeat:", ""]
        for r in stats_rows:
            figures = ", ".join(
                f"{k}={format_size(v) if k.startswith('bytes') else (f'{v:.3f}' if isinstance(v, float) else v)}"
                for k, v in r["stats"].items()
            )
            lines.append(f"- ({r['workload']}) {r['contender']} n_jobs={r['n_jobs']}: {figures}")
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
        f"{every}; g needs scikit-learn)",
    )
    parser.add_argument("--contenders", default=",".join(CONTENDERS), help="comma-separated contenders")
    parser.add_argument("--n-jobs", type=int, default=2, help="workers (default 2)")
    parser.add_argument("--pickle-budget", type=parse_size, default=4 * GiB, help="skip pickling beyond this")
    parser.add_argument(
        "--plot", metavar="FILE", help="PNG of time and memory against n_jobs (workload h; needs matplotlib)"
    )
    parser.add_argument("--output", metavar="FILE", help="write the markdown report with a machine header")
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
    if args.output:
        argv_used = [command or prog] + list(sys.argv[1:] if argv is None else argv)
        header = ["# memshare benchmark results", "", "Machine (shared and noisy: compare ratios, not times):", ""]
        with open(args.output, "w", encoding="utf-8") as out:
            out.write("\n".join(header + machine_description(argv_used)) + "\n\n" + table)
    if args.plot and not plot_sweep(report, args.plot):
        print("note: --plot needs workload h (the n_jobs sweep); no plot written", file=sys.stderr)
    wrong = [m for m in report.measurements if not m.correct]
    return 1 if wrong else 0
