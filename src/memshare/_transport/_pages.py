"""Which pages of a private file mapping this process has written, from ``/proc/self/pagemap``.

A copy-on-write mapping reads its file until a page is written; from then
that page is the process's own. The parent asks it of an array held once
(changed since its file was written?) and of a copy-on-write argument; a
worker of a copy-on-write result that views a file its task was given.
"""

from __future__ import annotations

import mmap

from .._lifetime import _procfs
from .._numpy import np
from ._refs import data_address, root_array

PAGE = mmap.PAGESIZE

# /proc/self/pagemap: one 64-bit entry per virtual page.
_PM_PRESENT = 1 << 63
_PM_SWAPPED = 1 << 62
_PM_FILE = 1 << 61  # a page of a file, or shared anonymous memory


def changed_pages(first_page: int, end: int) -> np.ndarray:
    """Indexes (from ``first_page``) of the pages in ``[first_page, end)`` written since they were mapped.

    A page of a private file mapping is a file page until a write copies it:
    present and no longer a file page, or swapped out (only private copies
    are swapped, file pages are dropped), means written.
    """
    count = (end - first_page) // PAGE
    entries = np.frombuffer(_procfs.pagemap(first_page // PAGE, count), dtype=np.uint64)
    present, swapped, file = (np.uint64(flag) for flag in (_PM_PRESENT, _PM_SWAPPED, _PM_FILE))
    written = ((entries & present) != 0) & ((entries & file) == 0)
    written |= (entries & swapped) != 0
    return np.flatnonzero(written)


def copy_on_write_unwritten(array: np.ndarray) -> bool:
    """True when no page of the copy-on-write mapping behind ``array`` is private to this process.

    Asked of ``/proc/self/pagemap`` for the whole mapping (not just the
    view's pages: simpler, and a written page anywhere is rare). A page is
    private once written, and only then can it differ from the file. False
    when the page flags cannot be read. The parent asks it of a
    copy-on-write argument, a worker of a copy-on-write result viewing a
    file its task was given. A write made after this answer races with the
    readers of the file, as any write to an argument while tasks read it
    does, or a write to a result by a thread the task left running.
    """
    root = root_array(array)
    start = data_address(root)
    first_page = start // PAGE * PAGE
    end = -(-(start + root.nbytes) // PAGE) * PAGE
    try:
        return changed_pages(first_page, end).size == 0
    except OSError:
        return False
