"""The pictures of a benchmark run: each contender against joblib per workload, and the n_jobs sweep (matplotlib).

matplotlib is optional (the ``bench`` extra): it is imported only to draw,
and :func:`write_picture` says how to get it where it is missing.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
import time
from typing import Dict, Optional

from .machine import MiB, format_size
from .results import Measurement, Report, noise_reason, summarize
from .runners import CONTENDERS


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


#: Below this ratio the picture's axis is linear, above it logarithmic (symlog): a ratio of 0, memshare's best
#: (no extra memory at all), is drawn at 0 instead of falling off a log axis.
LINEAR_BELOW = 0.05


def workloads_figure(report: Report):
    """The figure of :func:`plot_workloads` (a matplotlib Figure, not yet saved), or None if nothing to plot.

    Each bar starts at 1 (as joblib) and ends at the contender's ratio to
    joblib: down is better. The axis is symlog, linear below
    :data:`LINEAR_BELOW`, so that a ratio of 0 reaches the bottom of the axis
    instead of vanishing as it would on a log axis.
    """
    rows = [
        r
        for r in summarize(report)
        if r["n_jobs"] == report.n_jobs and r["contender"] != report.references.get(r["workload"], "joblib")
    ]
    rows = [r for r in rows if r["time_ratio"] is not None or r["memory_ratio"] is not None]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(dict.fromkeys((r["workload"], r["operation"]) for r in rows))
    ticks = [
        " ".join(filter(None, (report.short_names.get(key, ""), operation, f"({key})"))) for key, operation in keys
    ]
    names = [c for c in CONTENDERS if any(r["contender"] == c for r in rows)]
    colors = {name: plt.get_cmap("tab20")(CONTENDERS.index(name) % 20) for name in names}
    width = 0.8 / len(names)
    fig = plt.figure(figsize=(13, 6), layout="constrained")
    axes = fig.subplots(1, 2)
    for ax, column, title in zip(axes, ("time_ratio", "memory_ratio"), ("time / joblib", "peak extra memory / joblib")):
        for i, name in enumerate(names):
            mine = {(r["workload"], r["operation"]): r[column] for r in rows if r["contender"] == name}
            xs = [k for k, key in enumerate(keys) if mine.get(key) is not None]
            values = [mine[keys[x]] for x in xs]
            ax.bar(
                [x + (i - (len(names) - 1) / 2) * width for x in xs],
                [v - 1 for v in values],
                width,
                bottom=1,
                label=name,
                color=colors[name],
            )
        ax.axhline(1.0, color="black", linewidth=1)
        ax.set_yscale("symlog", linthresh=LINEAR_BELOW, linscale=0.5)
        ax.set_ylim(0, max(2.0, ax.get_ylim()[1]))  # 1 (as joblib) never at the top edge
        tilted = len(keys) > 4  # names side by side would overlap
        ax.set_xticks(range(len(keys)), ticks, rotation=35 if tilted else 0, ha="right" if tilted else "center")
        ax.set_title(title)
        ax.set_ylabel(f"{title} (1 = as joblib, < 1 is better)")
    reference = "; (p) against joblib's pool" if any(key == "p" for key, _ in keys) else ""
    # One entry per contender, wherever its bars are; under the axes, inside the figure.
    entries = {label: handle for ax in axes for handle, label in zip(*ax.get_legend_handles_labels())}
    fig.legend(entries.values(), entries.keys(), loc="outside lower center", ncol=min(len(names), 6), fontsize="small")
    noisy = " - TOO NOISY TO TRUST" if noise_reason(report) else ""
    fig.suptitle(
        f"memshare bench: each contender against joblib{reference}, array of {format_size(report.size)}, "
        f"n_jobs={report.n_jobs}, median of {report.repeats} repeat(s){noisy}\n"
        f"bars from 1 (as joblib) to the ratio; axis linear below {LINEAR_BELOW}, logarithmic above, so that 0 "
        "(no extra memory) is drawn at 0; workload keys as in the report",
        fontsize="medium",
    )
    return fig


def plot_workloads(report: Report, path: str) -> bool:
    """PNG of each contender's time and peak memory against joblib's, per workload; False if nothing to plot.

    The picture people look at first: one bar per contender and workload
    (ratio to joblib, 1 = as joblib), at the run's n_jobs; see :func:`workloads_figure`.
    """
    fig = workloads_figure(report)
    if fig is None:
        return False
    import matplotlib.pyplot as plt

    fig.savefig(path)
    plt.close(fig)
    return True


def timeline_runs(report: Report, workload: Optional[str] = None) -> Dict[str, Measurement]:
    """For one workload, each contender's timed call of median peak that has a trace, by contender.

    The workload is ``workload``, or the first one run where memshare and
    joblib both have a trace, at the run's n_jobs and its first operation.
    Empty when there is none.
    """
    keys = [workload] if workload else list(dict.fromkeys(m.workload for m in report.measurements))
    for key in keys:
        mine = [m for m in report.measurements if m.workload == key and m.n_jobs == report.n_jobs and m.trace]
        operation = mine[0].operation if mine else ""
        chosen: Dict[str, Measurement] = {}
        for contender in CONTENDERS:
            runs = sorted(
                (m for m in mine if m.contender == contender and m.operation == operation),
                key=lambda m: m.peak_extra_bytes,
            )
            if runs:
                chosen[contender] = runs[(len(runs) - 1) // 2]
        if "memshare" in chosen and "joblib" in chosen:
            return chosen
    return {}


def plot_timeline(report: Report, path: str, workload: Optional[str] = None) -> bool:
    """PNG of memory over time during one timed call of each contender (see :func:`timeline_runs`); False if none.

    Each line is the extra memory of a contender's process tree, sampled
    while its call ran and until memory settled after it returned; a dotted
    line of the same colour marks the return.
    """
    runs = timeline_runs(report, workload)
    if not runs:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for contender, run in runs.items():
        times = [seconds for seconds, _ in run.trace]
        values = [extra / MiB for _, extra in run.trace]
        (line,) = ax.plot(times, values, label=f"{contender}: peak {format_size(run.peak_extra_bytes)}")
        ax.axvline(run.seconds, color=line.get_color(), linestyle=":", linewidth=1)
    key = next(iter(runs.values())).workload
    ax.set(xlabel="seconds since the call started (dotted: it returned)", ylabel="extra memory (MiB)")
    noisy = " - TOO NOISY TO TRUST" if noise_reason(report) else ""
    ax.set_title(
        f"({key}) {report.titles.get(key, '')}\narray of {format_size(report.size)}, n_jobs={report.n_jobs}{noisy}",
        fontsize="medium",
    )
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def write_timeline(report: Report, path: str) -> str:
    """Write the memory-over-time picture of ``report`` to ``path``; say what happened."""
    path = os.path.abspath(path)
    if not plot_timeline(report, path):
        return "timeline: none: no workload ran both memshare and joblib"
    return f"timeline: {path} (memory over time, memshare against joblib)"


def default_picture_path(stamp: Optional[str] = None) -> str:
    """Where the default run puts its picture: a new file in the temp folder, named by the time (or ``stamp``).

    Not the current folder: a run from a project's folder must not leave files in it unless asked (``--picture``).
    """
    return os.path.join(tempfile.gettempdir(), f"memshare-bench-{stamp or time.strftime('%Y%m%d-%H%M%S')}.png")


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
