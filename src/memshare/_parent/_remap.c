/* The memory operation of arrays held once that must not lose a write.
 *
 * Holding an array once means writing a range of its memory into a new shared
 * file and then mapping the file over that range (MAP_PRIVATE | MAP_FIXED).
 * A write into the range between the two steps, by any thread (a NumPy
 * operation releases the GIL), would land in memory that the new mapping then
 * replaces, and be lost. So the range is made read-only first: a thread that
 * writes into it meanwhile takes a fault, and this module's SIGSEGV handler
 * makes it wait until the file is mapped over the range; its write is then
 * retried on the new, writable mapping. Every other fault goes to the handler
 * that was there before, as if this module had never been loaded.
 *
 * Written in C because the handler must not run Python code, and the steps
 * must not depend on the GIL: the GIL is released while the range is moved,
 * and one mutex lets one range be guarded at a time.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

/* The range being moved now (or moved last), and whether it is read-only now. */
static _Atomic uintptr_t guarded_start;
static _Atomic uintptr_t guarded_end;
static _Atomic int guarding;
/* The ranges moved lately, with when each move ended. A thread that faulted
 * during a move may run its handler only after that move ended, and another
 * began on the next piece: a fault in a range moved less than LATE_FAULT_NS
 * ago is retried, not passed on. A real fault there is passed on once that
 * time is up. */
#define RECENT_MOVES 1024
#define LATE_FAULT_NS 2000000000LL
static struct {
    _Atomic uintptr_t start;
    _Atomic uintptr_t end;
    _Atomic long long ended_ns;
} recent[RECENT_MOVES];
static unsigned next_recent; /* under the mutex */
/* The handler before ours: every fault outside a guarded range goes there. */
static struct sigaction previous_action;
static pthread_mutex_t moving = PTHREAD_MUTEX_INITIALIZER;

static long long monotonic_ns(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (long long)now.tv_sec * 1000000000LL + now.tv_nsec;
}

static int moved_lately(uintptr_t at) {
    long long now = monotonic_ns();
    for (unsigned i = 0; i < RECENT_MOVES; i++) {
        if (at >= atomic_load(&recent[i].start) && at < atomic_load(&recent[i].end) &&
            now - atomic_load(&recent[i].ended_ns) < LATE_FAULT_NS)
            return 1;
    }
    return 0;
}

static void on_fault(int signum, siginfo_t *info, void *context) {
    (void)context;
    int saved_errno = errno;
    uintptr_t at = (uintptr_t)info->si_addr;
    if (info->si_code > 0) {
        if (at >= atomic_load(&guarded_start) && at < atomic_load(&guarded_end)) {
            while (atomic_load(&guarding))
                sched_yield();
        }
        if (moved_lately(at)) {
            errno = saved_errno;
            return; /* the write is retried, on the file's writable mapping */
        }
    }
    /* Not ours: put the previous handler back and let the fault happen again
     * under it (a signal sent by kill() or raise() is sent again instead). */
    sigaction(signum, &previous_action, NULL);
    if (info->si_code <= 0)
        raise(signum);
    errno = saved_errno;
}

/* In a child forked while a range was guarded (the GIL is released during a
 * move, so another thread may fork): the child's copy of the range is still
 * the read-only original, which no move will map over. Make it writable
 * again and start unlocked. */
static void after_fork_in_child(void) {
    if (atomic_load(&guarding)) {
        uintptr_t start = atomic_load(&guarded_start);
        mprotect((void *)start, atomic_load(&guarded_end) - start, PROT_READ | PROT_WRITE);
        atomic_store(&guarding, 0);
    }
    pthread_mutex_init(&moving, NULL);
}

/* Make on_fault the SIGSEGV handler unless it already is (another handler,
 * faulthandler's say, may have been installed since); 0, or -1 with errno. */
static int install_handler(void) {
    struct sigaction current, ours;
    if (sigaction(SIGSEGV, NULL, &current) != 0)
        return -1;
    if ((current.sa_flags & SA_SIGINFO) && current.sa_sigaction == on_fault)
        return 0;
    memset(&ours, 0, sizeof ours);
    ours.sa_sigaction = on_fault;
    ours.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_RESTART;
    sigemptyset(&ours.sa_mask);
    previous_action = current;
    return sigaction(SIGSEGV, &ours, NULL);
}

