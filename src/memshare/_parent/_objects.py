"""Large argument objects: found among a task's arguments, measured, pickled once per call into a dump.

:class:`ObjectPacker` is one session's side of it: for each task it finds
the arguments that may pickle large (``_routes.object_candidate``), measures
them with a pickling pass that writes nothing, and writes those of more than
``max_nbytes`` (``_routes.object_route``) to a dump once per call, through
the session's dump table. The task's payload then names each dump wherever
it meets the object (``_reducers.pack``'s ``objects``), and the worker
unpickles each once per task: every task gets its own object, as under
joblib, and an object reached from several places is one object there.
"""

from __future__ import annotations

import functools
import pickle
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Dict, Iterable, Iterator, List, Optional, Set, Tuple, Union

from .._compat import batched_calls
from .._config import Settings
from .._numpy import np
from .._payload._broadcast import Broadcast
from .._payload._envelope import with_objects
from .._payload._main_values import PLAIN_TYPES
from .._payload._reducers import Reducers, pack
from .._payload._routes import PICKLE, Route, buffer_route, object_candidate, object_route
from .._payload._unpacking import Reduction
from .._transport._refs import ArrayRef
from ._dumps import DumpTable

#: Argument objects of a call remembered as pickling small (see ObjectPacker.pack): at most this many,
#: weighing (pickled) at most this much, so that objects made anew for each task are not kept for the call.
_SMALL_OBJECTS = 256
_SMALL_BYTES = 8 * 1024**2
#: What an array or buffer that would leave the stream weighs while an object is measured.
_PLACEHOLDER: Reduction = (int, ())


@dataclass(frozen=True)
class Carrier:
    """What the packer needs of its session: its settings and dump table, and how it carries out routes.

    ``new_record`` makes a record of what a payload holds (the session's
    per-task record), which ``reduce_argument``/``reduce_buffer`` fill as they
    carry out routes and ``abandon`` releases; ``route_of`` is the session's
    pure decision for an array (``_routes.input_route`` with its settings);
    ``note_arrow`` is told each Arrow object met (see ``_kept_buffers``).
    Every call into the dump table is made with ``lock`` held.
    """

    settings: Settings
    reducers: Optional[Reducers]
    lock: ContextManager
    dumps: DumpTable
    new_record: Callable[[], Any]
    reduce_argument: Callable[[Any, np.ndarray], Optional[Reduction]]
    reduce_buffer: Callable[[Any, pickle.PickleBuffer], Optional[ArrayRef]]
    abandon: Callable[[Any], None]
    check_open: Callable[[], None]
    route_of: Callable[[np.ndarray], Route]
    note_arrow: Optional[Callable[[Any], None]] = None


