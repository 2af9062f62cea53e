"""CPU torch tensors travel as the NumPy arrays they share memory with: written once, mapped copy-on-write.

A task gets a ``torch.Tensor`` of the sender's dtype, shape, strides and
values; its writes reach neither the parent's tensor nor another task's.
Large tensor results come back through result files. Tensors that torch
pickles with state of their own (grad, sparse, bfloat16, subclasses,
conjugate bits) are pickled by torch, as before. memshare never imports torch.
"""

from __future__ import annotations

import gc
import os
import zlib

import numpy as np
import pytest
from conftest import made_where_glibc_maps_it, mappings_of, memfds_held, memshare_entries

import memshare
from memshare import MemmappingPool, Parallel, delayed

torch = pytest.importorskip(
    "torch",
    reason="torch tensors are tested only where torch is installed (pip install torch==2.13.0, a CPU build "
    "on the main environment's Python 3.11 x86_64; elsewhere pip would download a CUDA build of several GB)",
)

LIMIT = "1M"
TRANSPORTS = ["Parallel", "MemmappingPool"]
TASKS = 8


def big_tensor(rows: int = 4096, columns: int = 4096, seed: int = 0):
    """A float32 tensor of random values (64 MiB by default); above 32 MiB, a malloc chunk of its own (see conftest)."""
    from memshare._parent import _held_memory

    def make():
        return torch.rand(rows, columns, generator=torch.Generator().manual_seed(seed))

    def unfit(tensor):
        return _held_memory.mmapped_chunk(tensor.data_ptr(), tensor.numel() * tensor.element_size(), aligned=True)

    nbytes = rows * columns * 4
    if nbytes <= 32 * 1024**2:  # glibc may serve it from its heap by rule (its mmap threshold rises up to 32 MiB)
        return make()
    return made_where_glibc_maps_it(make, unfit, nbytes)


def checksum(tensor) -> int:
    """crc32 of the tensor's values in C order (any layout)."""
    return zlib.crc32(memoryview(tensor.contiguous().numpy()).cast("B"))


def geometry(tensor) -> tuple:
    return type(tensor).__name__, str(tensor.dtype), tuple(tensor.shape), tuple(tensor.stride())


def look_then_write(tensor, index: int) -> tuple:
    """What the task sees before writing, then a write into its own tensor (which must not crash)."""
    seen = geometry(tensor), checksum(tensor)
    tensor[index] = -1.0 - index
    return seen + (float(tensor[index].flatten()[0]),)


def run(transport: str, func, items, max_nbytes=LIMIT) -> list:
    if transport == "Parallel":
        return Parallel(n_jobs=2, max_nbytes=max_nbytes, batch_size=1)(delayed(func)(*item) for item in items)
    with MemmappingPool(2, max_nbytes=max_nbytes) as pool:
        return pool.starmap(func, items, chunksize=1)


def written_once(stats) -> bool:
    """The tensor's memory was written to shared memory once (dumped or held once), not pickled as an object."""
    return stats["arrays_dumped"] + stats["arrays_held_once"] == 1 and stats["objects_dumped"] == 0


def leaks(shm_dir) -> list:
    return memshare_entries(shm_dir) + memfds_held()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_large_tensor_reaches_eight_tasks_written_once_and_their_writes_stay_theirs(transport):
    X = big_tensor()
    before = checksum(X)
    seen = run(transport, look_then_write, [(X, i) for i in range(TASKS)])
    assert written_once(memshare.last_call_stats()), memshare.last_call_stats()
    for i, (got, crc, after_write) in enumerate(seen):
        # Every task saw the parent's values: no earlier task's write (two workers run four tasks each).
        assert got == geometry(X) and crc == before, i
        assert after_write == -1.0 - i
    assert checksum(X) == before  # no task's write reached the parent
    del X, seen
    gc.collect()
    assert memfds_held() == []


VIEWS = {
    "transpose": lambda X: X.T,
    "every other column": lambda X: X[:, ::2],
    "a quarter of the rows": lambda X: X[::4],
    "offset": lambda X: X[1:, 3:],
}


def see(tensor) -> tuple:
    return geometry(tensor), checksum(tensor)


@pytest.mark.parametrize("make", list(VIEWS.values()), ids=list(VIEWS))
def test_a_view_keeps_its_strides_and_values(shm_dir, make):
    X = big_tensor()
    view = make(X)
    seen = run("Parallel", see, [(view,)] * 3)
    assert seen == [(geometry(view), checksum(view))] * 3
    stats = memshare.last_call_stats()
    assert stats["arrays_dumped"] == 1 and stats["objects_dumped"] == 0, stats
    del X, view
    assert leaks(shm_dir) == []


