"""What a pool's map calls give back: chunked results joined into one list, and a progress bar over them."""

from __future__ import annotations

import itertools
import sys
from typing import Any, Iterable, Iterator, Optional


class ChunkedMapResult:
    """The result of ``map_async``/``starmap_async``: the standard result object, with the chunks' lists joined.

    It has the methods of :class:`multiprocessing.pool.AsyncResult`.
    """

    def __init__(self, chunks: Any) -> None:
        self._chunks = chunks

    def ready(self) -> bool:
        return self._chunks.ready()

    def successful(self) -> bool:
        return self._chunks.successful()

    def wait(self, timeout: Optional[float] = None) -> None:
        self._chunks.wait(timeout)

    def get(self, timeout: Optional[float] = None) -> list:
        return join_chunks(self._chunks.get(timeout))


def join_chunks(chunks: list) -> list:
    return list(itertools.chain.from_iterable(chunks))


def length_of(iterable: Any) -> Optional[int]:
    return len(iterable) if hasattr(iterable, "__len__") else None


def with_progress_bar(results: Iterable, total: Optional[int]) -> Iterator:
    """Yield ``results`` while a tqdm bar on stderr counts them."""
    from tqdm.auto import tqdm

    with tqdm(total=total, file=sys.stderr, unit="task", desc="memshare", dynamic_ncols=True) as bar:
        for result in results:
            bar.update(1)
            yield result
