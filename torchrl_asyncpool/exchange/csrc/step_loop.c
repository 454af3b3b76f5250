/*
 * The pass loop's env steps for plain gymnasium envs, in C (workers/stepper.py,
 * _Stepper.step_pass), and for the gymnasium env under a TorchRL GymEnv on the fast path
 * (TorchRLGymFastAdapter.c_step: its step count and reward sum too). For each env of a group:
 * its action value from the slot's action row, env.step(action), the observation copied into the
 * slot's row (cast from float64 where the row is float32, as DoubleToFloat casts), the step count
 * and the reward sum advanced and written into theirs, and the record staged in the
 * lists RecordWriter.plain_staging() hands out (only for a writer whose add() does nothing
 * more: no recurrent inputs, no restart flags), as GymnasiumEnvAdapter.step_into and
 * RecordWriter.add do in Python.
 * What stays Python: the env's step itself (a call of its bound method) and the copy of an
 * observation that is not a same-format C-contiguous buffer of the row's shape (exchange.native's
 * fit_rows converts it, or refuses another shape). Only the
 * worker's pass-loop thread calls it, with the GIL held throughout.
 */
#include "native.h"

/* the fields of a slot's fast tuple (stepper._fast_step) */
enum { F_INDEX, F_STEP, F_ACTION, F_MAKE_ACTION, F_OBS, F_COUNT, F_SUM, F_FIELDS };
/* the RecordWriter's staging lists, in the order step_group takes them */
enum { L_IDX, L_STS, L_REWARDS, L_TIMES, L_LISTS };

static double
monotonic_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t); /* time.perf_counter's clock on Linux */
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* What copies an observation that is not a same-format buffer of the row's shape: exchange.native's
   fit_rows(dst, src, key), which converts what fits and raises for what does not (set by
   set_obs_fallback when that module is imported); numpy's dst[...] = src until then. */
static PyObject *obs_fallback = NULL;

const char ap_set_obs_fallback_doc[] =
             "set_obs_fallback(fit)\n\n"
             "fit(dst, src, key) copies the observations step_group cannot memcpy (another dtype, shape or\n"
             "type): it converts what fits the row and raises ValueError for what does not.";

PyObject *
ap_set_obs_fallback(PyObject *module, PyObject *fit)
{
    if (!PyCallable_Check(fit)) {
        PyErr_SetString(PyExc_TypeError, "set_obs_fallback takes a callable fit(dst, src, key)");
        return NULL;
    }
    Py_XSETREF(obs_fallback, Py_NewRef(fit));
    Py_RETURN_NONE;
}

