"""The wire protocol between the parent and its workers: what a task and its outcome carry.

Transports (the pool, the loky backend) only ever send a :class:`Task` (or an
:class:`Unsent` placeholder) to a worker and receive an :class:`Outcome` back; the worker side is ``_worker``,
the parent side ``_session`` (restoring an outcome: ``_adopt``). Both
messages are small: large arrays inside their streams are file references.
A failure in the task travels back as a :class:`Failure` inside a non-``ok``
outcome. This module is the bottom of the transport: it imports none of it.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from .._lifetime._folders import FolderPair
from .._numpy import np
from ._refs import RESULT, ArrayRef

#: Where a result slot's array is: a file (a result file to adopt, or the
#: user's own mapping to view), or the array itself when no file had room.
Slot = Union[ArrayRef, "np.ndarray"]

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

    def __reduce__(self) -> Tuple[Any, tuple]:
        # Every task of a session carries the same spec: pickle it once (the
        # dataclass's own reduction goes through copyreg in Python, for every
        # task), and let each worker unpickle each distinct spec once.
        wire = self.__dict__.get("_wire")
        if wire is None:
            wire = pickle.dumps((self.folder, self.max_nbytes, self.inbox, self.owner), protocol=5)
            object.__setattr__(self, "_wire", wire)
        return _result_spec, (wire,)


#: In a worker: the specs met so far, by their pickled form (a few per parent; see _result_spec).
_received_specs: Dict[bytes, ResultSpec] = {}


def _result_spec(wire: bytes) -> ResultSpec:
    spec = _received_specs.get(wire)
    if spec is None:
        if len(_received_specs) >= 64:  # specs of sessions long gone: start afresh
            _received_specs.clear()
        spec = _received_specs[wire] = ResultSpec(*pickle.loads(wire))
        object.__setattr__(spec, "_wire", wire)
    return spec


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
class Unsent:
    """Stands for a task its front end could not pack; the worker sends it back as it is (``_frontends._dispatch``)."""

    key: int  # identifies the failure in the parent's feed


@dataclass(frozen=True)
class Failure:
    """The exception a task raised, with the worker-side traceback as text."""

    exception: BaseException
    traceback: str


__all__ = ["Failure", "Outcome", "Receive", "ResultSpec", "Slot", "Task"]
