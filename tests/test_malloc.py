"""Which malloc serves the process, and the glibc chunk layouts that arrays held once rely on."""

import ctypes
import io
import json
import mmap
import os
import platform
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import run_script

from memshare._lifetime import _procfs
from memshare._parent import _held_memory, _malloc
from memshare._tools import doctor as _doctor

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc", reason="glibc's malloc is Linux's"
)

PAGE = mmap.PAGESIZE
MIB = 1024**2
SRC = Path(__file__).resolve().parents[1] / "src"

#: The layout of glibc's mmapped chunks on each glibc version CI runs (read in each version's malloc.c, and seen).
LAYOUT_BY_GLIBC = {(2, 36): _malloc.WHOLE_MAPPING, (2, 43): _malloc.TRAILING_HEADER}

_libc = ctypes.CDLL("libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.malloc.restype = ctypes.c_void_p
_libc.malloc.argtypes = [ctypes.c_size_t]
_libc.free.argtypes = [ctypes.c_void_p]


def glibc_version():
    return tuple(int(part) for part in platform.libc_ver()[1].split(".")[:2])


class FakeChunk:
    """Private anonymous pages with a header written as glibc would, followed by a read-only page.

    The read-only page ends the run of private anonymous writable memory, so
    that the chunk's mapping ends where the test says whatever lies beyond.
    """

    def __init__(self, pages):
        self.length = (pages + 1) * PAGE
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        self.base = _libc.mmap(None, self.length, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
        assert self.base not in (None, ctypes.c_void_p(-1).value)
        self.end = self.base + pages * PAGE
        assert _libc.mprotect(self.end, PAGE, mmap.PROT_READ) == 0
        self.data = self.base + _malloc.CHUNK_HEADER

    def header(self, prev_size, size_word):
        (ctypes.c_size_t * 2).from_address(self.base)[:] = [prev_size, size_word]
        return self

    def close(self):
        _libc.munmap(self.base, self.length)


@pytest.fixture
def fake_chunk():
    made = []

    def make(pages=4):
        made.append(FakeChunk(pages))
        return made[-1]

    yield make
    for chunk in made:
        chunk.close()


def test_this_process_malloc_is_glibc_and_doctor_can_say_how():
    found = _held_memory.malloc_in_use()
    assert found.glibc, found
    assert found.name == f"glibc {platform.libc_ver()[1]}'s" and "mallinfo counted" in found.how
    assert found.layout in (_malloc.WHOLE_MAPPING, _malloc.TRAILING_HEADER), found


def test_doctor_says_which_malloc_it_found_and_how_it_knows():
    lines = []
    _doctor.run_doctor(say=lines.append)
    found = [line.strip() for line in lines if line.strip().startswith("malloc:")]
    assert found == [f"malloc: {_held_memory.malloc_in_use().describe()}"], lines
    assert found[0].startswith("malloc: glibc ") and "mallinfo counted" in found[0] and "mmapped chunks" in found[0]


FRESH_CHUNKS = """
import ctypes, json
import numpy as np
from memshare._parent import _held_memory, _malloc

MIB = 1024**2
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
blocks = []
for nbytes in (48 * MIB, 48 * MIB + 1, 40 * MIB - 24, 40 * MIB - 8):
    block = libc.malloc(nbytes)
    blocks.append([_malloc.chunk_layout(block), _held_memory.mmapped_chunk(block, nbytes)])
    libc.free(ctypes.c_void_p(block))
arrays = [np.empty(48 * MIB // 8) for _ in range(3)]  # neighbours: their mappings may merge in the maps
print(json.dumps({"layout": _held_memory.malloc_in_use().layout, "blocks": blocks,
                  "arrays": [_held_memory.mmapped_chunk(a.ctypes.data, a.nbytes) for a in arrays]}))
"""


@pytest.fixture(scope="module")
def fresh_chunks():
    """What a fresh interpreter's large blocks and arrays are. In a long-lived one (the suite) glibc may serve
    even 48 MiB from the top of a heap grown and freed before, whatever the mmap threshold: not a fresh process."""
    return json.loads(run_script(FRESH_CHUNKS).stdout.strip().splitlines()[-1])


def test_the_layout_of_glibc_mmapped_chunks_is_the_one_known_for_this_glibc(fresh_chunks):
    layout = fresh_chunks["layout"]
    assert layout == _held_memory.malloc_in_use().layout
    assert layout == LAYOUT_BY_GLIBC.get(glibc_version(), layout), (glibc_version(), layout)
    # A block of 48 MiB straight from glibc (above any mmap threshold, and never touched) is a chunk of its own.
    assert fresh_chunks["blocks"] == [[layout, None]] * 4


def test_a_fresh_large_array_is_a_chunk_of_its_own_mapping(fresh_chunks):
    assert fresh_chunks["arrays"] == [None, None, None]


@pytest.mark.parametrize("layout", [_malloc.WHOLE_MAPPING, _malloc.TRAILING_HEADER])
def test_both_layouts_are_accepted_when_the_mapping_holds_the_array(fake_chunk, layout):
    chunk = fake_chunk(4)
    size = 4 * PAGE if layout == _malloc.WHOLE_MAPPING else 4 * PAGE - _malloc.CHUNK_HEADER
    chunk.header(0, size | _malloc.IS_MMAPPED)
    assert _malloc.mapping_end(chunk.base, size | _malloc.IS_MMAPPED) == (chunk.end, layout)
    assert _malloc.chunk_layout(chunk.data) == layout
    assert _held_memory.mmapped_chunk(chunk.data, 4 * PAGE - 24) is None
    # The array must lie inside the mapping the header describes.
    assert "smaller than the array" in _held_memory.mmapped_chunk(chunk.data, 4 * PAGE)


@pytest.mark.parametrize(
    "prev_size, size_word, reason",
    [
        (0, 4 * PAGE | 0x1, "from the heap"),  # PREV_INUSE: a heap chunk
        (0, 4 * PAGE | 0x5, "from the heap"),  # a chunk of another arena
        (16, (4 * PAGE - 16) | 0x2, "layout memshare does not know"),  # memalign: the chunk is inside its mapping
        (1, (4 * PAGE - 16) | 0x2, "layout memshare does not know"),  # glibc 2.43's flag of a huge-page mapping
        (0, (4 * PAGE - 8) | 0x2, "layout memshare does not know"),  # neither layout ends on a page boundary
        (0, 0x2, "layout memshare does not know"),
        (0, 8 * PAGE | 0x2, "not wholly private anonymous memory"),  # the mapping would run past what is mapped
    ],
)
def test_other_headers_are_refused(fake_chunk, prev_size, size_word, reason):
    chunk = fake_chunk(4).header(prev_size, size_word)
    assert reason in _held_memory.mmapped_chunk(chunk.data, PAGE)


def test_memory_that_is_not_private_anonymous_is_refused():
    shared = mmap.mmap(-1, 4 * PAGE)  # shared anonymous memory
    address = ctypes.addressof(ctypes.c_char.from_buffer(shared))
    try:
        (ctypes.c_size_t * 2).from_address(address)[:] = [0, 4 * PAGE | _malloc.IS_MMAPPED]
        reason = _held_memory.mmapped_chunk(address + _malloc.CHUNK_HEADER, PAGE)
    finally:
        del address
    assert reason == "its memory is not a private anonymous mapping"


def test_a_heap_chunk_whose_header_starts_a_page_is_said_to_be_from_the_heap():
    # The heap is private memory with a name ([heap]); once in 256 or so, a small array's header starts a page.
    blocks = []
    try:
        for _ in range(20000):
            blocks.append(_libc.malloc(72))
            address = blocks[-1]
            if (address - _malloc.CHUNK_HEADER) % PAGE == 0 and _in_heap(address):
                break
        else:
            pytest.fail("none of 20000 small allocations had its header at a page's start in [heap]")
        reason = _held_memory.mmapped_chunk(address, 64)
    finally:
        for block in blocks:
            _libc.free(block)
    assert reason == "not a malloc chunk of its own mapping (glibc served it from the heap)"


def _in_heap(address):
    with open("/proc/self/maps") as maps:
        for line in maps:
            low, high = (int(x, 16) for x in line.split()[0].split("-"))
            if low <= address < high:
                return line.rstrip().endswith("[heap]")
    return False


def _maps_naming(start, end, name):
    """/proc/self/maps as it is, with [start, end) named as the kernel names anonymous memory.

    Naming a range splits the mapping that holds it, as the kernel does: the
    range may be part of a larger anonymous mapping it was merged with.
    """
    with open("/proc/self/maps", "rb") as maps:
        lines = maps.read().splitlines()
    named = []
    for line in lines:
        fields = line.split()
        low, high = (int(x, 16) for x in fields[0].split(b"-"))
        if len(fields) != 5 or high <= start or low >= end:
            named.append(line)
            continue
        rest = b" ".join(fields[1:5])
        pieces = [(low, start, b""), (start, end, b"    [anon:" + name + b"]"), (end, high, b"")]
        for first, last, label in pieces:
            first, last = max(first, low), min(last, high)
            if first < last:
                named.append(b"%x-%x %s%s" % (first, last, rest, label))
    return b"\n".join(named) + b"\n"


def test_a_named_anonymous_mapping_is_anonymous(fake_chunk, monkeypatch):
    """glibc names its mappings "[anon:glibc: malloc]" when the tunable glibc.mem.decorate_maps is set."""
    chunk = fake_chunk(4).header(0, 4 * PAGE | _malloc.IS_MMAPPED)
    name = b"glibc: malloc"
    pr_set_vma, pr_set_vma_anon_name = 0x53564D41, 0
    _libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_char_p]
    if _libc.prctl(pr_set_vma, pr_set_vma_anon_name, chunk.base, 4 * PAGE, name) != 0:
        # This kernel names no anonymous mapping (CONFIG_ANON_VMA_NAME): the maps are shown as one that does.
        named = _maps_naming(chunk.base, chunk.end, name)
        monkeypatch.setattr(_procfs, "open", lambda *args, **kwargs: io.BytesIO(named), raising=False)
    with getattr(_procfs, "open", open)("/proc/self/maps", "rb") as maps:
        assert any(line.startswith(b"%x-" % chunk.base) and b"[anon:glibc: malloc]" in line for line in maps)
    assert _held_memory.mmapped_chunk(chunk.data, PAGE) is None


def _elf_type(path):
    with open(path, "rb") as executable:
        header = executable.read(18)
    return int.from_bytes(header[16:18], sys.byteorder) if header[:4] == b"\x7fELF" else None


def _non_pie_pythons():
    """The machine's Python executables that are not position-independent (ELF type EXEC), as Debian builds them."""
    found = set()
    for folder in ("/usr/bin", "/usr/local/bin"):
        for path in Path(folder).glob("python3*"):
            real = os.path.realpath(path)
            if real.endswith(("-config", "m-config")) or not os.access(real, os.X_OK):
                continue
            if _elf_type(real) == 2:  # ET_EXEC
                found.add(real)
    return sorted(found)


@pytest.mark.parametrize("python", _non_pie_pythons() or [None])
def test_glibc_malloc_is_found_in_a_non_pie_python(python):
    """A non-PIE executable's malloc symbol is its own PLT entry: memshare still finds glibc's malloc behind it."""
    if python is None:
        pytest.skip("no non-PIE Python on this machine")
    code = textwrap.dedent(
        f"""
        import importlib, sys, types
        package = sys.modules["probe"] = types.ModuleType("probe")  # memshare's folder, without its __init__
        package.__path__ = [{str(SRC / "memshare")!r}]
        found = importlib.import_module("probe._parent._malloc").find()
        print(found.glibc, found.describe())
        """
    )
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.startswith("True glibc") and "PLT entry" in out and "which leads to" in out, out


_ALLOCATOR = r"""
/* A preloaded allocator for tests: nothing is freed, and each block of 1 MiB or
   more is a mapping of its own whose header looks like glibc's (prev_size 0,
   size | IS_MMAPPED), so that only glibc's own accounting tells it apart. */
#include <stddef.h>
#include <string.h>
#include <sys/mman.h>

static char *pool;
static size_t left;
static volatile int lock;

static void *block(size_t n, size_t align)
{
    size_t *head;
    if (align < 16)
        align = 16;
    if (n >= (1 << 20) && align == 16) {
        size_t total = (n + 16 + 4095) & ~(size_t)4095;
        char *m = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED)
            return NULL;
        head = (size_t *)m;
        head[0] = 0;
        head[1] = total | 2;
        return m + 16;
    }
    while (__sync_lock_test_and_set(&lock, 1))
        ;
    size_t need = n + 16 + align;
    if (need > left) {
        size_t grow = need > (64 << 20) ? need : (64 << 20);
        char *m = mmap(NULL, grow, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED) {
            __sync_lock_release(&lock);
            return NULL;
        }
        pool = m;
        left = grow;
    }
    char *data = (char *)(((size_t)pool + 16 + align - 1) & ~(align - 1));
    size_t used = (size_t)(data - pool) + ((n + 15) & ~(size_t)15);
    pool += used;
    left -= used;
    __sync_lock_release(&lock);
    head = (size_t *)(data - 16);
    head[0] = 0;
    head[1] = (n + 16 + 15) & ~(size_t)15;
    return data;
}

static size_t usable(void *p) { return ((((size_t *)p)[-1]) & ~(size_t)7) - 16; }

void *malloc(size_t n) { return block(n, 16); }
void free(void *p) { (void)p; }
void *calloc(size_t a, size_t b) { return block(a * b, 16); } /* fresh memory is zero */
void *realloc(void *p, size_t n)
{
    void *q = block(n, 16);
    if (p && q)
        memcpy(q, p, usable(p) < n ? usable(p) : n);
    return q;
}
void *memalign(size_t align, size_t n) { return block(n, align); }
void *aligned_alloc(size_t align, size_t n) { return block(n, align); }
void *valloc(size_t n) { return block(n, 4096); }
void *pvalloc(size_t n) { return block((n + 4095) & ~(size_t)4095, 4096); }
int posix_memalign(void **out, size_t align, size_t n)
{
    *out = block(n, align);
    return *out ? 0 : 12;
}
size_t malloc_usable_size(void *p) { return p ? usable(p) : 0; }
"""


def test_a_preloaded_allocator_is_refused_even_when_its_blocks_look_like_glibcs(tmp_path):
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build an allocator")
    source, library = tmp_path / "bump.c", tmp_path / "libbump.so"
    source.write_text(_ALLOCATOR)
    subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    code = textwrap.dedent(
        """
        import numpy as np
        from memshare._parent import _held_memory
        array = np.ones(48 * 1024**2 // 8)
        # The block passes every check of its header and mapping: only the allocator's identity is wrong.
        print(_held_memory.mmapped_chunk(array.ctypes.data, array.nbytes))
        print(_held_memory.unsupported_reason())
        """
    )
    env = dict(os.environ, LD_PRELOAD=str(library))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    chunk, reason = result.stdout.splitlines()
    assert chunk == "None", result.stdout
    assert reason.startswith("needs glibc's malloc; this process's is another allocator than glibc"), reason
    assert str(library) in reason, reason  # named, whether malloc resolves to it or to a PLT entry leading to it
    doctor = [sys.executable, "-m", "memshare", "doctor"]
    lines = subprocess.run(doctor, capture_output=True, text=True, timeout=120, env=env).stdout.splitlines()
    held = [line.strip() for line in lines if line.strip().startswith(("arrays held once:", "malloc:"))]
    assert held[0].startswith("arrays held once: off (unavailable here: needs glibc's malloc"), lines
    assert held[1].startswith("malloc: another allocator than glibc") and str(library) in held[1], lines
