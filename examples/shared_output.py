"""Workers fill disjoint row blocks of a shared output: a blocked matrix product."""

import numpy as np

import memshare
from memshare import Parallel, delayed


def multiply_block(a, b, out, start, stop):
    np.matmul(a[start:stop], b, out=out[start:stop])


def main(n: int = 1200, block: int = 200) -> None:
    rng = np.random.default_rng(0)
    a = memshare.share(rng.random((n, n)))
    b = memshare.share(rng.random((n, n)))
    out = memshare.empty((n, n))
    Parallel(n_jobs=2)(delayed(multiply_block)(a, b, out, i, i + block) for i in range(0, n, block))
    assert np.allclose(out, a @ b)
    print("blocked product OK:", memshare.last_call_stats())


if __name__ == "__main__":
    main()
