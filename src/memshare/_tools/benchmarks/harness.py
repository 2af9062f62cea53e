"""Run workloads x contenders with repeats, each contender in a process of its own; the command line of the bench.

Contenders are interleaved within each repeat (and their order rotated from
one repeat to the next) because the machines this runs on are shared and
noisy: a slow minute then hurts every contender alike, and the ratio
memshare/joblib from the same run is the figure to trust, not absolute times.
The run records the load average before and after, which the report
(``report``) judges noise by; it writes a picture of each contender against
joblib (``plots``).

Before any process or data exists, a size the machine's memory cannot hold is
refused (``machine.check_fits``); a contender process that dies is reported
by name and signal, and the run goes on.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .machine import GiB, MiB, check_fits, default_size, format_size, load_average, machine_description, parse_size
from .plots import default_picture_path, plot_sweep, write_picture, write_timeline
from .processes import ContenderDied, ContenderProcess
from .report import markdown_table
from .results import Measurement, Report
from .runners import CONTENDERS, LIMIT_PARTS, PICKLING
from .workloads import Workload, make_workloads

QUICK_SIZE = 8 * MiB
DEFAULT_WORKLOADS = "abcdefghijklmnpqr"


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
    """Run the chosen workloads (keys ``a``-``n``, ``p``-``r``) for each contender ``repeats`` times, interleaved.

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
        report.short_names[workload.key] = workload.short
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
                            trace=process.last_trace,
                        )
                    )
                    bar.update(1)


def build_parser(
    prog: str = "python -m benchmarks.run",
    default_workloads: str = DEFAULT_WORKLOADS,
    default_size: Optional[int] = None,
    default_contenders: Sequence[str] = CONTENDERS,
) -> argparse.ArgumentParser:
    """Command-line options of ``python -m benchmarks.run`` and ``python -m memshare bench``, with their defaults."""
    parser = argparse.ArgumentParser(prog=prog, description="Benchmark memshare against joblib and others.")
    size_default = (
        "default " + (format_size(default_size) if default_size else "min(1 GiB, RAM / 16, free /dev/shm / 4)")
    ) + f"; {format_size(QUICK_SIZE)} with --quick"
    left_out = "".join(k for k in DEFAULT_WORKLOADS if k not in default_workloads)
    every = "all of them" if not left_out else f"all but {left_out}: pass {DEFAULT_WORKLOADS} for all"
    unlisted = ", ".join(c for c in CONTENDERS if c not in default_contenders)
    contenders_default = f"all but {unlisted}, which run when listed" if unlisted else "all"
    parser.add_argument("--size", type=parse_size, default=None, help=f"array size, e.g. 256M or 1G ({size_default})")
    parser.add_argument("--quick", action="store_true", help="small sizes and 1 repeat (for tests)")
    parser.add_argument("--repeats", type=int, default=None, help="repeats per contender (default 3, quick 1)")
    parser.add_argument(
        "--workloads",
        default=default_workloads,
        help=f"workload keys among {DEFAULT_WORKLOADS}, listed with the results (default {default_workloads}: "
        f"{every}; g needs scikit-learn; j, k, m and n need pandas and pyarrow, r needs torch, and are skipped "
        "without them)",
    )
    parser.add_argument(
        "--contenders",
        default=",".join(default_contenders),
        help=f"comma-separated, among {', '.join(CONTENDERS)} (default: {contenders_default}; each workload runs "
        "those of its own contenders that are listed, as its table shows)",
    )
    parser.add_argument("--n-jobs", type=int, default=2, help="workers (default 2)")
    parser.add_argument("--pickle-budget", type=parse_size, default=4 * GiB, help="skip pickling beyond this")
    parser.add_argument(
        "--plot", metavar="FILE", help="PNG of time and memory against n_jobs (workload h; needs matplotlib)"
    )
    parser.add_argument(
        "--output",
        metavar="FILE",
        help="the full markdown report with a machine header (default: memshare-bench-<date>-<time>.md in the temp "
        "folder, its path printed; the terminal shows the tables without the columns' definitions)",
    )
    parser.add_argument(
        "--picture",
        metavar="FILE",
        help="PNG of time and memory per workload against joblib (default: memshare-bench-<date>-<time>.png in the "
        "temp folder, its path printed; needs matplotlib, else the run says how to get it)",
    )
    parser.add_argument("--no-picture", action="store_true", help="write no picture")
    parser.add_argument(
        "--timeline",
        metavar="FILE",
        help="PNG of memory over time during one timed call of each contender, memshare against joblib, on the "
        "first workload run (the repeat of median peak; needs matplotlib)",
    )
    parser.add_argument(
        "--memory-mode",
        choices=("tree", "machine"),
        default="tree",
        help="shared memory counted: the tree's new /dev/shm files and memfds (default) or the machine's Shmem",
    )
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress bar on stderr (there is none when it is not a terminal)"
    )
    return parser


# Optional dependencies (the "bench" extra): module, what needs it, when it is needed.
_OPTIONAL = (
    ("matplotlib", "--plot", lambda args: bool(args.plot)),
    ("matplotlib", "--timeline", lambda args: bool(args.timeline)),
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
    default_contenders: Sequence[str] = CONTENDERS,
) -> int:
    """Parse options, run, print the table, write the report and plot. Returns the exit code."""
    args = build_parser(prog, default_workloads, default_size, default_contenders).parse_args(argv)
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
            # A bar redrawn in place is only for a terminal: in a file or a pipe it is one endless line.
            progress=not args.no_progress and sys.stderr.isatty(),
            memory_mode=args.memory_mode,
        )
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    # The terminal gets the tables and one legend; the file gets every definition, memshare's own figures and
    # the machine. Neither goes to the current folder unless asked (--output, --picture).
    stamp = time.strftime("%Y%m%d-%H%M%S")
    print(markdown_table(report, full=False))
    output = os.path.abspath(args.output or os.path.join(tempfile.gettempdir(), f"memshare-bench-{stamp}.md"))
    argv_used = [command or prog] + list(sys.argv[1:] if argv is None else argv)
    header = ["# memshare benchmark results", "", "Machine (shared and noisy: compare ratios, not times):", ""]
    with open(output, "w", encoding="utf-8") as out:
        out.write("\n".join(header + machine_description(argv_used)) + "\n\n" + markdown_table(report))
    print(f"report: {output} (every column defined, memshare.last_call_stats() and the machine)")
    if not args.no_picture:
        print(write_picture(report, args.picture or default_picture_path(stamp)))
    if args.timeline:
        print(write_timeline(report, args.timeline))
    if args.plot and not plot_sweep(report, args.plot):
        print("note: --plot needs workload h (the n_jobs sweep); no plot written", file=sys.stderr)
    wrong = [m for m in report.measurements if not m.correct]
    return 1 if wrong else 0
