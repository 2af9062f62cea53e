"""Starting workers never deadlocks when the garbage collector finalizes a loky semaphore at the wrong moment.

loky 3.4 (bundled by joblib 1.3 and 1.4) holds a plain lock in ``ResourceTracker.ensure_running``; a collection
there that finalizes a semaphore of an earlier executor calls ``ensure_running`` again in the same thread. Seen
as a call hanging forever while it started its workers. Importing memshare makes that lock re-entrant.
"""

from __future__ import annotations

import gc
import threading

from joblib.externals.loky.backend import resource_tracker
from joblib.externals.loky.backend.synchronize import Lock as LokyLock

import memshare  # noqa: F401  (importing memshare is what makes the tracker safe)


class _Cycle:
    """Garbage that only the cyclic collector frees, holding a loky semaphore."""

    def __init__(self) -> None:
        self.lock = LokyLock()
        self.me = self


def test_a_semaphore_finalized_inside_the_tracker_does_not_deadlock(monkeypatch):
    tracker = resource_tracker._resource_tracker
    tracker.ensure_running()
    probe = tracker._check_alive

    def probe_after_a_collection():
        gc.collect()  # as if the collector ran right here, inside ensure_running's lock
        return probe()

    monkeypatch.setattr(tracker, "_check_alive", probe_after_a_collection)
    gc.collect()
    gc.disable()  # the semaphore must be collected inside the tracker, not before
    try:
        _Cycle()
        done = threading.Event()
        runner = threading.Thread(target=lambda: (tracker.ensure_running(), done.set()), daemon=True)
        runner.start()
        runner.join(timeout=30)
    finally:
        gc.enable()
    assert done.is_set(), "ensure_running deadlocked on a semaphore finalized inside it"
