/* The two memory operations of arrays held once that must not be split.
 *
 * Holding an array once means writing a range of its memory into its shared
 * file and then mapping the file over that range (MAP_PRIVATE | MAP_FIXED),
 * or, for pages written since, writing them into the file again and
 * dropping their private copies (MADV_DONTNEED). A write into the range that
 * falls between the two steps would be lost. Each function below does both
 * steps in one call without releasing the GIL, so no Python code of any
 * thread (and no Python signal handler) can run in between. Written in C
 * because a pair of ctypes calls can be separated by a thread switch.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

static int write_all(int fd, const char *address, Py_ssize_t length, long long offset) {
    Py_ssize_t done = 0;
    while (done < length) {
        ssize_t written = pwrite(fd, address + done, (size_t)(length - done), (off_t)(offset + done));
        if (written < 0 && errno == EINTR)
            continue;
        if (written <= 0) {
            if (written == 0)
                errno = EIO;
            return -1;
        }
        done += written;
    }
    return 0;
}

/* The second step, on the same whole pages: 0 on success, -1 with errno set. */
typedef int (*second_step)(void *address, size_t length, int fd, off_t offset);

static int remap_private(void *address, size_t length, int fd, off_t offset) {
    void *mapped = mmap(address, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED, fd, offset);
    return mapped == MAP_FAILED ? -1 : 0;
}

static int drop_private_copies(void *address, size_t length, int fd, off_t offset) {
    (void)fd;
    (void)offset;
    return madvise(address, length, MADV_DONTNEED);
}

/* Raise ValueError and return -1 when the arguments are not whole pages of an open file; else 0.
 *
 * Checked before anything is written: both steps work on whole pages (mmap
 * and madvise round a partial page up and would zero, or drop, the rest of
 * it), and a step that failed on an unaligned address after the write would
 * leave the file written for nothing. */
static int check_arguments(int fd, long long offset, unsigned long long address, Py_ssize_t length) {
    long page = sysconf(_SC_PAGESIZE);
    if (page <= 0)
        page = 4096;
    if (length <= 0 || length % page != 0) {
        PyErr_Format(PyExc_ValueError,
                     "memshare: the length must be a positive multiple of the page size (%ld bytes), not %zd", page,
                     length);
        return -1;
    }
    if (address == 0 || address % (unsigned long long)page != 0) {
        PyErr_Format(PyExc_ValueError, "memshare: the address 0x%llx is not at the start of a page (%ld bytes)",
                     address, page);
        return -1;
    }
    if (address + (unsigned long long)length < address) {
        PyErr_SetString(PyExc_ValueError, "memshare: the range wraps around the end of the address space");
        return -1;
    }
    if (offset < 0 || offset % page != 0) {
        PyErr_Format(PyExc_ValueError,
                     "memshare: the file offset must be a non-negative multiple of the page size (%ld bytes), not %lld",
                     page, offset);
        return -1;
    }
    if (fd < 0 || fcntl(fd, F_GETFD) == -1) {
        PyErr_Format(PyExc_ValueError, "memshare: %d is not an open file descriptor", fd);
        return -1;
    }
    return 0;
}

/* Parse (fd, file_offset, address, length), check them, write the memory into the file, then run ``then``. */
static PyObject *write_then(PyObject *args, second_step then) {
    int fd;
    long long offset;
    unsigned long long address;
    Py_ssize_t length;
    if (!PyArg_ParseTuple(args, "iLKn", &fd, &offset, &address, &length))
        return NULL;
    if (check_arguments(fd, offset, address, length) < 0)
        return NULL;
    if (write_all(fd, (const char *)(uintptr_t)address, length, offset) < 0 ||
        then((void *)(uintptr_t)address, (size_t)length, fd, (off_t)offset) != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(copy_then_remap_doc,
             "copy_then_remap(fd, file_offset, address, length)\n\n"
             "Write the memory [address, address + length) into fd at file_offset, then map that\n"
             "part of the file privately over the same memory. address, file_offset and length must\n"
             "be whole pages (ValueError before anything is touched otherwise).");

static PyObject *copy_then_remap(PyObject *self, PyObject *args) { return write_then(args, remap_private); }

PyDoc_STRVAR(rewrite_then_drop_doc,
             "rewrite_then_drop(fd, file_offset, address, length)\n\n"
             "Write the memory [address, address + length) into fd at file_offset, then drop the\n"
             "private copies of those pages so that they read the file again. address, file_offset\n"
             "and length must be whole pages (ValueError before anything is touched otherwise).");

static PyObject *rewrite_then_drop(PyObject *self, PyObject *args) { return write_then(args, drop_private_copies); }

static PyMethodDef methods[] = {
    {"copy_then_remap", copy_then_remap, METH_VARARGS, copy_then_remap_doc},
    {"rewrite_then_drop", rewrite_then_drop, METH_VARARGS, rewrite_then_drop_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "memshare._remap", "Memory operations of arrays held once that must not be split.",
    -1, methods,
};

PyMODINIT_FUNC PyInit__remap(void) { return PyModule_Create(&module); }
