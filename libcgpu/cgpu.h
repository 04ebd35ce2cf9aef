/*
 * cgpu.h: internal interfaces of libcgpu (not installed, not exported).
 *
 * region.c  attaches the container's region, owns this process's slot and
 *           implements the limit check and the gate;
 * launch.c  which threads are between a gate and the driver (a drain waits
 *           for them);
 * watch.c   the watcher thread: answers the daemon's closes once this
 *           process's queued work has drained (flight.c waits for it);
 * track.c   remembers the size and GPU of every live allocation;
 * hooks.c   resolves the real driver and NVML and defines every exported
 *           wrapper, cuGetProcAddress, dlsym and dlvsym, and checks that
 *           nothing ahead of libcgpu takes the wrapped names.
 */
#ifndef CGPU_INTERNAL_H
#define CGPU_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "region.h"

#define CGPU_HIDDEN __attribute__((visibility("hidden")))
#define CGPU_EXPORT __attribute__((visibility("default")))
#define cgpu_likely(x) __builtin_expect(!!(x), 1)
#define cgpu_unlikely(x) __builtin_expect(!!(x), 0)
/* initial-exec: read with one instruction, not a __tls_get_addr call per
 * launch (libcgpu is preloaded, so its TLS is in the static block; these few
 * bytes fit the surplus glibc keeps even where it is loaded later). */
#define CGPU_FAST_TLS __attribute__((tls_model("initial-exec")))

/* ---- region.c ---- */

/* The mapped control part, or NULL when this process runs without a region
 * (pass-through); the account part, or NULL when it could not be mapped
 * writable (then nothing can be charged and allocations are refused). */
extern const struct cgpu_control *cgpu_region_ptr CGPU_HIDDEN;
extern struct cgpu_account *cgpu_account_ptr CGPU_HIDDEN;
/* This process's slot, or NULL until first needed. */
extern struct cgpu_proc *cgpu_slot_ptr CGPU_HIDDEN;

/* Map the region once; returns its control part or NULL. Thread safe. */
const struct cgpu_control *cgpu_region_attach(void) CGPU_HIDDEN;

static inline const struct cgpu_control *cgpu_region(void)
{
    const struct cgpu_control *r = __atomic_load_n(&cgpu_region_ptr, __ATOMIC_ACQUIRE);
    return cgpu_likely(r != NULL) ? r : cgpu_region_attach();
}
/* This process's slot, claimed on first use; NULL if every slot is taken. */
struct cgpu_proc *cgpu_slot_claim(void) CGPU_HIDDEN;

static inline struct cgpu_proc *cgpu_slot(void)
{
    struct cgpu_proc *s = __atomic_load_n(&cgpu_slot_ptr, __ATOMIC_ACQUIRE);
    return cgpu_likely(s != NULL) ? s : cgpu_slot_claim();
}

/* Reserve `size` bytes on container GPU g for this process: 0 on success,
 * -1 when the container would exceed its limit (or no slot is free). */
int cgpu_reserve(int g, uint64_t size) CGPU_HIDDEN;
/* Give back bytes reserved earlier (never below zero). */
void cgpu_unreserve(int g, uint64_t size) CGPU_HIDDEN;
/* Container-wide bytes in use on GPU g: the sum of the slots, or what the
 * daemon saw the others hold plus this process's own count when more. */
uint64_t cgpu_usage(int g) CGPU_HIDDEN;
/* Zero the slots of processes that are gone; returns how many. */
int cgpu_reclaim_dead(void) CGPU_HIDDEN;
/* Over the limit: in eGPU mode runs the OOM script and stops the process
 * (does not return); in cGPU mode counts the refusal and returns. */
void cgpu_over_limit(int g, uint64_t request) CGPU_HIDDEN;

long cgpu_futex_wait(const uint32_t *addr, uint32_t val, uint64_t timeout_ns) CGPU_HIDDEN;
/* Bump GPU g's doorbell and wake the daemon waiting on it. */
void cgpu_ring(int g) CGPU_HIDDEN;
/* Wait while the gate of GPU g is closed: CGPU_PASS_OPENED once it opened,
 * CGPU_PASS_ARMED when it is armed (see region.h), CGPU_PASS_FAILED_OPEN when
 * the daemon's heartbeat is stale. */
