"""Round trips through the sharing policy, in one process (fast, exhaustive).

The worker side runs in-process here: ``run_task`` maps the files exactly as
a worker would. Cross-process behaviour is tested in test_pool/test_backend.
"""

import mmap
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memshare._config import Settings
from memshare._parent._session import Session
from memshare._worker._run import run_task

DTYPES = [
    "<f8",
    ">f8",
    "<i4",
    ">i2",
    "u1",
    "?",
    "<c16",
    ">c8",
    "<f2",
    "M8[s]",
    "m8[ms]",
    "S5",
    "<U3",
    [("a", "<i4"), ("b", ">f8")],
]


def describe(x):
    return {
        "type": type(x).__name__,
        "shape": x.shape,
        "strides": x.strides,
        "dtype": x.dtype.str if x.dtype.fields is None else x.dtype.descr,
        "c": x.flags.c_contiguous,
        "f": x.flags.f_contiguous,
        "bytes": np.ascontiguousarray(x).tobytes(),
        "aligned": x.ctypes.data % 64 if x.size else 0,
        "writeable": x.flags.writeable,
    }


def roundtrip(session, func, *args):
    ok, value = session.finish(run_task(session.pack_task(func, args)))
    if not ok:
        raise value
    return value


@pytest.fixture
def session(shm_dir):
    s = Session(Settings(max_nbytes=0))
    yield s
    s.close()


def random_array(dtype, shape, seed=0):
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * np.dtype(dtype).itemsize, dtype=np.uint8)
    array = raw.view(dtype).reshape(shape)
    if np.dtype(dtype).kind in "fc":
        array[np.isnan(array)] = 0
    if np.dtype(dtype).kind == "U":
        array = np.full(shape, "héé", dtype=dtype)
    if np.dtype(dtype).kind == "?":
        array = raw.astype(bool).reshape(shape)
    return array


views = st.sampled_from(["all", "T", "rev", "step2", "col", "neg_step_T"])


def take_view(array, how):
    if array.ndim == 0 or how == "all":
        return array
    if how == "T":
        return array.T
    if how == "rev":
        return array[::-1]
    if how == "step2":
        return array[::2]
    if how == "col":
        return array[..., 1:] if array.shape[-1] > 1 else array
    return array[::-2].T


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(1, 5), min_size=0, max_size=3).map(tuple),
    order=st.sampled_from("CF"),
    how=views,
)
def test_dumped_arrays_arrive_with_same_bytes_dtype_and_order(session, dtype, shape, order, how):
    array = take_view(np.asarray(random_array(dtype, shape), order=order), how)
    got = roundtrip(session, describe, array)
    want = describe(array)
    assert got["bytes"] == want["bytes"]
    assert got["dtype"] == want["dtype"] and got["shape"] == want["shape"]
    assert got["type"] == "memmap"
    # A dump starts a page-aligned file; a large view may travel as a view into
    # its base's dump, keeping its own offset, so it is element-aligned there.
    if how == "all":
        assert got["aligned"] == 0
    assert got["aligned"] % array.dtype.alignment == 0
    # Contiguous layouts are kept as they are; other layouts arrive C-ordered when
    # dumped alone, or with their own strides as a view into their base's dump.
    if want["c"] or want["f"]:
        assert (got["c"], got["f"]) == (want["c"], want["f"])
    else:
        assert got["c"] or got["strides"] == want["strides"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    dtype=st.sampled_from(["<f8", ">i4", "u1", "<c16", [("a", "<i4"), ("b", ">f8")]]),
    shape=st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple),
    offset_pages=st.integers(0, 3),
    extra=st.integers(0, 7),
    how=views,
)
def test_memmap_views_arrive_with_identical_geometry(session, tmp_path, dtype, shape, offset_pages, extra, how):
    path = tmp_path / f"user-{os.getpid()}.dat"
    offset = offset_pages * mmap.ALLOCATIONGRANULARITY + extra * np.dtype(dtype).itemsize
    path.write_bytes(b"\0" * (offset + int(np.prod(shape)) * np.dtype(dtype).itemsize))
    memmap = np.memmap(path, dtype=dtype, mode="r+", offset=offset, shape=shape)
    memmap[...] = random_array(dtype, shape)
    array = take_view(memmap, how)
    got = roundtrip(session, describe, array)
    want = describe(array)
    assert got["bytes"] == want["bytes"]
    assert (got["shape"], got["strides"], got["dtype"]) == (want["shape"], want["strides"], want["dtype"])
    assert (got["c"], got["f"]) == (want["c"], want["f"])
    assert session.stats.arrays_dumped == 0  # referenced, never copied
    del memmap, array


