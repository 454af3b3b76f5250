/*
 * The consumer's hot path in C: lease the ready slots of the arena (state scan, oldest-first
 * selection, row gathers into the staging buffer) and answer them (row scatters into the
 * response fields, state stores, doorbell rings), one call each (Engine); and the workers'
 * row copies into their transition chunks (Rows) and per-pass stores and publish (Pass).
 *
 * Python keeps everything else (the policy, TensorDicts, argument checks, errors): this
 * module only moves bytes between buffers that SlotConsumer hands it once, at start-up, and
 * never allocates or touches a Python object per call beyond its arguments and return
 * value. The pure-Python SlotConsumer remains the reference implementation; the two are
 * tested against the same oracle (see docs/source/design.rst, "The native exchange").
 *
 * Ordering: a worker writes a record, then stores OBS_READY; a consumer loads the state with
 * acquire semantics before it copies the record out. The consumer writes an answer, then
 * stores ACTION_READY with release semantics, then rings the worker's eventfd (a system
 * call, which the worker's wait also is).
 *
 * Doorbells (ring, drain, wait): eventfd writes and reads that keep the GIL, and one poll that
 * drains the doorbell before it takes the GIL back. A Python-level os.eventfd_read, or a
 * poll(0), lets the GIL go for a system call of a microsecond or two; under contention (16
 * env threads of a worker, the serving thread and the learner) another thread takes it and
 * the caller then waits for that thread's whole Python run, and each hand-over costs futex
 * calls. See torchrl_asyncpool/exchange/doorbell.py.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <linux/futex.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* the slot states of torchrl_asyncpool/exchange/slot_states.py */
enum { S_FREE = 0, S_OBS_READY = 1, S_LEASED = 2, S_ACTION_READY = 3, S_ERROR = 4 };

/* above this many bytes a gather runs without the GIL (pixel batches) */
#define NOGIL_BYTES (256 * 1024)

/* The type object of a class of this module: Name, Name_init, Name_dealloc, Name_methods, Name_doc. */
#define NATIVE_TYPE(Name)                                                                            \
    {                                                                                                \
        PyVarObject_HEAD_INIT(NULL, 0).tp_name = "torchrl_asyncpool.exchange._native." #Name,        \
        .tp_basicsize = sizeof(Name), .tp_flags = Py_TPFLAGS_DEFAULT, .tp_doc = Name##_doc,           \
        .tp_new = PyType_GenericNew, .tp_init = (initproc)Name##_init,                                \
        .tp_dealloc = (destructor)Name##_dealloc, .tp_methods = Name##_methods,                       \
    }

typedef struct {
    char *src;
    char *dst;
    Py_ssize_t row; /* bytes per slot */
} Gather;

typedef struct {
    int64_t idx;
    double t;
} Aged;

typedef struct {
    PyObject_HEAD
    Py_ssize_t n;
    int32_t *state;
    double *ready_time;
    double *lease_time;
    int64_t *env_index; /* staging rows' env index, [n] */
    Gather *gathers;
    Py_ssize_t ngathers;
    Py_ssize_t gather_row_bytes; /* sum of the gathers' rows */
    char **resp;
    Py_ssize_t *resp_row;
    Py_ssize_t nresp;
    int *bell_fd;
    Py_ssize_t nbells;
    int64_t *slot_bell;
    unsigned char *rung; /* [nbells] scratch of answer() */
    Aged *aged;          /* [n] scratch of lease() */
    double *stats;       /* the arena's consumer_stats */
    Py_ssize_t st[8];    /* positions in stats: frames, batches, partial, fill, obs dwell, action dwell,
                            actions, wait (exchange/metrics.py owns them) */
    Py_buffer *views;    /* every buffer held, released at dealloc */
    Py_ssize_t nviews;
} Engine;

/* Takes a writable C-contiguous buffer of exactly nbytes into views[*nviews] (released by the
   owner's dealloc) and points *out at its memory. */
static int
hold_buffer(Py_buffer *views, Py_ssize_t *nviews, PyObject *obj, Py_ssize_t nbytes, const char *what, void *out)
{
    Py_buffer *view = &views[*nviews];
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        return -1;
    }
    (*nviews)++;
    if (view->len != nbytes) {
        PyErr_Format(PyExc_ValueError, "%s: a buffer of %zd bytes was expected, got %zd", what, nbytes, view->len);
        return -1;
    }
    *(void **)out = view->buf;
    return 0;
}

#define take_buffer(self, obj, nbytes, what, out) hold_buffer((self)->views, &(self)->nviews, obj, nbytes, what, out)

/* Adds n to the eventfd counter fd: 0, or -1 with errno set. A saturated counter (EAGAIN) is
   not an error: its waiter is woken anyway. */
static int
ring_fd(int fd, uint64_t n)
{
    return write(fd, &n, sizeof(n)) == (ssize_t)sizeof(n) || errno == EAGAIN ? 0 : -1;
}

