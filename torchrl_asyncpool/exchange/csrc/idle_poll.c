/*
 * Idle polling. A blocking poll(2) makes the remote ring a cross-core wake-up: on a VM whose
 * vCPUs halt when idle (cpuidle haltpoll with guest_halt_poll_ns=0) it costs ~100 us round trip
 * through the host, and a reschedule IPI to a busy vCPU costs more. With idle polling on, a
 * waiter parks on a futex of its own process instead, and one SCHED_IDLE thread per process,
 * which runs only when its core has nothing else to run, polls the parked waiters' descriptors
 * with poll(0) (which registers no wait queue, so the remote write wakes nobody) and wakes a
 * waiter whose descriptors fired: a same-core wake of a few microseconds. A starved poller (its
 * core busy) is covered by the waiter's own capped futex wait. The poller parks itself when no
 * waiter was parked for a while.
 * Only the short waits of a running exchange gain: a wait still parked after IDLE_PATIENCE_NS
 * (a paused collector, envs held by back-pressure, a pool nobody drives) blocks in poll(2) for
 * the rest of it, so that an idle pool leaves its cores idle; its one slow wake-up at the end
 * is nothing against a wait that long.
 *
 * Threads. The waiters (any Python thread, without the GIL) and the poller share:
 *   - each IdleWaiter: `state` is the hand-over word (a waiter claims a free record with a CAS,
 *     fills it, publishes it with a release store of PARKED; the poller reads it only after an
 *     acquire load sees PARKED). Its descriptors are atomics too: a waiter may free the record and
 *     another claim and refill it while the poller is still reading it. Such a torn read only
 *     polls the wrong descriptors once (a spurious wake, after which the waiter polls for itself
 *     and parks again, or a missed one, which the next round or the waiter's capped wait makes
 *     up), and no thread ever waits for the SCHED_IDLE poller, which may not run for a long time;
 *   - the CPU mask the poller follows: a seqlock (idle_mask_seq odd while a waiter writes the
 *     words), written by one waiter at a time (a trylock: a waiter that finds another writing
 *     skips its update) and read by the poller without a lock, retried when torn;
 *   - the switches idle_on and idle_cap_ns, set by set_idle_poll and read by every wait;
 *   - the poller's start (idle_claim_pid, idle_started_pid) and parking (idle_poller_parked,
 *     idle_armed).
 * idle_main_thread is written once, at import, before any wait runs.
 */
#include "native.h"

#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <strings.h>
#include <sys/syscall.h>

#define IDLE_WAITERS 64
#define IDLE_PARK_NS 5000000LL /* the poller parks after 5 ms without a parked waiter */
#define IDLE_BLOCK (-3) /* inside idle_wait: the wait ran out of patience */
#define MAIN_BLOCK_MS 50 /* the main thread's blocking rest goes back to Python this often */

enum { W_FREE = 0, W_TAKEN = 1, W_PARKED = 2 /* the poller checks it */, W_FIRED = 3 };

typedef struct {
    _Atomic int state;
    _Atomic int nfds;
    _Atomic int fd[WAIT_STACK_FDS]; /* polled for POLLIN */
} IdleWaiter;

static IdleWaiter idle_waiters[IDLE_WAITERS];
static _Atomic int idle_on = -1;          /* -1: not read yet */
static _Atomic long idle_cap_ns = 1000000; /* a parked waiter polls by itself at least this often */
static _Atomic pid_t idle_claim_pid, idle_started_pid;
static _Atomic int idle_poller_parked; /* 1 while the poller sleeps on it */
static _Atomic long idle_armed;        /* counts parkings, so the poller sees activity */

/* The CPU mask of the last thread that parked: the poller follows it, so that its wake-up is a
   same-core one in a pinned process (its thread may have been started before the pinning). */
#define MASK_WORDS (sizeof(cpu_set_t) / sizeof(unsigned long))
static _Atomic unsigned long idle_mask[MASK_WORDS];
static _Atomic long idle_mask_seq; /* odd while a waiter writes idle_mask; +2 per new mask */
static pthread_mutex_t idle_mask_writer = PTHREAD_MUTEX_INITIALIZER; /* waiters only */

static pthread_t idle_main_thread; /* the thread that imported the module: Python's main thread */

/* Starvation. The poller runs only on an idle core; where another process keeps the cores busy
   it hardly runs, and every parked waiter is woken by its own capped wait instead, up to
   idle_cap_ns late: on cheap envs (MuJoCo, ~60 us a step) that halved a pool's throughput beside
   one busy process, while blocking waits were slowed by far less. A waiter that finds its
   descriptors fired after its own wait timed out counts a late wake, one woken by the poller a
   timely one; when late wakes outnumber timely ones by STARVE_SCORE, the process's waits block
   in poll(2) for STARVE_BACKOFF_NS (then idle polling is tried again). */
#define STARVE_SCORE 32
#define STARVE_BACKOFF_NS 500000000LL
static _Atomic long idle_late, idle_timely, idle_backoffs;
static _Atomic int idle_score;
static _Atomic int64_t idle_backoff_until; /* mono_ns; 0: never */

