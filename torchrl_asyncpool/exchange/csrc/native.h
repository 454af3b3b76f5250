/*
 * Shared definitions of the C extension torchrl_asyncpool.exchange._native.
 *
 * One extension module, built from one file per concept (setup.py lists them):
 *
 *   module.c      the module object, its function table, and the buffer helpers every type uses
 *   engine.c      Engine: the consumer's lease / answer / scan over the arena (exchange/consumer.py;
 *                 exchange/reference_engine.py is its pure-Python specification)
 *   stores.c      the workers' stores: Rows (row copies into transition chunks), Pass (per-pass
 *                 record stores and publish), copy_into (an observation copy that keeps the GIL)
 *   step_loop.c   step_group: the pass loop's steps of plain gymnasium envs (action, env.step,
 *                 observation copy, the record staged) without a Python frame of ours per env
 *   doorbell.c    eventfd ring / drain and the one-GIL-release wait (exchange/doorbell.py)
 *   idle_poll.c   the per-process SCHED_IDLE poller that idle-polled waits park on
 *   wake_probe.c  the measurement of a cross-core wake-up that decides idle polling
 *
 * Threads. Every datum two threads share is a C11 atomic, or is only touched with the GIL held
 * (noted where it is). Metric sums in the arena have one writer and readers elsewhere: sum_add
 * and count_add. Data in the arena shared with other processes is ordered by the slot
 * state word: a writer stores the record, then the state with release semantics; a reader
 * loads the state with acquire semantics before it reads the record (slot_load / slot_store).
 */
#ifndef TORCHRL_ASYNCPOOL_NATIVE_H
#define TORCHRL_ASYNCPOOL_NATIVE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <poll.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* The slot states of torchrl_asyncpool/exchange/slot_states.py (one int32 word per slot).
   test_native_exchange checks these against the Python values through the module constants. */
enum slot_state {
    SLOT_FREE = 0,
    SLOT_OBS_READY = 1,
    SLOT_LEASED = 2,
    SLOT_ACTION_READY = 3,
    SLOT_ERROR = 4,
};

/* The record step types of torchrl_asyncpool/step_type.py (StepType, stored as int8). */
enum step_type {
    STEP_FIRST = 0,
    STEP_MID = 1,
    STEP_TERMINATION = 2,
    STEP_TRUNCATION = 3,
};

/* above this many bytes a copy runs without the GIL (pixel batches) */
#define NOGIL_BYTES (256 * 1024)

/* The state word of a slot, read before its record (pairs with the writer's slot_store). The
   arena's words are int32 in shared memory, written by other processes; GCC and Clang give
   _Atomic int32_t the size and alignment of int32_t, so the cast is the C11 way to read them. */
static inline int32_t
slot_load(int32_t *word)
{
    return atomic_load_explicit((_Atomic int32_t *)word, memory_order_acquire);
}

/* Stores a slot's state after its record (release: the record is visible first). */
static inline void
slot_store(int32_t *word, int32_t state)
{
    atomic_store_explicit((_Atomic int32_t *)word, state, memory_order_release);
}

/* Adds x to a metric sum that only this thread writes and other threads or processes read
   (PoolMetrics, the driver's metrics() while a serving thread runs): relaxed atomic accesses,
   so that a reader never sees a torn value; no read-modify-write instruction is needed with
   one writer, and on x86-64 these compile to the plain loads and stores. */
static inline void
sum_add(double *sum, double x)
{
    _Atomic double *a = (_Atomic double *)sum;
    atomic_store_explicit(a, atomic_load_explicit(a, memory_order_relaxed) + x, memory_order_relaxed);
}

static inline void
count_add(int64_t *count, int64_t x)
{
    _Atomic int64_t *a = (_Atomic int64_t *)count;
    atomic_store_explicit(a, atomic_load_explicit(a, memory_order_relaxed) + x, memory_order_relaxed);
}

