/*
 * cgpu.h: internal interfaces of libcgpu (not installed, not exported).
 *
 * region.c  attaches the container's region, owns this process's slot and
 *           implements the limit check and the gate;
 * watch.c   the watcher thread: answers the daemon's closes once this
 *           process's queued work has drained (flight.c waits for it);
 * track.c   remembers the size and GPU of every live allocation;
 * hooks.c   resolves the real driver and NVML and defines every exported
 *           wrapper, cuGetProcAddress and dlsym.
 */
#ifndef CGPU_INTERNAL_H
#define CGPU_INTERNAL_H

#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "region.h"

#define CGPU_HIDDEN __attribute__((visibility("hidden")))
#define CGPU_EXPORT __attribute__((visibility("default")))
#define cgpu_likely(x) __builtin_expect(!!(x), 1)
#define cgpu_unlikely(x) __builtin_expect(!!(x), 0)

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

/* Launches of this process between passing a gate and the driver's return,
 * per container GPU: a drain (watch.c) waits for them to reach the driver. */
extern uint32_t cgpu_launching[CGPU_MAX_GPUS] CGPU_HIDDEN;

static inline uint64_t cgpu_coarse_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* ---- watch.c ---- */

/* Whether this process answers the closes of GPU g (set at its first launch). */
extern uint32_t cgpu_watching[CGPU_MAX_GPUS] CGPU_HIDDEN;
/* Start answering closes of GPU g: the watcher thread, started once. */
void cgpu_watch(int g) CGPU_HIDDEN;
void cgpu_watch_after_fork(void) CGPU_HIDDEN;

/* Enter a launch on GPU g: wait while its gate is closed, then count the
 * launch as in progress. The fast path is one load of the gate and one
 * atomic add (no clock: last_launch_ns is stamped with the in-flight
 * markers, flight.c); the gate is looked at again after the add, so that a drain
 * that starts after the close either sees this launch in progress or this
 * launch sees the gate closed (see cgpu_flight_drain). */
static inline void cgpu_launch_enter(const struct cgpu_control *r, int g)
{
    if (cgpu_unlikely(!__atomic_load_n(&cgpu_watching[g], __ATOMIC_RELAXED)))
        cgpu_watch(g);
    int armed = 0;
    for (;;) {
        if (cgpu_likely(__atomic_load_n(&r->gpu[g].gate, __ATOMIC_ACQUIRE) == CGPU_GATE_OPEN)) {
            __atomic_fetch_add(&cgpu_launching[g], 1, __ATOMIC_SEQ_CST);
            if (cgpu_likely(__atomic_load_n(&r->gpu[g].gate, __ATOMIC_SEQ_CST) ==
                            CGPU_GATE_OPEN))
                break;
            __atomic_fetch_sub(&cgpu_launching[g], 1, __ATOMIC_SEQ_CST);
        }
        enum cgpu_pass pass = cgpu_gate_wait(g);
        if (pass == CGPU_PASS_FAILED_OPEN) {
            __atomic_fetch_add(&cgpu_launching[g], 1, __ATOMIC_SEQ_CST);
            break;
        }
        if (pass == CGPU_PASS_ARMED) { /* as above: a drain sees it, or it sees the close */
            __atomic_fetch_add(&cgpu_launching[g], 1, __ATOMIC_SEQ_CST);
            if (__atomic_load_n(&r->gpu[g].gate, __ATOMIC_SEQ_CST) != CGPU_GATE_CLOSED) {
                armed = 1;
                break;
            }
            __atomic_fetch_sub(&cgpu_launching[g], 1, __ATOMIC_SEQ_CST);
        }
    }
    struct cgpu_proc *s = cgpu_slot();
    if (cgpu_likely(s != NULL))
        __atomic_fetch_add(&s->gpu[g].launches, 1, __ATOMIC_RELAXED);
    if (cgpu_unlikely(armed)) /* after the count: the daemon looks at it when woken */
        cgpu_armed_ring(g);
}

static inline void cgpu_launch_exit(int g)
{
    __atomic_fetch_sub(&cgpu_launching[g], 1, __ATOMIC_RELEASE);
}

uint64_t cgpu_now_ns(void) CGPU_HIDDEN;
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
