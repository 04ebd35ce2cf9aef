/*
 * region.h: the shared-memory region between the host daemon and libcgpu.
 *
 * One region file per container (path in $CGPU_REGION, else
 * CGPU_CONTAINER_REGION_PATH), mapped MAP_SHARED
 * by every process of the container and by the daemon. The layout is
 * versioned: a reader refuses a region whose magic, version or size differ.
 * cgpu_km/region.py mirrors this header with ctypes; a test compiles a probe
 * against this file and compares every offset and size.
 *
 * Rules that make it safe without locks (a killed process can hold nothing):
 *  - Memory is counted per process slot. A process adds to its own slot
 *    first, then sums all slots; if the sum is over the limit it takes the
 *    addition back. Of any set of racing allocations that all succeed, the
 *    one that summed last saw all of them, so the container total never
 *    exceeds the limit. The container total is the sum of the slots: no
 *    separate counter exists that could drift or go negative.
 *  - A slot whose process is gone (kill(pid, 0) fails, or /proc shows a
 *    zombie or a different start time) is reclaimed by whoever notices it
 *    (another process of the container, or the daemon) with a compare-and-
 *    swap on its state, then zeroed: its bytes leave the total at once.
 *  - The gate is a futex word written only by the daemon. Waiters use
 *    FUTEX_WAIT with a timeout and re-check the heartbeat, so a dead daemon
 *    never blocks a launch for longer than gate_timeout_ns.
 *  - The gate acts at launch time only, so each process also keeps its
 *    queued work short (gpu.max_inflight launches per stream, see
 *    libcgpu/flight.c): work queued before the gate closed drains quickly.
 *
 * All timestamps are CLOCK_MONOTONIC nanoseconds (Python: time.monotonic_ns()).
 * All fields are naturally aligned; 64-bit fields are read and written with
 * single atomic loads and stores.
 */
#ifndef CGPU_REGION_H
#define CGPU_REGION_H

#include <stdint.h>

#define CGPU_REGION_MAGIC 0x314e4f4947455243ULL /* "CREGION1" little-endian */
#define CGPU_REGION_VERSION 2u
#define CGPU_MAX_GPUS 16
#define CGPU_MAX_PROCS 256
#define CGPU_ID_LEN 72
#define CGPU_PATH_LEN 256
#define CGPU_UUID_LEN 96
#define CGPU_DEFAULT_GATE_TIMEOUT_NS 2000000000ULL
/* gpu.max_inflight when the creator does not say: a process keeps at most
 * about this many launches per stream queued ahead of the GPU, so a closed
 * gate takes effect within that many kernels (0 = unbounded). */
#define CGPU_DEFAULT_MAX_INFLIGHT 16u
/* Where a container finds its region when $CGPU_REGION is not set (the OCI
 * hook bind-mounts it there); $CGPU_REGION set but empty means no region. */
#define CGPU_CONTAINER_REGION_PATH "/run/cgpu/region"

/* region.mode */
#define CGPU_MODE_CGPU 0u
#define CGPU_MODE_EGPU 1u

/* gpu.gate (futex word) */
#define CGPU_GATE_OPEN 0u
#define CGPU_GATE_CLOSED 1u

/* proc.state */
#define CGPU_SLOT_FREE 0u
#define CGPU_SLOT_CLAIMING 1u   /* being filled by its new owner */
#define CGPU_SLOT_LIVE 2u
#define CGPU_SLOT_RECLAIMING 3u /* being zeroed after its owner died */

/* Per container GPU k (the k-th GPU the container sees). 256 bytes. */
struct cgpu_gpu {
    uint64_t limit;          /* bytes the container may hold; 0 = no limit (whole device) */
    uint64_t ctx_bytes;      /* charged once per process holding a context on this GPU */
    uint32_t gate;           /* futex word, CGPU_GATE_*; written by the daemon only */
    uint32_t host_index;     /* the GPU's index on the host (NVML index) */
    uint64_t gate_changes;   /* daemon: times the gate was opened or closed */
    char uuid[CGPU_UUID_LEN]; /* "GPU-...", matched against the driver; "" = by ordinal */
    uint32_t max_inflight;   /* launches a process may keep queued per stream; 0 = unbounded */
    uint32_t reserved32;     /* 0 */
    uint8_t reserved[120];
};

/* One process's use of one GPU. 64 bytes, written by the owner only. */
struct cgpu_proc_gpu {
    uint64_t mem;            /* bytes held, including `inflight` */
    uint64_t inflight;       /* part of `mem` still being checked against the limit */
    uint64_t launches;       /* kernel and graph launches issued */
    uint64_t last_launch_ns; /* CLOCK_MONOTONIC_COARSE stamp of the last launch (~4 ms grain) */
    uint64_t gate_wait_ns;   /* total time launches spent blocked at the closed gate */
    uint32_t pending;        /* launches waiting now: at the gate, or for the GPU (max_inflight) */
    uint32_t contexts;       /* contexts held (ctx_bytes charged while > 0) */
    uint64_t allocs;         /* successful allocations */
    uint64_t oom_refusals;   /* allocations refused for the limit */
};

/* One process of the container. 64-byte header + one line per GPU. */
struct cgpu_proc {
    uint32_t state;          /* CGPU_SLOT_* */
    int32_t pid;             /* in the process's own pid namespace */
    uint64_t start_time;     /* field 22 of /proc/<pid>/stat (clock ticks after boot) */
    uint64_t pidns;          /* inode of /proc/self/ns/pid, 0 if unknown */
    uint64_t attach_ns;      /* when the slot was claimed */
    char comm[32];           /* process name, for views */
    struct cgpu_proc_gpu gpu[CGPU_MAX_GPUS];
};

struct cgpu_region {
    uint64_t magic;          /* CGPU_REGION_MAGIC */
    uint32_t version;        /* CGPU_REGION_VERSION */
    uint32_t size;           /* sizeof(struct cgpu_region) */
    uint32_t ngpus;          /* gpu[0..ngpus) are valid */
    uint32_t mode;           /* CGPU_MODE_* */
    uint64_t heartbeat_ns;   /* daemon's last stamp; 0 = no daemon (gates fail open) */
    uint64_t gate_timeout_ns; /* gates fail open when the heartbeat is older than this */
    uint32_t slots_used;     /* high-water mark: proc[0..slots_used) may be in use */
    uint32_t flags;          /* reserved, 0 */
    uint64_t created_ns;     /* when the region was created */
    char container_id[CGPU_ID_LEN];
    char oom_script[CGPU_PATH_LEN]; /* eGPU: program run before an over-limit process stops */
    uint8_t reserved[128];
    struct cgpu_gpu gpu[CGPU_MAX_GPUS];
    struct cgpu_proc proc[CGPU_MAX_PROCS];
};

#if defined(__STDC_VERSION__) && __STDC_VERSION__ >= 201112L
_Static_assert(sizeof(struct cgpu_gpu) == 256, "cgpu_gpu layout");
_Static_assert(sizeof(struct cgpu_proc_gpu) == 64, "cgpu_proc_gpu layout");
_Static_assert(sizeof(struct cgpu_proc) == 64 + 64 * CGPU_MAX_GPUS, "cgpu_proc layout");
_Static_assert(sizeof(struct cgpu_region) ==
                   512 + 256 * CGPU_MAX_GPUS + sizeof(struct cgpu_proc) * CGPU_MAX_PROCS,
               "cgpu_region layout");
#endif

#endif /* CGPU_REGION_H */
