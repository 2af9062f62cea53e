"""``TempFolder``: the owner's handle on one private folder pair, and the process's removal of its folders.

A ``TempFolder`` belongs to one pool, one joblib call (or managed ``with
Parallel()`` context), or the process's shared-array store. Its folders are
made lazily, on the first file. Its
:class:`~memshare._lifetime._file_lifetime.FileLifetime` removes them once:
at :meth:`TempFolder.remove`, when the object is collected, or at
interpreter exit. If the owner dies without any of those, its watchdog
process (``_watchdog``) does. Only the process that made them removes them. The first
folder of a process sweeps the folders of dead owners (``_sweep``).

The watchdog also removes a killed owner's loky semaphores; while it runs,
they are not registered with loky's resource tracker
(:func:`leave_loky_semaphores_to_watchdog`), which would otherwise warn about
each after a kill, as leaked or as already gone.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import stat
import tempfile
import weakref
from typing import List, Optional, Set

from .. import _forksafe
from . import _procfs
from ._file_lifetime import FileLifetime
from ._folder_warnings import forget_warnings, warn_if_on_disk
from ._folders import FolderPair
from ._location import SHM_ROOT, Location, choose_location, fallback_base
from ._owners import Owner, new_folder_name, new_twin_name
from ._sweep import sweep_dead_owners
from ._watchdog import WatchdogClient

#: Spare twins per folder, used in turn when a twin's name is taken (see ``FolderPair.spares``).
SPARE_TWINS = 2


class _ProcessState:
    """Process-wide cleanup bookkeeping.

    One per process because the things it tracks are per process: the
    watchdog pipe, the folders to remove at exit, and whether dead owners'
    folders were swept already. Reset in forked children, which own nothing.
    """

    def __init__(self) -> None:
        self.lock = _forksafe.lock()
        self.watchdog = WatchdogClient()
        self.live_paths: Set[str] = set()
        self.swept = False
        # loky semaphores of this process left to the watchdog rather than loky's tracker.
        self.semaphores: Set[str] = set()
        self.tracker_hooked = False

    def after_fork_in_child(self) -> None:
        self.watchdog.forget_after_fork()
        self.lock = _forksafe.lock()
        self.live_paths = set()
        self.semaphores = set()  # the parent's: its own loky unregisters them, never this child


_state = _ProcessState()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_state.after_fork_in_child)


def live_folders() -> List[str]:
    """This process's folders (primaries and disk twins) not removed yet, made or still to be made."""
    with _state.lock:
        return sorted(_state.live_paths)


def _remove_paths(paths: List[str]) -> None:
    for path in paths:
        if _is_own_dir(path):
            shutil.rmtree(path, ignore_errors=True)
        with _state.lock:
            _state.live_paths.discard(path)
        _state.watchdog.unregister(path)
        forget_warnings(path)


@atexit.register
def _remove_all_at_exit() -> None:
    with _state.lock:
        paths = list(_state.live_paths)
    _remove_paths(paths)
    _state.watchdog.close()


def leave_loky_semaphores_to_watchdog() -> None:
    """Have this process's watchdog, not loky's resource tracker, remove its loky semaphores after a kill.

    Called before memshare starts loky workers. From then on, loky's
    ``resource_tracker.register`` and ``unregister`` leave out the
    semaphores this process names (``/loky-<pid>-*``) while its watchdog
    runs: loky unlinks them at a normal exit, and the watchdog after a
    kill, once the tracker, whose pid it is told here, has exited. Both
    removing them would make the tracker warn about each; the watchdog must
    be the one, since it outlives a killed process group and the tracker
    does not.
    """
    from joblib.externals.loky.backend import resource_tracker

    from .._compat import loky_tracker

    if not _state.watchdog.start():
        return  # no watchdog: loky's tracker keeps the job
    with _state.lock:
        if not _state.tracker_hooked:
            _state.tracker_hooked = True
            _hook_tracker(resource_tracker)
    pid, fd = loky_tracker()  # started now if it was not, as starting a worker would
    if pid is None and fd is not None:
        # Forked from the process that started it: without its pid, the watchdog
        # would remove the semaphores while a worker still starting needs them.
        pid = _procfs.pipe_reader(fd)
    if pid is not None:
        _state.watchdog.watch_tracker(pid)


def _hook_tracker(module) -> None:
    """Wrap loky's ``register``/``unregister`` (called by its semaphores by module attribute) as said above."""
    register, unregister = module.register, module.unregister

    # No lock: loky unregisters from a semaphore's finalizer, which a garbage collection may
    # run in a thread holding any lock. A set's add, membership and discard are atomic, and
    # each name is unregistered once.
    def register_unless_watched(name, rtype):
        if rtype == "semlock" and name.startswith(f"/loky-{os.getpid()}-") and _state.watchdog.running():
            _state.semaphores.add(name)
            return
        register(name, rtype)

    def unregister_unless_watched(name, rtype):
        if rtype == "semlock" and name in _state.semaphores:
            _state.semaphores.discard(name)
            return
        unregister(name, rtype)

    module.register, module.unregister = register_unless_watched, unregister_unless_watched


def _is_own_dir(path: str) -> bool:
    """True when ``path`` is a directory of this user (not something another user planted at a twin's name)."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid()


class TempFolder:
    """The owner's handle on one private folder pair.

    Nothing touches the disk until :attr:`pair` is first used to create a
    file; :meth:`remove` is idempotent and safe to call from any thread.
    """

    def __init__(self, base: Optional[str] = None, location: Optional[Location] = None) -> None:
        """``location`` (from :func:`choose_location`) wins over ``base`` (an explicit temp folder)."""
        location = location or choose_location(base)
        warn_if_on_disk(location)
        primary_base = location.base
        owner = Owner.current()
        fallback = fallback_base(primary_base)
        # Each twin has a random part of its own (see FolderPair).
        twins = [os.path.join(fallback, new_twin_name(owner)) for _ in range(1 + SPARE_TWINS)] if fallback else []
        self.location = location
        self.pair = FolderPair(
            os.path.join(primary_base, new_folder_name(owner)),
            twins[0] if twins else None,
            location.in_memory,
            tuple(twins[1:]),
        )
        paths = list(self.pair.folders())
        with _state.lock:
            sweep = not _state.swept
            _state.swept = True
            _state.live_paths.update(paths)
        if sweep:
            # Local file systems only (see _sweep).
            sweep_dead_owners({primary_base, fallback or primary_base, SHM_ROOT, tempfile.gettempdir()})
        # Registered before any file exists: a worker may create the folder
        # (for a result) before the owner does, and it must still be cleaned.
        for path in paths:
            _state.watchdog.register(path)
        # One owner and no readers: current until removed or collected. The finalizer runs end() once,
        # whichever thread calls remove() (FileLifetime itself is not thread-safe).
        self.lifetime = FileLifetime(self.pair.primary, functools.partial(_remove_own_paths, os.getpid(), paths))
        self._finalizer = weakref.finalize(self, self.lifetime.end)

    def remove(self) -> None:
        """Delete the folders and everything in them (in the process that made them; see below)."""
        self._finalizer()


def _remove_own_paths(owner: int, paths: List[str]) -> None:
    """A :class:`TempFolder`'s removal: only in the process that made it.

    A forked child inherits its parent's TempFolder objects; when it drops
    one (its copy of a registry reset after the fork, say) or closes an
    inherited session, the folder is still the parent's and in use. Old loky
    releases start every worker with fork() then exec(), so this runs in
    every such worker for a moment.
    """
    if os.getpid() == owner:
        _remove_paths(paths)