static inline int64_t
mono_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* The type object of a class of this module: Name, Name_init, Name_dealloc, Name_methods, Name_doc. */
#define NATIVE_TYPE(Name)                                                                            \
    {                                                                                                \
        PyVarObject_HEAD_INIT(NULL, 0).tp_name = "torchrl_asyncpool.exchange._native." #Name,        \
        .tp_basicsize = sizeof(Name), .tp_flags = Py_TPFLAGS_DEFAULT, .tp_doc = Name##_doc,           \
        .tp_new = PyType_GenericNew, .tp_init = (initproc)Name##_init,                                \
        .tp_dealloc = (destructor)Name##_dealloc, .tp_methods = Name##_methods,                       \
    }

/* A row copy between two buffers of whole rows. */
typedef struct {
    char *src;
    char *dst;
    Py_ssize_t row; /* bytes per row */
} Gather;

/* ---- module.c: buffer helpers ---- */

/* Takes a writable C-contiguous buffer of exactly nbytes into views[*nviews] (released by the
   owner's dealloc) and points *out at its memory. */
int ap_hold_buffer(Py_buffer *views, Py_ssize_t *nviews, PyObject *obj, Py_ssize_t nbytes, const char *what,
                   void *out);
#define take_buffer(self, obj, nbytes, what, out) ap_hold_buffer((self)->views, &(self)->nviews, obj, nbytes, what, out)

/* Takes a contiguous int64 buffer (a numpy int64 array) into *v; TypeError naming it otherwise. */
int ap_index_buffer(PyObject *obj, Py_buffer *v, const char *what);

/* ---- doorbell.c ---- */

/* Adds n to the eventfd counter fd: 0, or -1 with errno set (a saturated counter is not an error). */
int ap_ring_fd(int fd, uint64_t n);
/* Reads and zeroes the non-blocking eventfd counter fd into *value: 0, or -1 with errno set. */
int ap_drain_fd(int fd, uint64_t *value);

PyObject *ap_ring(PyObject *module, PyObject *args);
PyObject *ap_drain(PyObject *module, PyObject *arg);
PyObject *ap_wait(PyObject *module, PyObject *args);
extern const char ap_ring_doc[], ap_drain_doc[], ap_wait_doc[];

/* ---- idle_poll.c ---- */

#define WAIT_STACK_FDS 16 /* descriptors a wait holds on its stack (and an idle-polled wait at most) */
#define IDLE_PATIENCE_NS 5000000LL /* a wait idle-polls for its first 5 ms, then blocks */
/* idle_wait's answer when the main thread's wait reached its self-check with nothing fired:
   the caller takes the GIL, runs pending signal handlers (a signal that arrived between two
   futex waits interrupted neither) and calls again with what is left of the timeout */
#define IDLE_AGAIN (-2)

void ap_idle_init(void);
int ap_idle_enabled(void);
int ap_idle_wait(struct pollfd *p, Py_ssize_t n, int timeout_ms, int64_t give_up);
PyObject *ap_set_idle_poll(PyObject *module, PyObject *args);
PyObject *ap_idle_stats(PyObject *module, PyObject *unused);
extern const char ap_idle_stats_doc[];
extern const char ap_set_idle_poll_doc[];

/* ---- wake_probe.c ---- */

PyObject *ap_wake_probe(PyObject *module, PyObject *args);
extern const char ap_wake_probe_doc[];

/* ---- stores.c and engine.c ---- */

PyObject *ap_copy_into(PyObject *module, PyObject *args);
extern const char ap_copy_into_doc[];

/* step_loop.c */
PyObject *ap_step_group(PyObject *module, PyObject *args);
extern const char ap_step_group_doc[];
PyObject *ap_set_obs_fallback(PyObject *module, PyObject *fit);
extern const char ap_set_obs_fallback_doc[];
extern PyTypeObject ap_EngineType, ap_RowsType, ap_PassType;

#endif
