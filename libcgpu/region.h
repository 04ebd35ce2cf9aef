/*
 * region.h: the shared memory between the host daemon and libcgpu.
 *
 * A container's region is a directory of two files (path in $CGPU_REGION;
 * inside a container started by the hook, CGPU_CONTAINER_REGION_DIR):
 *
 *   control  written by the daemon (and whoever created the region), mapped
 *            read-only by the container's processes: limits, gates, the
 *            heartbeat and everything else the daemon decides. The hook
 *            bind-mounts it read-only, so even root in the container (which
 *            runc gives no CAP_SYS_ADMIN) cannot change it.
 *   account  written by the container's processes, one slot each: memory
 *            held, launches, waits, drain answers. The daemon reads it and
 *            checks what it reads against the kernel's view; a process that
 *            rewrites its own slot gains no more than one that bypasses
 *            libcgpu (the NVML backstop still counts and stops it).
 *
 * Both are mapped MAP_SHARED by every process of the container and by the
 * daemon. Their layouts are versioned: a reader refuses a file whose magic,
 * version or size differ. cgpu_km/dataplane/region.py mirrors this header with ctypes;
 * a test compiles a probe against this file and compares every offset.
 *
 * Rules that make it safe without locks (a killed process can hold nothing):
 *  - Memory is counted per process slot. A process adds to its own slot
 *    first, then sums all slots; if the sum is over the limit it takes the
 *    addition back. Of any set of racing allocations that all succeed, the
 *    one that summed last saw all of them, so the container total never
 *    exceeds the limit. The container total is the sum of the slots.
 *  - A slot whose process is gone is reclaimed by whoever notices it
 *    (another process of the container, or the daemon, which asks the
 *    kernel) with a compare-and-swap on its state, then zeroed.
 *  - A gate is a futex word written only by the daemon. Waiters use
 *    FUTEX_WAIT with a timeout and re-check the heartbeat, so a dead daemon
 *    never blocks a launch for longer than gate_timeout_ns.
 *  - One container's work runs on a GPU at a time (policies 0-4): the daemon
 *    opens a gate for a slice, then closes it and bumps close_seq. Each
 *    process's watcher thread (libcgpu/watch.c) then waits until the work it
 *    queued before the close has finished and answers with drained_seq and
 *    drained_ns, the time its last marker completed. The holder's GPU time
 *    is from the grant to the last answer; only then is the next container
 *    granted. Processes keep their queued work short (gpu.max_inflight
 *    launches per stream, and gpu.queue_ns of GPU time over all streams,
 *    libcgpu/flight.c), so a drain is short too.
 *  - The slice's end: while another container waits the daemon writes when
 *    the holder's slice ends (gpu.close_at_ns, before the gate opens, or
 *    later while it is open). Launches stop at that time by themselves, and
 *    each watcher answers the close to come (close_seq + 1) once its work
 *    has finished, with a ring; a process says it does (proc.gpu.
 *    closes_itself). The daemon then wakes once a switch, on the answer, not
 *    also at the slice's end; it closes the gates of those that do not say
 *    so at that time. A time that has come is never moved while the gate
 *    stays open: the daemon closes it first (an answer ahead stands for a
 *    close).
 *  - The account can be rewritten by any process of the container, so it is
 *    not the only word on memory: every memory round the daemon publishes in
 *    control.seen what the kernel's view (NVML by pid namespace and cgroup)
 *    says each of the container's processes holds. An allocation is admitted
 *    only if the slots' sum and that figure both leave room (region.c,
 *    seen_room): the others' published bytes, less those of processes that
 *    are gone, plus what this process itself holds by its own private count.
 *
 * All timestamps are CLOCK_MONOTONIC nanoseconds (Python: time.monotonic_ns()).
 * All fields are naturally aligned; 64-bit fields are read and written with
 * single atomic loads and stores.
 */
#ifndef CGPU_REGION_H
#define CGPU_REGION_H

#include <stdint.h>

#define CGPU_CONTROL_MAGIC 0x344c544355504743ULL /* "CGPUCTL4" little-endian */
#define CGPU_ACCOUNT_MAGIC 0x3454434155504743ULL /* "CGPUACT4" little-endian */
#define CGPU_REGION_VERSION 4u
#define CGPU_MAX_GPUS 16
#define CGPU_MAX_PROCS 256
#define CGPU_MAX_SEEN 256 /* control.seen entries: the container's GPU processes per NVML */
/* A publication older than this is not believed (no daemon, or its memory
 * service is stuck): then, as without a daemon, only the account counts. */