def test_a_tensor_from_numpy_travels_written_once_and_stays_the_parents(shm_dir):
    array = np.random.default_rng(0).random((2048, 2048))  # 32 MiB
    tensor = torch.from_numpy(array)
    expected = array.copy()
    seen = run("Parallel", look_then_write, [(tensor, i) for i in range(4)])
    assert written_once(memshare.last_call_stats()), memshare.last_call_stats()
    assert [s[:2] for s in seen] == [(geometry(tensor), checksum(tensor))] * 4
    np.testing.assert_array_equal(array, expected)
    del tensor, array
    assert leaks(shm_dir) == []


@pytest.mark.parametrize("dtype", ["int64", "uint8", "bool", "float16", "float64", "complex64", "uint16"])
def test_each_dtype_numpy_has_comes_back_alike(shm_dir, dtype):
    dtype = getattr(torch, dtype)
    tensor = (torch.arange(2 * 1024**2) % 7).to(dtype)
    seen = run("Parallel", see, [(tensor,)] * 2)
    assert seen == [(geometry(tensor), checksum(tensor))] * 2
    assert memshare.last_call_stats()["arrays_dumped"] == 1
    assert leaks(shm_dir) == []


def filled(value: float):
    return torch.full((1024, 1024), float(value))  # 4 MiB


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_large_tensor_results_come_back_as_tensors_through_shared_memory(shm_dir, transport):
    results = run(transport, filled, [(i,) for i in range(TASKS)])
    assert [geometry(r) for r in results] == [geometry(filled(0))] * TASKS
    assert [float(r[5, 5]) for r in results] == [float(i) for i in range(TASKS)]
    stats = memshare.last_call_stats()
    assert stats["results_by_reference"] == TASKS, stats
    paths = [path for path, _ in mappings_of([r.data_ptr() for r in results])]
    assert all("result-" in path for path in paths), paths
    results[0][0, 0] = 42.0  # the parent's own writable memory
    assert float(results[0][0, 0]) == 42.0
    del results
    gc.collect()
    assert leaks(shm_dir) == []


def whole(tensor):
    return tensor


