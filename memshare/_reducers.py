"""The sharing policy: which arrays travel as file references, both ways.

This module knows nothing of pools or executors. It turns any picklable
object into a payload in which every ``np.ndarray`` (nested
anywhere: in tuples, dicts, DataFrames, sparse matrices, estimators) was
handed to an *array policy* first:

* :class:`InputPolicy`, in the parent, for task arguments: arrays already
  backed by a file mapping become references whatever their size; other
  arrays larger than ``max_nbytes`` are dumped once (by the session, which
  deduplicates by identity) and become references; the rest are pickled.
* :class:`ResultPolicy`, in a worker, for return values: views of the user's
  own file mappings come back as references to the same memory; other large
  arrays, including views of the call's temporary dumps, are written to a
  new result file that the parent adopts (see :func:`adopt_result`), after
  the value is pickled (see ``_result_files``).

Payloads (plain ``bytes``) are pickled with cloudpickle (lambdas, functions of ``__main__``)
and pickle protocol 5.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import os
import pickle
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import cloudpickle
import numpy as np

from ._folders import FolderPair, unlink_quietly
from ._mapping import array_from_ref, map_file
from ._refs import DUMP, RESULT, SHARED, USER, ArrayRef, data_address, find_backing, is_copy_on_write, root_array
from ._release import can_release
from ._result_files import create_result_file, fill_result_file
from ._shared_store import lookup_shared
from ._stats import REFERENCED, log_decision

# Reduction used for arrays that travel by value: numpy's own.
Reduction = Tuple[Callable[..., Any], tuple]


class _Pickler(cloudpickle.Pickler):
    def __init__(self, file: io.BytesIO, reduce_array: Callable[[np.ndarray], Optional[Reduction]]) -> None:
        super().__init__(file, protocol=5)
        self._reduce_array = reduce_array

    def reducer_override(self, obj: Any) -> Any:
        # Exact types only: other ndarray subclasses (masked arrays, matrices)
        # pickle their own way, through plain arrays that come back here.
        if type(obj) is np.ndarray or type(obj) is np.memmap:
            reduced = self._reduce_array(obj)
            if reduced is not None:
                return reduced
            if type(obj) is np.memmap:
                # A memmap that is not shared as a file must not be rebuilt as
                # a memmap without a file on the other side.
                return _plain_reduction(obj)
            return NotImplemented
        return super().reducer_override(obj)


def _plain_reduction(array: np.ndarray) -> Reduction:
    return np.asarray(array).view(np.ndarray).__reduce_ex__(5)


def pack(obj: Any, reduce_array: Callable[[np.ndarray], Optional[Reduction]]) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer, reduce_array).dump(obj)
    return buffer.getvalue()


#: Where results that moved while written are now: a new file, or the array itself,
#: sent by value because no file had room. Keyed by the path the payload names.
Moves = Dict[str, Union[ArrayRef, np.ndarray]]


def unpack(stream: bytes, moved: Optional[Moves] = None) -> Any:
    """Unpickle a payload; ``moved`` is a worker's record of results that moved (see ``ResultPolicy``)."""
    if not moved:
        return pickle.loads(stream)
    return _FollowingMoves(io.BytesIO(stream), moved).load()


class _FollowingMoves(pickle.Unpickler):
    """Unpickles results with :func:`adopt_result` told where moved results are now.

    ``find_class`` is the hook pickle gives for choosing what a global name
    loads: the payload names ``adopt_result`` and gets it with the moves bound.
    """

    def __init__(self, file: io.BytesIO, moved: Moves) -> None:
        super().__init__(file)
        self._moved = moved

    def find_class(self, module: str, name: str) -> Any:
        if module == adopt_result.__module__ and name == adopt_result.__name__:
            return functools.partial(adopt_result, moved=self._moved)
        return super().find_class(module, name)


def _rebuild_input(ref: ArrayRef) -> np.memmap:
    """In a worker: the shared array, mapped through the process's cache."""
    return array_from_ref(ref, cached=True)


def _rebuild_reference(ref: ArrayRef) -> np.ndarray:
    """In the parent: a result that views the user's own file mapping."""
    shared = lookup_shared(ref)
    if shared is not None:
        return shared
    return array_from_ref(ref, cached=False)


def _owned_here(ref: ArrayRef) -> bool:
    """True when ``ref`` is a shared array that this process allocated."""
    return lookup_shared(ref) is not None


def adopt_result(ref: ArrayRef, moved: Optional[Moves] = None) -> np.ndarray:
    """In the parent: map a worker's result file and delete its name at once.

    From then on the memory lives exactly as long as the returned array (the
    mapping is its base); nothing is left on disk whatever happens next. The
    array is a plain, writable ``np.ndarray``: the mapping is shared but no
    other process has the file any more. ``moved`` maps the paths of results
    that moved while the worker wrote them to where they are now.
    """
    if moved:
        now = moved.get(ref.path, ref)
        if isinstance(now, np.ndarray):
            return now  # no file had room: it came by value
        ref = now
    if ref.kind != RESULT:
        raise PermissionError(f"memshare: {ref.path!r} is not a result file")
    base = map_file(dataclasses.replace(ref, mode="r+"))
    unlink_quietly(ref.path)
    raw = base.base  # the mmap.mmap under the np.memmap: a plain ndarray over it is no memmap
    return np.ndarray(ref.shape, ref.dtype, buffer=raw, offset=ref.offset, strides=ref.strides)


