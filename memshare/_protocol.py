"""The wire protocol between the parent and its workers: what a task and its outcome carry.

Transports (the pool, the loky backend) only ever send a :class:`Task` to a
worker and receive an :class:`Outcome` back; the worker side is ``_worker``,
the parent side ``_session``. Both messages are small: large arrays inside
their streams are file references. A failure in the task travels back as a
:class:`Failure` inside a non-``ok`` outcome, so that the parent can release
the task's files and re-raise the original exception with the worker's
traceback (:func:`restore`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import numpy as np

from ._errors import RemoteTraceback
from ._folders import FolderPair
from ._reducers import Receive, ResultSpec, Slot, unpack
from ._refs import RESULT, ArrayRef


@dataclass(frozen=True)
class Task:
    """Parent to worker: one call to run."""

    token: int  # identifies the task in the parent's session
    stream: bytes  # (function, args, kwargs), pickled with large arrays as file references
    results: ResultSpec


@dataclass(frozen=True)
class Outcome:
    """Worker to parent: what became of one task.

    The stream names each large array of the return value by a slot number;
    ``slots[n]`` says where slot ``n``'s array is: a result file to adopt
    (kind ``RESULT``, in the call's folder or its disk fallback), the user's
    own file mapping to view (kinds ``USER`` and ``SHARED``), or the array
    itself, sent by value because no file had room.
    """

    token: int
    ok: bool
    stream: bytes  # the return value packed by the result policy, or a Failure
    slots: Tuple[Slot, ...] = ()

    def result_files(self) -> List[ArrayRef]:
        """The slots that are result files the parent adopts."""
        return [where for where in self.slots if isinstance(where, ArrayRef) and where.kind == RESULT]

    def by_value(self) -> List[np.ndarray]:
        """The slots sent by value because no file had room."""
        return [where for where in self.slots if isinstance(where, np.ndarray)]


@dataclass(frozen=True)
class Failure:
    """The exception a task raised, with the worker-side traceback as text."""

    exception: BaseException
    traceback: str


def restore(
    outcome: Outcome, receive: Optional[Receive] = None, folder: Optional[FolderPair] = None
) -> Tuple[bool, Any]:
    """In the parent: (True, value) or (False, exception with remote traceback).

    ``receive`` gives the descriptors of result memfds the worker passed
    (see ``_handoff``), by (device, inode); result files are adopted only
    from ``folder``, the session's folder pair (see ``_reducers.adopt_result``).
    """
    try:
        value = unpack(outcome.stream, outcome.slots, receive, folder)
    except BaseException as exc:
        return False, exc
    if outcome.ok:
        return True, value
    exc = value.exception
    if exc.__cause__ is None:
        exc.__cause__ = RemoteTraceback(value.traceback)
    return False, exc