def first_half(tensor):
    return tensor[: tensor.shape[0] // 2]


def strided_tail(tensor):
    return tensor[tensor.shape[0] // 4 :: 3].T  # a tail, every third row, transposed


RETURNS = {"whole": whole, "first half": first_half, "strided tail": strided_tail}


def file_at(address: int) -> tuple:
    """(inode, name, permissions) of this process's mapping that holds ``address``."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(None, 5)
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if low <= address < high:
                return int(fields[4]), (fields[5].strip() if len(fields) > 5 else ""), fields[1]
    return 0, "", ""


@pytest.mark.parametrize("view", list(RETURNS), ids=list(RETURNS))
@pytest.mark.parametrize("holding", ["held", "dumped"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_task_returning_its_tensor_gives_back_its_file_mapped_copy_on_write(
    default_location, monkeypatch, transport, holding, view
):
    monkeypatch.setenv("MEMSHARE_PROMOTE", "1" if holding == "held" else "0")
    X = big_tensor()  # 64 MiB: a malloc chunk of its own, which can be held once
    original = X.clone()
    func = RETURNS[view]
    expected = func(original)
    results = run(transport, func, [(X,)] * TASKS)
    stats = memshare.last_call_stats()
    assert stats["results_of_inputs"] == TASKS, stats
    assert stats["bytes_results_of_inputs"] == TASKS * expected.numel() * 4, stats
    assert stats["results_by_reference"] == 0, stats  # no result file was made
    assert [geometry(r) for r in results] == [geometry(expected)] * TASKS
    assert all(torch.equal(r, expected) for r in results)
    # Each result maps the argument's own file privately, one file for all: no copy.
    files = [file_at(r.data_ptr()) for r in results]
    assert len({inode for inode, _, _ in files}) == 1, files
    kind = "held" if holding == "held" else "dump"
    assert all(f"memshare-{kind}-" in name and perms.endswith("p") for _, name, perms in files), files
    if holding == "held":
        assert files[0][0] == file_at(X.data_ptr() + 2 * os.sysconf("SC_PAGESIZE"))[0]  # X's whole pages map it
    # Copy-on-write: a write into a result reaches neither the parent's tensor nor another result...
    results[0].fill_(-1.0)
    assert torch.equal(X, original) and torch.equal(results[1], expected)
    # ...and a later write into the parent's tensor reaches no result.
    X.fill_(-2.0)
    assert all(torch.equal(r, expected) for r in results[1:])
    del X, results
    gc.collect()
    assert memfds_held() == []


def write_then_return(tensor, index: int):
    tensor[index] = -1.0 - index
    return tensor


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_task_returning_its_tensor_after_writing_into_it_gives_back_what_it_wrote(default_location, transport):
    X = big_tensor()
    original = X.clone()
    results = run(transport, write_then_return, [(X, i) for i in range(TASKS)])
    stats = memshare.last_call_stats()
    assert stats["results_of_inputs"] == 0 and stats["results_by_reference"] == TASKS, stats
    for i, result in enumerate(results):
        expected = original.clone()
        expected[i] = -1.0 - i
        assert torch.equal(result, expected), i
    assert torch.equal(X, original)
    del X, results
    gc.collect()
    assert memfds_held() == []


def summary(tensor) -> tuple:
    """Kind, dtype, shape, grad, layout, conjugate bit and values of any tensor, as torch's pickle keeps them."""
    dense = tensor.detach().to_dense() if tensor.layout != torch.strided else tensor.detach()
    dense = dense.resolve_conj()
    values = torch.view_as_real(dense) if dense.is_complex() else dense
    crc = zlib.crc32(values.to(torch.float64).contiguous().numpy().tobytes())
    return (type(tensor).__name__, str(tensor.dtype), tuple(tensor.shape), tensor.requires_grad, str(tensor.layout),
            tensor.is_conj(), crc)  # fmt: skip


def grad_tensor():
    return big_tensor(1024, 1024).requires_grad_()


def with_attribute():
    tensor = big_tensor(1024, 1024)
    tensor.note = "kept"
    return tensor


PICKLED_BY_TORCH = {
    "requires grad": grad_tensor,
    "bfloat16": lambda: big_tensor(1024, 1024).to(torch.bfloat16),
    "conjugate bit": lambda: torch.complex(big_tensor(512, 1024), big_tensor(512, 1024, 1)).conj(),
    "attribute": with_attribute,
}
#: Pickled by torch as objects made of plain tensors, which then travel as arrays.
MADE_OF_TENSORS = {
    "sparse": lambda: big_tensor(1024, 1024).relu().to_sparse(),
    "nn.Parameter": lambda: torch.nn.Parameter(big_tensor(1024, 1024), requires_grad=False),
}


def both_ways(make) -> tuple:
    """A tensor sent to two tasks and made by two tasks: the figures of each call; the tensors must survive."""
    tensor = make()
    seen = run("Parallel", summary, [(tensor,)] * 2)
    assert seen == [summary(tensor)] * 2
    sent = memshare.last_call_stats()
    back = Parallel(n_jobs=2, max_nbytes=LIMIT)(delayed(make)() for _ in range(2))
    assert [summary(t) for t in back] == [summary(tensor)] * 2
    assert getattr(back[0], "note", "kept") == "kept"
    return sent, memshare.last_call_stats()


@pytest.mark.parametrize("make", list(PICKLED_BY_TORCH.values()), ids=list(PICKLED_BY_TORCH))
def test_tensors_with_state_of_their_own_are_pickled_by_torch(shm_dir, make):
    sent, returned = both_ways(make)
    assert sent["arrays_dumped"] == sent["arrays_held_once"] == 0, sent
    assert returned["results_by_reference"] == 0, returned
    assert leaks(shm_dir) == []


@pytest.mark.parametrize("make", list(MADE_OF_TENSORS.values()), ids=list(MADE_OF_TENSORS))
def test_sparse_tensors_and_parameters_keep_their_kind_and_their_plain_tensors_travel_as_arrays(shm_dir, make):
    sent, returned = both_ways(make)
    assert sent["arrays_dumped"] >= 1 and sent["objects_dumped"] == 0, sent
    assert returned["results_by_reference"] >= 2, returned
    assert leaks(shm_dir) == []


def test_small_tensors_are_pickled_by_torch(shm_dir):
    tensor = torch.arange(1000.0)
    assert run("Parallel", see, [(tensor,)] * 2) == [see(tensor)] * 2
    assert memshare.last_call_stats()["arrays_dumped"] == 0


def test_a_tensor_changed_between_calls_is_sent_as_it_is_now(shm_dir):
    X = big_tensor(2048, 2048)
    with Parallel(n_jobs=2, max_nbytes=LIMIT) as parallel:
        first = parallel(delayed(checksum)(X) for _ in range(2))
        X[7, 7] = 12345.0
        second = parallel(delayed(checksum)(X) for _ in range(2))
    assert first != second and second == [checksum(X)] * 2
    del X
    assert leaks(shm_dir) == []


def test_the_decision_log_names_the_tensor_once(shm_dir, caplog):
    X = big_tensor(2048, 2048)
    with caplog.at_level("DEBUG", logger="memshare"):
        run("Parallel", checksum, [(X,)] * 4)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(("dumped", "held once"))]
    assert len(lines) == 1 and "tensor" in lines[0], lines


def fail_with(tensor):
    raise ValueError(f"task failed with {tensor.shape[0]} rows")


def test_nothing_is_left_after_a_task_error(shm_dir):
    X = big_tensor(2048, 2048)
    with pytest.raises(ValueError, match="task failed"):
        run("Parallel", fail_with, [(X,)] * 4)
    del X
    gc.collect()
    assert leaks(shm_dir) == []


def die_with(tensor):
    os.kill(os.getpid(), 9)


def test_nothing_is_left_after_a_worker_is_killed(shm_dir):
    X = big_tensor(2048, 2048)
    with pytest.raises(memshare.WorkerDiedError, match="SIGKILL"):
        run("Parallel", die_with, [(X,)] * 2)
    del X
    gc.collect()
    assert leaks(shm_dir) == []


def test_an_aligned_malloc_chunk_of_its_own_is_recognised_only_when_asked():
    from memshare._parent import _held_memory

    tensor = made_where_glibc_maps_it(  # torch's allocator: posix_memalign, 64-byte aligned
        lambda: torch.empty(64 * 1024**2, dtype=torch.uint8),
        lambda t: _held_memory.mmapped_chunk(t.data_ptr(), t.numel(), aligned=True),
        64 * 1024**2,
    )
    address = tensor.data_ptr()
    assert address % _held_memory.PAGE != 16  # not where plain malloc puts a chunk's data
    assert _held_memory.mmapped_chunk(address, tensor.numel()) is not None
    reason = _held_memory.mmapped_chunk(address, tensor.numel(), aligned=True)
    assert reason is None, reason
    assert "smaller than the array" in _held_memory.mmapped_chunk(address, 2 * tensor.numel(), aligned=True)


def held_file_of(tensor) -> str:
    from memshare._parent import _held_memory

    ((path, _),) = mappings_of([tensor.data_ptr() + 2 * _held_memory.PAGE])
    return path


def test_a_tensor_is_held_once_and_a_change_moves_it_to_a_new_file(default_location):
    X = big_tensor()
    with Parallel(n_jobs=2, max_nbytes=LIMIT) as parallel:
        first = parallel(delayed(checksum)(X) for _ in range(4))
        held = held_file_of(X)
        X[100, 100] = 7.0
        second = parallel(delayed(checksum)(X) for _ in range(4))
    stats = memshare.last_call_stats()  # both calls: one context
    assert stats["arrays_held_once"] == 1 and stats["arrays_dumped"] == 0, stats
    assert stats["bytes_refreshed"] == X.numel() * 4, stats
    assert "memshare-held" in held, held
    assert first != second and second == [checksum(X)] * 4
    del X
    gc.collect()
    assert memfds_held() == []


@pytest.mark.parametrize("first", ["array", "tensor"])
def test_an_array_and_its_from_numpy_tensor_never_send_stale_values(first):
    array = np.random.default_rng(1).random((4096, 2048))  # 64 MiB, held once by whichever goes first
    tensor = torch.from_numpy(array)

    values = {"array": array, "tensor": tensor}
    second = "tensor" if first == "array" else "array"
    assert send(values[first]) == [float(array.sum())] * 2
    array[5, 5] = 1e6  # a private page of whatever memory the first send left
    assert send(values[second]) == [float(array.sum())] * 2
    array[9, 9] = -1e6
    assert send(values[first]) == [float(array.sum())] * 2
    values.clear()
    del array, tensor
    gc.collect()
    assert memfds_held() == []


def total_of(value) -> float:
    return float(np.asarray(value).sum())


def send(value) -> list:
    return Parallel(n_jobs=2, max_nbytes=LIMIT)(delayed(total_of)(value) for _ in range(2))


@pytest.mark.parametrize("end", [fail_with, die_with], ids=["task error", "killed worker"])
def test_nothing_is_left_of_a_tensor_held_once_after_a_failed_call(default_location, end):
    X = big_tensor()  # 64 MiB: above glibc's largest mmap threshold, so a chunk of its own, which can be held once
    with pytest.raises((ValueError, memshare.WorkerDiedError)):
        run("Parallel", end, [(X,)] * 4)
    assert "memshare-held" in held_file_of(X)
    del X
    gc.collect()
    assert memfds_held() == []


def write_row(tensor, index: int) -> float:
    tensor[index] = -1.0
    return float(tensor[:, 0].sum())


@pytest.mark.parametrize("mode", ["r", "c", "r+", "w+"])
def test_a_task_may_write_into_its_tensor_under_every_mode_and_the_parents_never_changes(shm_dir, mode):
    X = torch.ones(1024, 1024)
    seen = Parallel(n_jobs=2, max_nbytes=LIMIT, mmap_mode=mode, batch_size=1)(
        delayed(write_row)(X, i) for i in range(4)
    )
    if mode in ("r", "c"):
        assert seen == [1022.0] * 4  # each task's write its own
    else:
        assert all(value <= 1022.0 for value in seen), seen  # the call's tasks share their dump, as arrays do
    assert float(X.sum()) == X.numel()
    del X
    assert leaks(shm_dir) == []