enum cgpu_pass { CGPU_PASS_FAILED_OPEN, CGPU_PASS_OPENED, CGPU_PASS_ARMED };
enum cgpu_pass cgpu_gate_wait(int g) CGPU_HIDDEN;
/* A launch passed GPU g's armed gate: ring, once per arming. */
void cgpu_armed_ring(int g) CGPU_HIDDEN;
/* How many of libcgpu's entry points resolve to other code first (hooks.c's
 * self-check): kept, and written into this process's slot (`hijacked` on
 * each of the container's GPUs), which it claims for that when there is a
 * region; every slot the process claims later gets it too. */
void cgpu_report_hijacked(uint64_t n) CGPU_HIDDEN;

/* ---- launch.c ---- */

/* A thread's launch between passing a gate and the driver's return: a drain
 * (flight.c) waits for them to reach the driver. One cache line each,
 * written by its thread only. */
#define CGPU_LAUNCHERS 1024
struct cgpu_launcher {
    uint32_t gpu;   /* 1 + the container GPU of the launch in progress, or 0 */
    uint32_t taken; /* a thread has it */
} __attribute__((aligned(64)));

extern struct cgpu_launcher cgpu_launchers[CGPU_LAUNCHERS] CGPU_HIDDEN;
/* The word of threads that have none of their own: they count in cgpu_launching. */
extern struct cgpu_launcher cgpu_launcher_shared CGPU_HIDDEN;
extern __thread struct cgpu_launcher *cgpu_launcher_self CGPU_HIDDEN CGPU_FAST_TLS;
extern uint32_t cgpu_launching[CGPU_MAX_GPUS] CGPU_HIDDEN;
/* 1 until the drain's membarrier is registered: each launch fences itself. */
extern int cgpu_launch_fence CGPU_HIDDEN;

/* This thread's word, taken on its first launch (or cgpu_launcher_shared). */
struct cgpu_launcher *cgpu_launcher_claim(void) CGPU_HIDDEN;
/* Register the drain's barrier; before the watcher thread starts. */
void cgpu_launch_barrier_register(void) CGPU_HIDDEN;
/* Wait until every launch on GPU g that passed its gate has reached the driver. */
void cgpu_launches_settle(int g) CGPU_HIDDEN;
void cgpu_launch_after_fork(void) CGPU_HIDDEN;

/* Say that this thread's launch on GPU g is past the gate; the caller then
 * looks at the gate again (and calls cgpu_launching_end if it closed). */
static inline void cgpu_launching_begin(int g)
{
    struct cgpu_launcher *me = cgpu_launcher_self;
    if (cgpu_unlikely(me == NULL))
        me = cgpu_launcher_claim();
    if (cgpu_likely(me != &cgpu_launcher_shared)) {
        __atomic_store_n(&me->gpu, (uint32_t)g + 1, __ATOMIC_RELAXED);
        if (cgpu_unlikely(__atomic_load_n(&cgpu_launch_fence, __ATOMIC_RELAXED)))
            __atomic_thread_fence(__ATOMIC_SEQ_CST);
        else /* the drain's membarrier is the barrier: only the compiler's here */
            __atomic_signal_fence(__ATOMIC_SEQ_CST);
    } else {
        __atomic_fetch_add(&cgpu_launching[g], 1, __ATOMIC_SEQ_CST);
    }
}

/* The launch reached the driver (or went back to the gate). */
static inline void cgpu_launching_end(int g)
{
    struct cgpu_launcher *me = cgpu_launcher_self;
    if (cgpu_likely(me != &cgpu_launcher_shared))
        __atomic_store_n(&me->gpu, 0, __ATOMIC_RELEASE);
    else
        __atomic_fetch_sub(&cgpu_launching[g], 1, __ATOMIC_RELEASE);
}

/* ---- watch.c ---- */

/* Whether this process answers the closes of GPU g (set at its first launch). */
extern uint32_t cgpu_watching[CGPU_MAX_GPUS] CGPU_HIDDEN;
/* Start answering closes of GPU g: the watcher thread, started once. */
void cgpu_watch(int g) CGPU_HIDDEN;
/* A launch on GPU g while the daemon asks for its idle reports (gpu.idle_grace_ns):
 * noted for the watcher, and a report of idle taken back. */
void cgpu_idle_launch(struct cgpu_proc *s, int g) CGPU_HIDDEN;
void cgpu_watch_after_fork(void) CGPU_HIDDEN;