#define CGPU_SEEN_MAX_AGE_NS 5000000000ULL
#define CGPU_ID_LEN 72
#define CGPU_PATH_LEN 256
#define CGPU_UUID_LEN 96
#define CGPU_DEFAULT_GATE_TIMEOUT_NS 2000000000ULL
/* gpu.max_inflight when the creator does not say: a process keeps at most
 * about this many launches per stream queued ahead of the GPU, so a closed
 * gate takes effect within that many kernels (0 = unbounded). */
#define CGPU_DEFAULT_MAX_INFLIGHT 16u
/* gpu.queue_ns is the GPU time a process may keep queued on the GPU ahead
 * of its newest launch, all its streams together, as libcgpu estimates it
 * (libcgpu/flight.c). When the daemon does not say (0): what a process
 * keeps at most while no other container waits for the GPU, which is what
 * a container that wakes waits behind (and one kernel); the dispatcher
 * writes CGPU_CONTENDED_QUEUE_NS while one does. With kernels longer than
 * the budget, one runs while the next waits to start. */
#define CGPU_DEFAULT_QUEUE_NS 4000000ULL
#define CGPU_CONTENDED_QUEUE_NS 1000000ULL
/* gpu.ctx_bytes: measure each process's context when it is created (the
 * device's used memory before and after, from NVML) and charge that. */
#define CGPU_CTX_MEASURE UINT64_MAX
/* Where a container finds its region (the OCI hook bind-mounts the two files
 * there). When control there is a mount point it is used whatever
 * $CGPU_REGION says (region.c, region_dir). */
#define CGPU_CONTAINER_REGION_DIR "/run/cgpu"
#define CGPU_CONTROL_NAME "control"
#define CGPU_ACCOUNT_NAME "account"

/* control.mode */
#define CGPU_MODE_CGPU 0u
#define CGPU_MODE_EGPU 1u

/* control.gpu.gate (futex word). ARMED: closed, but a launch may pass and
 * ring the doorbell (once per arming, gate_changes); the daemon then grants
 * the GPU or closes the gate. It arms the containers that would take the GPU
 * at once if they waited, so that they need not wait for it to say so. */
#define CGPU_GATE_OPEN 0u
#define CGPU_GATE_CLOSED 1u
#define CGPU_GATE_ARMED 2u

/* account.proc.state */
#define CGPU_SLOT_FREE 0u
#define CGPU_SLOT_CLAIMING 1u   /* being filled by its new owner */
#define CGPU_SLOT_LIVE 2u
#define CGPU_SLOT_RECLAIMING 3u /* being zeroed after its owner died */

/* ---- control: the daemon's decisions, read-only in the container ---- */

/* Per container GPU k (the k-th GPU the container sees). 256 bytes. */
struct cgpu_gpu {
    uint64_t limit;          /* bytes the container may hold; 0 = no limit (whole device) */
    uint64_t ctx_bytes;      /* charged per process holding a context; CGPU_CTX_MEASURE */
    uint32_t gate;           /* futex word, CGPU_GATE_* */
    uint32_t host_index;     /* the GPU's index on the host (NVML index) */
    uint64_t gate_changes;   /* times the gate was opened or closed */
    uint64_t close_seq;      /* bumps at every close; answered in proc.gpu.drained_seq */
    uint64_t grant_ns;       /* when the current grant began; 0 while the gate is not open */
    char uuid[CGPU_UUID_LEN]; /* "GPU-...", matched against the driver; "" = by ordinal */
    uint32_t max_inflight;   /* launches a process may keep queued per stream; 0 = unbounded */
    uint32_t reserved32;     /* 0 */
    uint64_t queue_ns;       /* GPU time a process may keep queued; 0 = CGPU_DEFAULT_QUEUE_NS */
    uint64_t idle_grace_ns;  /* > 0: tell when idle this long (proc.gpu.idle_ns); 0: nobody asks */
    uint64_t close_at_ns;    /* > 0 while open: the slice ends then (see above); 0: at the close */
    uint8_t reserved[80];
};

/* One GPU process of the container as the daemon saw it. 32 bytes. */
struct cgpu_seen {
    uint64_t pidns;          /* inode of its pid namespace */
    int32_t pid;             /* in that namespace */
    uint32_t gpu;            /* container GPU k */
    uint64_t start_time;     /* field 22 of /proc/<pid>/stat */
    uint64_t bytes;          /* what NVML says it holds on that GPU */
};

