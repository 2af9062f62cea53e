"""The one decision: how an array travels, given the array and what the sender already holds.

Pure functions: each reads the array, the call's settings and a read-only
view of what the sender holds, changes nothing, and returns a :class:`Route`.
Carrying a route out (writing a dump, holding an array once, writing a
result file) is the sender's job: the session for arguments, the worker's
``ResultPolicy`` for results; it may still fall back when the state of the
world at that moment (room, descriptors, a failed link) says no.
"""

from __future__ import annotations

import dataclasses
import types
from dataclasses import dataclass
from typing import Any, Callable, Container, Optional

from .._config import over_max_nbytes
from .._numpy import np, numpy_imported
from .._transport._backing import find_backing, is_copy_on_write, maps_privately
from .._transport._refs import DUMP, HELD, SHARED, USER, ArrayRef, data_address, root_array
from ._main_values import PLAIN_TYPES
from ._plain import plain_size_below

# Arguments (input_route):
#: In the stream, by value: small arrays, object dtypes, empty arrays.
PICKLE = "pickle"
#: The file the array already lives in, whatever its size: a view of the user's
#: np.memmap (with its own mode), a shared array (memshare.empty...), another session's
#: dump, a copy-on-write memmap none of whose pages was written (mapped copy-on-write),
#: the user's raw mmap under a read-only or copy-on-write call (with the call's mode;
#: a private one only while none of its pages was written).
#: Also a result viewing the user's file or another process's shared array.
REFERENCE = "reference"
#: A large array in ordinary memory: written once to a dump of the session, with the
#: mode workers map it with when it is not the session's (a copy-on-write memmap's copy);
#: or held once instead when the route says ``hold_once`` and the carrier can.
DUMP_ARRAY = "dump"
#: A large view covering at least half of a contiguous base: the base is dumped (or held
#: once) like DUMP_ARRAY, and the view is a reference into the base's file.
DUMP_BASE = "dump-base"
#: An array that maps one of the session's own current dumps: a reference to that dump,
#: which the task keeps from being deleted while it is pending.
OWN_DUMP = "own-dump"
#: Out-of-band buffers (buffer_route, both ways): a large contiguous buffer, written once
#: to a file and rebuilt over a mapping of it.
OUT_OF_BAND = "out-of-band"
# Results (result_route):
#: A shared array this worker allocated: its file gets a second name the parent adopts.
HAND_OVER = "hand-over"
#: A large array in ordinary memory, or a view of a dump (deleted when the call ends).
RESULT_FILE = "result-file"
#: Small arrays, object dtypes, empty arrays: in the stream.
BY_VALUE = "by-value"
#: A large view of a file the parent gave this task and no worker writes (its dump, or an array held
#: once, mapped read-only, or copy-on-write with no page written): the parent maps that file
#: copy-on-write; no copy, no new file.
INPUT_FILE = "input-file"
#: A result comes back as its argument's file only while that file is at most this many times the
#: result's size: the result keeps the whole file alive (a dump past the call's end, say).
FILE_PER_RESULT = 8
# Argument objects (object_route):
#: An argument object that pickles to more than ``max_nbytes``: pickled once per call into a
#: dump, which each task that passes it unpickles (a fresh object per task).
OBJECT_DUMP = "object-dump"


@dataclass(frozen=True)
class Route:
    """How one array travels; which fields are set depends on ``kind``."""

    kind: str
    #: REFERENCE, HAND_OVER, OWN_DUMP: the file the array already lives in.
    ref: Optional[ArrayRef] = None
    #: DUMP_ARRAY: the array to write; DUMP_BASE: the base to write.
    source: Optional[np.ndarray] = dataclasses.field(default=None, repr=False, compare=False)
    #: DUMP_ARRAY: the mode workers map the dump with, when it is not the session's.
    mode: Optional[str] = None
    #: DUMP_ARRAY, DUMP_BASE: hold ``source`` once rather than dump it, if the carrier can.
    hold_once: bool = False
    #: DUMP_ARRAY, DUMP_BASE: why the rules refuse holding ``source`` once (None: not refused, or not asked).
    not_held_once: Optional[str] = None


#: The only modes a held file is ever sent with: the worker's writes stay out of the file.
SAFE_MODES = ("r", "c")


def mode_unfit_reason(worker_mode: str) -> Optional[str]:
    """Why a held file must not be sent to workers mapping with ``worker_mode``, or None when it may.

    The rule for every call, whether the array is held once now or was held
    by an earlier call: the held file *is* the parent's memory (each page the
    parent has not written since reads it), so a worker writing into it
    would change the parent's array. Read-only and copy-on-write mappings
    keep the worker's writes, if any, in the worker.
    """
    if worker_mode in SAFE_MODES:
        return None
    return f"workers map it with mmap_mode={worker_mode!r}: their writes would reach the parent's array"