def test_transposed_2d_memmap_view_is_not_reshaped(session, tmp_path):
    memmap = np.memmap(tmp_path / "m.dat", dtype="f8", mode="w+", shape=(3, 4))
    memmap[:] = np.arange(12).reshape(3, 4)
    got = roundtrip(session, lambda x: np.asarray(x).tolist(), memmap.T)
    assert got == memmap.T.tolist()


def test_raw_mmap_arrays_are_referenced(session, tmp_path):
    path = tmp_path / "raw.bin"
    path.write_bytes(np.arange(100, dtype="<i8").tobytes())
    with open(path, "r+b") as handle:
        raw = mmap.mmap(handle.fileno(), 0)
    array = np.frombuffer(raw, dtype="<i8")[10:50:3]
    assert roundtrip(session, lambda x: x.tolist(), array) == array.tolist()
    assert session.stats.arrays_dumped == 0 and session.stats.arrays_referenced == 1
    del array


def test_zero_d_and_empty_arrays(session):
    assert roundtrip(session, lambda x: x.item(), np.array(3.5)) == 3.5
    empty = np.zeros((0, 4))
    assert roundtrip(session, lambda x: x.shape, empty) == (0, 4)
    assert session.stats.arrays_dumped == 1  # the 0-d array (8 bytes > 0); the empty one is pickled


def test_object_arrays_are_pickled_not_dumped(session):
    objects = np.array([{"a": 1}, [1, 2], "x"] * 1000, dtype=object)
    assert roundtrip(session, lambda x: (x[0], type(x).__name__), objects) == ({"a": 1}, "ndarray")
    assert session.stats.arrays_dumped == 0


def test_threshold_edges(shm_dir):
    session = Session(Settings(max_nbytes=800))
    try:
        roundtrip(session, len, np.zeros(100))  # exactly 800 bytes: pickled
        assert session.stats.arrays_dumped == 0
        roundtrip(session, len, np.zeros(801, dtype=np.uint8))  # one byte more: dumped
        assert session.stats.arrays_dumped == 1
    finally:
        session.close()


def test_dumping_disabled_pickles_everything(shm_dir):
    session = Session(Settings(max_nbytes=None))
    try:
        assert roundtrip(session, lambda x: type(x).__name__, np.zeros(10**6)) == "ndarray"
        assert session.stats.arrays_dumped == 0 and not os.listdir(shm_dir)
    finally:
        session.close()


def test_same_array_object_dumped_once_and_fresh_arrays_never_alias(session):
    big = np.arange(1000.0)
    for _ in range(100):
        roundtrip(session, len, big)
    assert session.stats.arrays_dumped == 1
    sums = [roundtrip(session, lambda x: float(x.sum()), np.full(1000, float(i))) for i in range(50)]
    assert sums == [1000.0 * i for i in range(50)]


def test_in_place_mutation_between_generations_is_seen(session):
    data = np.zeros(1000)
    assert roundtrip(session, lambda x: float(x.sum()), data) == 0.0
    data[5] = -0.0  # bitwise change that compares equal: must still be re-sent
    data[7] = 2.0
    session.new_generation()
    assert roundtrip(session, lambda x: float(x[7]), data) == 2.0
    session.new_generation()
    roundtrip(session, len, data)
    assert session.stats.arrays_dumped == 2  # unchanged on the third use: no new write


def test_pandas_and_sparse_buffers_are_shared(session):
    pd = pytest.importorskip("pandas")
    sparse = pytest.importorskip("scipy.sparse")
    frame = pd.DataFrame({"a": np.arange(10000.0), "b": np.arange(10000)})
    got = roundtrip(session, lambda f: float(f["a"].sum()) + float(f["b"].sum()), frame)
    assert got == float(frame["a"].sum() + frame["b"].sum())
    matrix = sparse.random(300, 300, density=0.1, format="csr", random_state=0)
    assert roundtrip(session, lambda m: float(m.sum()), matrix) == pytest.approx(matrix.sum())
    assert session.stats.arrays_dumped >= 4  # frame columns + data/indices/indptr


def test_views_covering_most_of_a_base_share_one_dump(session):
    base = np.arange(200_000.0).reshape(400, 500)
    views = [base.T, base[::-1], base[:, 1:], base.reshape(500, 400), base.view(np.int64)]
    for view in views:
        got = roundtrip(session, describe, view)
        want = describe(view)
        assert (got["bytes"], got["shape"], got["strides"], got["dtype"]) == (
            want["bytes"],
            want["shape"],
            want["strides"],
            want["dtype"],
        )
    for _ in range(10):
        roundtrip(session, len, base.T)  # a new view object each time
    assert session.stats.arrays_dumped == 1 and session.stats.bytes_dumped == base.nbytes