static void
note_wake(int timely)
{
    if (timely) {
        atomic_fetch_add_explicit(&idle_timely, 1, memory_order_relaxed);
        if (atomic_load_explicit(&idle_score, memory_order_relaxed) > 0) {
            atomic_fetch_sub_explicit(&idle_score, 1, memory_order_relaxed); /* may dip below 0 in a race: harmless */
        }
        return;
    }
    atomic_fetch_add_explicit(&idle_late, 1, memory_order_relaxed);
    if (atomic_fetch_add(&idle_score, 1) + 1 >= STARVE_SCORE) {
        atomic_store(&idle_score, 0);
        atomic_store(&idle_backoff_until, mono_ns() + STARVE_BACKOFF_NS);
        atomic_fetch_add(&idle_backoffs, 1);
    }
}

void
ap_idle_init(void)
{
    idle_main_thread = pthread_self();
}

static long
futex_op(_Atomic int *addr, int op, int val, const struct timespec *ts)
{
    return syscall(SYS_futex, addr, op, val, ts, NULL, 0);
}

/* A waiter publishes its CPU mask if it differs from the last one (no waiting on anyone). */
static void
mask_publish(const cpu_set_t *mine)
{
    unsigned long words[MASK_WORDS];
    memcpy(words, mine, sizeof(words));
    int same = 1;
    for (size_t j = 0; j < MASK_WORDS && same; j++) {
        same = atomic_load_explicit(&idle_mask[j], memory_order_relaxed) == words[j];
    }
    if (same || pthread_mutex_trylock(&idle_mask_writer) != 0) {
        return;
    }
    atomic_fetch_add_explicit(&idle_mask_seq, 1, memory_order_relaxed); /* odd: writing */
    atomic_thread_fence(memory_order_release);
    for (size_t j = 0; j < MASK_WORDS; j++) {
        atomic_store_explicit(&idle_mask[j], words[j], memory_order_relaxed);
    }
    atomic_fetch_add_explicit(&idle_mask_seq, 1, memory_order_release); /* even: done */
    pthread_mutex_unlock(&idle_mask_writer);
}