class InputPolicy:
    """Parent side: how task arguments travel (call it on each array).

    ``dump`` is the session's deduplicating writer, given the array and the
    mode workers must map it with (None: the session's ``mmap_mode``);
    ``on_reference`` lets the session count the files each task depends on.
    """

    def __init__(
        self,
        max_nbytes: Optional[int],
        dump: Callable[[np.ndarray, Optional[str]], ArrayRef],
        on_reference: Callable[[ArrayRef, np.ndarray], None],
        on_pickled: Callable[[np.ndarray], None],
    ) -> None:
        self.max_nbytes = max_nbytes
        self._dump = dump
        self._on_reference = on_reference
        self._on_pickled = on_pickled
        #: The error this policy raised (no room for a dump, say), if any: a
        #: failure of memshare's own, not of pickling the caller's arguments.
        self.error: Optional[BaseException] = None

    def __call__(self, array: np.ndarray) -> Optional[Reduction]:
        try:
            return self._reduce(array)
        except BaseException as exc:
            self.error = exc
            raise

    def _reduce(self, array: np.ndarray) -> Optional[Reduction]:
        if array.dtype.hasobject or array.nbytes == 0:
            self._on_pickled(array)
            return None
        ref = find_backing(array)
        if ref is not None:
            self._on_reference(ref, array)
            return _rebuild_input, (ref,)
        if self.max_nbytes is None or array.nbytes <= self.max_nbytes:
            self._on_pickled(array)
            return None
        ref = self._view_of_dumped_base(array)
        if ref is None:
            ref = self._dump(array, _dump_mode(array))
        return _rebuild_input, (ref,)

    def _view_of_dumped_base(self, array: np.ndarray) -> Optional[ArrayRef]:
        """Send a large view as a view of its dumped base array, if that is better.

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
        base_ref = self._dump(base, None)
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


@dataclass(frozen=True)
class ResultSpec:
    """What a worker needs to send results back: where, and above which size."""

    folder: FolderPair
    max_nbytes: Optional[int]


class ResultPolicy:
    """Worker side: how return values travel.

    Large arrays are not written while the return value is pickled: each
    gets an empty file and a reference at once, and :meth:`write_pending`
    writes them once the pickler and the task's own variables are gone. By
    then memshare often holds the only reference to an array, and its memory
    can be freed as it is written (see ``_release``).

    Records the files it made, so that they can be removed if anything
    fails, the results that moved while written (see ``_result_files``), and
    the sizes of those that went to the disk fallback or by value, for the
    parent to warn about and count.
    """

    def __init__(self, spec: ResultSpec) -> None:
        self.spec = spec
        self.written: List[str] = []
        self.moved: Moves = {}
        self.fallback_sizes: List[int] = []  # results written to the disk fallback
        self.pickled_sizes: List[int] = []  # results sent by value: no file had room
        # (reference, one-item list holding the array): the list is the only
        # reference memshare keeps, which _release.can_release relies on.
        self._pending: List[Tuple[ArrayRef, List[np.ndarray]]] = []

    def __call__(self, array: np.ndarray) -> Optional[Reduction]:
        if array.dtype.hasobject or array.nbytes == 0:
            return None
        ref = find_backing(array)
        if ref is not None and ref.kind == SHARED and _owned_here(ref):
            handed = self._hand_over(ref)
            if handed is not None:
                return adopt_result, (handed,)
        elif ref is not None and ref.kind in (USER, SHARED):
            log_decision(REFERENCED, array, ref.path)
            return _rebuild_reference, (ref,)
        # A view of a temporary dump (or of anything else) must come back as
        # independent memory: the dump is deleted when the call ends.
        if self.spec.max_nbytes is None or array.nbytes <= self.spec.max_nbytes:
            return None
        ref = create_result_file(self.spec.folder, array)
        self.written.append(ref.path)
        self._pending.append((ref, [array]))
        return adopt_result, (ref,)

    def write_pending(self) -> None:
        """Write the arrays of the pickled return value into their files.

        Call it after dropping every other reference to the return value.
        Each array is let go of as soon as it is written, so the next one
        is written with it already freed.
        """
        pending, self._pending = self._pending, []
        pending.reverse()  # pop() from the end, in the order they were pickled
        while pending:
            ref, box = pending.pop()
            release = can_release(box)  # before box[0] is read again: that read is one more reference
            final = fill_result_file(self.spec.folder, ref, box[0], release)
            box.clear()
            if isinstance(final, np.ndarray):
                self.moved[ref.path] = final
                self.pickled_sizes.append(final.nbytes)
            elif final.path != ref.path:
                self.moved[ref.path] = final
                self.written.append(final.path)
                if os.path.dirname(final.path) == self.spec.folder.fallback:
                    self.fallback_sizes.append(final.nbytes)

    def files_sent(self) -> List[str]:
        """The files the parent will adopt: one per array sent through a file."""
        return [path for path in self.written if path not in self.moved]

    def _hand_over(self, ref: ArrayRef) -> Optional[ArrayRef]:
        """Give the parent a shared array this worker allocated, with no copy.

        The file gets a second name in the call's folder, which the parent
        adopts like any result file; the worker's own name goes when its
        array is garbage-collected. Both then map the same pages.
        """
        path = self.spec.folder.link_file(ref.path, RESULT)
        if path is None:
            return None
        self.written.append(path)
        return dataclasses.replace(ref, path=path, kind=RESULT, mode="r+")

    def discard_written(self) -> None:
        """Remove every file made so far, written or not."""
        self._pending.clear()
        self.moved.clear()
        self.fallback_sizes.clear()
        self.pickled_sizes.clear()
        for path in self.written:
            unlink_quietly(path)
        self.written.clear()


__all__ = [
    "DUMP",
    "InputPolicy",
    "ResultPolicy",
    "ResultSpec",
    "adopt_result",
    "pack",
    "unpack",
]