class ObjectPacker:
    """One session's large argument objects: which to pickle once per call, and their dumps (through the table)."""

    def __init__(self, carrier: Carrier) -> None:
        self._carrier = carrier
        # Argument objects of this call found to pickle small, by id(), kept (so that the id names
        # nothing else meanwhile) and bounded: an object passed to many tasks is measured once.
        self._small: OrderedDict[int, Tuple[Any, int]] = OrderedDict()  # id -> (object, pickled size)
        self._small_bytes = 0

    def new_generation(self) -> None:
        """A new call: objects measured small may have grown since."""
        self._small.clear()
        self._small_bytes = 0

    def _remember_small(self, argument: Any, nbytes: int) -> None:
        self._small[id(argument)] = (argument, nbytes)
        self._small_bytes += nbytes
        while len(self._small) > _SMALL_OBJECTS or self._small_bytes > _SMALL_BYTES:
            _, (_, dropped) = self._small.popitem(last=False)
            self._small_bytes -= dropped

    def _known_small(self, argument: Any) -> bool:
        entry = self._small.get(id(argument))
        return entry is not None and entry[0] is argument

    def pack(self, arguments: Iterable[Any], record: Any) -> List[Tuple[Any, Union[ArrayRef, bytes]]]:
        """The large argument objects of a task, each with the dump of its payload, pickled once per call.

        An argument that may pickle large (``_routes.object_candidate``) is
        measured first by a pickling pass that changes nothing
        (:meth:`_measure`). Above ``max_nbytes`` (``OBJECT_DUMP``) it is
        pickled for real, alone, into a dump that every task of the call
        passing the same object reads; the task's stream, and the payloads of
        other large objects, name that dump wherever they meet the object, so
        that the worker unpickles it once per task, as one object however many
        places reach it. Smaller candidates stay in the task's stream, and are
        remembered as small for the rest of the call; when measuring gave
        their payload as it is, it goes in the task's envelope, named like a
        dump, so that it is pickled once.
        """
        max_nbytes = self._carrier.settings.max_nbytes
        if max_nbytes is None:
            return []  # nothing leaves the task payloads
        candidates: List[Any] = []
        for argument in _candidates_among(arguments, functools.partial(object_candidate, max_nbytes=max_nbytes)):
            if all(argument is not other for other in candidates):
                candidates.append(argument)
        if not candidates:
            return []
        dumped: Dict[int, Tuple[Any, ArrayRef]] = {}
        new: List[Any] = []
        with self._carrier.lock:
            self._carrier.check_open()
            for candidate in candidates:
                ref = self._carrier.dumps.objects.object_dump(candidate, record.files)
                if ref is not None:
                    dumped[id(candidate)] = (candidate, ref)
                elif not self._known_small(candidate):
                    new.append(candidate)
        large: List[Any] = []
        small: List[Any] = []
        refers: Dict[int, List[int]] = {}
        measured: Dict[int, Optional[bytes]] = {}
        for candidate in new:
            payload, named, final = self._measure(candidate, candidates)
            refers[id(candidate)] = [id(candidates[index]) for index in named]
            measured[id(candidate)] = payload if final else None
            if object_route(len(payload), max_nbytes).kind == PICKLE:
                self._remember_small(candidate, len(payload))
                small.append(candidate)
            else:
                large.append(candidate)
        for candidate in _inner_first(large, refers):
            inner = [dumped[key] for key in refers[id(candidate)] if key in dumped]
            payload = self._final_payload(candidate, candidates, measured, refers, dumped)
            dumped[id(candidate)] = (candidate, self._dump_object(candidate, inner, record, payload))
        objects: List[Tuple[Any, Any]] = list(dumped.values())
        for candidate in small:
            # A small object measured once goes in the task's envelope as it was measured, instead of
            # being pickled again in the stream (an object made anew for each task: pickled once).
            payload = self._final_payload(candidate, candidates, measured, refers, dumped)
            if payload is not None:
                objects.append((candidate, payload))
        return objects

    @staticmethod
    def _final_payload(
        candidate: Any,
        candidates: List[Any],
        measured: Dict[int, Optional[bytes]],
        refers: Dict[int, List[int]],
        dumped: Dict[int, Tuple[Any, ArrayRef]],
    ) -> Optional[bytes]:
        """The measured payload of ``candidate`` naming the dumps of the objects it reaches; None if it cannot be.

        It can when nothing in it left the stream (see :meth:`_measure`) and
        every candidate it reaches was dumped: the envelope then names their
        dumps, and the stream is the one measured (no second pickling).
        """
        payload = measured[id(candidate)]
        if payload is None or any(key not in dumped for key in refers[id(candidate)]):
            return None
        others = [other for other in candidates if other is not candidate]
        if not others:
            return payload
        return with_objects(payload, [dumped[id(other)][1] if id(other) in dumped else None for other in others])

    def _measure(self, candidate: Any, candidates: List[Any]) -> Tuple[bytes, Set[int], bool]:
        """``candidate`` pickled with stand-ins, the other ``candidates`` it reaches (indices), and whether
        that payload is final.

        Nothing is written or counted: each array and buffer that would leave
        the stream (``_routes`` decides, purely) weighs a placeholder, and so
        does each other candidate it reaches. The payload is final when no
        array or buffer left the stream: only the objects it names then
        differ from the real one (see :func:`~memshare._payload._envelope.with_objects`).
        """
        max_nbytes = self._carrier.settings.max_nbytes
        named: Set[int] = set()
        left_the_stream: List[bool] = []

        def measure_array(array: np.ndarray) -> Optional[Reduction]:
            if self._carrier.route_of(array).kind == PICKLE:
                return None
            left_the_stream.append(True)
            return _PLACEHOLDER

        def measure_buffer(buffer: pickle.PickleBuffer) -> Optional[int]:
            view = memoryview(buffer)
            if buffer_route(view.nbytes, view.contiguous, max_nbytes).kind == PICKLE:
                return None
            left_the_stream.append(True)
            return 0

        others = [(other, None) for other in candidates if other is not candidate]
        payload = pack(
            candidate,
            measure_array,
            reducers=self._carrier.reducers,
            reduce_buffer=measure_buffer,
            objects=others,
            on_object=named.add,
        )
        # on_object counted indices into ``others``: turn them into indices into ``candidates``.
        indices = [index for index, other in enumerate(candidates) if other is not candidate]
        return payload, {indices[index] for index in named}, not left_the_stream

    def _dump_object(
        self, candidate: Any, inner: List[Tuple[Any, ArrayRef]], record: Any, payload: Optional[bytes]
    ) -> ArrayRef:
        """Write ``candidate``'s payload to a dump of this call, pickling it unless ``payload`` is given already;
        the ``inner`` objects it reaches, dumped already, are named in it, not copied.

        What its payload needs (the dumps of its arrays and buffers, and of
        the objects it names) is held by its dump's entry, not by the task.
        """
        needs = self._carrier.new_record()
        try:
            for other, _ in inner:
                with self._carrier.lock:
                    self._carrier.dumps.objects.object_dump(other, needs.files)  # held while the candidate's dump lives
            if payload is None:
                payload = pack(
                    candidate,
                    functools.partial(self._carrier.reduce_argument, needs),
                    reducers=self._carrier.reducers,
                    reduce_buffer=functools.partial(self._carrier.reduce_buffer, needs),
                    objects=inner,
                    on_arrow=self._carrier.note_arrow,
                )
            with self._carrier.lock:
                self._carrier.check_open()
                return self._carrier.dumps.objects.dump_object(candidate, payload, needs, record.files)
        except BaseException:
            record.error = record.error or needs.error
            self._carrier.abandon(needs)
            raise


