"""The data and tasks of the workloads whose tasks return their input: a NumPy array (q) and a torch tensor (r).

Each of :data:`RETURN_TASKS` tasks is given the same large ``X`` and returns it. memshare gives the parent
``X``'s own file (held once, or its dump) mapped copy-on-write for each result, with no copy; a contender that
pickles results sends each one back whole. torch is imported only here, by the contender processes of (r), and
(r) is skipped without it (:func:`torch_skip`). The workloads themselves are declared in
``workloads.make_workloads``.
"""

from __future__ import annotations

from typing import Any, List, Optional

import numpy as np

if __package__:
    from .runners import Task
else:  # imported as a top-level module by _contender.py, which must not import memshare (see there)
    from runners import Task

#: How many tasks each return ``X``: as many results, each of ``X``'s size.
RETURN_TASKS = 8


# Task functions: module level so that every contender can pickle them by reference.
def returned(x: Any, i: int) -> Any:
    """``x`` itself (``i`` only makes tasks distinct)."""
    return x


def import_torch(i: int) -> int:
    """Import torch in the worker that runs it, before any timing: a pickled tensor needs it there."""
    import torch  # noqa: F401

    return i


def return_tasks(x: Any, pickles: bool) -> List[Task]:
    """Each task gets the whole ``X`` and returns it: pickling contenders too (there is no slice to send)."""
    return [(returned, (x, i)) for i in range(RETURN_TASKS)]


def input_nbytes(x: Any) -> int:
    """The size of ``X``, an array or a tensor."""
    if isinstance(x, np.ndarray):
        return x.nbytes
    return x.numel() * x.element_size()


def returned_pickled_bytes(x: Any) -> int:
    """What a pickling contender copies per call: ``X`` into every task, and (not counted here) back."""
    return RETURN_TASKS * input_nbytes(x)


def torch_skip() -> Optional[str]:
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return "needs torch, not installed here (pip install torch)"
    return None


def tensor_data(size: int, quick: bool) -> Any:
    """A 1-D float64 tensor of about ``size`` bytes, allocated by torch (random values, seeded)."""
    import torch

    generator = torch.Generator().manual_seed(0)
    return torch.rand(max(64, size // 8), dtype=torch.float64, generator=generator)


def warm_torch(n_jobs: int) -> List[Task]:
    """Tiny tasks that make every worker import torch before the timed call."""
    return [(import_torch, (i,)) for i in range(4 * n_jobs)]


def tensors_equal(result: Any, expected: Any) -> bool:
    """Every result a ``torch.Tensor`` of the expected dtype, shape, strides and values."""
    import torch

    if not isinstance(result, (list, tuple)) or len(result) != len(expected):
        return False
    return all(
        type(r) is torch.Tensor
        and r.dtype == e.dtype
        and tuple(r.shape) == tuple(e.shape)
        and tuple(r.stride()) == tuple(e.stride())
        and bool(torch.equal(r, e))
        for r, e in zip(result, expected)
    )
