/*
 * The wake-up probe (doorbell.py's wake_cost_ns). What idle polling saves is the cost of waking
 * a thread parked on an idle core, which depends on the machine (a VM whose idle vCPUs halt to
 * the host pays ~50 us a wake, bare metal with shallow C-states a few us). The probe measures it as the pool's waits see it: an echo thread
 * pinned to another CPU blocks in poll(2) on an eventfd, the caller rings it after a short sleep
 * (so that both cores went idle) and blocks until the echo rings back.
 *
 * Threads: the echo thread reads its WakeEcho, written before pthread_create and never after;
 * the caller joins it before the struct goes away.
 */
#include "native.h"

#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/eventfd.h>

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

const char ap_wake_probe_doc[] =
             "wake_probe(rounds=64, gap_us=300) -> int or None\n\n"
             "Median nanoseconds of an eventfd round trip between this thread and an echo thread\n"
             "on another CPU of this process's mask, each round after a gap_us sleep (both cores\n"
             "idle, as a pool's waits find them): two wake-ups of a thread blocked in poll(2).\n"
             "None when the process may run on one CPU only or the probe cannot be set up. The\n"
             "calling thread is pinned for the probe and its CPU mask restored afterwards.";

PyObject *
ap_wake_probe(PyObject *module, PyObject *args)
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

