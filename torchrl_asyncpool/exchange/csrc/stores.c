/*
 * The workers' stores into the arena and their chunks: Rows (row copies from slot fields into
 * transition chunks), Pass (a pass's record stores and publish: step types, end flags, rewards,
 * step timers, ready times, OBS_READY, one ring of the consumer) and copy_into (an observation
 * copy that keeps the GIL). Called by torchrl_asyncpool/workers through exchange/native.py.
 *
 * Threads: a Pass may be shared by the env threads of a threaded worker; every method runs with
 * the GIL held from start to end (none lets it go), and each record touches only its own slot.
 */
#include "native.h"

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
    if (ap_index_buffer(so, &sv, "src_rows") < 0) {
        return NULL;
    }
    if (ap_index_buffer(dobj, &dv, "dst_rows") < 0) {
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

PyTypeObject ap_RowsType = NATIVE_TYPE(Rows);

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
    /* store()'s checked values, 3 doubles per slot, made once (a pass's group holds each slot
       at most once; a longer list, which can only repeat slots, gets a buffer of its own) */
    double *scratch;
} Pass;

static void
Pass_dealloc(Pass *self)
{
    for (Py_ssize_t i = 0; i < self->nviews; i++) {
        PyBuffer_Release(&self->views[i]);
    }
    PyMem_Free(self->scratch);
    Py_TYPE(self)->tp_free((PyObject *)self);
}


static int
Pass_init(Pass *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"state", "ready_time", "reward", "step_type", "done", "terminated", "truncated",
                             "step_time", "step_count", "consumer_fd", NULL};
    PyObject *o[9];
    int fd;
    if (self->nviews != 0 || self->scratch != NULL) {
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
    self->scratch = PyMem_Malloc(sizeof(double) * 3 * (size_t)n);
    if (self->scratch == NULL) {
        PyErr_NoMemory();
        return -1;
    }
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

/* A record's step type and the end flags it implies (TorchRL's done/terminated/truncated). */
static void
store_step_type(Pass *self, Py_ssize_t i, int st)
{
    const Py_ssize_t fb = self->flag_bytes;
    self->step_type[i] = (int8_t)st;
    memset(self->terminated + i * fb, st == STEP_TERMINATION, (size_t)fb);
    memset(self->truncated + i * fb, st == STEP_TRUNCATION, (size_t)fb);
    memset(self->done + i * fb, st == STEP_TERMINATION || st == STEP_TRUNCATION, (size_t)fb);
}

static int
valid_step_type(long st)
{
    return st >= STEP_FIRST && st <= STEP_TRUNCATION;
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
    if (ap_index_buffer(slots_obj, &iv, "slots") < 0) {
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
    vals = k <= self->n ? self->scratch : PyMem_Malloc(sizeof(double) * 3 * (size_t)k);
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
        if (!valid_step_type(st)) {
            PyErr_Format(PyExc_ValueError, "step type %ld is not one of 0..3", st);
            goto done;
        }
        vals[3 * j] = (double)st;
        vals[3 * j + 1] = r;
        vals[3 * j + 2] = t;
    }
    for (Py_ssize_t j = 0; j < k; j++) {
        int64_t i = idx[j];
        store_step_type(self, i, (int)vals[3 * j]);
        self->reward[i] = (float)vals[3 * j + 1];
        sum_add(&self->step_time[i], vals[3 * j + 2]); /* read by PoolMetrics */
        count_add(&self->step_count[i], 1);
    }
    result = Py_NewRef(Py_True);
done:
    if (vals != self->scratch) {
        PyMem_Free(vals);
    }
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
        slot_store(&self->state[i], SLOT_OBS_READY); /* after the record */
    }
    if (k > 0 && ap_ring_fd(self->consumer_fd, (uint64_t)k) < 0) {
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
    if (!valid_step_type(st)) {
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
    store_step_type(self, i, st);
    self->reward[i] = (float)r;
    if (dt >= 0.0) {
        sum_add(&self->step_time[i], dt);
        count_add(&self->step_count[i], 1);
    }
    self->ready_time[i] = now;
    slot_store(&self->state[i], SLOT_OBS_READY); /* after the record */
    if (ap_ring_fd(self->consumer_fd, 1) < 0) {
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

PyTypeObject ap_PassType = NATIVE_TYPE(Pass);

/* -- observation copies --------------------------------------------------------------------- */

const char ap_copy_into_doc[] =
             "copy_into(dst, src) -> bool\n\n"
             "dst[...] = src for two C-contiguous buffers of the same format and shape: copied (without\n"
             "the GIL only above 256 KiB) and True; False, with nothing copied, for anything else (the\n"
             "caller then converts it, or refuses another shape: exchange.native.fit_rows). numpy lets\n"
             "the GIL go for every copy of more than 500 elements, and in a threaded worker another env\n"
             "thread then takes it.";

PyObject *
ap_copy_into(PyObject *module, PyObject *args)
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