/* Takes a contiguous int64 buffer (a numpy int64 array) into *v; TypeError naming it otherwise. */
static int
index_buffer(PyObject *obj, Py_buffer *v, const char *what)
{
    if (PyObject_GetBuffer(obj, v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        return -1;
    }
    if (v->itemsize != 8 || v->format == NULL || (strcmp(v->format, "l") != 0 && strcmp(v->format, "q") != 0)) {
        PyBuffer_Release(v);
        PyErr_Format(PyExc_TypeError, "%s must be a contiguous int64 buffer", what);
        return -1;
    }
    return 0;
}

static void
Engine_dealloc(Engine *self)
{
    for (Py_ssize_t i = 0; i < self->nviews; i++) {
        PyBuffer_Release(&self->views[i]);
    }
    PyMem_Free(self->views);
    PyMem_Free(self->gathers);
    PyMem_Free(self->resp);
    PyMem_Free(self->resp_row);
    PyMem_Free(self->bell_fd);
    PyMem_Free(self->rung);
    PyMem_Free(self->aged);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* (src, dst, row_bytes) triples -> Gather / (dst, row_bytes) pairs -> response fields */
static int
parse_fields(Engine *self, PyObject *seq, int with_src, const char *what)
{
    PyObject *fast = PySequence_Fast(seq, what);
    if (fast == NULL) {
        return -1;
    }
    Py_ssize_t k = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    if (with_src) {
        self->gathers = PyMem_Calloc(k > 0 ? k : 1, sizeof(Gather));
        self->ngathers = k;
    } else {
        self->resp = PyMem_Calloc(k > 0 ? k : 1, sizeof(char *));
        self->resp_row = PyMem_Calloc(k > 0 ? k : 1, sizeof(Py_ssize_t));
        self->nresp = k;
    }
    if ((with_src && self->gathers == NULL) || (!with_src && (self->resp == NULL || self->resp_row == NULL))) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t j = 0; j < k; j++) {
        PyObject *src = NULL, *dst = NULL;
        Py_ssize_t row = 0;
        int ok = with_src ? PyArg_ParseTuple(items[j], "OOn", &src, &dst, &row)
                          : PyArg_ParseTuple(items[j], "On", &dst, &row);
        if (!ok) {
            Py_DECREF(fast);
            return -1;
        }
        if (row < 0) {
            Py_DECREF(fast);
            PyErr_Format(PyExc_ValueError, "%s: negative row size", what);
            return -1;
        }
        if (with_src) {
            Gather *g = &self->gathers[j];
            g->row = row;
            self->gather_row_bytes += row;
            if (take_buffer(self, src, row * self->n, what, &g->src) < 0 ||
                take_buffer(self, dst, row * self->n, what, &g->dst) < 0) {
                Py_DECREF(fast);
                return -1;
            }
        } else {
            self->resp_row[j] = row;
            if (take_buffer(self, dst, row * self->n, what, &self->resp[j]) < 0) {
                Py_DECREF(fast);
                return -1;
            }
        }
    }
    Py_DECREF(fast);
    return 0;
}

static int
Engine_init(Engine *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"state", "ready_time", "lease_time", "env_index", "gathers", "responses",
                             "bell_fds", "slot_bell", "stats", "stat_slots", NULL};
    PyObject *state, *ready_time, *lease_time, *env_index, *gathers, *responses, *bell_fds, *slot_bell, *stats;
    Py_ssize_t *st = self->st;
    if (self->views != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Engine.__init__ may run once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOOOOOO(nnnnnnnn)", kwlist, &state, &ready_time, &lease_time,
                                     &env_index, &gathers, &responses, &bell_fds, &slot_bell, &stats, &st[0], &st[1],
                                     &st[2], &st[3], &st[4], &st[5], &st[6], &st[7])) {
        return -1;
    }
    Py_ssize_t ng = PySequence_Size(gathers), nr = PySequence_Size(responses), nb = PySequence_Size(bell_fds);
    if (ng < 0 || nr < 0 || nb < 0) {
        return -1;
    }
    Py_buffer probe;
    if (PyObject_GetBuffer(state, &probe, PyBUF_SIMPLE) < 0) {
        return -1;
    }
    self->n = probe.len / (Py_ssize_t)sizeof(int32_t);
    PyBuffer_Release(&probe);
    if (self->n < 1) {
        PyErr_SetString(PyExc_ValueError, "state: an int32 buffer of at least one slot was expected");
        return -1;
    }
    Py_ssize_t n = self->n;
    self->views = PyMem_Calloc(6 + 2 * ng + nr, sizeof(Py_buffer));
    self->aged = PyMem_Calloc(n, sizeof(Aged));
    self->bell_fd = PyMem_Calloc(nb > 0 ? nb : 1, sizeof(int));
    self->rung = PyMem_Calloc(nb > 0 ? nb : 1, 1);
    if (self->views == NULL || self->aged == NULL || self->bell_fd == NULL || self->rung == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    char *p;
    if (take_buffer(self, state, n * 4, "state", &p) < 0) return -1;
    self->state = (int32_t *)p;
    if (take_buffer(self, ready_time, n * 8, "ready_time", &p) < 0) return -1;
    self->ready_time = (double *)p;
    if (take_buffer(self, lease_time, n * 8, "lease_time", &p) < 0) return -1;
    self->lease_time = (double *)p;
    if (take_buffer(self, env_index, n * 8, "env_index", &p) < 0) return -1;
    self->env_index = (int64_t *)p;
    if (take_buffer(self, slot_bell, n * 8, "slot_bell", &p) < 0) return -1;
    self->slot_bell = (int64_t *)p;
    Py_buffer sv;
    if (PyObject_GetBuffer(stats, &sv, PyBUF_SIMPLE) < 0) return -1;
    Py_ssize_t nstats = sv.len / 8;
    PyBuffer_Release(&sv);
    for (int j = 0; j < 8; j++) {
        if (st[j] < 0 || st[j] >= nstats) {
            PyErr_Format(PyExc_ValueError, "stat_slots[%d] = %zd is outside the %zd stats", j, st[j], nstats);
            return -1;
        }
    }
    if (take_buffer(self, stats, nstats * 8, "stats", &p) < 0) return -1;
    self->stats = (double *)p;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (self->slot_bell[i] < 0 || self->slot_bell[i] >= nb) {
            PyErr_Format(PyExc_ValueError, "slot_bell[%zd] = %lld is not a doorbell index in [0, %zd)", i,
                         (long long)self->slot_bell[i], nb);
            return -1;
        }
    }
    self->nbells = nb;
    for (Py_ssize_t j = 0; j < nb; j++) {
        PyObject *item = PySequence_GetItem(bell_fds, j);
        if (item == NULL) return -1;
        long fd = PyLong_AsLong(item);
        Py_DECREF(item);
        if (fd == -1 && PyErr_Occurred()) return -1;
        self->bell_fd[j] = (int)fd;
    }
    if (parse_fields(self, gathers, 1, "gathers") < 0) return -1;
    if (parse_fields(self, responses, 0, "responses") < 0) return -1;
    return 0;
}

static int
by_age(const void *a, const void *b)
{
    const Aged *x = a, *y = b;
    if (x->t != y->t) return x->t < y->t ? -1 : 1;
    return x->idx < y->idx ? -1 : (x->idx > y->idx);
}

static int
by_index(const void *a, const void *b)
{
    const Aged *x = a, *y = b;
    return x->idx < y->idx ? -1 : (x->idx > y->idx);
}

PyDoc_STRVAR(scan_doc,
             "scan() -> (obs_ready, action_ready, errors, oldest_ready_time)\n\n"
             "Counts the slots in OBS_READY, ACTION_READY and ERROR; the earliest ready_time of the\n"
             "OBS_READY slots (inf when none).");

static PyObject *
Engine_scan(Engine *self, PyObject *Py_UNUSED(ignored))
{
    Py_ssize_t ready = 0, answered = 0, errors = 0;
    double oldest = Py_HUGE_VAL;
    for (Py_ssize_t i = 0; i < self->n; i++) {
        int32_t s = __atomic_load_n(&self->state[i], __ATOMIC_ACQUIRE);
        if (s == S_OBS_READY) {
            ready++;
            if (self->ready_time[i] < oldest) oldest = self->ready_time[i];
        } else if (s == S_ACTION_READY) {
            answered++;
        } else if (s == S_ERROR) {
            errors++;
        }
    }
    return Py_BuildValue("nnnd", ready, answered, errors, oldest);
}

PyDoc_STRVAR(lease_doc,
             "lease(cap, now, waited) -> (b, dwell_sum)\n\n"
             "Leases the ready slots (the cap longest-waiting ones, in slot order, if more are ready):\n"
             "their indices go to env_index[:b], their records to the gathers' dst[:b], their state to\n"
             "LEASED and lease_time to now. dwell_sum adds now - ready_time over the b slots. A batch\n"
             "(b > 0) is added to the stats, with waited seconds of waiting before it.");

static PyObject *
Engine_lease(Engine *self, PyObject *args)
{
    Py_ssize_t cap;
    double now, waited;
    if (!PyArg_ParseTuple(args, "ndd", &cap, &now, &waited)) {
        return NULL;
    }
    if (cap < 1) {
        PyErr_Format(PyExc_ValueError, "cap must be >= 1, got %zd", cap);
        return NULL;
    }
    Aged *aged = self->aged;
    Py_ssize_t b = 0;
    for (Py_ssize_t i = 0; i < self->n; i++) {
        if (__atomic_load_n(&self->state[i], __ATOMIC_ACQUIRE) == S_OBS_READY) {
            aged[b].idx = i;
            aged[b].t = self->ready_time[i];
            b++;
        }
    }
    if (b > cap) {
        qsort(aged, (size_t)b, sizeof(Aged), by_age);
        b = cap;
        qsort(aged, (size_t)b, sizeof(Aged), by_index);
    }
    double dwell = 0.0;
    for (Py_ssize_t r = 0; r < b; r++) {
        int64_t i = aged[r].idx;
        self->env_index[r] = i;
        self->lease_time[i] = now;
        dwell += now - aged[r].t;
        __atomic_store_n(&self->state[i], S_LEASED, __ATOMIC_RELAXED); /* only consumers read LEASED */
    }
    int nogil = b * self->gather_row_bytes > NOGIL_BYTES;
    PyThreadState *ts = nogil ? PyEval_SaveThread() : NULL;
    for (Py_ssize_t j = 0; j < self->ngathers; j++) {
        const Gather *g = &self->gathers[j];
        Py_ssize_t row = g->row;
        for (Py_ssize_t r = 0; r < b; r++) {
            memcpy(g->dst + r * row, g->src + aged[r].idx * row, (size_t)row);
        }
    }
    if (ts != NULL) PyEval_RestoreThread(ts);
    if (b > 0) {
        double *a = self->stats;
        const Py_ssize_t *st = self->st;
        a[st[0]] += (double)b;
        a[st[1]] += 1.0;
        a[st[2]] += b < cap ? 1.0 : 0.0;
        a[st[3]] += (double)b / (double)cap;
        a[st[4]] += dwell;
        a[st[7]] += waited;
    }
    return Py_BuildValue("nd", b, dwell);
}