def _inner_first(objects: List[Any], refers: Dict[int, List[int]]) -> List[Any]:
    """``objects`` ordered so that each comes after the ones it reaches (by ``refers``: id -> ids); cycles broken.

    An object dumped after the objects it contains names them instead of
    copying them. In a cycle, the first object met is dumped first and
    contains a copy of the others.
    """
    by_id = {id(obj): obj for obj in objects}
    ordered: List[Any] = []
    state: Dict[int, int] = {}  # 1: being visited, 2: placed

    def visit(key: int) -> None:
        if state.get(key):
            return  # placed, or a cycle: break it here
        state[key] = 1
        for inner in refers.get(key, ()):
            if inner in by_id:
                visit(inner)
        state[key] = 2
        ordered.append(by_id[key])

    for obj in objects:
        visit(id(obj))
    return ordered


#: A built-in container argument with at most this many items offers its items as candidates too.
_FEW_PARTS = 16


def _candidates_among(arguments: Iterable[Any], may_be_large: Callable[[Any], bool], depth: int = 2) -> Iterator[Any]:
    """Each argument that ``may_be_large``, then its items when it is a small built-in container, ``depth`` levels down.

    ``delayed(f)((table, i))`` passes a new tuple to each task: the tuple is
    small once ``table`` in it is named, and ``table`` is the object to
    pickle once per call. A container found small has only small items: they
    are not looked at.
    """
    for argument in arguments:
        kind = type(argument)
        if kind in PLAIN_TYPES or isinstance(argument, Broadcast) or not may_be_large(argument):
            continue  # plain values: the common case of tiny tasks
        yield argument
        if depth == 0:
            continue
        if kind in (tuple, list) and len(argument) <= _FEW_PARTS:
            yield from _candidates_among(argument, may_be_large, depth - 1)
        elif kind is dict and len(argument) <= _FEW_PARTS:
            yield from _candidates_among(argument.values(), may_be_large, depth - 1)


def task_arguments(func: Any, args: tuple, kwargs: dict) -> List[Any]:
    """The objects a task passes to the user's functions (of each call of a joblib batch, of a pool's chunk, or
    ``args`` and ``kwargs``), leaving out those of plain types (numbers, strings, bytes, None).

    A plain loop rather than chained generators: a batch of tiny tasks
    passes hundreds of numbers, and this runs for every batch.
    """
    found: List[Any] = []
    calls = batched_calls(func)
    if calls is not None:
        for _, call_args, call_kwargs in calls:
            for argument in call_args:
                if type(argument) not in PLAIN_TYPES:
                    found.append(argument)
            if call_kwargs:
                for argument in call_kwargs.values():
                    if type(argument) not in PLAIN_TYPES:
                        found.append(argument)
        return found
    arguments_of = getattr(func, "arguments_of", None)  # a chunk of a pool's map (``_feed.MapChunk``)
    if arguments_of is not None and len(args) == 1:
        return [argument for argument in arguments_of(args[0]) if type(argument) not in PLAIN_TYPES]
    for argument in args:
        if type(argument) not in PLAIN_TYPES:
            found.append(argument)
    for argument in kwargs.values():
        if type(argument) not in PLAIN_TYPES:
            found.append(argument)
    return found
