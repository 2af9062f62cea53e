"""MemmappingPool: a large input shared once, large results returned through shared memory."""

import numpy as np

import memshare


def normalise_block(data: np.ndarray, start: int, stop: int) -> np.ndarray:
    block = data[start:stop]
    return (block - block.mean(axis=0)) / block.std(axis=0)  # a new 32 MB array, returned with no pickling


def main() -> None:
    data = np.random.default_rng(0).random((200_000, 80))  # 128 MB, written to /dev/shm once
    bounds = [(i, i + 50_000) for i in range(0, 200_000, 50_000)]
    with memshare.MemmappingPool(2) as pool:
        blocks = pool.starmap(normalise_block, [(data, a, b) for a, b in bounds], progress=True)
    stats = memshare.last_call_stats()
    assert all(type(b) is np.ndarray and b.flags.writeable for b in blocks)
    assert np.allclose(np.vstack(blocks)[:50_000], normalise_block(data, 0, 50_000))
    print(f"dumped {stats['arrays_dumped']} input, {stats['results_by_reference']} results came back by reference")


if __name__ == "__main__":
    main()