static int
fit_obs(PyObject *dst, PyObject *src, PyObject *key)
{
    if (obs_fallback == NULL) {
        return PyObject_SetItem(dst, Py_Ellipsis, src);
    }
    PyObject *r = PyObject_CallFunctionObjArgs(obs_fallback, dst, src, key, NULL);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

/* dst[...] = src: one memcpy for same-format C-contiguous buffers of up to NOGIL_BYTES (the copy
   keeps the GIL, as copy_into's does), fit_obs for anything else. key: the Dict space's key, or None. */
static int
copy_obs(PyObject *dst, PyObject *src, PyObject *key)
{
    Py_buffer d, s;
    int same = 0;
    if (PyObject_GetBuffer(dst, &d, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        return fit_obs(dst, src, key);
    }
    if (PyObject_GetBuffer(src, &s, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        PyBuffer_Release(&d);
        return fit_obs(dst, src, key);
    }
    const char *df = d.format ? d.format : "B", *sf = s.format ? s.format : "B";
    /* a float32 row of a float64 observation (TorchRL's DoubleToFloat of a MuJoCo env) is cast
       element by element, as numpy's astype rounds */
    int cast = strcmp(df, "f") == 0 && strcmp(sf, "d") == 0 && d.len / 4 == s.len / 8;
    same = (cast || (d.len == s.len && d.itemsize == s.itemsize && strcmp(df, sf) == 0)) && d.len <= NOGIL_BYTES &&
           d.ndim == s.ndim;
    for (int j = 0; same && j < d.ndim; j++) {
        same = d.shape[j] == s.shape[j];
    }
    if (same && cast) {
        float *out = (float *)d.buf;
        const double *in = (const double *)s.buf;
        for (Py_ssize_t j = 0; j < d.len / 4; j++) {
            out[j] = (float)in[j];
        }
    } else if (same && d.buf != s.buf) {
        memmove(d.buf, s.buf, (size_t)d.len);
    }
    PyBuffer_Release(&s);
    PyBuffer_Release(&d);
    return same ? 0 : fit_obs(dst, src, key);
}

/* env.step's action for one slot: row[()] (a numpy scalar of a Discrete space's int64 row) when
   make is None, else make(row) (a Box row's copy, a scalar of another integer dtype). */
static PyObject *
action_value(PyObject *row, PyObject *make, PyObject *empty)
{
    return make == Py_None ? PyObject_GetItem(row, empty) : PyObject_CallOneArg(make, row);
}

/* The one element of a writable state array or row of itemsize bytes (the stepper checked the
   dtypes: int64 counts, float32 sums), or NULL with an exception set; release b after. */
static void *
element(PyObject *o, Py_buffer *b, Py_ssize_t itemsize)
{
    if (PyObject_GetBuffer(o, b, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        return NULL;
    }
    if (b->len != itemsize) {
        PyBuffer_Release(b);
        PyErr_Format(PyExc_TypeError, "step_group: a step count or reward sum must be one element of %zd bytes",
                     itemsize);
        return NULL;
    }
    return b->buf;
}

/* The state and the row of a count or sum tuple (its items 0 and 1) in sb and rb: 0 (release
   both after), or -1 with an exception set. */
static int
state_and_row(PyObject *t, Py_ssize_t itemsize, Py_buffer *sb, Py_buffer *rb)
{
    if (element(PyTuple_GET_ITEM(t, 0), sb, itemsize) == NULL) {
        return -1;
    }
    if (element(PyTuple_GET_ITEM(t, 1), rb, itemsize) == NULL) {
        PyBuffer_Release(sb);
        return -1;
    }
    return 0;
}

/* TorchRL's StepCounter on the fast path: count = (state, row, max_steps) with int64 [1] arrays;
   the state counts the step, the row gets it, and reaching max_steps (> 0) truncates. */
static int
count_step(PyObject *count, int *truncated)
{
    long long max_steps = PyLong_AsLongLong(PyTuple_GET_ITEM(count, 2));
    Py_buffer sb, rb;
    if ((max_steps == -1 && PyErr_Occurred()) || state_and_row(count, 8, &sb, &rb) < 0) {
        return -1;
    }
    int64_t n = ++*(int64_t *)sb.buf;
    *(int64_t *)rb.buf = n;
    if (max_steps > 0 && n >= max_steps) {
        *truncated = 1;
    }
    PyBuffer_Release(&rb);
    PyBuffer_Release(&sb);
    return 0;
}

/* TorchRL's RewardSum on the fast path: total = (state, row), float32 [1] arrays; the reward,
   rounded to float32 as reward_spec.encode rounds it, is added in float32 as torch adds it. */
static int
sum_reward(PyObject *total, PyObject *reward)
{
    double r = reward == Py_None ? 0.0 : PyFloat_AsDouble(reward);
    Py_buffer sb, rb;
    if ((r == -1.0 && PyErr_Occurred()) || state_and_row(total, 4, &sb, &rb) < 0) {
        return -1;
    }
    float sum = *(float *)sb.buf + (float)r;
    *(float *)sb.buf = sum;
    *(float *)rb.buf = sum;
    PyBuffer_Release(&rb);
    PyBuffer_Release(&sb);
    return 0;
}

/* Steps one slot and writes its observation (and its count and sum); its step type (enum
   step_type), or -1 with an exception set. *reward gets a new reference to the reward (None:
   0.0, as RecordWriter.add). */
static int
step_one(PyObject *fast, PyObject *empty, PyObject **reward)
{
    PyObject *action = action_value(PyTuple_GET_ITEM(fast, F_ACTION), PyTuple_GET_ITEM(fast, F_MAKE_ACTION), empty);
    if (action == NULL) {
        return -1;
    }
    PyObject *out = PyObject_CallOneArg(PyTuple_GET_ITEM(fast, F_STEP), action);
    Py_DECREF(action);
    if (out == NULL) {
        return -1;
    }
    int st = -1;
    if (!PyTuple_Check(out) || PyTuple_GET_SIZE(out) != 5) {
        PyErr_Format(PyExc_ValueError,
                     "env.step must return (observation, reward, terminated, truncated, info), got %.200R", out);
        goto done;
    }
    PyObject *rows = PyTuple_GET_ITEM(fast, F_OBS), *obs = PyTuple_GET_ITEM(out, 0);
    if (PyTuple_Check(rows)) { /* a Dict space: ((key, row), ...), each row gets obs[key] */
        for (Py_ssize_t m = 0; m < PyTuple_GET_SIZE(rows); m++) {
            PyObject *pair = PyTuple_GET_ITEM(rows, m);
            PyObject *value = PyObject_GetItem(obs, PyTuple_GET_ITEM(pair, 0));
            int rc = value == NULL ? -1 : copy_obs(PyTuple_GET_ITEM(pair, 1), value, PyTuple_GET_ITEM(pair, 0));
            Py_XDECREF(value);
            if (rc < 0) {
                goto done;
            }
        }
    } else if (copy_obs(rows, obs, Py_None) < 0) {
        goto done;
    }
    int terminated = PyObject_IsTrue(PyTuple_GET_ITEM(out, 2));
    int truncated = terminated < 0 ? -1 : PyObject_IsTrue(PyTuple_GET_ITEM(out, 3));
    if (truncated < 0) {
        goto done;
    }
    PyObject *count = PyTuple_GET_ITEM(fast, F_COUNT), *total = PyTuple_GET_ITEM(fast, F_SUM);
    PyObject *r = PyTuple_GET_ITEM(out, 1);
    if ((count != Py_None && count_step(count, &truncated) < 0) || (total != Py_None && sum_reward(total, r) < 0)) {
        goto done;
    }
    st = terminated ? STEP_TERMINATION : (truncated ? STEP_TRUNCATION : STEP_MID);
    *reward = r == Py_None ? PyFloat_FromDouble(0.0) : Py_NewRef(r);
    if (*reward == NULL) {
        st = -1;
    }
done:
    Py_DECREF(out);
    return st;
}

static int
append_new(PyObject *list, PyObject *item)
{
    if (item == NULL) {
        return -1;
    }
    int rc = PyList_Append(list, item);
    Py_DECREF(item);
    return rc;
}

/* The slot tuples fast[start:n] have step_group's layout: 0, or -1 with a TypeError set. */
static int
check_slots(PyObject *fast, Py_ssize_t start, Py_ssize_t n)
{
    for (Py_ssize_t j = start; j < n; j++) {
        PyObject *f = PyList_GET_ITEM(fast, j);
        if (!PyTuple_Check(f) || PyTuple_GET_SIZE(f) != F_FIELDS) {
            PyErr_SetString(PyExc_TypeError, "step_group: each slot is a tuple of 7 fields");
            return -1;
        }
        PyObject *count = PyTuple_GET_ITEM(f, F_COUNT), *total = PyTuple_GET_ITEM(f, F_SUM);
        if ((count != Py_None && (!PyTuple_Check(count) || PyTuple_GET_SIZE(count) != 3 ||
                                  !PyLong_Check(PyTuple_GET_ITEM(count, 2)))) ||
            (total != Py_None && (!PyTuple_Check(total) || PyTuple_GET_SIZE(total) != 2))) {
            PyErr_SetString(PyExc_TypeError,
                            "step_group: a slot's step count is None or (state, row, max_steps: int), its reward "
                            "sum None or (state, row)");
            return -1;
        }
    }
    return 0;
}

const char ap_step_group_doc[] =
    "step_group(stepper, fast, start, idx, sts, rewards, times, slow_s, hold_s) -> (k, ended)\n\n"
    "Steps the slots fast[start:] in order (each slot's tuple: index, env.step, action row, action\n"
    "maker or None, observation row or ((key, row), ...) for a Dict space, step count (state, row,\n"
    "max_steps) or None, reward sum (state, row) or None) and appends each record to the four staging lists (slot,\n"
    "step type, reward, step seconds), as RecordWriter.add does. Stops after a step slower than\n"
    "slow_s or once hold_s has passed since the group started. Returns how many were stepped and\n"
    "the positions (in fast) of those whose episode ended. If a step raises, stepper.current is\n"
    "set to that slot's index and the exception propagates; the records before it stay staged.";

PyObject *
ap_step_group(PyObject *module, PyObject *args)
{
    PyObject *stepper, *fast, *lists[L_LISTS];
    Py_ssize_t start;
    double slow_s, hold_s;
    if (!PyArg_ParseTuple(args, "OO!nO!O!O!O!dd", &stepper, &PyList_Type, &fast, &start, &PyList_Type,
                          &lists[L_IDX], &PyList_Type, &lists[L_STS], &PyList_Type, &lists[L_REWARDS],
                          &PyList_Type, &lists[L_TIMES], &slow_s, &hold_s)) {
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(fast);
    if (start < 0 || start > n) {
        PyErr_Format(PyExc_IndexError, "start %zd outside the %zd slots", start, n);
        return NULL;
    }
    if (check_slots(fast, start, n) < 0) {
        return NULL;
    }
    PyObject *ended = PyList_New(0), *empty = PyTuple_New(0);
    if (ended == NULL || empty == NULL) {
        Py_XDECREF(ended);
        Py_XDECREF(empty);
        return NULL;
    }
    Py_ssize_t k = 0;
    double t_group = monotonic_s(), t = t_group;
    for (Py_ssize_t j = start; j < n; j++) {
        /* a step may run any Python, but nothing else holds this list: the item stays alive */
        PyObject *f = PyList_GET_ITEM(fast, j);
        PyObject *reward = NULL;
        int st = step_one(f, empty, &reward);
        if (st < 0) {
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            PyObject_SetAttrString(stepper, "current", PyTuple_GET_ITEM(f, F_INDEX)); /* names the env */
            PyErr_Clear();
            PyErr_Restore(type, value, tb);
            goto fail;
        }
        double t_end = monotonic_s(), dt = t_end - t;
        t = t_end;
        /* the four entries of one record are made before any is appended (only an append that runs
           out of memory can leave the lists unaligned, and the worker then fails anyway) */
        PyObject *items[L_LISTS] = {Py_NewRef(PyTuple_GET_ITEM(f, F_INDEX)), PyLong_FromLong(st), reward,
                                    PyFloat_FromDouble(dt)};
        int ok = items[L_STS] != NULL && items[L_TIMES] != NULL;
        for (int m = 0; m < L_LISTS; m++) {
            ok = ok && PyList_Append(lists[m], items[m]) == 0;
        }
        for (int m = 0; m < L_LISTS; m++) {
            Py_XDECREF(items[m]);
        }
        if (!ok) {
            goto fail;
        }
        k++;
        if (st != STEP_MID && append_new(ended, PyLong_FromSsize_t(j)) < 0) {
            goto fail;
        }
        if (dt > slow_s || t_end - t_group > hold_s) {
            break;
        }
    }
    Py_DECREF(empty);
    return Py_BuildValue("(nN)", k, ended);
fail:
    Py_DECREF(empty);
    Py_DECREF(ended);
    return NULL;
}