def test_small_views_of_big_arrays_are_dumped_alone(session):
    base = np.arange(1_000_000.0)
    assert roundtrip(session, lambda x: float(x.sum()), base[:1000]) == float(base[:1000].sum())
    assert session.stats.bytes_dumped == 8000  # not the 8 MB base


def write_privately(x):
    before = x[0]
    x[1] = -5.0  # copy-on-write: private to this task
    return type(x).__name__, x.mode, bool(x.flags.writeable), float(before), float(x[1])


def test_copy_on_write_memmap_is_copied_and_mapped_copy_on_write(session, tmp_path):
    path = tmp_path / "cow.dat"
    np.arange(1000.0).tofile(path)
    cow = np.memmap(path, dtype="f8", mode="c", shape=(1000,))
    cow[0] = 42.0  # a private page: the file still holds 0.0
    assert roundtrip(session, write_privately, cow) == ("memmap", "c", True, 42.0, -5.0)
    assert roundtrip(session, write_privately, cow[10:]) == ("memmap", "c", True, 10.0, -5.0)
    assert cow[1] == 1.0 and np.fromfile(path)[1] == 1.0  # the task's writes stayed in the task
    assert session.stats.arrays_dumped == 2 and session.stats.arrays_referenced == 0  # copied, not referenced
    readonly = cow[:500]
    readonly.flags.writeable = False
    assert roundtrip(session, lambda x: bool(x.flags.writeable), readonly) is False
    del cow, readonly


def memmap_attributes(x):
    return str(x.filename), x.offset, x.mode


def slice_of_own_memmap(path, offset):
    return np.memmap(path, dtype="u1", mode="r+", offset=offset, shape=(100,))[3:50]


@pytest.mark.parametrize("mode", ["r+", "r", "w+"])
def test_memmaps_rebuilt_from_references_report_numpys_filename_offset_and_mode(session, tmp_path, mode):
    path = tmp_path / "offset.dat"
    if mode != "w+":
        path.write_bytes(bytes(range(256)) * 40)
    memmap = np.memmap(path, dtype="u1", mode=mode, offset=4097, shape=(100,))
    if mode == "w+":
        memmap[:] = np.arange(100)
    view = memmap[3:50]
    expected_mode = "r+" if mode == "w+" else mode  # joblib's choice too: reopening must not zero the file
    assert (str(view.filename), view.offset) == (str(path), 4097)  # numpy: a slice keeps its memmap's offset
    # An input in a worker, and a view of it sent back as a result.
    assert roundtrip(session, memmap_attributes, view) == (str(path), 4097, expected_mode)
    assert roundtrip(session, memmap_attributes, np.asarray(view)) == (str(path), 4097, expected_mode)
    back = roundtrip(session, lambda x: x[2:], view)
    assert (type(back), str(back.filename), back.offset, back.mode) == (np.memmap, str(path), 4097, expected_mode)
    np.testing.assert_array_equal(back, memmap[5:50])
    # A result sliced from a memmap the task opened itself.
    result = roundtrip(session, slice_of_own_memmap, str(path), 4097)
    assert (str(result.filename), result.offset, result.mode) == (str(path), 4097, "r+")
    reopened = np.memmap(result.filename, dtype="u1", mode="r", offset=result.offset, shape=(100,))
    np.testing.assert_array_equal(reopened[3:50], result)
    del memmap, view, back, result, reopened


class RaisesWhenPickled:
    def __init__(self, exc):
        self.exc = exc

    def __reduce__(self):
        raise self.exc


@pytest.mark.parametrize("exc", [RuntimeError("no way"), ValueError("bad state"), OSError(5, "device gone")])
def test_any_exception_while_pickling_an_argument_is_an_unpicklable_argument_error(session, exc):
    import pickle

    import memshare

    with pytest.raises(memshare.UnpicklableArgumentError, match=f"{type(exc).__name__}: .*picklable") as info:
        session.pack_task(len, (np.ones(1000), RaisesWhenPickled(exc)))
    assert isinstance(info.value, pickle.PicklingError) and isinstance(info.value, TypeError)
    assert info.value.__cause__ is exc
    with pytest.raises(KeyboardInterrupt):  # not an error of the argument: raised as itself
        session.pack_task(len, (RaisesWhenPickled(KeyboardInterrupt()),))


def test_no_room_for_an_input_is_raised_as_itself_not_as_unpicklable(session, monkeypatch):
    import errno

    import memshare
    import memshare._lifetime._folders as folders_module

    def no_room(fd, offset, nbytes):
        raise OSError(errno.ENOSPC, "no space left")

    monkeypatch.setattr(folders_module, "reserve", no_room)
    with pytest.raises(memshare.SharedMemoryFullError, match="no room for a") as info:
        session.pack_task(len, (np.ones(1000),))
    assert not isinstance(info.value, memshare.UnpicklableArgumentError)