PyDoc_STRVAR(answer_doc,
             "answer(idx, values, now, lease_time=-1.0)\n\n"
             "Writes values[k] (a C-contiguous buffer of len(idx) rows of field k, or of one row that\n"
             "every row gets) into the response rows idx, stores ACTION_READY in those slots, then\n"
             "rings each of their doorbells once. Adds the answers to the stats, with the time since\n"
             "their lease (lease_time >= 0: the one lease time of every row; else each slot's own).");

static PyObject *
Engine_answer(Engine *self, PyObject *args)
{
    PyObject *idx_obj, *values;
    double now, lease_t = -1.0;
    if (!PyArg_ParseTuple(args, "OOd|d", &idx_obj, &values, &now, &lease_t)) {
        return NULL;
    }
    Py_buffer iv;
    if (index_buffer(idx_obj, &iv, "idx") < 0) {
        return NULL;
    }
    PyObject *fast = NULL, *result = NULL;
    Py_buffer *vals = NULL; /* zeroed: .obj stays NULL until taken */
    const int64_t *idx = (const int64_t *)iv.buf;
    Py_ssize_t b = iv.len / 8;
    for (Py_ssize_t r = 0; r < b; r++) {
        if (idx[r] < 0 || idx[r] >= self->n) {
            PyErr_Format(PyExc_IndexError, "slot index %lld out of [0, %zd)", (long long)idx[r], self->n);
            goto done;
        }
    }
    fast = PySequence_Fast(values, "values must be a sequence");
    if (fast == NULL) goto done;
    if (PySequence_Fast_GET_SIZE(fast) != self->nresp) {
        PyErr_Format(PyExc_ValueError, "%zd values given for %zd response fields", PySequence_Fast_GET_SIZE(fast),
                     self->nresp);
        goto done;
    }
    vals = PyMem_Calloc(self->nresp > 0 ? self->nresp : 1, sizeof(Py_buffer));
    if (vals == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    PyObject **items = PySequence_Fast_ITEMS(fast);
    /* every buffer is checked before the first byte is written */
    for (Py_ssize_t k = 0; k < self->nresp; k++) {
        if (PyObject_GetBuffer(items[k], &vals[k], PyBUF_C_CONTIGUOUS) < 0) goto done;
        if (vals[k].len != b * self->resp_row[k] && vals[k].len != self->resp_row[k]) {
            PyErr_Format(PyExc_ValueError, "response field %zd: %zd bytes given for %zd rows of %zd bytes", k,
                         vals[k].len, b, self->resp_row[k]);
            goto done;
        }
    }
    for (Py_ssize_t k = 0; k < self->nresp; k++) {
        Py_ssize_t row = self->resp_row[k];
        const char *src = vals[k].buf;
        Py_ssize_t step = vals[k].len == b * row ? row : 0; /* 0: one row for all */
        for (Py_ssize_t r = 0; r < b; r++) {
            memcpy(self->resp[k] + idx[r] * row, src + r * step, (size_t)row);
        }
    }
    double dwell = 0.0;
    if (lease_t >= 0.0) {
        dwell = (double)b * (now - lease_t);
    } else {
        for (Py_ssize_t r = 0; r < b; r++) dwell += now - self->lease_time[idx[r]];
    }
    for (Py_ssize_t r = 0; r < b; r++) {
        __atomic_store_n(&self->state[idx[r]], S_ACTION_READY, __ATOMIC_RELEASE); /* after the data */
    }
    for (Py_ssize_t r = 0; r < b; r++) {
        int64_t bell = self->slot_bell[idx[r]];
        if (self->rung[bell]) continue;
        self->rung[bell] = 1;
        if (ring_fd(self->bell_fd[bell], 1) < 0) {
            PyErr_SetFromErrno(PyExc_OSError);
            for (Py_ssize_t q = 0; q < b; q++) self->rung[self->slot_bell[idx[q]]] = 0;
            goto done;
        }
    }
    for (Py_ssize_t r = 0; r < b; r++) self->rung[self->slot_bell[idx[r]]] = 0;
    self->stats[self->st[6]] += (double)b;
    self->stats[self->st[5]] += dwell;
    result = Py_NewRef(Py_None);
done:
    if (vals != NULL) {
        for (Py_ssize_t k = 0; k < self->nresp; k++) {
            if (vals[k].obj != NULL) PyBuffer_Release(&vals[k]);
        }
        PyMem_Free(vals);
    }
    Py_XDECREF(fast);
    PyBuffer_Release(&iv);
    return result;
}

static PyMethodDef Engine_methods[] = {
    {"scan", (PyCFunction)Engine_scan, METH_NOARGS, scan_doc},
    {"lease", (PyCFunction)Engine_lease, METH_VARARGS, lease_doc},
    {"answer", (PyCFunction)Engine_answer, METH_VARARGS, answer_doc},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(Engine_doc,
             "Engine(state, ready_time, lease_time, env_index, gathers, responses, bell_fds, slot_bell,\n"
             "       stats, stat_slots)\n\n"
             "The consumer's lease and answer over buffers it holds from construction on: the arena's\n"
             "state (int32 [n]), ready_time and lease_time (float64 [n]); the staging env index\n"
             "(int64 [n]); gathers, (src, dst, row_bytes) of the request fields the batches carry;\n"
             "responses, (dst, row_bytes) of the response fields; the doorbell descriptors and\n"
             "slot_bell (int64 [n]), the doorbell of each slot; the arena's consumer_stats (float64)\n"
             "and the 8 positions in it of exchange.metrics.STAT_SLOTS. Every per-slot buffer is\n"
             "C-contiguous with n rows.");

static PyTypeObject EngineType = NATIVE_TYPE(Engine);

/* ---- Rows: row copies between two sets of buffers (a worker's chunk writes) ---------------- */

typedef struct {
    PyObject_HEAD
    Gather *pairs; /* src, dst, row bytes */
    Py_ssize_t npairs;
    Py_ssize_t nsrc, ndst; /* rows every pair's src / dst holds at least */
    Py_buffer *views;
    Py_ssize_t nviews;
} Rows;

static void
Rows_dealloc(Rows *self)
{
    for (Py_ssize_t i = 0; i < self->nviews; i++) {
        PyBuffer_Release(&self->views[i]);
    }
    PyMem_Free(self->views);
    PyMem_Free(self->pairs);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int
Rows_init(Rows *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"pairs", NULL};
    PyObject *pairs;
    if (self->views != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Rows.__init__ may run once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O", kwlist, &pairs)) {
        return -1;
    }
    PyObject *fast = PySequence_Fast(pairs, "pairs must be a sequence of (src, dst, row_bytes)");
    if (fast == NULL) {
        return -1;
    }
    Py_ssize_t k = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    self->pairs = PyMem_Calloc(k > 0 ? k : 1, sizeof(Gather));
    self->views = PyMem_Calloc(2 * (k > 0 ? k : 1), sizeof(Py_buffer));
    self->nsrc = self->ndst = PY_SSIZE_T_MAX;
    int rc = -1;
    if (self->pairs == NULL || self->views == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t j = 0; j < k; j++) {
        PyObject *src, *dst;
        Py_ssize_t row;
        if (!PyArg_ParseTuple(items[j], "OOn", &src, &dst, &row)) goto done;
        if (row <= 0) {
            PyErr_Format(PyExc_ValueError, "pair %zd: row_bytes must be > 0, got %zd", j, row);
            goto done;
        }
        Py_buffer *sv = &self->views[self->nviews], *dv = &self->views[self->nviews + 1];
        if (PyObject_GetBuffer(src, sv, PyBUF_C_CONTIGUOUS) < 0) goto done;
        self->nviews++;
        if (PyObject_GetBuffer(dst, dv, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto done;
        self->nviews++;
        if (sv->len % row != 0 || dv->len % row != 0) {
            PyErr_Format(PyExc_ValueError, "pair %zd: buffers of %zd and %zd bytes are not rows of %zd bytes", j,
                         sv->len, dv->len, row);
            goto done;
        }
        self->pairs[j].src = sv->buf;
        self->pairs[j].dst = dv->buf;
        self->pairs[j].row = row;
        if (sv->len / row < self->nsrc) self->nsrc = sv->len / row;
        if (dv->len / row < self->ndst) self->ndst = dv->len / row;
    }
    self->npairs = k;
    rc = 0;
done:
    Py_DECREF(fast);
    return rc;
}

static int
rows_check(const Rows *self, int64_t s, int64_t d)
{
    if (s < 0 || s >= self->nsrc || d < 0 || d >= self->ndst) {
        PyErr_Format(PyExc_IndexError, "row %lld -> %lld outside [0, %zd) -> [0, %zd)", (long long)s, (long long)d,
                     self->nsrc, self->ndst);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(Rows_copy_doc,
             "copy(src_rows, dst_rows)\n\n"
             "For every pair, copies row src_rows[r] of src to row dst_rows[r] of dst (two int64\n"
             "buffers of the same length; every index is checked before anything is copied).");

static PyObject *
Rows_copy(Rows *self, PyObject *args)
{
    PyObject *so, *dobj;
    if (!PyArg_ParseTuple(args, "OO", &so, &dobj)) {
        return NULL;
    }
    Py_buffer sv, dv;
    if (index_buffer(so, &sv, "src_rows") < 0) {
        return NULL;
    }
    if (index_buffer(dobj, &dv, "dst_rows") < 0) {
        PyBuffer_Release(&sv);
        return NULL;
    }
    PyObject *result = NULL;
    if (sv.len != dv.len) {
        PyErr_Format(PyExc_ValueError, "src_rows and dst_rows differ in length (%zd, %zd)", sv.len / 8, dv.len / 8);
        goto done;
    }
    const int64_t *s = sv.buf, *d = dv.buf;
    Py_ssize_t b = sv.len / 8;
    for (Py_ssize_t r = 0; r < b; r++) {
        if (rows_check(self, s[r], d[r]) < 0) goto done;
    }
    for (Py_ssize_t j = 0; j < self->npairs; j++) {
        const Gather *g = &self->pairs[j];
        for (Py_ssize_t r = 0; r < b; r++) {
            memcpy(g->dst + d[r] * g->row, g->src + s[r] * g->row, (size_t)g->row);
        }
    }
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&sv);
    PyBuffer_Release(&dv);
    return result;
}

PyDoc_STRVAR(Rows_copy_one_doc, "copy_one(src_row, dst_row)\n\nFor every pair, copies one row of src to one row of dst.");

static PyObject *
Rows_copy_one(Rows *self, PyObject *args)
{
    Py_ssize_t s, d;
    if (!PyArg_ParseTuple(args, "nn", &s, &d)) {
        return NULL;
    }
    if (rows_check(self, s, d) < 0) {
        return NULL;
    }
    for (Py_ssize_t j = 0; j < self->npairs; j++) {
        const Gather *g = &self->pairs[j];
        memcpy(g->dst + d * g->row, g->src + s * g->row, (size_t)g->row);
    }
    Py_RETURN_NONE;
}

static PyMethodDef Rows_methods[] = {
    {"copy", (PyCFunction)Rows_copy, METH_VARARGS, Rows_copy_doc},
    {"copy_one", (PyCFunction)Rows_copy_one, METH_VARARGS, Rows_copy_one_doc},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(Rows_doc,
             "Rows(pairs)\n\n"
             "Row copies between buffers held from construction on: pairs of (src, dst, row_bytes),\n"
             "each a C-contiguous buffer of whole rows (a worker's slot fields and the matching\n"
             "fields of its chunk buffers, viewed as [chunks * T] rows).");

static PyTypeObject RowsType = NATIVE_TYPE(Rows);

/* ---- Pass: a worker's per-pass stores and its publish --------------------------------------- */

typedef struct {
    PyObject_HEAD
    Py_ssize_t n;
    int32_t *state;
    double *ready_time;
    float *reward;
    int8_t *step_type;
    char *done, *terminated, *truncated;
    Py_ssize_t flag_bytes; /* bytes of one slot's flag row */
    double *step_time;
    int64_t *step_count;
    int consumer_fd;
    Py_buffer views[9];
    Py_ssize_t nviews;
} Pass;

static void
Pass_dealloc(Pass *self)
{
    for (Py_ssize_t i = 0; i < self->nviews; i++) {
        PyBuffer_Release(&self->views[i]);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}


static int
Pass_init(Pass *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"state", "ready_time", "reward", "step_type", "done", "terminated", "truncated",
                             "step_time", "step_count", "consumer_fd", NULL};
    PyObject *o[9];
    int fd;
    if (self->nviews != 0) {
        PyErr_SetString(PyExc_RuntimeError, "Pass.__init__ may run once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOOOOOOi", kwlist, &o[0], &o[1], &o[2], &o[3], &o[4], &o[5],
                                     &o[6], &o[7], &o[8], &fd)) {
        return -1;
    }
    Py_buffer probe;
    if (PyObject_GetBuffer(o[0], &probe, PyBUF_SIMPLE) < 0) return -1;
    Py_ssize_t n = self->n = probe.len / 4;
    Py_ssize_t flag_len;
    PyBuffer_Release(&probe);
    if (PyObject_GetBuffer(o[4], &probe, PyBUF_SIMPLE) < 0) return -1;
    flag_len = probe.len;
    PyBuffer_Release(&probe);
    if (n < 1 || flag_len % n != 0 || flag_len == 0) {
        PyErr_SetString(PyExc_ValueError, "state and done must hold rows of at least one slot");
        return -1;
    }
    self->flag_bytes = flag_len / n;
    void *p;
    if (take_buffer(self, o[0], n * 4, "state", &p) < 0) return -1;
    self->state = p;
    if (take_buffer(self, o[1], n * 8, "ready_time", &p) < 0) return -1;
    self->ready_time = p;
    if (take_buffer(self, o[2], n * 4, "reward (float32, one per slot)", &p) < 0) return -1;
    self->reward = p;
    if (take_buffer(self, o[3], n, "step_type (int8)", &p) < 0) return -1;
    self->step_type = p;
    if (take_buffer(self, o[4], flag_len, "done", &p) < 0) return -1;
    self->done = p;
    if (take_buffer(self, o[5], flag_len, "terminated", &p) < 0) return -1;
    self->terminated = p;
    if (take_buffer(self, o[6], flag_len, "truncated", &p) < 0) return -1;
    self->truncated = p;
    if (take_buffer(self, o[7], n * 8, "step_time", &p) < 0) return -1;
    self->step_time = p;
    if (take_buffer(self, o[8], n * 8, "step_count", &p) < 0) return -1;
    self->step_count = p;
    self->consumer_fd = fd;
    return 0;
}

/* A reward as a double: a Python float or int, or a buffer holding one float32 or float64
   (a numpy array of one element). 1: *out set; 0: another kind of reward (no error set). */
static int
reward_value(PyObject *ro, double *out)
{
    if (PyFloat_Check(ro) || PyLong_Check(ro)) {
        *out = PyFloat_AsDouble(ro);
        return (*out == -1.0 && PyErr_Occurred()) ? -1 : 1;
    }
    if (!PyObject_CheckBuffer(ro)) {
        return 0;
    }
    Py_buffer v;
    if (PyObject_GetBuffer(ro, &v, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear();
        return 0;
    }
    int ok = 0;
    if (v.format != NULL && v.len == 4 && strcmp(v.format, "f") == 0) {
        *out = (double)*(const float *)v.buf;
        ok = 1;
    } else if (v.format != NULL && v.len == 8 && strcmp(v.format, "d") == 0) {
        *out = *(const double *)v.buf;
        ok = 1;
    }
    PyBuffer_Release(&v);
    return ok;
}

PyDoc_STRVAR(Pass_store_doc,
             "store(slots, step_types, rewards, times) -> bool\n\n"
             "The records of one group of a pass: for slot slots[j] (int64 buffer), its step type\n"
             "and done/terminated/truncated flags from step_types[j], its reward, and its step timer\n"
             "and counter. The lists are checked before anything is written; False (nothing\n"
             "written) when a reward is not one number (a Python float or int, or a buffer of one\n"
             "float32 or float64): the caller stores that group itself.");

static PyObject *
Pass_store(Pass *self, PyObject *args)
{
    PyObject *slots_obj, *sts, *rewards, *times;
    if (!PyArg_ParseTuple(args, "OO!O!O!", &slots_obj, &PyList_Type, &sts, &PyList_Type, &rewards, &PyList_Type,
                          &times)) {
        return NULL;
    }
    Py_buffer iv;
    if (index_buffer(slots_obj, &iv, "slots") < 0) {
        return NULL;
    }
    PyObject *result = NULL;
    double *vals = NULL;
    const int64_t *idx = iv.buf;
    Py_ssize_t k = iv.len / 8;
    if (PyList_GET_SIZE(sts) != k || PyList_GET_SIZE(rewards) != k || PyList_GET_SIZE(times) != k) {
        PyErr_Format(PyExc_ValueError, "store got %zd slots but %zd step types, %zd rewards and %zd times", k,
                     PyList_GET_SIZE(sts), PyList_GET_SIZE(rewards), PyList_GET_SIZE(times));
        goto done;
    }
    vals = PyMem_Malloc(sizeof(double) * 3 * (k > 0 ? k : 1));
    if (vals == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t j = 0; j < k; j++) {
        if (idx[j] < 0 || idx[j] >= self->n) {
            PyErr_Format(PyExc_IndexError, "slot %lld out of [0, %zd)", (long long)idx[j], self->n);
            goto done;
        }
        double r;
        int kind = reward_value(PyList_GET_ITEM(rewards, j), &r);
        if (kind < 0) goto done;
        if (kind == 0) { /* not one float: the caller's numpy stores take this group */
            result = Py_NewRef(Py_False);
            goto done;
        }
        long st = PyLong_AsLong(PyList_GET_ITEM(sts, j));
        double t = PyFloat_AsDouble(PyList_GET_ITEM(times, j));
        if (PyErr_Occurred()) goto done;
        if (st < S_FREE || st > 3) {
            PyErr_Format(PyExc_ValueError, "step type %ld is not one of 0..3", st);
            goto done;
        }
        vals[3 * j] = (double)st;
        vals[3 * j + 1] = r;
        vals[3 * j + 2] = t;
    }
    const Py_ssize_t fb = self->flag_bytes;
    for (Py_ssize_t j = 0; j < k; j++) {
        int64_t i = idx[j];
        int st = (int)vals[3 * j];
        self->step_type[i] = (int8_t)st;
        memset(self->terminated + i * fb, st == 2, (size_t)fb); /* TERMINATION */
        memset(self->truncated + i * fb, st == 3, (size_t)fb);  /* TRUNCATION */
        memset(self->done + i * fb, st >= 2, (size_t)fb);
        self->reward[i] = (float)vals[3 * j + 1];
        self->step_time[i] += vals[3 * j + 2];
        self->step_count[i] += 1;
    }
    result = Py_NewRef(Py_True);
done:
    PyMem_Free(vals);
    PyBuffer_Release(&iv);
    return result;
}

PyDoc_STRVAR(Pass_publish_doc,
             "publish(slots, now)\n\n"
             "Publishes the records of the slots (a list of ints): ready_time = now, then OBS_READY\n"
             "(release ordering, after the data), then one ring of the consumer's doorbell by their count.");

static PyObject *
Pass_publish(Pass *self, PyObject *args)
{
    PyObject *slots;
    double now;
    if (!PyArg_ParseTuple(args, "O!d", &PyList_Type, &slots, &now)) {
        return NULL;
    }
    Py_ssize_t k = PyList_GET_SIZE(slots);
    for (Py_ssize_t j = 0; j < k; j++) {
        Py_ssize_t i = PyNumber_AsSsize_t(PyList_GET_ITEM(slots, j), PyExc_OverflowError);
        if (i == -1 && PyErr_Occurred()) return NULL;
        if (i < 0 || i >= self->n) {
            PyErr_Format(PyExc_IndexError, "slot %zd out of [0, %zd)", i, self->n);
            return NULL;
        }
    }
    for (Py_ssize_t j = 0; j < k; j++) {
        Py_ssize_t i = PyNumber_AsSsize_t(PyList_GET_ITEM(slots, j), PyExc_OverflowError);
        self->ready_time[i] = now;
        __atomic_store_n(&self->state[i], S_OBS_READY, __ATOMIC_RELEASE);
    }
    if (k > 0 && ring_fd(self->consumer_fd, (uint64_t)k) < 0) {
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(Pass_record_doc,
             "record(slot, step_type, reward, dt, now) -> bool\n\n"
             "One slot's record, stored and published: its step type and end flags, its reward (one\n"
             "number, as store() takes it, else False and nothing written), dt added to its step timer and\n"
             "1 to its step count when dt >= 0, ready_time = now, then OBS_READY (release ordering)\n"
             "and one ring of the consumer's doorbell.");

static PyObject *
Pass_record(Pass *self, PyObject *args)
{
    Py_ssize_t i;
    int st;
    PyObject *ro;
    double dt, now;
    if (!PyArg_ParseTuple(args, "niOdd", &i, &st, &ro, &dt, &now)) {
        return NULL;
    }
    if (i < 0 || i >= self->n) {
        PyErr_Format(PyExc_IndexError, "slot %zd out of [0, %zd)", i, self->n);
        return NULL;
    }
    if (st < S_FREE || st > 3) {
        PyErr_Format(PyExc_ValueError, "step type %d is not one of 0..3", st);
        return NULL;
    }
    double r;
    int kind = reward_value(ro, &r);
    if (kind < 0) {
        return NULL;
    }
    if (kind == 0) {
        Py_RETURN_FALSE;
    }
    const Py_ssize_t fb = self->flag_bytes;
    self->step_type[i] = (int8_t)st;
    memset(self->terminated + i * fb, st == 2, (size_t)fb);
    memset(self->truncated + i * fb, st == 3, (size_t)fb);
    memset(self->done + i * fb, st >= 2, (size_t)fb);
    self->reward[i] = (float)r;
    if (dt >= 0.0) {
        self->step_time[i] += dt;
        self->step_count[i] += 1;
    }
    self->ready_time[i] = now;
    __atomic_store_n(&self->state[i], S_OBS_READY, __ATOMIC_RELEASE);
    if (ring_fd(self->consumer_fd, 1) < 0) {
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_TRUE;
}

static PyMethodDef Pass_methods[] = {
    {"record", (PyCFunction)Pass_record, METH_VARARGS, Pass_record_doc},
    {"store", (PyCFunction)Pass_store, METH_VARARGS, Pass_store_doc},
    {"publish", (PyCFunction)Pass_publish, METH_VARARGS, Pass_publish_doc},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(Pass_doc,
             "Pass(state, ready_time, reward, step_type, done, terminated, truncated, step_time,\n"
             "     step_count, consumer_fd)\n\n"
             "A worker's stores for a pass over its slots, over the arena's buffers: state (int32),\n"
             "ready_time, step_time (float64), reward (float32, one per slot), step_type (int8), the\n"
             "three flag fields (bool rows), step_count (int64), and the consumer's eventfd.");

static PyTypeObject PassType = NATIVE_TYPE(Pass);

/* -- doorbells ------------------------------------------------------------------------------ */

PyDoc_STRVAR(ring_doc,
             "ring(fd, n=1)\n\n"
             "Adds n to the eventfd counter fd, keeping the GIL (a saturated counter, EAGAIN, is\n"
             "ignored: its waiter is woken anyway).");

static PyObject *
native_ring(PyObject *module, PyObject *args)
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
    if (ring_fd(fd, v) < 0) {
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(drain_doc,
             "drain(fd) -> int\n\n"
             "Reads and zeroes the non-blocking eventfd counter fd, keeping the GIL; returns what it\n"
             "held (0 when it held nothing).");

static int
drain_fd(int fd, uint64_t *value)
{
    *value = 0;
    if (read(fd, value, sizeof(*value)) == (ssize_t)sizeof(*value)) {
        return 0;
    }
    *value = 0;
    return errno == EAGAIN ? 0 : -1;
}

static PyObject *
native_drain(PyObject *module, PyObject *arg)
{
    int fd = (int)PyLong_AsLong(arg);
    if (fd == -1 && PyErr_Occurred()) {
        return NULL;
    }
    uint64_t v;
    if (drain_fd(fd, &v) < 0) {
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromUnsignedLongLong((unsigned long long)v);
}

PyDoc_STRVAR(wait_doc,
             "wait(fds, timeout_ms, drain_fd=-1, idle=-1) -> list\n\n"
             "poll(2) on the descriptors fds (a tuple of ints, POLLIN) for at most timeout_ms\n"
             "milliseconds (-1: no limit); returns the descriptors that are readable or hung up, in\n"
             "the order of fds. When drain_fd (one of fds) is readable it is drained before the GIL\n"
             "is taken back. The GIL is let go once, and only when the poll may block (timeout_ms != 0).\n"
             "An interrupted poll returns [] once pending signal handlers have run. idle: 1 parks a\n"
             "blocking wait for this process's idle poller (see set_idle_poll), 0 blocks in poll(2),\n"
             "-1 follows the process's setting.");

#define WAIT_STACK_FDS 16

/* Drains fd if the poll found it readable; 0, or the errno of a failed read. */
static int
drain_if_ready(const struct pollfd *p, Py_ssize_t n, int fd)
{
    uint64_t drained;
    for (Py_ssize_t j = 0; fd >= 0 && j < n; j++) {
        if (p[j].fd == fd && (p[j].revents & POLLIN)) {
            return drain_fd(fd, &drained) < 0 ? errno : 0;
        }
    }
    return 0;
}

/* -- idle polling --------------------------------------------------------------------------
 * A blocking poll(2) makes the remote ring a cross-core wake-up: on a VM whose vCPUs halt when
 * idle (cpuidle haltpoll with guest_halt_poll_ns=0) it costs ~100 us round trip through the host,
 * and a reschedule IPI to a busy vCPU costs more. With idle polling on, a waiter parks on a
 * futex of its own process instead, and one SCHED_IDLE thread per process, which runs only when
 * its core has nothing else to run, polls the parked waiters' descriptors with poll(0) (which
 * registers no wait queue, so the remote write wakes nobody) and wakes a waiter whose
 * descriptors fired: a same-core wake of a few microseconds. A starved poller (its core busy)
 * is covered by the waiter's own capped futex wait. The poller parks itself when no waiter was
 * parked for a while.
 * Only the short waits of a running exchange gain: a wait still parked after IDLE_PATIENCE_NS
 * (a paused collector, envs held by back-pressure, a pool nobody drives) blocks in poll(2) for
 * the rest of it, so that an idle pool leaves its cores idle; its one slow wake-up at the end
 * is nothing against a wait that long. */

#define IDLE_WAITERS 64
#define IDLE_PATIENCE_NS 5000000LL /* a wait idle-polls for its first 5 ms, then blocks */
#define IDLE_PARK_NS 5000000LL /* the poller parks after 5 ms without a parked waiter */

typedef struct {
    _Atomic int state; /* 0 free, 1 taken, 2 parked (the poller checks it), 3 fired */
    int nfds;
    struct pollfd p[WAIT_STACK_FDS];
} IdleWaiter;

static IdleWaiter idle_waiters[IDLE_WAITERS];
static int idle_on = -1;     /* -1: not read yet */
static long idle_cap_ns = 1000000; /* a parked waiter polls by itself at least this often */
static _Atomic pid_t idle_claim_pid, idle_started_pid;
static _Atomic int idle_poller_parked; /* 1 while the poller sleeps on it */
static _Atomic long idle_armed;        /* counts parkings, so the poller sees activity */
/* the CPU mask of the last thread that parked: the poller follows it, so that its wake-up is a
   same-core one in a pinned process (its thread may have been started before the pinning) */
static cpu_set_t idle_mask;
static _Atomic long idle_mask_gen;

static long
futex_op(_Atomic int *addr, int op, int val, const struct timespec *ts)
{
    return syscall(SYS_futex, addr, op, val, ts, NULL, 0);
}

static int64_t
mono_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

#define IDLE_POLLER_NAME "asyncpool-idle"

static void *
idle_poller(void *arg)
{
    (void)arg;
    sigset_t all; /* a process-directed signal must reach a Python thread, never this one */
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL);
    struct sched_param sp = {0};
    sched_setscheduler(0, SCHED_IDLE, &sp);
    pthread_setname_np(pthread_self(), IDLE_POLLER_NAME); /* what ps -L and top -H show */
    int64_t last_active = mono_ns();
    long seen = atomic_load(&idle_armed), mask_gen = 0;
    for (;;) {
        int any = 0;
        long gen = atomic_load(&idle_mask_gen);
        if (gen != mask_gen) {
            cpu_set_t m = idle_mask;
            sched_setaffinity(0, sizeof(m), &m);
            mask_gen = gen;
        }
        for (int i = 0; i < IDLE_WAITERS; i++) {
            IdleWaiter *w = &idle_waiters[i];
            if (atomic_load_explicit(&w->state, memory_order_acquire) != 2) {
                continue;
            }
            any = 1;
            struct pollfd q[WAIT_STACK_FDS];
            int n = w->nfds;
            if (n <= 0 || n > WAIT_STACK_FDS) {
                continue;
            }
            memcpy(q, w->p, (size_t)n * sizeof(struct pollfd));
            if (poll(q, (nfds_t)n, 0) > 0) {
                int parked = 2;
                if (atomic_compare_exchange_strong(&w->state, &parked, 3)) {
                    futex_op(&w->state, FUTEX_WAKE_PRIVATE, 1, NULL);
                }
            }
        }
        long now_armed = atomic_load(&idle_armed);
        if (any || now_armed != seen) {
            seen = now_armed;
            last_active = mono_ns();
        } else if (mono_ns() - last_active > IDLE_PARK_NS) {
            atomic_store(&idle_poller_parked, 1);
            /* a waiter parking after this store wakes us (see idle_wait) */
            if (atomic_load(&idle_armed) == seen) {
                futex_op(&idle_poller_parked, FUTEX_WAIT_PRIVATE, 1, NULL);
            }
            atomic_store(&idle_poller_parked, 0);
            last_active = mono_ns();
            seen = atomic_load(&idle_armed);
        }
        sched_yield(); /* lets the other processes' pollers on this core have their turn */
    }
    return NULL;
}

/* Starts this process's poller (again after a fork); 0, or -1 when it cannot run. */
static int
idle_start(void)
{
    pid_t me = getpid();
    if (atomic_load(&idle_started_pid) == me) {
        return 0;
    }
    pid_t seen = atomic_load(&idle_claim_pid);
    if (seen != me && atomic_compare_exchange_strong(&idle_claim_pid, &seen, me)) {
        for (int i = 0; i < IDLE_WAITERS; i++) { /* a forked child inherits its parent's records */
            atomic_store(&idle_waiters[i].state, 0);
        }
        atomic_store(&idle_poller_parked, 0);
        pthread_attr_t attr;
        pthread_t t;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&attr, 64 * 1024);
        int rc = pthread_create(&t, &attr, idle_poller, NULL);
        pthread_attr_destroy(&attr);
        if (rc != 0) {
            idle_on = 0;
            return -1;
        }
        atomic_store(&idle_started_pid, me);
        return 0;
    }
    while (atomic_load(&idle_started_pid) != me && idle_on) {
        sched_yield();
    }
    return idle_on ? 0 : -1;
}

/* idle_wait's answer when the main thread's wait reached its self-check with nothing fired:
   the caller takes the GIL, runs pending signal handlers (a signal that arrived between two
   futex waits interrupted neither) and calls again with what is left of the timeout */
#define IDLE_AGAIN (-2)
#define IDLE_BLOCK (-3) /* inside idle_wait: the wait ran out of patience */
#define MAIN_BLOCK_MS 50 /* the main thread's blocking rest goes back to Python this often */

/* The rest of a wait that ran out of patience: a blocking poll until the deadline (mono_ns, -1:
 * none). The main thread blocks for at most MAIN_BLOCK_MS at a time and then answers IDLE_AGAIN:
 * a signal that lands between its last check and the poll interrupts nothing (it was delivered
 * already), and its handler must not wait for the whole timeout. */
static int
blocking_rest(struct pollfd *p, Py_ssize_t n, int64_t deadline, int main_thread)
{
    int ms = -1;
    if (deadline >= 0) {
        int64_t left = deadline - mono_ns();
        ms = left <= 0 ? 0 : (int)((left + 999999) / 1000000);
    }
    int capped = main_thread && (ms < 0 || ms > MAIN_BLOCK_MS);
    int got = poll(p, (nfds_t)n, capped ? MAIN_BLOCK_MS : ms);
    return got == 0 && capped ? IDLE_AGAIN : got;
}

static pthread_t idle_main_thread; /* the thread that imported the module: Python's main thread */

/* poll(p, n, timeout_ms) with idle polling (see above) until give_up (mono_ns), then a
 * blocking poll; called without the GIL. */
static int
idle_wait(struct pollfd *p, Py_ssize_t n, int timeout_ms, int64_t give_up)
{
    int main_thread = pthread_equal(pthread_self(), idle_main_thread);
    int64_t deadline = timeout_ms < 0 ? -1 : mono_ns() + (int64_t)timeout_ms * 1000000LL;
    int got = poll(p, (nfds_t)n, 0);
    if (got == 0 && mono_ns() >= give_up) {
        return blocking_rest(p, n, deadline, main_thread);
    }
    if (got != 0 || n > WAIT_STACK_FDS || idle_start() < 0) {
        return got != 0 ? got : poll(p, (nfds_t)n, timeout_ms);
    }
    IdleWaiter *w = NULL;
    for (int i = 0; i < IDLE_WAITERS && w == NULL; i++) {
        int free_ = 0;
        if (atomic_compare_exchange_strong(&idle_waiters[i].state, &free_, 1)) {
            w = &idle_waiters[i];
        }
    }
    if (w == NULL) { /* more waiters than records */
        return poll(p, (nfds_t)n, timeout_ms);
    }
    memcpy(w->p, p, (size_t)n * sizeof(struct pollfd));
    w->nfds = (int)n;
    cpu_set_t mine;
    if (sched_getaffinity(0, sizeof(mine), &mine) == 0 && !CPU_EQUAL(&mine, &idle_mask)) {
        idle_mask = mine;
        atomic_fetch_add(&idle_mask_gen, 1);
    }
    for (;;) {
        atomic_store_explicit(&w->state, 2, memory_order_release);
        atomic_fetch_add(&idle_armed, 1);
        if (atomic_load(&idle_poller_parked)) {
            atomic_store(&idle_poller_parked, 0);
            futex_op(&idle_poller_parked, FUTEX_WAKE_PRIVATE, 1, NULL);
        }
        got = poll(p, (nfds_t)n, 0); /* a ring between the first check and the parking */
        if (got != 0) {
            break;
        }
        int64_t wait_ns = idle_cap_ns;
        if (deadline >= 0) {
            int64_t left = deadline - mono_ns();
            if (left <= 0) {
                break;
            }
            if (left < wait_ns) {
                wait_ns = left;
            }
        }
        struct timespec ts = {(time_t)(wait_ns / 1000000000LL), (long)(wait_ns % 1000000000LL)};
        if (futex_op(&w->state, FUTEX_WAIT_PRIVATE, 2, &ts) < 0 && errno == EINTR) {
            got = -1; /* the caller runs the signal handlers */
            break;
        }
        got = poll(p, (nfds_t)n, 0);
        if (got != 0) {
            break;
        }
        int64_t now = mono_ns();
        if (deadline >= 0 && now >= deadline) {
            break;
        }
        if (now >= give_up) {
            got = IDLE_BLOCK;
            break;
        }
        if (main_thread) {
            got = IDLE_AGAIN;
            break;
        }
    }
    int err = errno;
    atomic_store_explicit(&w->state, 0, memory_order_release);
    if (got == IDLE_BLOCK) {
        return blocking_rest(p, n, deadline, main_thread);
    }
    errno = err;
    return got;
}

static int
idle_enabled(void)
{
    if (idle_on < 0) { /* first use: the environment decides until set_idle_poll says otherwise */
        const char *v = getenv("TORCHRL_ASYNCPOOL_IDLE_POLL"); /* 0/false/off/no: off, as doorbell.py reads it */
        idle_on = v != NULL && v[0] != '\0' && strcmp(v, "0") != 0 && strcasecmp(v, "false") != 0 &&
                  strcasecmp(v, "off") != 0 && strcasecmp(v, "no") != 0;
        const char *cap = getenv("TORCHRL_ASYNCPOOL_IDLE_POLL_CAP_US");
        if (cap != NULL && atol(cap) > 0) {
            idle_cap_ns = atol(cap) * 1000L;
        }
    }
    return idle_on;
}

static PyObject *
native_wait(PyObject *module, PyObject *args)
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
            idle = idle_enabled();
        }
        int64_t deadline = timeout_ms < 0 ? -1 : mono_ns() + (int64_t)timeout_ms * 1000000LL;
        int64_t give_up = mono_ns() + IDLE_PATIENCE_NS; /* across the main thread's returns */
        for (;;) {
            Py_BEGIN_ALLOW_THREADS;
            got = idle ? idle_wait(p, n, timeout_ms, give_up) : poll(p, (nfds_t)n, timeout_ms);
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

PyDoc_STRVAR(set_idle_poll_doc,
             "set_idle_poll(on, cap_us=0) -> bool\n\n"
             "Turns idle polling of this process's blocking waits on or off (see the module's idle\n"
             "polling comment) and returns what it was; cap_us > 0 sets how often a parked waiter\n"
             "polls by itself when the poller does not run. Without a call, the environment variable\n"
             "TORCHRL_ASYNCPOOL_IDLE_POLL (1 / 0) decides at the first wait.");

static PyObject *
native_set_idle_poll(PyObject *module, PyObject *args)
{
    int on;
    long cap_us = 0;
    if (!PyArg_ParseTuple(args, "p|l", &on, &cap_us)) {
        return NULL;
    }
    int was = idle_enabled();
    idle_on = on;
    if (cap_us > 0) {
        idle_cap_ns = cap_us * 1000L;
    }
    return PyBool_FromLong(was);
}

/* -- wake-up probe -----------------------------------------------------------------------------
 * What idle polling saves is the cost of waking a thread parked on an idle core, which depends
 * on the machine (a VM whose idle vCPUs halt to the host pays ~50 us a wake, bare metal with
 * shallow C-states a few us). The probe measures it as the pool's waits see it: an echo thread
 * pinned to another CPU blocks in poll(2) on an eventfd, the caller rings it after a short sleep
 * (so that both cores went idle) and blocks until the echo rings back. */

typedef struct {
    int ping, pong, rounds, cpu;
} WakeEcho;

static void *
wake_echo(void *arg)
{
    WakeEcho *e = arg;
    sigset_t all; /* a process-directed signal must reach a Python thread, never this one */
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL);
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(e->cpu, &one);
    pthread_setaffinity_np(pthread_self(), sizeof(one), &one);
    struct pollfd p = {e->ping, POLLIN, 0};
    uint64_t v;
    for (int i = 0; i < e->rounds; i++) {
        if (poll(&p, 1, 2000) <= 0 || read(e->ping, &v, sizeof(v)) != (ssize_t)sizeof(v)) {
            break; /* the caller stopped ringing: its own wait times out too */
        }
        v = 1;
        if (write(e->pong, &v, sizeof(v)) != (ssize_t)sizeof(v)) {
            break;
        }
    }
    return NULL;
}

static int
cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

PyDoc_STRVAR(wake_probe_doc,
             "wake_probe(rounds=64, gap_us=300) -> int or None\n\n"
             "Median nanoseconds of an eventfd round trip between this thread and an echo thread\n"
             "on another CPU of this process's mask, each round after a gap_us sleep (both cores\n"
             "idle, as a pool's waits find them): two wake-ups of a thread blocked in poll(2).\n"
             "None when the process may run on one CPU only or the probe cannot be set up. The\n"
             "calling thread is pinned for the probe and its CPU mask restored afterwards.");

static PyObject *
native_wake_probe(PyObject *module, PyObject *args)
{
    int rounds = 64, gap_us = 300;
    if (!PyArg_ParseTuple(args, "|ii", &rounds, &gap_us)) {
        return NULL;
    }
    if (rounds < 1 || rounds > 100000 || gap_us < 0 || gap_us > 1000000) {
        PyErr_Format(PyExc_ValueError, "wake_probe needs 1 <= rounds <= 100000 and 0 <= gap_us <= 1e6, got %d, %d",
                     rounds, gap_us);
        return NULL;
    }
    cpu_set_t mask;
    if (sched_getaffinity(0, sizeof(mask), &mask) != 0 || CPU_COUNT(&mask) < 2) {
        Py_RETURN_NONE;
    }
    int cpus[2], found = 0;
    for (int c = 0; c < CPU_SETSIZE && found < 2; c++) {
        if (CPU_ISSET(c, &mask)) cpus[found++] = c;
    }
    int64_t *rt = PyMem_Malloc((size_t)rounds * sizeof(int64_t));
    if (rt == NULL) {
        return PyErr_NoMemory();
    }
    WakeEcho e = {eventfd(0, EFD_CLOEXEC), eventfd(0, EFD_CLOEXEC), rounds, cpus[0]};
    int done = 0;
    pthread_t t;
    if (e.ping >= 0 && e.pong >= 0 && pthread_create(&t, NULL, wake_echo, &e) == 0) {
        Py_BEGIN_ALLOW_THREADS;
        cpu_set_t me;
        CPU_ZERO(&me);
        CPU_SET(cpus[1], &me);
        sched_setaffinity(0, sizeof(me), &me);
        struct pollfd p = {e.pong, POLLIN, 0};
        struct timespec gap = {gap_us / 1000000, (long)(gap_us % 1000000) * 1000L};
        uint64_t v = 1;
        for (; done < rounds; done++) {
            nanosleep(&gap, NULL);
            int64_t t0 = mono_ns();
            v = 1;
            if (write(e.ping, &v, sizeof(v)) != (ssize_t)sizeof(v) || poll(&p, 1, 2000) <= 0 ||
                read(e.pong, &v, sizeof(v)) != (ssize_t)sizeof(v)) {
                break;
            }
            rt[done] = mono_ns() - t0;
        }
        pthread_join(t, NULL);
        sched_setaffinity(0, sizeof(mask), &mask);
        Py_END_ALLOW_THREADS;
    }
    if (e.ping >= 0) close(e.ping);
    if (e.pong >= 0) close(e.pong);
    PyObject *out;
    if (done < rounds) {
        out = Py_None;
        Py_INCREF(out);
    } else {
        qsort(rt, (size_t)rounds, sizeof(int64_t), cmp_i64);
        out = PyLong_FromLongLong(rt[rounds / 2]);
    }
    PyMem_Free(rt);
    return out;
}

/* -- observation copies --------------------------------------------------------------------- */

PyDoc_STRVAR(copy_into_doc,
             "copy_into(dst, src) -> bool\n\n"
             "dst[...] = src for two C-contiguous buffers of the same format and shape: copied (without\n"
             "the GIL only above 256 KiB) and True; False, with nothing copied, for anything else (the\n"
             "caller then lets numpy convert or broadcast). numpy lets the GIL go for every copy of\n"
             "more than 500 elements, and in a threaded worker another env thread then takes it.");

static PyObject *
native_copy_into(PyObject *module, PyObject *args)
{
    PyObject *dst_obj, *src_obj;
    if (!PyArg_ParseTuple(args, "OO", &dst_obj, &src_obj)) {
        return NULL;
    }
    Py_buffer d, s;
    if (PyObject_GetBuffer(dst_obj, &d, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        Py_RETURN_FALSE;
    }
    if (PyObject_GetBuffer(src_obj, &s, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        PyBuffer_Release(&d);
        Py_RETURN_FALSE;
    }
    int same = d.len == s.len && d.itemsize == s.itemsize && d.ndim == s.ndim &&
               strcmp(d.format ? d.format : "B", s.format ? s.format : "B") == 0;
    for (int j = 0; same && j < d.ndim; j++) {
        same = d.shape[j] == s.shape[j];
    }
    if (same && d.buf != s.buf && d.len > 0) {
        if (d.len > NOGIL_BYTES) {
            Py_BEGIN_ALLOW_THREADS;
            memmove(d.buf, s.buf, (size_t)d.len);
            Py_END_ALLOW_THREADS;
        } else {
            memmove(d.buf, s.buf, (size_t)d.len);
        }
    }
    PyBuffer_Release(&s);
    PyBuffer_Release(&d);
    return PyBool_FromLong(same);
}

static PyMethodDef native_functions[] = {
    {"copy_into", (PyCFunction)native_copy_into, METH_VARARGS, copy_into_doc},
    {"ring", (PyCFunction)native_ring, METH_VARARGS, ring_doc},
    {"drain", (PyCFunction)native_drain, METH_O, drain_doc},
    {"wait", (PyCFunction)native_wait, METH_VARARGS, wait_doc},
    {"set_idle_poll", (PyCFunction)native_set_idle_poll, METH_VARARGS, set_idle_poll_doc},
    {"wake_probe", (PyCFunction)native_wake_probe, METH_VARARGS, wake_probe_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "torchrl_asyncpool.exchange._native",
    .m_doc = "The consumer's lease and answer, the workers' row copies and stores, and GIL-keeping doorbell calls in C (see torchrl_asyncpool.exchange.native).",
    .m_size = -1,
    .m_methods = native_functions,
};

PyMODINIT_FUNC
PyInit__native(void)
{
    static struct {
        const char *name;
        PyTypeObject *type;
    } types[] = {{"Engine", &EngineType}, {"Rows", &RowsType}, {"Pass", &PassType}};
    idle_main_thread = pthread_self();
    PyObject *m = PyModule_Create(&native_module);
    if (m == NULL) {
        return NULL;
    }
    for (size_t j = 0; j < sizeof(types) / sizeof(types[0]); j++) {
        if (PyType_Ready(types[j].type) < 0 || PyModule_AddObjectRef(m, types[j].name, (PyObject *)types[j].type) < 0) {
            Py_DECREF(m);
            return NULL;
        }
    }
    return m;
}