static int write_all(int fd, const char *address, size_t length, off_t offset) {
    size_t done = 0;
    while (done < length) {
        ssize_t written = pwrite(fd, address + done, length - done, offset + (off_t)done);
        if (written < 0 && errno == EINTR)
            continue;
        if (written <= 0) {
            if (written == 0)
                errno = EIO;
            return -1;
        }
        done += (size_t)written;
    }
    return 0;
}

/* Write [address, address + length) into fd at offset, then map it there; 0, or -1 with errno.
 *
 * On failure the range is writable again and still holds the array's values
 * (the old mapping is replaced only by the successful mmap). */
static int move_to_file(int fd, off_t offset, void *address, size_t length) {
    int error = 0;
    pthread_mutex_lock(&moving);
    if (install_handler() != 0) {
        error = errno;
        goto unlock;
    }
    atomic_store(&guarded_start, (uintptr_t)address);
    atomic_store(&guarded_end, (uintptr_t)address + length);
    atomic_store(&guarding, 1);
    if (mprotect(address, length, PROT_READ) != 0) {
        error = errno;
        goto unguard;
    }
    if (write_all(fd, (const char *)address, length, offset) != 0 ||
        mmap(address, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED, fd, offset) == MAP_FAILED) {
        error = errno;
        mprotect(address, length, PROT_READ | PROT_WRITE);
    }
unguard:
    /* Recorded before the guard drops, so that a waiting handler finds it. */
    atomic_store(&recent[next_recent].start, (uintptr_t)address);
    atomic_store(&recent[next_recent].end, (uintptr_t)address + length);
    atomic_store(&recent[next_recent].ended_ns, monotonic_ns());
    next_recent = (next_recent + 1) % RECENT_MOVES;
    atomic_store(&guarding, 0);
unlock:
    pthread_mutex_unlock(&moving);
    errno = error;
    return error ? -1 : 0;
}

/* Raise ValueError and return -1 when the arguments are not whole pages of an open file; else 0.
 *
 * Checked before anything is written: mmap works on whole pages (it would
 * round a partial page up and replace the rest of it), and a step that failed
 * on an unaligned address after the write would leave the file written for
 * nothing. */
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

PyDoc_STRVAR(copy_then_remap_doc,
             "copy_then_remap(fd, file_offset, address, length)\n\n"
             "Write the memory [address, address + length) into fd at file_offset, then map that\n"
             "part of the file privately over the same memory. Threads that write into the range\n"
             "meanwhile wait, and their writes land in the new mapping. address, file_offset and\n"
             "length must be whole pages (ValueError before anything is touched otherwise).");

static PyObject *copy_then_remap(PyObject *self, PyObject *args) {
    (void)self;
    int fd, result;
    long long offset;
    unsigned long long address;
    Py_ssize_t length;
    if (!PyArg_ParseTuple(args, "iLKn", &fd, &offset, &address, &length))
        return NULL;
    if (check_arguments(fd, offset, address, length) < 0)
        return NULL;
    /* Without the GIL: a thread holding it may write into the range and wait
     * in on_fault, which needs nothing from this thread but the move. */
    Py_BEGIN_ALLOW_THREADS
    result = move_to_file(fd, (off_t)offset, (void *)(uintptr_t)address, (size_t)length);
    Py_END_ALLOW_THREADS
    if (result != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy_then_remap", copy_then_remap, METH_VARARGS, copy_then_remap_doc},
    {NULL, NULL, 0, NULL},
};

/* No state of the interpreter: the guard is the process's, behind its mutex. */
static PyModuleDef_Slot slots[] = {
#ifdef Py_mod_gil
    {Py_mod_gil, Py_MOD_GIL_NOT_USED},
#endif
    {0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "memshare._parent._remap", "Moving memory of arrays held once into its file without losing a write.",
    0, methods, slots, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__remap(void) {
    static int registered;
    if (!registered) {
        if (pthread_atfork(NULL, NULL, after_fork_in_child) != 0) {
            PyErr_SetString(PyExc_ImportError, "memshare: cannot register the C helper's fork handler");
            return NULL;
        }
        registered = 1;
    }
    return PyModuleDef_Init(&module);
}
