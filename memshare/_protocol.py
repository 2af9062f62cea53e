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
from typing import Any, Tuple, Union

import numpy as np

from ._errors import RemoteTraceback
from ._reducers import ResultSpec, unpack
from ._refs import ArrayRef


@dataclass(frozen=True)
class Task:
    """Parent to worker: one call to run."""

    token: int  # identifies the task in the parent's session
    stream: bytes  # (function, args, kwargs), packed with the input policy
    results: ResultSpec


@dataclass(frozen=True)
class Outcome:
    """Worker to parent: what became of one task."""

    token: int
    ok: bool
    stream: bytes  # the return value packed with the result policy, or a Failure
    result_arrays: int = 0  # arrays returned through result files
    result_bytes: int = 0
    # Results that moved while written: (first path, where now: a file, or the array by value).
    moved: Tuple[Tuple[str, Union[ArrayRef, np.ndarray]], ...] = ()
    fallback_sizes: Tuple[int, ...] = ()  # bytes of each result written to the disk fallback
    pickled_sizes: Tuple[int, ...] = ()  # bytes of each result sent by value: no file had room


@dataclass(frozen=True)
class Failure:
    """The exception a task raised, with the worker-side traceback as text."""

    exception: BaseException
    traceback: str


def restore(outcome: Outcome) -> Tuple[bool, Any]:
    """In the parent: (True, value) or (False, exception with remote traceback)."""
    try:
        value = unpack(outcome.stream, dict(outcome.moved))
    except BaseException as exc:
        return False, exc
    if outcome.ok:
        return True, value
    exc = value.exception
    if exc.__cause__ is None:
        exc.__cause__ = RemoteTraceback(value.traceback)
    return False, exc
