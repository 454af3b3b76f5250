/*
 * Doorbells: eventfd rings and drains that keep the GIL, and one poll that drains the doorbell
 * before it takes the GIL back (exchange/doorbell.py). A Python-level os.eventfd_read, or a
 * poll(0), lets the GIL go for a system call of a microsecond or two; under contention (16 env
 * threads of a worker, the serving thread and the learner) another thread takes it and the
 * caller then waits for that thread's whole Python run, and each hand-over costs futex calls.
 * A blocking wait may idle-poll instead of blocking in poll(2): see idle_poll.c.
 */
#include "native.h"

/* Adds n to the eventfd counter fd: 0, or -1 with errno set. A saturated counter (EAGAIN) is
   not an error: its waiter is woken anyway. */
int
ap_ring_fd(int fd, uint64_t n)
{
    return write(fd, &n, sizeof(n)) == (ssize_t)sizeof(n) || errno == EAGAIN ? 0 : -1;
}

const char ap_ring_doc[] =
             "ring(fd, n=1)\n\n"
             "Adds n to the eventfd counter fd, keeping the GIL (a saturated counter, EAGAIN, is\n"
             "ignored: its waiter is woken anyway).";

PyObject *
ap_ring(PyObject *module, PyObject *args)
{
    int fd;
    PyObject *n_obj = NULL;
    if (!PyArg_ParseTuple(args, "i|O", &fd, &n_obj)) {
        return NULL;
    }
    uint64_t v = 1;
    if (n_obj != NULL) { /* any integer (numpy's too), as os.eventfd_write takes it */
        PyObject *n = PyNumber_Index(n_obj);
        if (n == NULL) {
            return NULL;
        }
        unsigned long long u = PyLong_AsUnsignedLongLong(n);
        Py_DECREF(n);
        if (u == (unsigned long long)-1 && PyErr_Occurred()) {
            return NULL;
        }
        v = (uint64_t)u;
    }
    if (ap_ring_fd(fd, v) < 0) {
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

const char ap_drain_doc[] =
             "drain(fd) -> int\n\n"
             "Reads and zeroes the non-blocking eventfd counter fd, keeping the GIL; returns what it\n"
             "held (0 when it held nothing).";

int
ap_drain_fd(int fd, uint64_t *value)
{
    *value = 0;
    if (read(fd, value, sizeof(*value)) == (ssize_t)sizeof(*value)) {
        return 0;
    }
    *value = 0;
    return errno == EAGAIN ? 0 : -1;
}

PyObject *
ap_drain(PyObject *module, PyObject *arg)
{
    int fd = (int)PyLong_AsLong(arg);
    if (fd == -1 && PyErr_Occurred()) {
        return NULL;
    }
    uint64_t v;
    if (ap_drain_fd(fd, &v) < 0) {
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromUnsignedLongLong((unsigned long long)v);
}

const char ap_wait_doc[] =
             "wait(fds, timeout_ms, drain_fd=-1, idle=-1) -> list\n\n"
             "poll(2) on the descriptors fds (a tuple of ints, POLLIN) for at most timeout_ms\n"
             "milliseconds (-1: no limit); returns the descriptors that are readable or hung up, in\n"
             "the order of fds. When drain_fd (one of fds) is readable it is drained before the GIL\n"
             "is taken back. The GIL is let go once, and only when the poll may block (timeout_ms != 0).\n"
             "An interrupted poll returns [] once pending signal handlers have run. idle: 1 parks a\n"
             "blocking wait for this process's idle poller (see set_idle_poll), 0 blocks in poll(2),\n"
             "-1 follows the process's setting.";

/* Drains fd if the poll found it readable; 0, or the errno of a failed read. */
static int
drain_if_ready(const struct pollfd *p, Py_ssize_t n, int fd)
{
    uint64_t drained;
    for (Py_ssize_t j = 0; fd >= 0 && j < n; j++) {
        if (p[j].fd == fd && (p[j].revents & POLLIN)) {
            return ap_drain_fd(fd, &drained) < 0 ? errno : 0;
        }
    }
    return 0;
}

PyObject *
ap_wait(PyObject *module, PyObject *args)
{
    PyObject *fds;
    int timeout_ms, drain = -1, idle = -1;
    if (!PyArg_ParseTuple(args, "O!i|ii", &PyTuple_Type, &fds, &timeout_ms, &drain, &idle)) {
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(fds);
    struct pollfd stack[WAIT_STACK_FDS];
    struct pollfd *p = stack;
    if (n > WAIT_STACK_FDS) {
        p = PyMem_Malloc((size_t)n * sizeof(struct pollfd));
        if (p == NULL) {
            return PyErr_NoMemory();
        }
    }
    PyObject *result = NULL;
    for (Py_ssize_t j = 0; j < n; j++) {
        long fd = PyLong_AsLong(PyTuple_GET_ITEM(fds, j));
        if (fd == -1 && PyErr_Occurred()) {
            goto done;
        }
        p[j].fd = (int)fd;
        p[j].events = POLLIN;
        p[j].revents = 0;
    }
    int got, err = 0, drain_err = 0;
    if (timeout_ms == 0) { /* cannot block: keeps the GIL */
        got = poll(p, (nfds_t)n, 0);
        err = errno;
        if (got > 0) drain_err = drain_if_ready(p, n, drain);
    } else {
        if (idle < 0) {
            idle = ap_idle_enabled();
        }
        int64_t deadline = timeout_ms < 0 ? -1 : mono_ns() + (int64_t)timeout_ms * 1000000LL;
        int64_t give_up = mono_ns() + IDLE_PATIENCE_NS; /* across the main thread's returns */
        for (;;) {
            Py_BEGIN_ALLOW_THREADS;
            got = idle ? ap_idle_wait(p, n, timeout_ms, give_up) : poll(p, (nfds_t)n, timeout_ms);
            err = errno;
            if (got > 0) drain_err = drain_if_ready(p, n, drain); /* before the GIL is taken back */
            Py_END_ALLOW_THREADS;
            if (got != IDLE_AGAIN) {
                break;
            }
            if (PyErr_CheckSignals() < 0) {
                goto done;
            }
            if (deadline >= 0) {
                int64_t left = deadline - mono_ns();
                if (left <= 0) {
                    got = 0;
                    break;
                }
                timeout_ms = (int)((left + 999999) / 1000000); /* the last wait ends at the deadline */
            }
        }
    }
    if (got < 0) {
        if (err == EINTR) {
            if (PyErr_CheckSignals() < 0) {
                goto done;
            }
            result = PyList_New(0);
            goto done;
        }
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    if (drain_err) {
        errno = drain_err;
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    result = PyList_New(0);
    if (result == NULL) {
        goto done;
    }
    for (Py_ssize_t j = 0; j < n && got > 0; j++) {
        if (p[j].revents) {
            if (PyList_Append(result, PyTuple_GET_ITEM(fds, j)) < 0) {
                Py_CLEAR(result);
                goto done;
            }
        }
    }
done:
    if (p != stack) {
        PyMem_Free(p);
    }
    return result;
}

