/*
 * cgpu.h: internal interfaces of libcgpu (not installed, not exported).
 *
 * region.c  attaches the container's region, owns this process's slot and
 *           implements the limit check and the gate;
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

/* The mapped region, or NULL when this process runs without one (pass-through). */
extern struct cgpu_region *cgpu_region_ptr CGPU_HIDDEN;
/* This process's slot, or NULL until first needed. */
extern struct cgpu_proc *cgpu_slot_ptr CGPU_HIDDEN;

/* Map $CGPU_REGION once; returns the region or NULL. Thread safe. */
struct cgpu_region *cgpu_region(void) CGPU_HIDDEN;
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
/* Container-wide bytes in use on GPU g (sum of the slots). */
uint64_t cgpu_usage(int g) CGPU_HIDDEN;
/* Zero the slots of processes that are gone; returns how many. */
int cgpu_reclaim_dead(void) CGPU_HIDDEN;
/* Over the limit: in eGPU mode runs the OOM script and stops the process
 * (does not return); in cGPU mode counts the refusal and returns. */
void cgpu_over_limit(int g, uint64_t request) CGPU_HIDDEN;

/* Wait while the gate of GPU g is closed (fails open on a stale heartbeat). */
void cgpu_gate_wait(int g) CGPU_HIDDEN;

static inline uint64_t cgpu_coarse_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* The launch fast path: one load of the gate, two owner-only updates. */
static inline void cgpu_gate_pass(struct cgpu_region *r, int g)
{
    if (cgpu_unlikely(__atomic_load_n(&r->gpu[g].gate, __ATOMIC_ACQUIRE) != CGPU_GATE_OPEN))
        cgpu_gate_wait(g);
    struct cgpu_proc *s = cgpu_slot();
    if (cgpu_likely(s != NULL)) {
        __atomic_fetch_add(&s->gpu[g].launches, 1, __ATOMIC_RELAXED);
        __atomic_store_n(&s->gpu[g].last_launch_ns, cgpu_coarse_ns(), __ATOMIC_RELAXED);
    }
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
