"""One benchmark contender for one workload, in a process of its own, driven by the harness over a socket.

Each contender gets a fresh interpreter so that no contender can bias another: joblib never runs in a process
that imported memshare (which registers a joblib backend and starts its own executor), and one contender's
leftovers (workers, mappings, freed but unreturned memory) never weigh on the next one's time or memory.

This file is run as a script (``python .../_contender.py NAME FD``), not imported from the package: its folder
is then first on ``sys.path`` and ``workloads`` (with the sibling modules it imports: ``runners``,
``workloads_data``, ``workloads_pool``) is imported as a top-level module, without importing memshare.
Only the memshare contenders (and the workloads that share an array with ``memshare.share``) import it.

Protocol (pickled tuples on the socket, the harness speaks first):

- ``("prepare", key, size, quick)`` -> ``("prepared", pickled_bytes)``: build the workload's data;
- ``("measure", n_jobs, operation)`` -> ``("ready",)`` (``operation``: one of the workload's ``operations``, or
  ``""``); workers are started and warmed, the harness starts its memory
  sampler on this process tree, then sends ``("go",)`` -> ``("done", seconds)``; the harness stops its
  sampler, sends ``("sampled",)`` -> ``("measured", correct, stats, imported_memshare)``;
- ``("quit",)``: exit. Any failure is answered with ``("error", traceback)`` and the process exits.
"""

from __future__ import annotations

import gc
import socket
import sys
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any, Dict

import runners  # the sibling modules, imported as top-level (see above)
import workloads


def _measure(conn: Connection, workload: workloads.Workload, data: Any, name: str, n_jobs: int, operation: str) -> Any:
    with workload.session(data, name, n_jobs, operation) as run:
        gc.collect()
        conn.send(("ready",))
        conn.recv()  # "go": the memory sampler has its baseline
        start = time.perf_counter()
        result = run()
        seconds = time.perf_counter() - start
        conn.send(("done", seconds))
        conn.recv()  # "sampled": the sampler is stopped, what follows is not measured
    return result


def serve(conn: Connection, name: str) -> None:
    """Answer the harness's commands until ``quit``."""
    workload = data = None
    size, quick = 0, False
    expected: Dict[str, Any] = {}  # by operation
    while True:
        message = conn.recv()
        command = message[0]
        if command == "quit":
            return
        if command == "prepare":
            _, key, size, quick = message
            workload = workloads.make_workloads()[key]
            data, expected = workload.prepare_for(size, quick, name), {}
            conn.send(("prepared", workload.pickled_bytes(data)))
        elif command == "measure":
            operation = message[2] if len(message) > 2 else ""
            if workload.fresh_data:
                data = None  # the old data goes first: never two copies at once
                gc.collect()
                data = workload.prepare_for(size, quick, name)
            else:
                data = workloads.fresh(data)
            result = _measure(conn, workload, data, name, message[1], operation)
            correct = True
            if name not in runners.LIMIT_PARTS:
                if operation not in expected:  # computed once, after the first run: never timed, never sampled
                    expected[operation] = workload.expected(data, operation)
                correct = workload.check(result, expected[operation])
            del result
            stats: Dict[str, Any] = {}
            if name.startswith("memshare"):
                import memshare

                figures = memshare.last_call_stats() or {}
                stats = {k: figures[k] for k in workload.stat_keys if k in figures}
            conn.send(("measured", correct, stats, "memshare" in sys.modules))
        else:
            raise ValueError(f"unknown command {command!r}")


def main() -> int:
    name, fd = sys.argv[1], int(sys.argv[2])
    conn = Connection(socket.socket(fileno=fd).detach())
    try:
        serve(conn, name)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return 1
    finally:
        conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
