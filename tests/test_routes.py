"""The one decision of how an array travels, tested with no processes and no session.

``input_route`` and ``result_route`` are pure: they read the array and what
the sender holds, and change nothing. Every route is covered here; the
sessions and workers that carry them out are tested elsewhere.
"""

import dataclasses
import mmap

import numpy as np
import pytest

import memshare
from memshare._lifetime._owners import Owner, new_folder_name
from memshare._payload._routes import (
    BY_VALUE,
    DUMP_ARRAY,
    DUMP_BASE,
    HAND_OVER,
    INPUT_FILE,
    OWN_DUMP,
    PICKLE,
    REFERENCE,
    RESULT_FILE,
    Route,
    copied_route,
    input_route,
    result_route,
    view_in_dump,
)
from memshare._transport._backing import find_backing
from memshare._transport._refs import DUMP, SHARED, USER

LIMIT = 1024  # max_nbytes of these tests: arrays of more than 128 float64 are large
LARGE = 1000
NOTHING_HELD = frozenset()


def never_owned(ref):
    return False


def always_owned(ref):
    return True


@pytest.fixture
def user_memmap(tmp_path):
    path = tmp_path / "data.bin"
    np.arange(float(LARGE)).tofile(path)
    array = np.memmap(path, dtype=np.float64, mode="r+")
    yield array
    del array


@pytest.fixture
def dump_memmap(tmp_path):
    """A memmap of a file where a session writes its dumps (a memshare folder, a ``dump-`` name)."""
    folder = tmp_path / new_folder_name(Owner.current())
    folder.mkdir()
    path = folder / "dump-0123456789abcdef.bin"
    np.arange(float(LARGE)).tofile(path)
    array = np.memmap(path, dtype=np.float64, mode="r")
    yield array
    del array


# -- arguments -----------------------------------------------------------------


def test_small_object_and_empty_arrays_are_pickled():
    for array in (np.ones(10), np.array([object()] * LARGE, dtype=object), np.empty((0, LARGE))):
        assert input_route(array, LIMIT, NOTHING_HELD).kind == PICKLE


def test_large_arrays_are_dumped_and_nothing_is_dumped_without_a_threshold():
    array = np.ones(LARGE)
    route = input_route(array, LIMIT, NOTHING_HELD)
    assert route.kind == DUMP_ARRAY and route.source is array and route.mode is None
    assert input_route(array, None, NOTHING_HELD).kind == PICKLE


def test_user_memmaps_and_their_views_go_by_reference_whatever_their_size(user_memmap):
    for array in (user_memmap, user_memmap[::3], user_memmap[:4]):
        route = input_route(array, LIMIT, NOTHING_HELD)
        assert route.kind == REFERENCE and route.ref.kind == USER
        assert route.ref.shape == array.shape and route.ref.strides == array.strides


def test_arrays_over_a_raw_file_mmap_go_by_reference(tmp_path):
    path = tmp_path / "raw.bin"
    path.write_bytes(bytes(8 * LARGE))
    with open(path, "r+b") as handle:
        mapping = mmap.mmap(handle.fileno(), 0)
    array = np.frombuffer(mapping, dtype=np.float64)
    try:
        route = input_route(array, LIMIT, NOTHING_HELD)
        assert route.kind == REFERENCE and route.ref.path == str(path)
    finally:
        del array, route
        mapping.close()


def raw_mapping(path, access=mmap.ACCESS_WRITE):
    with open(path, "r+b") as handle:
        return mmap.mmap(handle.fileno(), 0, access=access)


@pytest.fixture
def raw_file(tmp_path):
    path = tmp_path / "raw.bin"
    np.arange(float(LARGE)).tofile(path)
    return path


