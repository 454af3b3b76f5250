/*
 * Engine: the consumer's hot path over the arena, one call each for lease (scan the state words,
 * take the oldest ready slots up to the cap, gather their records into the staging buffer, mark
 * them leased), answer (scatter the actions into the response fields, mark the slots answered, ring
 * each worker once) and scan (count the states).
 *
 * torchrl_asyncpool/exchange/reference_engine.py is the executable specification of this type:
 * the same interface and results in pure Python, and test_engine_equivalence.py drives both over
 * the same random sequences. SlotConsumer calls either without knowing which.
 *
 * Allocation: everything is allocated in __init__ (per layout); lease and answer allocate
 * nothing but their Python return value.
 *
 * Threads: an Engine belongs to the one consumer thread of its pool. lease lets the GIL go for
 * large gathers; `busy` (read and written only with the GIL held) refuses a second call on the
 * same Engine from another thread in that window instead of letting it share the scratch arrays.
 */
#include "native.h"

#include <stdlib.h>

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
    Py_buffer *vals;     /* [nresp] scratch of answer(): the values' buffers */
    Aged *aged;          /* [n] scratch of lease() */
    double *stats;       /* the arena's consumer_stats */
    Py_ssize_t st[8];    /* positions in stats: frames, batches, partial, fill, obs dwell, action dwell,
                            actions, wait (exchange/metrics.py owns them) */
    Py_buffer *views;    /* every buffer held, released at dealloc */
    Py_ssize_t nviews;
    int busy; /* a lease or answer runs (GIL held to read or write it) */
} Engine;

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
    PyMem_Free(self->vals);
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
        self->vals = PyMem_Calloc(k > 0 ? k : 1, sizeof(Py_buffer));
        self->nresp = k;
    }
    if ((with_src && self->gathers == NULL) ||
        (!with_src && (self->resp == NULL || self->resp_row == NULL || self->vals == NULL))) {
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

/* Takes the Engine for one call (GIL held); RuntimeError when another thread is inside it. */
static int
engine_enter(Engine *self)
{
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError,
                        "Engine: called from two threads at once (one consumer thread may drive a pool)");
        return -1;
    }
    self->busy = 1;
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
        int32_t s = slot_load(&self->state[i]);
        if (s == SLOT_OBS_READY) {
            ready++;
            if (self->ready_time[i] < oldest) oldest = self->ready_time[i];
        } else if (s == SLOT_ACTION_READY) {
            answered++;
        } else if (s == SLOT_ERROR) {
            errors++;
        }
    }
    return Py_BuildValue("nnnd", ready, answered, errors, oldest);
}

PyDoc_STRVAR(lease_doc,
             "lease(cap, now, waited) -> (b, dwell_sum)\n\n"
             "Leases the ready slots (the cap longest-waiting ones, in slot order, if more are ready;\n"
             "equal ready times go by slot index): their indices go to env_index[:b], their records to\n"
             "the gathers' dst[:b], their state to LEASED and lease_time to now. dwell_sum adds\n"
             "now - ready_time over the b slots in slot order. A batch (b > 0) is added to the stats,\n"
             "with waited seconds of waiting before it.");

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
    if (engine_enter(self) < 0) {
        return NULL;
    }
    Aged *aged = self->aged;
    Py_ssize_t b = 0;
    for (Py_ssize_t i = 0; i < self->n; i++) {
        if (slot_load(&self->state[i]) == SLOT_OBS_READY) {
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
        /* relaxed: only consumers read LEASED, and this thread is the consumer */
        atomic_store_explicit((_Atomic int32_t *)&self->state[i], SLOT_LEASED, memory_order_relaxed);
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
        sum_add(&a[st[0]], (double)b);
        sum_add(&a[st[1]], 1.0);
        sum_add(&a[st[2]], b < cap ? 1.0 : 0.0);
        sum_add(&a[st[3]], (double)b / (double)cap);
        sum_add(&a[st[4]], dwell);
        sum_add(&a[st[7]], waited);
    }
    self->busy = 0;
    return Py_BuildValue("nd", b, dwell);
}

PyDoc_STRVAR(answer_doc,
             "answer(idx, values, now, lease_time=-1.0)\n\n"
             "Writes values[k] (a C-contiguous buffer of len(idx) rows of field k, or of one row that\n"
             "every row gets) into the response rows idx, stores ACTION_READY in those slots, then\n"
             "rings each of their doorbells once (in the order of idx). Adds the answers to the stats,\n"
             "with the time since their lease (lease_time >= 0: the one lease time of every row; else\n"
             "each slot's own, summed in the order of idx). Every index and buffer is checked before\n"
             "the first byte is written.");

static PyObject *
Engine_answer(Engine *self, PyObject *args)
{
    PyObject *idx_obj, *values;
    double now, lease_t = -1.0;
    if (!PyArg_ParseTuple(args, "OOd|d", &idx_obj, &values, &now, &lease_t)) {
        return NULL;
    }
    Py_buffer iv;
    if (ap_index_buffer(idx_obj, &iv, "idx") < 0) {
        return NULL;
    }
    if (engine_enter(self) < 0) {
        PyBuffer_Release(&iv);
        return NULL;
    }
    PyObject *fast = NULL, *result = NULL;
    Py_buffer *vals = self->vals; /* .obj NULL until taken, and again after release */
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
    PyObject **items = PySequence_Fast_ITEMS(fast);
    /* every buffer is checked before the first byte is written */
    for (Py_ssize_t k = 0; k < self->nresp; k++) {
        if (PyObject_GetBuffer(items[k], &vals[k], PyBUF_C_CONTIGUOUS) < 0) {
            vals[k].obj = NULL;
            goto done;
        }
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
        slot_store(&self->state[idx[r]], SLOT_ACTION_READY); /* after the data */
    }
    for (Py_ssize_t r = 0; r < b; r++) {
        int64_t bell = self->slot_bell[idx[r]];
        if (self->rung[bell]) continue;
        self->rung[bell] = 1;
        if (ap_ring_fd(self->bell_fd[bell], 1) < 0) {
            PyErr_SetFromErrno(PyExc_OSError);
            for (Py_ssize_t q = 0; q < b; q++) self->rung[self->slot_bell[idx[q]]] = 0;
            goto done;
        }
    }
    for (Py_ssize_t r = 0; r < b; r++) self->rung[self->slot_bell[idx[r]]] = 0;
    sum_add(&self->stats[self->st[6]], (double)b);
    sum_add(&self->stats[self->st[5]], dwell);
    result = Py_NewRef(Py_None);
done:
    for (Py_ssize_t k = 0; k < self->nresp; k++) {
        if (vals[k].obj != NULL) {
            PyBuffer_Release(&vals[k]); /* sets .obj back to NULL */
        }
    }
    Py_XDECREF(fast);
    PyBuffer_Release(&iv);
    self->busy = 0;
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
             "C-contiguous with n rows. exchange.reference_engine.ReferenceEngine is its pure-Python\n"
             "specification.");

PyTypeObject ap_EngineType = NATIVE_TYPE(Engine);
