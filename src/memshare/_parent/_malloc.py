"""Which malloc serves this process, found by asking it, and how glibc lays out the blocks it maps on their own.

Arrays are held once only where glibc's malloc serves NumPy's allocations:
remapping an array's pages is safe when ``free()`` will unmap the whole
block, which holds for glibc's mmapped chunks and nothing else. Comparing
the address of the process's ``malloc`` with libc's is not a test of that:
a non-PIE executable (Debian's and Ubuntu's ``python3``) answers with its
own PLT entry, which leads to libc's malloc all the same. So memshare asks
the allocator itself (:func:`find`): it calls the process's ``malloc`` for a
block larger than any mmap threshold and checks that glibc's own accounting
(``mallinfo2``, called in libc) counted it. A preloaded allocator (jemalloc,
tcmalloc) answers the call without glibc knowing, and is refused.

glibc writes a two-word header (prev_size, size) before the data of each
chunk; a chunk served by ``mmap()`` starts its mapping and has the
``IS_MMAPPED`` bit in its size word. What the size word counts changed in
glibc 2.43: before, the whole mapping; from 2.43, the mapping less a
trailing header, so that mmapped chunks have the layout of heap chunks
(``mmap_size = prev_size + size + 2 words``). :func:`mapping_end` accepts
these two layouts only, each one checked on the glibc that has it (2.36 and
2.43 in CI).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import sys
from dataclasses import dataclass
from typing import Optional, Tuple

from .._lifetime import _procfs

PAGE = mmap.PAGESIZE
WORD = ctypes.sizeof(ctypes.c_size_t)
CHUNK_HEADER = 2 * WORD
IS_MMAPPED = 0x2
SIZE_FLAGS = 0x7

# Larger than glibc's largest dynamic mmap threshold (32 MiB on 64-bit), so
# that glibc maps it on its own unless a free heap chunk that large exists.
# Never touched: it costs an mmap() and a munmap(), no memory.
PROBE_BYTES = 64 * 1024**2

#: The size word counts the whole mapping (glibc before 2.43).
WHOLE_MAPPING = "the chunk's size is its whole mapping"
#: The size word counts the mapping less a trailing header (glibc 2.43 on).
TRAILING_HEADER = "the chunk's size is its mapping less a trailing two-word header"


@dataclass(frozen=True)
class Malloc:
    """What serves this process's ``malloc()``, and how that was found out."""

    glibc: bool
    #: For doctor: "glibc 2.36's", or what was found instead.
    name: str
    #: The evidence, in words.
    how: str
    #: The layout of glibc's mmapped chunks seen on the probe (WHOLE_MAPPING, TRAILING_HEADER), or None.
    layout: Optional[str] = None
    #: The address the process's ``malloc`` symbol resolves to (0 if unknown): where it leads is told on demand.
    address: int = 0

    def describe(self) -> str:
        """The allocator and the evidence, in words (for doctor, and for why arrays are not held once)."""
        provider = f"{_provider(self.address)}; " if self.address else ""
        layout = f"; in its mmapped chunks, {self.layout}" if self.layout else ""
        return f"{self.name} ({provider}{self.how}{layout})"


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ] + [("keepcost", ctypes.c_size_t)]


class _MallInfo(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_int)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ] + [("keepcost", ctypes.c_int)]


def _glibc_counter(libc: ctypes.CDLL):
    """A function returning the bytes glibc's malloc has handed out (mapped blocks plus heap chunks in use).

    Looked up in libc's own handle, whose scope is libc and its
    dependencies: a preloaded allocator cannot answer it in glibc's place.
    ``mallinfo2`` exists from glibc 2.33; ``mallinfo``'s int fields suffice
    for a 64 MiB difference before that.
    """
    try:
        info = libc.mallinfo2
        info.restype = _MallInfo2
    except AttributeError:
        info = libc.mallinfo
        info.restype = _MallInfo
    info.argtypes = []

    def handed_out() -> int:
        counts = info()
        return counts.hblkhd + counts.uordblks

    return handed_out


def object_at(address: int) -> Optional[str]:
    """The file mapped at ``address`` in this process (/proc/self/maps), or None."""
    try:
        mappings = _procfs.mappings()
    except OSError:
        return None
    for mapping in mappings:
        if mapping.start <= address < mapping.end:
            return None if mapping.path is None else os.fsdecode(mapping.path)
    return None


def _provider(address: int) -> str:
    """Where the process's ``malloc`` symbol points, in words: the object that defines it, or the PLT that leads on."""
    path = object_at(address)
    if path is None:
        return f"malloc is at {address:#x}, in no file"
    executable = _procfs.executable()
    if executable is not None and os.path.realpath(path) == executable:
        # A non-PIE executable that calls malloc: dlsym() gives its PLT
        # entry (the function's canonical address), which jumps to whatever
        # the dynamic linker bound: the first object loaded that defines it.
        definer = _first_definer()
        leads_to = f", which leads to {definer}" if definer else ""
        return f"malloc resolves to the PLT entry of {os.path.basename(path)} (not position-independent){leads_to}"
    return f"malloc resolves to {path}"


