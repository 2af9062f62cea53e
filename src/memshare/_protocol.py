"""The wire protocol between the parent and its workers: what a task and its outcome carry.

Transports (the pool, the loky backend) only ever send a :class:`Task` to a
worker and receive an :class:`Outcome` back; the worker side is ``_worker``,
the parent side ``_session`` (restoring an outcome: ``_adopt``). Both
messages are small: large arrays inside their streams are file references.
A failure in the task travels back as a :class:`Failure` inside a non-``ok``
outcome. This module is the bottom of the transport: it imports none of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple, Union

import numpy as np

from ._folders import FolderPair
from ._refs import RESULT, ArrayRef

#: Where a result slot's array is: a file (a result file to adopt, or the
#: user's own mapping to view), or the array itself when no file had room.
Slot = Union[ArrayRef, np.ndarray]

#: In the parent: the descriptor a worker passed for the memfd of (device, inode), or None (see ``_handoff``).
Receive = Callable[[Tuple[int, int]], Optional[int]]


@dataclass(frozen=True)
class ResultSpec:
    """What a worker needs to send results back: where, and above which size."""

    folder: FolderPair
    max_nbytes: Optional[int]
    #: The address of the parent's inbox for result memfds (``_handoff``), and the parent's pid;
    #: None: results are named files.
    inbox: Optional[str] = None
    owner: int = 0


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


__all__ = ["Failure", "Outcome", "Receive", "ResultSpec", "Slot", "Task"]
