/*
 * The module torchrl_asyncpool.exchange._native: its function table, its types and constants,
 * and the buffer helpers the types share. See native.h for the files and what each holds.
 */
#include "native.h"

int
ap_hold_buffer(Py_buffer *views, Py_ssize_t *nviews, PyObject *obj, Py_ssize_t nbytes, const char *what, void *out)
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

int
ap_index_buffer(PyObject *obj, Py_buffer *v, const char *what)
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

static PyMethodDef native_functions[] = {
    {"copy_into", (PyCFunction)ap_copy_into, METH_VARARGS, ap_copy_into_doc},
    {"step_group", (PyCFunction)ap_step_group, METH_VARARGS, ap_step_group_doc},
    {"set_obs_fallback", (PyCFunction)ap_set_obs_fallback, METH_O, ap_set_obs_fallback_doc},
    {"ring", (PyCFunction)ap_ring, METH_VARARGS, ap_ring_doc},
    {"drain", (PyCFunction)ap_drain, METH_O, ap_drain_doc},
    {"wait", (PyCFunction)ap_wait, METH_VARARGS, ap_wait_doc},
    {"set_idle_poll", (PyCFunction)ap_set_idle_poll, METH_VARARGS, ap_set_idle_poll_doc},
    {"idle_stats", (PyCFunction)ap_idle_stats, METH_NOARGS, ap_idle_stats_doc},
    {"wake_probe", (PyCFunction)ap_wake_probe, METH_VARARGS, ap_wake_probe_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "torchrl_asyncpool.exchange._native",
    .m_doc = "The consumer's lease and answer, the workers' row copies and stores, and GIL-keeping doorbell "
             "calls in C (see torchrl_asyncpool.exchange.native).",
    .m_size = -1,
    .m_methods = native_functions,
};

PyMODINIT_FUNC
PyInit__native(void)
{
    static const struct {
        const char *name;
        PyTypeObject *type;
    } types[] = {{"Engine", &ap_EngineType}, {"Rows", &ap_RowsType}, {"Pass", &ap_PassType}};
    /* the enums of native.h, so that a test can hold them to the Python values they mirror */
    static const struct {
        const char *name;
        long value;
    } constants[] = {
        {"SLOT_FREE", SLOT_FREE},
        {"SLOT_OBS_READY", SLOT_OBS_READY},
        {"SLOT_LEASED", SLOT_LEASED},
        {"SLOT_ACTION_READY", SLOT_ACTION_READY},
        {"SLOT_ERROR", SLOT_ERROR},
        {"STEP_FIRST", STEP_FIRST},
        {"STEP_MID", STEP_MID},
        {"STEP_TERMINATION", STEP_TERMINATION},
        {"STEP_TRUNCATION", STEP_TRUNCATION},
    };
    ap_idle_init();
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
    for (size_t j = 0; j < sizeof(constants) / sizeof(constants[0]); j++) {
        if (PyModule_AddIntConstant(m, constants[j].name, constants[j].value) < 0) {
            Py_DECREF(m);
            return NULL;
        }
    }
    return m;
}