class _PhdrInfo(ctypes.Structure):
    _fields_ = [("addr", ctypes.c_void_p), ("name", ctypes.c_char_p)]  # the first fields of dl_phdr_info


def _first_definer() -> Optional[str]:
    """The first object in load order (after the executable) whose own code defines ``malloc``; None if unknown.

    The dynamic linker binds a symbol to its first definition in that
    order: the executable, preloaded objects, then the libraries.
    """
    names: list = []
    callback_type = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(_PhdrInfo), ctypes.c_size_t, ctypes.c_void_p)

    def collect(info, _size, _data):  # runs under the loader's lock: no dlopen() here
        names.append(info.contents.name)
        return 0

    try:
        _libc().dl_iterate_phdr(callback_type(collect), None)
    except (OSError, AttributeError):
        return None
    for name in names[1:]:
        if not name:
            continue
        path = os.fsdecode(name)
        try:
            address = ctypes.cast(ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY).malloc, ctypes.c_void_p)
        except (OSError, AttributeError):
            continue  # the vDSO, or an object that neither defines nor needs malloc
        found = object_at(address.value or 0)
        if found is not None and os.path.realpath(found) == os.path.realpath(path):
            return path
    return None


def mapping_end(chunk: int, size_word: int) -> Tuple[Optional[int], Optional[str]]:
    """The end of the mapping of an mmapped chunk at ``chunk`` with this size word, and its layout; or (None, None).

    The mapping's end is a page boundary: the size word counts either the
    whole mapping (glibc before 2.43) or the mapping less a trailing header
    (2.43 on). The two differ by 16 bytes, so at most one is whole pages.
    """
    size = size_word & ~SIZE_FLAGS
    if size and size % PAGE == 0:
        return chunk + size, WHOLE_MAPPING
    if (size + CHUNK_HEADER) % PAGE == 0:
        return chunk + size + CHUNK_HEADER, TRAILING_HEADER
    return None, None


def chunk_layout(address: int) -> Optional[str]:
    """The layout of the glibc mmapped chunk whose data starts at ``address``; None when it is not one.

    Only for memory known to be a live malloc() block of at least a page:
    its header is read without checking the maps.
    """
    chunk = address - CHUNK_HEADER
    if chunk % PAGE:
        return None
    prev_size, size_word = (ctypes.c_size_t * 2).from_address(chunk)
    if prev_size or not size_word & IS_MMAPPED:
        return None
    return mapping_end(chunk, size_word)[1]


def _libc() -> ctypes.CDLL:
    try:
        return ctypes.CDLL("libc.so.6")  # glibc's name on Linux; find_library would run ldconfig
    except OSError:
        return ctypes.CDLL(ctypes.util.find_library("c"))


def find() -> Malloc:
    """Which malloc serves this process: glibc's when a block from the process's ``malloc`` is counted by glibc."""
    if not sys.platform.startswith("linux"):
        return Malloc(False, "not glibc's", "glibc's malloc is Linux's")
    # The C library this process runs (platform.libc_ver() would read the executable's file to guess it).
    libc_name, _, libc_version = (_confstr("CS_GNU_LIBC_VERSION") or "").partition(" ")
    if libc_name != "glibc":
        return Malloc(False, "not glibc's", "the C library is not glibc")
    try:
        libc = _libc()
        process = ctypes.CDLL(None)
        handed_out = _glibc_counter(libc)
        malloc, free = process.malloc, process.free
    except (OSError, AttributeError) as exc:
        return Malloc(False, "unknown", f"glibc's malloc cannot be asked: {exc}")
    malloc.restype, malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    free.restype, free.argtypes = None, [ctypes.c_void_p]
    address = ctypes.cast(malloc, ctypes.c_void_p).value or 0
    counted, layout = 0, None
    # Another thread may free glibc memory between the two counts: a few tries.
    for _ in range(3):
        before = handed_out()
        block = malloc(PROBE_BYTES)
        if not block:
            return Malloc(False, "unknown", "malloc() of a 64 MiB probe failed", address=address)
        try:
            counted = handed_out() - before
            layout = chunk_layout(block) if counted >= PROBE_BYTES else None
        finally:
            free(block)
        if counted >= PROBE_BYTES:
            how = "glibc's mallinfo counted a 64 MiB block from the process's malloc()"
            return Malloc(True, f"glibc {libc_version}'s", how, layout, address)
    return Malloc(
        False,
        f"another allocator than glibc {libc_version}'s",
        "glibc's mallinfo did not count a 64 MiB block from the process's malloc() (a preloaded allocator such as "
        "jemalloc or tcmalloc?)",
        address=address,
    )


def _confstr(name: str) -> Optional[str]:
    try:
        return os.confstr(name)
    except (ValueError, OSError):
        return None
