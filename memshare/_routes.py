"""The one decision: how an array travels, given the array and what the sender already holds.

Every array met while pickling a task's arguments (in the parent) or its
return value (in a worker) is asked one question: how does it travel? The
answer is a :class:`Route`, computed here by pure functions that read the
array and a read-only view of what the sender holds, and change nothing.
Carrying a route out (writing a dump, linking a file, counting) is the
sender's job: ``_session`` for arguments, ``_reducers.ResultPolicy`` for
results.

Arguments (:func:`input_route`):

``PICKLE``
    In the stream, by value: small arrays, object dtypes, empty arrays.
``REFERENCE``
    The file the array already lives in: a view of the user's ``np.memmap``
    or ``mmap``, a shared array (``memshare.empty``...), or a dump of
    another session. Whatever its size: no copy is ever made.
``DUMP``
    A large array in ordinary memory: written once to a dump file of the
    session (deduplicated by identity), with the mode workers map it with
    when it is not the session's (a copy-on-write memmap's copy). A
    copy-on-write memmap whose pages are all still its file's (the sender
    says so) is a ``REFERENCE`` to its file instead, mapped copy-on-write. The session
    carries out the dump of an eligible array by holding it once instead
    (``_promotion``): its memory becomes its file, for every later call too.
``VIEW_OF_DUMP``
    A view into one of the session's dumps: either a large view covering
    at least half of a contiguous base, whose base is dumped (once) so that
    every such view of it shares one file; or a view of a dump the session
    already holds, met again (a nested call's argument).

Out-of-band buffers (:func:`buffer_route`), both ways: a ``PickleBuffer``
that pickle protocol 5 offers (pyarrow's buffers, Arrow-backed pandas
columns, any object that pickles out of band) is ``OUT_OF_BAND`` when large
(written once to a file, rebuilt over a mapping of it) and ``PICKLE`` when
small or not contiguous (in the stream, as before). NumPy arrays never get
here large: their own route comes first.

Results (:func:`result_route`):

``REFERENCE``
    A view of the user's own file mapping, or of a shared array of another
    process: the parent maps the same memory.
``HAND_OVER``
    A shared array this worker allocated: its file gets a second name the
    parent adopts, with no copy.
``RESULT_FILE``
    A large array in ordinary memory, or a view of a temporary dump (which
    is deleted when the call ends): written to a new result file.
``BY_VALUE``
    Small arrays, object dtypes, empty arrays: in the stream.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Container, Optional

import numpy as np

from ._refs import DUMP, SHARED, USER, ArrayRef, data_address, find_backing, is_copy_on_write, root_array

PICKLE = "pickle"
REFERENCE = "reference"
DUMP_ARRAY = "dump"
VIEW_OF_DUMP = "view-of-dump"
HAND_OVER = "hand-over"
RESULT_FILE = "result-file"
BY_VALUE = "by-value"
OUT_OF_BAND = "out-of-band"


@dataclass(frozen=True)
class Route:
    """How one array travels; which fields are set depends on ``kind``."""

    kind: str
    #: REFERENCE, HAND_OVER, VIEW_OF_DUMP of a held dump: the file the array already lives in.
    ref: Optional[ArrayRef] = None
    #: DUMP_ARRAY: the array to write; VIEW_OF_DUMP of a base to dump: that base.
    source: Optional[np.ndarray] = dataclasses.field(default=None, repr=False, compare=False)
    #: DUMP_ARRAY: the mode workers map the dump with, when it is not the session's.
    mode: Optional[str] = None


def input_route(
    array: np.ndarray,
    max_nbytes: Optional[int],
    held_dumps: Container[str],
    copy_on_write_unwritten: Optional[Callable[[np.ndarray], bool]] = None,
) -> Route:
    """How a task argument travels to a worker.

    ``max_nbytes`` is the session's threshold (None: never dump);
    ``held_dumps`` holds the paths of the session's current dump files;
    ``copy_on_write_unwritten`` tells whether no page of a copy-on-write
    memmap was written in this process (None: not known, so it is copied).
    """
    if array.dtype.hasobject or array.nbytes == 0:
        return Route(PICKLE)
    ref = find_backing(array)
    if ref is None and copy_on_write_unwritten is not None and is_copy_on_write(array):
        # Its file is its content while none of its pages is private: the
        # worker maps the file copy-on-write (read-only if the view is).
        if copy_on_write_unwritten(array):
            ref = find_backing(array, copy_on_write=True)
    if ref is not None:
        if ref.kind == DUMP and ref.path in held_dumps:
            return Route(VIEW_OF_DUMP, ref=ref)
        return Route(REFERENCE, ref=ref)
    if max_nbytes is None or array.nbytes <= max_nbytes:
        return Route(PICKLE)
    base = _dumpable_base(array)
    if base is not None:
        return Route(VIEW_OF_DUMP, source=base)
    return Route(DUMP_ARRAY, source=array, mode=_dump_mode(array))


def _dumpable_base(array: np.ndarray) -> Optional[np.ndarray]:
    """The base to dump instead of the large view ``array``, if that is better.

    ``delayed(f)(X.T)`` in a loop makes a new view object per task; dumped
    one by one, each would be written again. When the view covers at least
    half of a contiguous base, the base is dumped once (deduplicated by its
    identity, like any array) and every view becomes a reference into it,
    with its own offset, strides and dtype: the file has the base's exact
    memory layout. Small views of big arrays are still dumped alone.
    """
    base = root_array(array)
    if base is array or base.dtype.hasobject or 2 * array.nbytes < base.nbytes:
        return None
    if type(base) is not np.ndarray or not (base.flags.c_contiguous or base.flags.f_contiguous):
        return None
    return base


def view_in_dump(array: np.ndarray, base: np.ndarray, base_ref: ArrayRef) -> ArrayRef:
    """The reference to ``array``, a view of ``base``, in the dump of ``base`` at ``base_ref``."""
    offset = base_ref.offset + data_address(array) - data_address(base)
    return dataclasses.replace(
        base_ref, offset=offset, shape=tuple(array.shape), strides=tuple(array.strides), dtype=array.dtype
    )


def _dump_mode(array: np.ndarray) -> Optional[str]:
    """The mode workers map ``array``'s dump with, when it is not the session's.

    A copy-on-write memmap is copied (its private pages may differ from its
    file) and the copy is mapped copy-on-write, as joblib maps the memmap:
    writable, with writes private to each task.
    """
    if is_copy_on_write(array):
        return "c" if array.flags.writeable else "r"
    return None


def buffer_route(nbytes: int, contiguous: bool, max_nbytes: Optional[int]) -> Route:
    """How one buffer that pickle offers out of band travels (either way).

    ``OUT_OF_BAND`` from ``max_nbytes`` on (None: never). At, not only above
    as for arrays: Arrow data read in batches has many buffers of exactly a
    power of two (2**17 rows of 8 bytes is 1 MiB, joblib's default
    threshold), and each would otherwise be pickled for every task.
    ``PICKLE`` otherwise: small or empty, or not contiguous (pickle then
    copies it into the stream itself).
    """
    if max_nbytes is None or nbytes == 0 or nbytes < max_nbytes or not contiguous:
        return Route(PICKLE)
    return Route(OUT_OF_BAND)


def result_route(array: np.ndarray, max_nbytes: Optional[int], owned_here: Callable[[ArrayRef], bool]) -> Route:
    """How a worker's return value travels back to the parent.

    ``owned_here`` tells whether a reference is to a shared array this
    process allocated (and can hand over).
    """
    if array.dtype.hasobject or array.nbytes == 0:
        return Route(BY_VALUE)
    ref = find_backing(array)
    if ref is not None and ref.kind == SHARED and owned_here(ref):
        return Route(HAND_OVER, ref=ref)
    if ref is not None and ref.kind in (USER, SHARED):
        return Route(REFERENCE, ref=ref)
    # A view of a temporary dump (or of anything else) must come back as
    # independent memory: the dump is deleted when the call ends.
    return copied_route(array, max_nbytes)


def copied_route(array: np.ndarray, max_nbytes: Optional[int]) -> Route:
    """How a result travels when it must be copied: a file when large, else in the stream.

    Also the way of a shared array whose hand-over failed (its file could
    not be linked into the call's folder: another file system).
    """
    if max_nbytes is None or array.nbytes <= max_nbytes:
        return Route(BY_VALUE)
    return Route(RESULT_FILE)
