"""The parent side of one pool or one joblib call: pack tasks, carry out their routes, restore their results.

A :class:`Session` owns a :class:`TempFolder`, the dump table of the files
written into it (``_dumps``) and its side of arrays held once
(``_held_once``). Its ``_arguments`` decide each argument's route and carry
it out into a per-task record; the session releases what a task held when it
is done, and restores its outcome, taking the result memfds its worker passed.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import pickle
import stat
from typing import Any, Dict, Optional, Tuple

from .. import _forksafe
from .._config import Settings
from .._errors import UnpicklableArgumentError
from .._lifetime import _memfd
from .._lifetime._folder_warnings import warn_fallback, warn_result_pickled
from .._lifetime._holdings import held_bytes
from .._lifetime._temp_folder import TempFolder
from .._payload._plain import plain_call
from .._payload._reducers import Reducers, pack
from .._stats import CallStats, logger, record_finished
from .._transport._handoff import Inbox
from .._transport._protocol import Outcome, ResultSpec, Task
from .._transport._refs import RESULT, ArrayRef
from ._adopt import restore, restore_with_memfds
from ._arguments import ArgumentRoutes, TaskRecord
from ._dumps import DumpTable
from ._kept_buffers import KeptIn
from ._kept_buffers import store as kept_buffers
from ._objects import Carrier, ObjectPacker, task_arguments


class Session:
    """Dumps, references and results of one pool or call. Thread-safe."""

    def __init__(self, settings: Settings, reducers: Optional[Reducers] = None, threads_instead: str = "") -> None:
        """``reducers`` (type -> reducer) are used when pickling task arguments.

        ``threads_instead`` is how the user of this session's front end runs
        tasks in threads, named when an argument cannot be pickled.
        """
        self.settings = settings
        self._threads_instead = threads_instead or "use backend='threading'"
        self._reducers = dict(reducers) if reducers else None
        self.folder = TempFolder(settings.temp_folder)
        self.stats = CallStats()
        # Re-entrant because a dumped array may be garbage-collected while
        # this thread packs a task, and its weak reference callback (in the
        # dump table) then takes the lock in the same thread.
        self._lock = _forksafe.rlock()
        kept = KeptIn(kept_buffers(), self.folder.location)
        self._dumps = DumpTable(self.folder.pair, self.stats, self._lock, self._release_record, kept)
        self._arguments = ArgumentRoutes(settings, self.stats, self._lock, self._dumps, self._check_open)
        self._tasks: Dict[int, TaskRecord] = {}  # pending tasks
        self._tokens = itertools.count(1)
        self._objects = ObjectPacker(
            Carrier(
                settings,
                self._reducers,
                self._lock,
                self._dumps,
                new_record=TaskRecord,
                reduce_argument=self._arguments.reduce_argument,
                reduce_buffer=self._arguments.reduce_buffer,
                abandon=self._abandon,
                check_open=self._check_open,
                route_of=self._arguments.route_of,
                note_arrow=self._arguments.note_arrow,
            )
        )
        self._closed = False
        self._inbox = self._open_inbox()
        self._results = ResultSpec(
            self.folder.pair if self._inbox else dataclasses.replace(self.folder.pair, in_memory=False),
            settings.max_nbytes,
            self._inbox.address if self._inbox else None,
            os.getpid(),
        )

    def _open_inbox(self) -> Optional[Inbox]:
        """Where workers pass result memfds (see ``_handoff``); None: results are named files."""
        if not self.folder.pair.in_memory:
            return None
        try:
            return Inbox(self.folder.pair.primary)  # the session's private folder: no other user can connect
        except OSError as exc:
            logger.info("memshare: results are named files, no socket to receive memfds on: %s", exc)
            return None

    @property
    def results(self) -> ResultSpec:
        """Where and how workers send this session's results back: the same for every task."""
        return self._results

    # -- calls ---------------------------------------------------------------

    def new_generation(self) -> None:
        """Mark the start of a new call: reused arrays get checked for changes, earlier calls' buffers go."""
        self._dumps.new_generation()
        self._objects.new_generation()

    # -- tasks ---------------------------------------------------------------

    def pack_task(self, func: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Task:
        """Pack a call of ``func`` for a worker, dumping large arrays as needed.

        Any failure to pickle the function or an argument (whatever the
        exception its ``__reduce__`` raised) is raised in the caller's thread
        as :class:`UnpicklableArgumentError`, the original as its cause, as
        joblib raises a ``PicklingError``. memshare's own failures while
        dumping (``SharedMemoryFullError``...) and ``KeyboardInterrupt`` are
        raised as themselves.
        """
        # The lock is taken for each array the pickler meets (reduce_argument)
        # and to register the task, not across the pickling of everything
        # else: the result thread finishing other tasks need not wait for it.
        self._check_open()
        if self._reducers is None and plain_call(func, args, kwargs or {}):
            # Nothing to route, hold or release: no record, and the standard pickler (the full
            # path below reports whatever it cannot pickle).
            try:
                stream = pickle.dumps((func, args, kwargs or {}), protocol=5)
            except Exception:
                stream = None
            if stream is not None:
                self.stats.add(tasks=1, bytes_pickled=len(stream))
                return Task(next(self._tokens), stream, self._results)
        record = TaskRecord()
        reduce_array = functools.partial(self._arguments.reduce_argument, record)
        reduce_buffer = None  # no threshold: every buffer stays in the stream
        if self.settings.max_nbytes is not None:
            reduce_buffer = functools.partial(self._arguments.reduce_buffer, record)
        kwargs = kwargs or {}
        try:
            objects = self._objects.pack(task_arguments(func, args, kwargs), record)
            stream = pack(
                (func, args, kwargs),
                reduce_array,
                reducers=self._reducers,
                reduce_buffer=reduce_buffer,
                objects=objects,
                on_arrow=self._arguments.note_arrow if reduce_buffer is not None else None,
                reduce_broadcast=functools.partial(self._arguments.reduce_broadcast, record),
            )
        except Exception as exc:
            self._abandon(record)
            if exc is record.error:
                raise
            raise UnpicklableArgumentError(
                f"memshare: cannot send a call of {_name_of(func)} to a worker process: "
                f"{type(exc).__name__}: {exc}. Pass only "
                "picklable arguments (locks, open files, generators, sockets and database connections are "
                f"not), create such objects inside the task, or {self._threads_instead}."
            ) from exc
        except BaseException:
            self._abandon(record)
            raise
        with self._lock:
            if self._closed:  # closed while this task was packed: its files went with the folder
                self._release_record(record)
                self._check_open()
            token = next(self._tokens)
            self._tasks[token] = record
            self.stats.add(tasks=1, bytes_pickled=len(stream))
        return Task(token, stream, self._results)

    def _abandon(self, record: TaskRecord) -> None:
        """Release what a task that will never be sent holds."""
        with self._lock:
            self._release_record(record)

    def finish(self, outcome: Outcome) -> Tuple[bool, Any]:
        """Restore a finished task's result or exception, then release its files.

        The files go after the restore: a result that views one of them (the
        task returned its argument) is mapped from it first (``_adopt.map_given``).
        The worker leaves warnings about its results to the parent (its own
        would go to its stderr, out of the caller's ``warnings`` filters):
        results that went to the disk fallback, or by value, warn here, once
        per call like inputs, and are counted.
        """
        try:
            files, by_value = outcome.result_files(), outcome.by_value()
            in_place = [ref for ref in outcome.slots if isinstance(ref, ArrayRef) and ref.kind != RESULT]
            pair = self.folder.pair
            on_disk = [ref.nbytes for ref in files if pair.is_fallback(ref.path)]
            self.stats.add(
                results_by_reference=len(files),
                bytes_results_by_reference=sum(ref.nbytes for ref in files),
                results_of_inputs=len(in_place),
                bytes_results_of_inputs=sum(ref.nbytes for ref in in_place),
                fallback_files=len(on_disk),
                results_pickled_no_room=len(by_value),
            )
            if on_disk:
                warn_fallback(pair.primary, pair.fallback, max(on_disk), stacklevel=2)
            if by_value:
                warn_result_pickled(pair, max(array.nbytes for array in by_value))
            open_given = functools.partial(self._open_given, outcome.token)
            if self._inbox is None:
                return restore(outcome, folder=self.folder.pair, open_given=open_given)
            return restore_with_memfds(outcome, self._inbox, self.folder.pair, open_given)
        finally:
            self.task_done(outcome.token)

    def _open_given(self, token: int, ref: ArrayRef) -> int:
        """A new descriptor of the file of ``ref``, found among the files the pending task ``token`` was given.

        Found by (device, inode) among the task's dumps and held files (or
        the session's current dumps), and opened through the session's own record of it (a memfd: a duplicate
        of the descriptor this process holds; a named file: its path, without
        following links, checked to be that file), never through the path the
        worker sent: a worker can make the parent map only the parent's own
        files that its task reads. Taken with the lock held: the task is
        pending until its outcome is restored, so the file cannot go meanwhile.
        """
        identity = (ref.device, ref.inode)
        with self._lock:
            record = self._tasks.get(token)
            own = None
            if record is not None:
                candidates = [self._dumps.ref_at(path) for path in record.files]
                candidates += [file.ref for _, file in record.held_once]
                # Or a current dump of the session that the task reads through another (an argument
                # object's dump keeps those its payload names): the session's own, alive while the lock is held.
                candidates.append(self._dumps.ref_at(ref.path))
                own = next((c for c in candidates if c is not None and (c.device, c.inode) == identity), None)
            if own is None:
                raise PermissionError(
                    f"memshare: refusing to map {ref.path!r}: a result names a file that its task was not given"
                )
            if _memfd.is_memfd_path(own.path):
                fd = _memfd.duplicate(own.path)
            else:
                fd = os.open(own.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or not own.is_file(info):
                raise FileNotFoundError(f"memshare: {own.path!r} was replaced since it was shared")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def task_done(self, token: int) -> None:
        """The task ``token`` will not read its inputs any more (done or abandoned)."""
        with self._lock:
            record = self._tasks.pop(token, None)
            if record is not None:
                self._release_record(record)

    # -- lifetimes -------------------------------------------------------------

    def _release_record(self, record: TaskRecord) -> None:
        self._dumps.release(record.files)
        for held, file in record.held_once:
            held.release(file)
        record.held_once.clear()

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran: nothing more can be packed."""
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("memshare: this pool or call has already finished")

    def close(self) -> None:
        """Delete every file of the session; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._dumps.close()
            self._objects.new_generation()  # lets go of the arguments remembered as small (a closed pool lives on)
            self._arguments.clear()
            for record in self._tasks.values():
                self._release_record(record)
            self._tasks.clear()
        if self._inbox is not None:
            self._inbox.close()  # descriptors of outcomes never restored go with it
        self.folder.remove()
        # Measured after the folder went: what outlives the call (set, not added: a session closes once).
        self.stats.bytes_in_shared_memory = held_bytes()
        record_finished(self.stats)


def _name_of(func: Any) -> str:
    items = getattr(func, "items", None)  # a joblib batch: name the function it calls
    if isinstance(items, list) and items and isinstance(items[0], tuple):
        func = items[0][0]
    inner = getattr(func, "func", None)  # a pool's map chunk, or a functools.partial: the function it calls
    if callable(inner):
        func = inner
    return getattr(func, "__qualname__", None) or type(func).__name__
