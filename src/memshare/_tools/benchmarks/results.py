"""The measurements of a benchmark run, and the figures drawn from them: medians, ratios, the limit, the loop, pools.

A :class:`Report` holds every :class:`Measurement` of a run with what the run
met on the way; :func:`summarize` gives one row per workload, n_jobs and
contender with its ratios to joblib (or to the workload's own reference),
:func:`limit_rows`, :func:`loop_rows` and :func:`pool_rows` the rows of the
other tables, and :func:`noise_reason` says when the run was too noisy to
trust. ``report`` writes them as markdown, ``plots`` as pictures.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from .runners import CONTENDERS, LIMIT_PARTS, POOL_CONTENDERS
from .workloads_pool import pool_start_method

LOOP_WORKLOAD = "i"  # the shared-array loop: per-call overheads and memory per call against the data size
POOL_WORKLOAD = "p"  # the pools on small items: ratios to mp.Pool with the same start method


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
    trace: List[Tuple[float, int]] = field(default_factory=list)  # (seconds, extra bytes): memory over time


@dataclass
class Report:
    """All measurements of a benchmark run, plus the notes (skips, failures) met on the way."""

    size: int
    n_jobs: int
    repeats: int
    measurements: List[Measurement] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    titles: Dict[str, str] = field(default_factory=dict)
    short_names: Dict[str, str] = field(default_factory=dict)  # workload -> a few words, for the picture
    memory_mode: str = "tree"
    limit_formulas: Dict[str, str] = field(default_factory=dict)  # workload -> Workload.limit_formula
    references: Dict[str, str] = field(default_factory=dict)  # workload -> Workload.reference, if not joblib
    cores: int = field(default_factory=lambda: os.cpu_count() or 1)
    load_before: Optional[Tuple[float, float, float]] = None  # os.getloadavg() before the first process started
    load_after: Optional[Tuple[float, float, float]] = None  # ... and after the last one ended


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