/* The poller's copy of the mask when a new one was published since *seen: 1 and *out set, or 0. */
static int
mask_read(long *seen, cpu_set_t *out)
{
    long s1 = atomic_load_explicit(&idle_mask_seq, memory_order_acquire);
    if (s1 == *seen || (s1 & 1)) {
        return 0; /* nothing new, or a waiter is writing it: the next round looks again */
    }
    unsigned long words[MASK_WORDS];
    for (size_t j = 0; j < MASK_WORDS; j++) {
        words[j] = atomic_load_explicit(&idle_mask[j], memory_order_relaxed);
    }
    atomic_thread_fence(memory_order_acquire);
    if (atomic_load_explicit(&idle_mask_seq, memory_order_relaxed) != s1) {
        return 0; /* torn */
    }
    *seen = s1;
    memcpy(out, words, sizeof(words));
    return 1;
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
    long seen = atomic_load(&idle_armed), mask_seen = 0;
    for (;;) {
        int any = 0;
        cpu_set_t m;
        if (mask_read(&mask_seen, &m)) {
            sched_setaffinity(0, sizeof(m), &m);
        }
        for (int i = 0; i < IDLE_WAITERS; i++) {
            IdleWaiter *w = &idle_waiters[i];
            if (atomic_load_explicit(&w->state, memory_order_acquire) != W_PARKED) {
                continue;
            }
            any = 1;
            struct pollfd q[WAIT_STACK_FDS];
            int n = atomic_load_explicit(&w->nfds, memory_order_relaxed);
            if (n <= 0 || n > WAIT_STACK_FDS) {
                continue;
            }
            for (int j = 0; j < n; j++) {
                q[j].fd = atomic_load_explicit(&w->fd[j], memory_order_relaxed);
                q[j].events = POLLIN;
                q[j].revents = 0;
            }
            if (poll(q, (nfds_t)n, 0) > 0) {
                int parked = W_PARKED;
                if (atomic_compare_exchange_strong(&w->state, &parked, W_FIRED)) {
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
            /* a waiter parking after this store wakes us (see ap_idle_wait) */
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
            atomic_store(&idle_waiters[i].state, W_FREE);
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
            atomic_store(&idle_on, 0);
            return -1;
        }
        atomic_store(&idle_started_pid, me);
        return 0;
    }
    while (atomic_load(&idle_started_pid) != me && atomic_load(&idle_on)) {
        sched_yield();
    }
    return atomic_load(&idle_on) ? 0 : -1;
}

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

/* poll(p, n, timeout_ms) with idle polling (see above) until give_up (mono_ns), then a
 * blocking poll; called without the GIL. */
int
ap_idle_wait(struct pollfd *p, Py_ssize_t n, int timeout_ms, int64_t give_up)
{
    int main_thread = pthread_equal(pthread_self(), idle_main_thread);
    int64_t deadline = timeout_ms < 0 ? -1 : mono_ns() + (int64_t)timeout_ms * 1000000LL;
    int got = poll(p, (nfds_t)n, 0);
    if (got == 0 && mono_ns() >= give_up) {
        return blocking_rest(p, n, deadline, main_thread);
    }
    if (got == 0 && mono_ns() < atomic_load(&idle_backoff_until)) { /* starved: see note_wake */
        return blocking_rest(p, n, deadline, main_thread);
    }
    if (got != 0 || n > WAIT_STACK_FDS || idle_start() < 0) {
        return got != 0 ? got : poll(p, (nfds_t)n, timeout_ms);
    }
    IdleWaiter *w = NULL;
    for (int i = 0; i < IDLE_WAITERS && w == NULL; i++) {
        int free_ = W_FREE;
        if (atomic_compare_exchange_strong(&idle_waiters[i].state, &free_, W_TAKEN)) {
            w = &idle_waiters[i];
        }
    }
    if (w == NULL) { /* more waiters than records */
        return poll(p, (nfds_t)n, timeout_ms);
    }
    for (Py_ssize_t j = 0; j < n; j++) {
        atomic_store_explicit(&w->fd[j], p[j].fd, memory_order_relaxed);
    }
    atomic_store_explicit(&w->nfds, (int)n, memory_order_relaxed);
    cpu_set_t mine;
    if (sched_getaffinity(0, sizeof(mine), &mine) == 0) {
        mask_publish(&mine);
    }
    for (;;) {
        atomic_store_explicit(&w->state, W_PARKED, memory_order_release); /* after the descriptors */
        atomic_fetch_add(&idle_armed, 1);
        if (atomic_load(&idle_poller_parked)) {
            atomic_store(&idle_poller_parked, 0);
            futex_op(&idle_poller_parked, FUTEX_WAKE_PRIVATE, 1, NULL);
        }
        got = poll(p, (nfds_t)n, 0); /* a ring between the first check and the parking */
        if (got != 0) {
            break;
        }
        int64_t wait_ns = atomic_load_explicit(&idle_cap_ns, memory_order_relaxed);
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
        if (futex_op(&w->state, FUTEX_WAIT_PRIVATE, W_PARKED, &ts) < 0 && errno == EINTR) {
            got = -1; /* the caller runs the signal handlers */
            break;
        }
        got = poll(p, (nfds_t)n, 0);
        if (got != 0) {
            note_wake(atomic_load_explicit(&w->state, memory_order_acquire) == W_FIRED);
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
    atomic_store_explicit(&w->state, W_FREE, memory_order_release);
    if (got == IDLE_BLOCK) {
        return blocking_rest(p, n, deadline, main_thread);
    }
    errno = err;
    return got;
}

int
ap_idle_enabled(void)
{
    int on = atomic_load(&idle_on);
    if (on < 0) { /* first use: the environment decides until set_idle_poll says otherwise */
        const char *v = getenv("TORCHRL_ASYNCPOOL_IDLE_POLL"); /* 0/false/off/no: off, as doorbell.py reads it */
        int from_env = v != NULL && v[0] != '\0' && strcmp(v, "0") != 0 && strcasecmp(v, "false") != 0 &&
                       strcasecmp(v, "off") != 0 && strcasecmp(v, "no") != 0;
        const char *cap = getenv("TORCHRL_ASYNCPOOL_IDLE_POLL_CAP_US");
        if (cap != NULL && atol(cap) > 0) {
            atomic_store(&idle_cap_ns, atol(cap) * 1000L);
        }
        int unread = -1; /* a set_idle_poll that ran meanwhile wins */
        atomic_compare_exchange_strong(&idle_on, &unread, from_env);
        on = atomic_load(&idle_on);
    }
    return on;
}

const char ap_idle_stats_doc[] =
    "idle_stats() -> (late, timely, backoffs)\n\n"
    "This process's idle-polled waits so far: woken late by their own capped wait with their\n"
    "descriptors fired (the poller starved), woken by the poller, and the times late wakes made\n"
    "the process's waits block in poll(2) for a while (see the starvation comment).";

PyObject *
ap_idle_stats(PyObject *module, PyObject *unused)
{
    return Py_BuildValue("(lll)", atomic_load(&idle_late), atomic_load(&idle_timely), atomic_load(&idle_backoffs));
}

const char ap_set_idle_poll_doc[] =
    "set_idle_poll(on, cap_us=0) -> bool\n\n"
    "Turns idle polling of this process's blocking waits on or off (see the module's idle\n"
    "polling comment) and returns what it was; cap_us > 0 sets how often a parked waiter\n"
    "polls by itself when the poller does not run. Without a call, the environment variable\n"
    "TORCHRL_ASYNCPOOL_IDLE_POLL (1 / 0) decides at the first wait.";

PyObject *
ap_set_idle_poll(PyObject *module, PyObject *args)
{
    int on;
    long cap_us = 0;
    if (!PyArg_ParseTuple(args, "p|l", &on, &cap_us)) {
        return NULL;
    }
    int was = ap_idle_enabled();
    atomic_store(&idle_on, on);
    if (cap_us > 0) {
        atomic_store(&idle_cap_ns, cap_us * 1000L);
    }
    return PyBool_FromLong(was);
}
