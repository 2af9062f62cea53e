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

/* Parse (fd, file_offset, address, length), write the memory into the file, then run ``then``. */
static PyObject *write_then(PyObject *args, second_step then) {
    int fd;
    long long offset;
    unsigned long long address;
    Py_ssize_t length;
    if (!PyArg_ParseTuple(args, "iLKn", &fd, &offset, &address, &length))
        return NULL;
    if (length < 0 || offset < 0) {
        PyErr_SetString(PyExc_ValueError, "negative length or offset");
        return NULL;
    }
    if (write_all(fd, (const char *)(uintptr_t)address, length, offset) < 0 ||
        then((void *)(uintptr_t)address, (size_t)length, fd, (off_t)offset) != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(copy_then_remap_doc,
             "copy_then_remap(fd, file_offset, address, length)\n\n"
             "Write the memory [address, address + length) into fd at file_offset, then map that\n"
             "part of the file privately over the same memory (whole pages, congruent offsets).");

static PyObject *copy_then_remap(PyObject *self, PyObject *args) { return write_then(args, remap_private); }

PyDoc_STRVAR(rewrite_then_drop_doc,
             "rewrite_then_drop(fd, file_offset, address, length)\n\n"
             "Write the memory [address, address + length) into fd at file_offset, then drop the\n"
             "private copies of those pages so that they read the file again (whole pages).");

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