struct cgpu_control {
    uint64_t magic;          /* CGPU_CONTROL_MAGIC */
    uint32_t version;        /* CGPU_REGION_VERSION */
    uint32_t size;           /* sizeof(struct cgpu_control) */
    uint32_t ngpus;          /* gpu[0..ngpus) are valid */
    uint32_t mode;           /* CGPU_MODE_* */
    uint64_t heartbeat_ns;   /* daemon's last stamp; 0 = no daemon (gates fail open) */
    uint64_t gate_timeout_ns; /* gates fail open when the heartbeat is older than this */
    uint32_t wake;           /* futex word: bumps at every close and limit change */
    uint32_t flags;          /* reserved, 0 */
    uint64_t created_ns;     /* when the region was created */
    char container_id[CGPU_ID_LEN];
    char oom_script[CGPU_PATH_LEN]; /* eGPU: run (inside the container) before a stop */
    uint8_t reserved[128];
    struct cgpu_gpu gpu[CGPU_MAX_GPUS];
    /* Version 4: what the daemon saw, under the seqlock seen_seq. */
    uint64_t seen_seq;       /* odd while the daemon writes seen */
    uint64_t seen_rounds;    /* publications so far */
    uint64_t seen_ns;        /* when published; older than CGPU_SEEN_MAX_AGE_NS is ignored */
    uint32_t nseen;          /* seen[0..nseen) are valid */
    uint32_t seen_reserved;  /* 0 */
    uint64_t seen_rest[CGPU_MAX_GPUS]; /* bytes of processes past CGPU_MAX_SEEN */
    struct cgpu_seen seen[CGPU_MAX_SEEN];
};

/* ---- account: what the container's processes report ---- */

/* One process's use of one GPU. 128 bytes, written by the owner only. */
struct cgpu_proc_gpu {
    uint64_t mem;            /* bytes held, including `inflight` */
    uint64_t inflight;       /* part of `mem` still being checked against the limit */
    uint64_t launches;       /* kernel and graph launches issued */
    uint64_t hijacked;       /* wrapped names other code here defines ahead of libcgpu */
    uint64_t gate_wait_ns;   /* total time launches spent blocked at the closed gate */
    uint32_t pending;        /* launches waiting now: at the gate, or for the GPU (max_inflight) */
    uint32_t contexts;       /* contexts held (ctx_bytes charged while > 0) */
    uint64_t allocs;         /* successful allocations */
    uint64_t oom_refusals;   /* allocations refused for the limit */
    uint64_t ctx_bytes;      /* bytes charged for its context on this GPU */
    uint64_t drained_seq;    /* the last gpu.close_seq its watcher answered */
    uint64_t drained_ns;     /* when the work it queued before that close had finished */
    uint32_t watching;       /* 1 while its watcher answers closes of this GPU */
    uint32_t closes_itself;  /* 1: it stops at gpu.close_at_ns and answers ahead (watch.c) */
    /* The last launch that waited at the closed gate until the heartbeat was stale: */
    uint64_t stale_heartbeat_ns; /* the heartbeat it judged stale (0: no daemon) */
    uint64_t gate_wake_ns;   /* when its last timed wait was to end (by stale + timeout) */
    uint64_t failed_open_ns; /* when it went on, written last; 0 = no launch did */
    uint64_t idle_ns;        /* when it went idle, once seen; rung a grace later (watch.c); 0: busy */
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

/* doorbell[k] is a futex word the daemon waits on: a process bumps it (and
 * wakes the daemon) when it starts waiting at the closed gate of GPU k, and
 * when its watcher answers a close of GPU k. */
struct cgpu_account {
    uint64_t magic;          /* CGPU_ACCOUNT_MAGIC */
    uint32_t version;        /* CGPU_REGION_VERSION */
    uint32_t size;           /* sizeof(struct cgpu_account) */
    uint32_t slots_used;     /* high-water mark: proc[0..slots_used) may be in use */
    uint32_t reserved32;
    uint64_t reserved[5];
    uint32_t doorbell[CGPU_MAX_GPUS];
    struct cgpu_proc proc[CGPU_MAX_PROCS];
};

#if defined(__STDC_VERSION__) && __STDC_VERSION__ >= 201112L
_Static_assert(sizeof(struct cgpu_gpu) == 256, "cgpu_gpu layout");
_Static_assert(sizeof(struct cgpu_seen) == 32, "cgpu_seen layout");
_Static_assert(sizeof(struct cgpu_control) ==
                   512 + 256 * CGPU_MAX_GPUS + 32 + 8 * CGPU_MAX_GPUS + 32 * CGPU_MAX_SEEN,
               "cgpu_control layout");
_Static_assert(sizeof(struct cgpu_proc_gpu) == 128, "cgpu_proc_gpu layout");
_Static_assert(sizeof(struct cgpu_proc) == 64 + 128 * CGPU_MAX_GPUS, "cgpu_proc layout");
_Static_assert(sizeof(struct cgpu_account) ==
                   64 + 4 * CGPU_MAX_GPUS + sizeof(struct cgpu_proc) * CGPU_MAX_PROCS,
               "cgpu_account layout");
#endif

#endif /* CGPU_REGION_H */
