"""Locks that a forked child can use even if another thread held them at the fork.

A child made by ``fork()`` has only the thread that forked, but a copy of
every lock: one that another thread (a pool's monitor or feeder, the mapping
pruner, a comparison thread) held at that moment stays locked in the child
forever, and the first use deadlocks. Every lock memshare creates comes from
here, and each is reset to unlocked in the child right after a fork, as the
standard library does for its own (``logging``, ``threading``).

Resetting is safe because the child does not continue what the other thread
was doing: the data such a lock guards is either reset too (the per-process
state of ``_temp_folder`` and ``_mapping``) or belongs to the parent's pools and
calls, which the child never uses.
"""

from __future__ import annotations

import os
import threading
import weakref

from ._compat import reinit_lock

_locks: weakref.WeakSet = weakref.WeakSet()
_registry_lock = threading.Lock()


def lock() -> threading.Lock:
    """A ``threading.Lock`` that is unlocked in a forked child."""
    new = threading.Lock()
    with _registry_lock:
        _locks.add(new)
    return new


def rlock() -> threading.RLock:
    """A ``threading.RLock`` that is unlocked in a forked child."""
    new = threading.RLock()
    with _registry_lock:
        _locks.add(new)
    return new


def _hold_registry() -> None:
    _registry_lock.acquire()


def _release_registry_in_parent() -> None:
    _registry_lock.release()


def _reset_in_child() -> None:
    # The registry lock was taken before the fork (so the set was not being
    # changed by another thread): the child's copy is held, by this thread.
    for each in list(_locks):
        reinit_lock(each)
    reinit_lock(_registry_lock)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=_hold_registry, after_in_parent=_release_registry_in_parent, after_in_child=_reset_in_child
    )