uint64_t cgpu_now_ns(void) CGPU_HIDDEN;

/* Whether the slice the daemon named for GPU g's open gate has ended
 * (gpu.close_at_ns): the process then waits as at a closed gate, and its
 * watcher answers the close that comes (watch.c). */
static inline int cgpu_past_close(const struct cgpu_control *r, int g)
{
    uint64_t at = __atomic_load_n(&r->gpu[g].close_at_ns, __ATOMIC_ACQUIRE);
    return cgpu_unlikely(at != 0) && cgpu_now_ns() >= at;
}

/* Enter a launch on GPU g: wait while its gate is closed, then mark the
 * launch in progress. The fast path is a load of the gate, two plain stores
 * (the thread's word, the slot's launch count) and the gate's load again
 * after the first, so that a drain that starts after the close either sees
 * this launch in progress or this launch sees the gate closed (see
 * cgpu_launches_settle). */
static inline void cgpu_launch_enter(const struct cgpu_control *r, int g)
{
    if (cgpu_unlikely(!__atomic_load_n(&cgpu_watching[g], __ATOMIC_RELAXED)))
        cgpu_watch(g);
    int armed = 0;
    for (;;) {
        if (cgpu_likely(__atomic_load_n(&r->gpu[g].gate, __ATOMIC_ACQUIRE) == CGPU_GATE_OPEN)) {
            cgpu_launching_begin(g);
            /* the slice's end after the thread's word: a watcher that closes
             * this process at that time settles the launches after it */
            if (cgpu_likely(__atomic_load_n(&r->gpu[g].gate, __ATOMIC_SEQ_CST) ==
                            CGPU_GATE_OPEN) && !cgpu_past_close(r, g))
                break;
            cgpu_launching_end(g);
        }
        enum cgpu_pass pass = cgpu_gate_wait(g);
        if (pass == CGPU_PASS_FAILED_OPEN) {
            cgpu_launching_begin(g);
            break;
        }
        if (pass == CGPU_PASS_ARMED) { /* as above: a drain sees it, or it sees the close */
            cgpu_launching_begin(g);
            if (__atomic_load_n(&r->gpu[g].gate, __ATOMIC_SEQ_CST) != CGPU_GATE_CLOSED) {
                armed = 1;
                break;
            }
            cgpu_launching_end(g);
        }
    }
    struct cgpu_proc *s = cgpu_slot();
    /* Not a locked add: the daemon only asks whether the count changed, and
     * a count that two threads race on still changes. */
    if (cgpu_likely(s != NULL)) {
        __atomic_store_n(&s->gpu[g].launches,
                         __atomic_load_n(&s->gpu[g].launches, __ATOMIC_RELAXED) + 1,
                         __ATOMIC_RELAXED);
        if (cgpu_unlikely(__atomic_load_n(&r->gpu[g].idle_grace_ns, __ATOMIC_RELAXED) != 0))
            cgpu_idle_launch(s, g);
    }
    if (cgpu_unlikely(armed)) /* after the count: the daemon looks at it when woken */
        cgpu_armed_ring(g);
}

static inline void cgpu_launch_exit(int g)
{
    cgpu_launching_end(g);
}

void cgpu_log(const char *fmt, ...) CGPU_HIDDEN __attribute__((format(printf, 1, 2)));

/* ---- track.c ---- */

enum cgpu_track_kind { CGPU_TRACK_PTR, CGPU_TRACK_HANDLE, CGPU_TRACK_ARRAY, CGPU_TRACK_CTX,
                       CGPU_TRACK_KINDS };

void cgpu_track_put(enum cgpu_track_kind kind, uint64_t key, uint64_t size, int g) CGPU_HIDDEN;
/* Remove and return the entry: 1 when found (size and g filled in). */
int cgpu_track_take(enum cgpu_track_kind kind, uint64_t key, uint64_t *size, int *g) CGPU_HIDDEN;
/* Look without removing. */
int cgpu_track_get(enum cgpu_track_kind kind, uint64_t key, uint64_t *size, int *g) CGPU_HIDDEN;
void cgpu_track_after_fork(void) CGPU_HIDDEN;

/* ---- hooks.c ---- */
void cgpu_hooks_after_fork(void) CGPU_HIDDEN;

#endif /* CGPU_INTERNAL_H */