def input_route(
    array: np.ndarray,
    max_nbytes: Optional[int],
    own_dumps: Container[str],
    copy_on_write_unwritten: Optional[Callable[[np.ndarray], bool]] = None,
    promote: bool = False,
    worker_mode: str = "r",
) -> Route:
    """How a task argument travels to a worker.

    ``max_nbytes`` is the session's threshold (None: never dump; see
    ``_config.over_max_nbytes``);
    ``own_dumps`` holds the paths of the session's current dump files;
    ``copy_on_write_unwritten`` tells whether no page of a private file
    mapping (a copy-on-write memmap, a private ``mmap.mmap``) was written in
    this process (None: not known, so it is copied);
    ``promote`` and ``worker_mode`` are the session's settings for holding
    arrays once and the mode its workers map files with.
    """
    if array.dtype.hasobject or array.nbytes == 0:
        return Route(PICKLE)
    ref = find_backing(array)
    if ref is None and copy_on_write_unwritten is not None and maps_privately(array):
        # Its file is its content while none of its pages is private: the
        # worker maps the file copy-on-write (read-only if the view is).
        if copy_on_write_unwritten(array):
            ref = find_backing(array, copy_on_write=True)
    if ref is not None and ref.memmap_mode is None:
        # A raw mapping (no np.memmap in the chain: find_backing sets memmap_mode exactly when there is one).
        ref = _in_call_mode(ref, worker_mode)
    if ref is not None:
        if ref.kind == DUMP and ref.path in own_dumps:
            return Route(OWN_DUMP, ref=ref)
        return Route(REFERENCE, ref=ref)
    if not over_max_nbytes(array.nbytes, max_nbytes):
        return Route(PICKLE)
    base = _dumpable_base(array)
    if base is not None:
        return _dump_route(DUMP_BASE, base, None, promote, worker_mode)
    return _dump_route(DUMP_ARRAY, array, _dump_mode(array), promote, worker_mode)


def _in_call_mode(ref: ArrayRef, worker_mode: str) -> Optional[ArrayRef]:
    """The reference to a raw mapping's file, mapped with the call's mode; None when it must be copied.

    A raw ``mmap.mmap`` has no mode of its own (a memmap's is kept, as
    joblib keeps it). joblib copies such an array and maps the copy with the
    call's mode; the file stands for that copy under 'r' (read-only) and 'c'
    (each task's writes its own), whatever the user's mapping allows. Under
    'r+' the copy shares writes among the call's tasks, never with the
    parent: the file cannot, as it is the parent's array.
    """
    if worker_mode not in ("r", "c"):
        return None
    return dataclasses.replace(ref, mode=worker_mode)


