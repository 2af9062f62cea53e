"""The markdown report of a benchmark run: its tables, what each contender and column means, the load, the notes.

Every contender and column is defined once, after the tables, so the report
reads on its own; the load averages before and after the run, and the verdict
on noise (``results.noise_reason``), head it. The terminal gets the short form
(``markdown_table(report, full=False)``): the tables and the contenders, about
a screen for the default run.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from .machine import MiB, format_size
from .results import LOOP_WORKLOAD, POOL_WORKLOAD, Report, limit_rows, loop_rows, noise_reason, pool_rows, summarize

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


def _contender_legend(contenders: Sequence[str]) -> List[str]:
    """Lines defining each contender of the tables once, in the order of :data:`CONTENDER_MEANINGS`."""
    named = [c for c in CONTENDER_MEANINGS if c in contenders]
    return ["", "Contenders:", ""] + [f"- `{c}`: {CONTENDER_MEANINGS[c]}" for c in named]


def _column_legend(table: str, columns: Sequence[Tuple[str, str]]) -> List[str]:
    """Lines defining the columns of one table, under a heading naming the table."""
    return ["", f"Columns of {table}:", ""] + [f"- {name}: {meaning}" for name, meaning in columns]


def _stat_bytes(nbytes: float) -> str:
    """Bytes for memshare's figures, where a few KiB of task payloads matter: KiB below 1 MiB."""
    if 0 < nbytes < 1024:
        return f"{nbytes:.0f} B"
    if 0 < nbytes < MiB:
        return f"{nbytes / 1024:.1f} KiB"
    return format_size(nbytes)


def markdown_table(report: Report, full: bool = True) -> str:
    """The results as markdown: the tables, then what their contenders, columns and workloads are, and the notes.

    Each table comes once, and each definition once, after all the tables. With
    ``full=False`` (what the terminal shows) the columns' definitions and
    memshare's own figures (``memshare.last_call_stats()``) are left out and the
    workloads get one short line each, so that a default run prints about a screen.
    """
    rows = summarize(report)
    shown = {r["contender"] for r in rows}
    columns: List[List[str]] = [_column_legend("the main table", COLUMN_MEANINGS)]
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
        shown |= {"memshare", "joblib"}
        columns.append(_column_legend("the table against the limit", LIMIT_COLUMN_MEANINGS))
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
        shown |= {r["contender"] for r in loops}
        columns.append(_column_legend(f"the shared-array loop's table ({LOOP_WORKLOAD})", LOOP_COLUMN_MEANINGS))
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
    # The short name is how the picture names the workload.
    lines += [f"- ({k}) {report.short_names.get(k, k)}: {t}" for k, t in report.titles.items()]
    lines += _contender_legend(shown)
    if full:
        lines += [line for legend in columns for line in legend]
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