def test_a_raw_mmap_is_referenced_with_the_calls_mode_and_copied_for_writable_calls(raw_file):
    # It has no mode of its own (a memmap keeps its own): the file stands for joblib's copy
    # under 'r' and 'c'; under 'r+' the copy's shared writes must not reach the parent's array.
    array = np.frombuffer(raw_mapping(raw_file), dtype=np.float64)
    view = array[LARGE // 4 :]
    view.flags.writeable = False
    for argument in (array, view):
        for mode in ("r", "c"):
            route = input_route(argument, LIMIT, NOTHING_HELD, worker_mode=mode)
            assert route.kind == REFERENCE and route.ref.path == str(raw_file) and route.ref.mode == mode
    assert input_route(array, LIMIT, NOTHING_HELD, worker_mode="r+").kind == DUMP_ARRAY
    route = input_route(view, LIMIT, NOTHING_HELD, worker_mode="r+")
    assert route.kind == DUMP_BASE and route.source is array
    assert input_route(array[:4], LIMIT, NOTHING_HELD, worker_mode="r+").kind == PICKLE
    del array, view, route


@pytest.mark.parametrize("access", ["access", "flags"])
def test_a_private_raw_mmap_is_referenced_only_while_no_page_is_written(raw_file, access):
    if access == "access":
        mapping = raw_mapping(raw_file, mmap.ACCESS_COPY)
    else:
        with open(raw_file, "r+b") as handle:
            mapping = mmap.mmap(handle.fileno(), 0, flags=mmap.MAP_PRIVATE)
    array = np.frombuffer(mapping, dtype=np.float64)
    assert find_backing(array) is None  # its private pages may differ from the file
    assert input_route(array, LIMIT, NOTHING_HELD).kind == DUMP_ARRAY  # nothing known: copied
    written = input_route(array, LIMIT, NOTHING_HELD, copy_on_write_unwritten=lambda a: False)
    assert written.kind == DUMP_ARRAY and written.mode is None  # the copy is mapped with the call's mode
    for mode in ("r", "c"):
        route = input_route(array, LIMIT, NOTHING_HELD, copy_on_write_unwritten=lambda a: True, worker_mode=mode)
        assert route.kind == REFERENCE and route.ref.path == str(raw_file) and route.ref.mode == mode
    unwritten_r_plus = input_route(array, LIMIT, NOTHING_HELD, copy_on_write_unwritten=lambda a: True, worker_mode="r+")
    assert unwritten_r_plus.kind == DUMP_ARRAY
    del array, route, written, unwritten_r_plus


def test_a_raw_mmap_split_in_several_entries_of_the_maps_is_still_one_file(raw_file):
    mapping = raw_mapping(raw_file)
    mapping.madvise(mmap.MADV_RANDOM, mmap.PAGESIZE, mmap.PAGESIZE)  # the kernel splits the mapping there
    with open("/proc/self/maps") as maps:
        assert sum(line.rstrip().endswith(str(raw_file)) for line in maps) >= 2
    array = np.frombuffer(mapping, dtype=np.float64)
    for start in (0, mmap.PAGESIZE // 8 - 1, mmap.PAGESIZE // 8 + 1):
        ref = find_backing(array[start:])
        assert ref is not None and ref.path == str(raw_file) and ref.offset == 8 * start
    del array, ref


def test_copy_on_write_memmaps_are_dumped_and_mapped_copy_on_write(user_memmap):
    writable = np.memmap(user_memmap.filename, dtype=np.float64, mode="c")
    route = input_route(writable, LIMIT, NOTHING_HELD)
    assert route.kind == DUMP_ARRAY and route.mode == "c"
    read_only = writable[:]
    read_only.flags.writeable = False
    assert input_route(read_only, LIMIT, NOTHING_HELD).mode == "r"
    assert input_route(writable[:4], LIMIT, NOTHING_HELD).kind == PICKLE  # small: by value, as any array


def test_a_view_covering_half_of_a_contiguous_base_is_a_view_of_the_base_dump():
    flat = np.arange(float(LARGE))
    base = flat.reshape(20, 50)
    for view in (base.T, base[10:], base[:, 1:]):
        route = input_route(view, LIMIT, NOTHING_HELD)
        assert route.kind == DUMP_BASE and route.source is flat and route.ref is None  # the root is dumped


def test_a_view_covering_less_than_half_of_its_base_is_dumped_alone():
    base = np.arange(float(4 * LARGE))
    view = base[: LARGE + 1]
    route = input_route(view, LIMIT, NOTHING_HELD)
    assert route.kind == DUMP_ARRAY and route.source is view


def test_view_in_dump_keeps_the_views_geometry_in_the_bases_file(user_memmap):
    base = np.arange(float(LARGE)).reshape(20, 50)
    base_ref = input_route(user_memmap, LIMIT, NOTHING_HELD).ref  # any file reference with offset 0
    for view in (base.T, base[10:, ::-1], base[:, 1:].view(np.int64)):
        ref = view_in_dump(view, base, base_ref)
        assert (ref.shape, ref.strides, ref.dtype) == (view.shape, view.strides, view.dtype)
        assert ref.path == base_ref.path and ref.offset == view.__array_interface__["data"][0] - base.ctypes.data


def test_shared_arrays_and_their_views_go_by_reference(shm_dir):
    shared = memshare.empty(LARGE)
    try:
        for array in (shared, shared[1:3]):
            route = input_route(array, LIMIT, NOTHING_HELD)
            assert route.kind == REFERENCE and route.ref.kind == SHARED
    finally:
        del shared, array


def test_a_view_of_a_dump_the_session_holds_is_a_view_of_that_dump(dump_memmap):
    held = {dump_memmap.filename}
    route = input_route(dump_memmap[::2], LIMIT, held)
    assert route.kind == OWN_DUMP and route.ref.kind == DUMP and route.source is None
    assert route.ref.path == dump_memmap.filename
    # Another session's dump (a nested call's input) is a plain reference.
    assert input_route(dump_memmap[::2], LIMIT, NOTHING_HELD).kind == REFERENCE


def test_an_array_to_dump_is_asked_to_be_held_once_when_the_settings_allow():
    array, base = np.ones(LARGE), np.arange(float(LARGE))
    for route in (
        input_route(array, LIMIT, NOTHING_HELD, promote=True, worker_mode="r"),
        input_route(base.reshape(20, 50).T, LIMIT, NOTHING_HELD, promote=True, worker_mode="c"),
    ):
        assert route.hold_once and route.not_held_once is None
    assert input_route(array, LIMIT, NOTHING_HELD).hold_once is False  # promote=False: not asked, nothing to log
    assert input_route(array, LIMIT, NOTHING_HELD).not_held_once is None


def test_holding_once_is_refused_with_its_reason_for_workers_that_map_writable():
    route = input_route(np.ones(LARGE), LIMIT, NOTHING_HELD, promote=True, worker_mode="r+")
    assert route.kind == DUMP_ARRAY and not route.hold_once
    assert "mmap_mode='r+'" in route.not_held_once


def test_a_copy_on_write_memmaps_copy_is_never_held_once(user_memmap):
    cow = np.memmap(user_memmap.filename, dtype=np.float64, mode="c")
    route = input_route(cow, LIMIT, NOTHING_HELD, promote=True, worker_mode="r")
    assert route.kind == DUMP_ARRAY and route.mode == "c"
    assert not route.hold_once and route.not_held_once is None


def _same_route(first, second):
    """Every field equal, ``source`` (not compared by the dataclass: an array) by identity."""
    return all(
        (getattr(first, f.name) is getattr(second, f.name))
        if f.name == "source"
        else (getattr(first, f.name) == getattr(second, f.name))
        for f in dataclasses.fields(Route)
    )


def _state(array):
    """What deciding must leave as it is: the array's memory, geometry, flags and chain of bases."""
    bases = []
    base = array.base
    while base is not None:
        bases.append(id(base))
        base = getattr(base, "base", None)
    flags = {name: getattr(array.flags, name) for name in ("writeable", "owndata", "c_contiguous", "f_contiguous")}
    return (array.__array_interface__, flags, bases, array.tobytes())


def test_deciding_changes_nothing(dump_memmap, user_memmap):
    held = {dump_memmap.filename}
    flat = np.arange(float(LARGE))
    arrays = [np.ones(LARGE), np.ones(10), flat.reshape(20, 50).T, dump_memmap[::2], user_memmap[1:]]
    for array in arrays:
        before = _state(array)
        for promote, mode in ((False, "r"), (True, "r"), (True, "r+")):
            first = input_route(array, LIMIT, held, promote=promote, worker_mode=mode)
            second = input_route(array, LIMIT, held, promote=promote, worker_mode=mode)
            assert _same_route(first, second), (first, second)
            assert first.source is None or first.source is array or first.source is flat  # never a copy
        assert _state(array) == before
    assert held == {dump_memmap.filename}


# -- results -------------------------------------------------------------------


def test_small_object_and_empty_results_are_pickled():
    for array in (np.ones(10), np.array([object()] * LARGE, dtype=object), np.empty((LARGE, 0))):
        assert result_route(array, LIMIT, never_owned).kind == BY_VALUE


def test_large_results_go_to_a_result_file_unless_there_is_no_threshold():
    assert result_route(np.ones(LARGE), LIMIT, never_owned).kind == RESULT_FILE
    assert result_route(np.ones(LARGE), None, never_owned).kind == BY_VALUE


def test_results_viewing_a_user_file_go_by_reference(user_memmap):
    route = result_route(user_memmap[2:], LIMIT, never_owned)
    assert route.kind == REFERENCE and route.ref.kind == USER


def test_results_over_a_private_raw_mmap_are_copied(raw_file):
    # Written or not: the parent gets the worker's values, never the file's.
    array = np.frombuffer(raw_mapping(raw_file, mmap.ACCESS_COPY), dtype=np.float64)
    assert result_route(array, LIMIT, never_owned).kind == RESULT_FILE
    array[0] = -1.0
    assert result_route(array, LIMIT, never_owned).kind == RESULT_FILE
    assert result_route(array[:4], LIMIT, never_owned).kind == BY_VALUE
    del array


def test_views_of_a_dump_the_task_was_not_given_come_back_as_copies(dump_memmap):
    assert result_route(dump_memmap, LIMIT, never_owned).kind == RESULT_FILE
    assert result_route(dump_memmap[:4], LIMIT, never_owned).kind == BY_VALUE
    assert result_route(dump_memmap, LIMIT, never_owned, given=never_owned).kind == RESULT_FILE


def test_large_views_of_a_dump_the_task_was_given_come_back_as_that_file(dump_memmap):
    for view in (dump_memmap, dump_memmap[: LARGE // 2], dump_memmap[::-3]):
        route = result_route(view, LIMIT, never_owned, given=always_owned)
        assert route.kind == INPUT_FILE
        assert route.ref == find_backing(view) and route.ref.kind == DUMP
    # Small ones are pickled; large ones that would keep a file of more than 8 times their size alive are copied.
    assert result_route(dump_memmap[:4], LIMIT, never_owned, given=always_owned).kind == BY_VALUE
    assert result_route(dump_memmap[::10], 512, never_owned, given=always_owned).kind == RESULT_FILE
    assert result_route(dump_memmap[::8], 512, never_owned, given=always_owned).kind == INPUT_FILE


def test_a_copy_on_write_view_of_a_dump_the_task_was_given_comes_back_as_that_file_only_unwritten(dump_memmap):
    # A torch argument is always mapped so, and NumPy's under mmap_mode="c": unwritten, its file is its content.
    private = np.memmap(dump_memmap.filename, dtype=np.float64, mode="c")
    asked = []

    def unwritten(array):
        asked.append(array)
        return True

    route = result_route(private[: LARGE // 2], LIMIT, never_owned, always_owned, unwritten)
    assert route.kind == INPUT_FILE and route.ref.kind == DUMP and route.ref.mode == "c"
    assert len(asked) == 1
    assert result_route(private, LIMIT, never_owned, always_owned, lambda array: False).kind == RESULT_FILE
    assert result_route(private, LIMIT, never_owned, never_owned, unwritten).kind == RESULT_FILE  # not given
    assert result_route(private, LIMIT, never_owned, always_owned).kind == RESULT_FILE  # not known: copied
    assert result_route(private[:4], LIMIT, never_owned, always_owned, unwritten).kind == BY_VALUE
    del private


def test_shared_arrays_are_handed_over_by_their_owner_and_referenced_by_others(shm_dir):
    shared = memshare.empty(LARGE)
    try:
        handed = result_route(shared, LIMIT, always_owned)
        assert handed.kind == HAND_OVER and handed.ref.kind == SHARED
        referenced = result_route(shared[:4], LIMIT, never_owned)
        assert referenced.kind == REFERENCE and referenced.ref.kind == SHARED
    finally:
        del shared


def test_a_result_that_must_be_copied_is_a_file_when_large():
    assert copied_route(np.ones(LARGE), LIMIT).kind == RESULT_FILE
    assert copied_route(np.ones(4), LIMIT).kind == BY_VALUE
    assert copied_route(np.ones(LARGE), None).kind == BY_VALUE