def _dump_route(kind: str, source: np.ndarray, mode: Optional[str], promote: bool, worker_mode: str) -> Route:
    """A route that writes ``source``: asking to hold it once when the settings and the modes allow.

    Only an array dumped with the session's mode is held once (a
    copy-on-write memmap's copy is not the array's own memory), and only
    for workers that map read-only or copy-on-write (``mode_unfit_reason``):
    that rule holds for every array, so its refusal is logged. Whether the
    array itself can be held once (its memory, the location, the room) is
    the carrier's to find out.
    """
    if not promote or mode is not None:
        return Route(kind, source=source, mode=mode)
    reason = mode_unfit_reason(worker_mode)
    return Route(kind, source=source, mode=mode, hold_once=reason is None, not_held_once=reason)


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

    ``OUT_OF_BAND`` above ``max_nbytes`` (None: never), as arrays: a buffer
    of exactly ``max_nbytes`` bytes is pickled (``_config.over_max_nbytes``).
    An array small enough to be pickled offers its own buffer here too, so
    any other rule would send it out of band after all. ``PICKLE`` otherwise:
    small or empty, or not contiguous (pickle then copies it into the
    stream itself).
    """
    if nbytes == 0 or not contiguous or not over_max_nbytes(nbytes, max_nbytes):
        return Route(PICKLE)
    return Route(OUT_OF_BAND)


def result_route(
    array: np.ndarray,
    max_nbytes: Optional[int],
    owned_here: Callable[[ArrayRef], bool],
    given: Callable[[ArrayRef], bool] = lambda ref: False,
    copy_on_write_unwritten: Optional[Callable[[np.ndarray], bool]] = None,
) -> Route:
    """How a worker's return value travels back to the parent.

    ``owned_here`` tells whether a reference is to a shared array this
    process allocated (and can hand over); ``given`` whether it is to a file
    the parent gave this task as its own (a dump, an array held once) and
    no worker writes: the parent still holds it until the outcome is
    restored, and maps it copy-on-write. Such a view comes back as that
    file when it would otherwise be a result file and is at least a
    ``FILE_PER_RESULT``-th of the file (the worker maps the whole file, the
    root of the view's chain of bases). A view of such a file mapped
    copy-on-write (a torch argument always is; NumPy's under
    ``mmap_mode="c"``) does too while ``copy_on_write_unwritten`` finds none
    of its pages written in this process (None: not known, so it is
    copied): only then is the file its content.
    """
    if array.dtype.hasobject or array.nbytes == 0:
        return Route(BY_VALUE)
    ref = find_backing(array)
    if ref is not None and ref.kind == SHARED and owned_here(ref):
        return Route(HAND_OVER, ref=ref)
    if ref is not None and ref.kind in (USER, SHARED):
        return Route(REFERENCE, ref=ref)
    copied = copied_route(array, max_nbytes)
    if copied.kind != RESULT_FILE or FILE_PER_RESULT * array.nbytes < root_array(array).nbytes:
        return copied
    if ref is None and copy_on_write_unwritten is not None and maps_privately(array):
        ref = find_backing(array, copy_on_write=True)  # checked unwritten below, once known to be given
        if ref is not None and ref.kind in (DUMP, HELD) and given(ref) and copy_on_write_unwritten(array):
            return Route(INPUT_FILE, ref=ref)
        return copied
    if ref is not None and ref.kind in (DUMP, HELD) and given(ref):
        return Route(INPUT_FILE, ref=ref)
    # A view of another dump (kept from an earlier task, or another process's)
    # or of anything else comes back as independent memory: that dump may be
    # deleted before the outcome is restored.
    return copied


def copied_route(array: np.ndarray, max_nbytes: Optional[int]) -> Route:
    """How a result travels when it must be copied: a file when large, else in the stream.

    Also the way of a shared array whose hand-over failed (its file could
    not be linked into the call's folder: another file system): the carrier
    finds the failure, this function decides what comes next.
    """
    if not over_max_nbytes(array.nbytes, max_nbytes):
        return Route(BY_VALUE)
    return Route(RESULT_FILE)


#: Types whose instances are never argument objects of their own: the plain types, slices and ranges
#: (pickled in place, at memcpy speed), arrays (routed one by one), and code (functions, classes, modules).
_NEVER_OBJECTS = (
    *PLAIN_TYPES, slice, range,
    type, types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.ModuleType,
)  # fmt: skip
#: How many objects :func:`object_candidate` looks at before it calls an argument a candidate.
_LOOK_AT = 64
#: The least pickled size of an argument object that goes to a dump, whatever ``max_nbytes`` says: a
#: smaller one costs each task less in its payload than a file, a mapping and an unpickling do, and a
#: ``max_nbytes`` meant for arrays (joblib's tests use 2) would make a file of every tuple around a memmap.
OBJECT_DUMP_MIN = 64 * 1024


def object_candidate(obj: Any, max_nbytes: Optional[int]) -> bool:
    """True when the argument ``obj`` may pickle to more than ``max_nbytes``: then pickle it alone to know.

    Cheap and conservative: built-in containers of plain values are measured
    exactly by the standard pickler (:func:`~._plain.plain_size_below`);
    otherwise a walk of at most ``_LOOK_AT`` objects through built-in
    containers, scalars, text and arrays, adding an upper bound of each one's
    pickled size (large arrays count as references, which they travel as),
    says "surely smaller" or gives up. Anything else (a class instance: a
    DataFrame, a fitted model) is a candidate. Scalars, text, arrays and code
    are never candidates themselves.
    """
    if max_nbytes is None or isinstance(obj, _NEVER_OBJECTS):
        return False
    if numpy_imported() and isinstance(obj, (np.ndarray, np.generic, np.dtype)):
        return False
    limit = max(max_nbytes + 1, OBJECT_DUMP_MIN)
    smaller = plain_size_below(obj, limit)
    if smaller is not None:
        return not smaller
    return not _surely_smaller(obj, limit)


def _surely_smaller(obj: Any, limit: int) -> bool:
    """True when ``obj`` surely pickles to less than ``limit`` bytes, the least size an object dump takes."""
    pending, budget, total = [obj], _LOOK_AT, 0
    while pending:
        item = pending.pop()
        budget -= 1
        if budget < 0:
            return False
        kind = type(item)
        if item is None or kind in (bool, float, complex):
            total += 24
        elif kind is int:
            total += 16 + item.bit_length() // 8
        elif kind is str:
            total += 16 + 4 * len(item)  # UTF-8: at most 4 bytes a character
        elif kind in (bytes, bytearray):
            total += 16 + len(item)
        elif kind in (list, tuple, set, frozenset):
            if len(item) > budget:
                return False
            total += 16
            pending.extend(item)
        elif kind is dict:
            if 2 * len(item) > budget:
                return False
            total += 16
            pending.extend(item.keys())
            pending.extend(item.values())
        elif numpy_imported() and kind is np.ndarray:
            total += 256 + (item.nbytes if item.nbytes < limit else 0)
        else:
            return False
        if total >= limit:
            return False
    return True


def object_route(nbytes: int, max_nbytes: Optional[int]) -> Route:
    """How an argument object that pickled alone to ``nbytes`` travels.

    ``OBJECT_DUMP`` above ``max_nbytes``, as arrays and buffers, but never
    below ``OBJECT_DUMP_MIN``, so that it is pickled once per call however
    many tasks pass it; ``PICKLE`` otherwise: its pickle goes in the task's
    own payload.
    """
    if nbytes < OBJECT_DUMP_MIN or not over_max_nbytes(nbytes, max_nbytes):
        return Route(PICKLE)
    return Route(OBJECT_DUMP)
