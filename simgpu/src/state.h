/*
 * state.h: the simulated GPUs' shared device model.
 *
 * All processes of a host (and of containers that bind-mount the file) map
 * one file, SIMGPU_STATE (default /dev/shm/simgpu-state), that holds the
 * devices, every process's memory, contexts, queued work and busy time, and a
 * log of what each device's engine ran. Both libcuda.so.1 and
 * libnvidia-ml.so.1 link this module; its symbols are hidden.
 *
 * The engine (SIMGPU_SCHED=timeslice, the default) schedules like a GPU
 * without MPS. Each process slot has one queue of work per device (all its
 * contexts and streams there feed it, so their kernels run in launch order):
 * the cumulative nanoseconds of kernels it ever queued (queued_ns) and ran
 * (done_ns). A kernel is complete once done_ns reaches its position, the
 * queued_ns right after it was added (so a zero-length kernel is complete
 * as soon as what its process queued before it). When several queues hold
 * work, the engine runs them in turn (round robin by slot) for one timeslice
 * each, preempting a running kernel at the slice's end; a switch to another
 * process costs SIMGPU_CTX_SWITCH_US of idle engine time; a queue that runs
 * dry gives up the rest of its slice; a lone queue runs on without switches.
 * Nothing is decided at launch: every lock holder first "advances" a device
 * from the time it was last advanced to now by replaying that round robin,
 * which is exact because the queues only change under the lock. Waiters
 * predict the earliest completion by running the same replay forward on a
 * copy (new work can only delay it), sleep until then and look again.
 * SIMGPU_SCHED=fifo keeps the older engine: one FIFO across all processes,
 * each kernel booked at launch (start = max(now, busy until)).
 *
 * Locking uses fcntl byte locks on that file, which the kernel drops when a
 * process dies, so a SIGKILLed process never leaves anything held:
 *  - the state mutex: an open-file-description (OFD) write lock on one byte,
 *    plus a process-local pthread mutex (OFD locks do not exclude threads
 *    sharing the descriptor);
 *  - liveness: each process with a slot holds a classic POSIX lock on its
 *    slot's byte; a slot whose byte is unlocked belongs to a dead process
 *    and is reclaimed (its memory, contexts and queued work vanish). F_GETLK
 *    on that byte also yields the holder's PID as seen from the caller's PID
 *    namespace.
 */
#ifndef SIMGPU_STATE_H
#define SIMGPU_STATE_H

#include <stdint.h>
#include <stddef.h>

#define SIM_HIDDEN __attribute__((visibility("hidden")))

#define SIM_MAX_DEVICES 16
#define SIM_MAX_PROCS 256
#define SIM_LOG_LEN 16384
#define SIM_NAME_LEN 96
#define SIM_UUID_LEN 96

#define SIM_DEFAULT_DEVICES "Tesla T4:15109MiB"
#define SIM_DEFAULT_STATE "/dev/shm/simgpu-state"
#define SIM_DEFAULT_CONTEXT_MEM (300ULL << 20)
#define SIM_DEFAULT_KERNEL_US 10ULL
#define SIM_DEFAULT_QUEUE_DEPTH 1024U
#define SIM_DEFAULT_UTIL_WINDOW_MS 1000ULL
#define SIM_DEFAULT_TIMESLICE_US 2000ULL
#define SIM_DEFAULT_CTX_SWITCH_US 25ULL
#define SIM_DEFAULT_NVML_SAMPLE_MS 167ULL
#define SIM_PROC_WORDS (SIM_MAX_PROCS / 64)

enum sim_sched { SIM_SCHED_TIMESLICE, SIM_SCHED_FIFO };

/* A stretch of time one process ran on the engine (merged while it runs on).
 * Appended in time order, so ends never decrease. */
struct sim_interval {
    uint64_t start_ns; /* CLOCK_MONOTONIC */
    uint64_t end_ns;
    uint64_t done_ns;  /* timeslice engine: the slot's done_ns at end_ns */
    int32_t slot;
    int32_t pid; /* recorded pid of the slot's owner */
    /* its generation (low bits): the recorded pid is the pid in the process's own
     * pid namespace when /proc is that namespace's, so two processes that held
     * one slot in turn may record one pid */
    uint32_t gen;
    uint32_t reserved;
};

/* The time-sliced engine of one device (see the top of this file). */
struct sim_engine {
    uint64_t at_ns;         /* replayed up to here */
    uint64_t switch_end_ns; /* run's context is loaded (it may run) from here */
    uint64_t slice_end_ns;  /* run's slice ends here, if another queue waits */
    int32_t run;            /* slot holding the engine, -1 when idle */
    int32_t last;           /* slot whose context is loaded, -1 none */
    uint64_t active[SIM_PROC_WORDS]; /* bit per slot: queued_ns > done_ns */
    uint64_t queued_ns[SIM_MAX_PROCS];
    uint64_t done_ns[SIM_MAX_PROCS];
};

struct sim_device {
    char name[SIM_NAME_LEN];
    char uuid[SIM_UUID_LEN];
    uint64_t total_bytes;
    uint64_t busy_until_ns; /* fifo engine: end of the last queued kernel */
    uint64_t busy_total_ns;
    struct sim_engine engine;
    uint64_t log_count;     /* intervals ever appended; ring index = count % SIM_LOG_LEN */
    struct sim_interval log[SIM_LOG_LEN];
};

struct sim_proc {
    int32_t pid;          /* recorded pid (SIMGPU_PID, else outermost NSpid, else getpid) */
    int32_t in_use;
    uint64_t generation;  /* bumps on every claim, so a reused slot is a new process */
    uint64_t mem_bytes[SIM_MAX_DEVICES];   /* allocations + context memory */
    uint32_t contexts[SIM_MAX_DEVICES];    /* contexts held on each device */
    uint64_t busy_ns[SIM_MAX_DEVICES];     /* engine time of its kernels */
    uint32_t nvml_bias_milli; /* factor on its NVML utilization, in thousandths */
};

struct sim_state {
    uint64_t magic;
    uint32_t layout_version;
    uint32_t device_count;
    uint64_t context_mem;
    char devices_spec[1024]; /* the SIMGPU_DEVICES text it was built from */
    uint32_t sched;          /* enum sim_sched */
    uint64_t timeslice_ns;
    uint64_t switch_ns;
    struct sim_proc procs[SIM_MAX_PROCS];
    struct sim_device devices[SIM_MAX_DEVICES];
};

/* Configuration parsed from the environment (pure; see parse_devices). */
struct sim_device_spec {
    char name[SIM_NAME_LEN];
    char uuid[SIM_UUID_LEN];
    uint64_t total_bytes;
};

SIM_HIDDEN int sim_parse_devices(const char *spec, struct sim_device_spec *out, int max,
                                 char *err, size_t errlen);
SIM_HIDDEN int sim_parse_size(const char *text, uint64_t *out);

/* Attach to (creating if needed) the shared state. 0 on success, -1 with a
 * message already printed to stderr. Idempotent and thread-safe. */
SIM_HIDDEN int sim_attach(void);
SIM_HIDDEN struct sim_state *sim_state(void);

SIM_HIDDEN void sim_lock(void);
SIM_HIDDEN void sim_unlock(void);

/* Under the lock: reclaim slots of dead processes. */
SIM_HIDDEN void sim_reap_locked(void);
/* Under the lock: this process's slot, claiming one if needed; -1 if full. */
SIM_HIDDEN int sim_self_slot_locked(void);
/* Under the lock: whether slot is held by a live process; *pid_out gets its
 * pid as seen from this process's PID namespace (recorded pid if invisible). */
SIM_HIDDEN int sim_slot_alive_locked(int slot, int32_t *pid_out);
/* Under the lock: bytes used on a device by all live processes. */
SIM_HIDDEN uint64_t sim_used_locked(int dev);
/* Under the lock, after sim_advance_locked: busy time of a device in
 * [from, to): of all processes (slot < 0), or of the process that held slot
 * with that recorded pid. */
SIM_HIDDEN uint64_t sim_busy_in_locked(int dev, int slot, uint32_t gen, uint64_t from_ns,
                                       uint64_t to_ns);
/* The same for n consecutive periods: out[i] gets the busy time in
 * [last_end - (n - i) * period, last_end - (n - 1 - i) * period). */
SIM_HIDDEN void sim_busy_periods_locked(int dev, int slot, uint32_t gen, uint64_t last_end_ns,
                                        uint64_t period_ns, unsigned n, uint64_t *out);
/* Under the lock: the start of the oldest interval the log of dev still holds
 * (0 while it has never wrapped). */
SIM_HIDDEN uint64_t sim_log_since_locked(int dev);

/* Where a piece of queued work ends: for the timeslice engine, a position in
 * a slot's queue on a device; for the fifo engine, a completion time. A
 * zeroed ticket stands for no work (complete). */
enum sim_ticket_kind { SIM_TICKET_NONE, SIM_TICKET_FIFO, SIM_TICKET_QUEUE };

struct sim_ticket {
    uint64_t pos;    /* queue: the slot's queued_ns just after the work */
    uint64_t gen;    /* queue: the slot's generation (its process) */
    uint64_t end_ns; /* fifo: completion time */
    int32_t slot;    /* queue */
    int32_t dev;
    uint32_t kind;   /* enum sim_ticket_kind */
};

/* Under the lock: replay dev's engine up to now (no-op for fifo). */
SIM_HIDDEN void sim_advance_locked(int dev);
/* Under the lock: queue a kernel of dur_ns on dev for slot (the fifo engine
 * starts it not before not_before_ns); *t gets where it ends. */
SIM_HIDDEN void sim_enqueue_locked(int dev, int slot, uint64_t dur_ns, uint64_t not_before_ns,
                                   struct sim_ticket *t);
/* Under the lock: whether the ticket's work has run (or vanished with its
 * process). */
SIM_HIDDEN int sim_ticket_done_locked(const struct sim_ticket *t);
/* Under the lock, for a done ticket: when its work completed (CLOCK_MONOTONIC),
 * or 0 when the log no longer tells. */
SIM_HIDDEN uint64_t sim_ticket_time_locked(const struct sim_ticket *t);
/* Sleep until the ticket's work has run. Takes the lock; never spins on it. */
SIM_HIDDEN void sim_ticket_wait(const struct sim_ticket *t);
/* The NVML bias drawn for a process (thousandths, 700..1400), from its slot
 * and recorded pid. */
SIM_HIDDEN uint32_t sim_drawn_bias_milli(int slot, int32_t pid);

/* Physical indexes selected from base[0..nbase) by a CUDA_VISIBLE_DEVICES-style
 * list (indexes into base and/or UUIDs or UUID prefixes; parsing stops at the
 * first entry that matches nothing, as NVIDIA's driver does). NULL list: all
 * of base. */
SIM_HIDDEN int sim_visible_devices(const char *list, const int *base, int nbase, int *map,
                                    int max);
/* The devices this process may see: SIMGPU_VISIBLE_DEVICES over all devices
 * (the simulated counterpart of the device nodes a container is given). */
SIM_HIDDEN int sim_process_devices(int *map, int max);
/* After fork(): the child gets its own slot on next use. */
SIM_HIDDEN void sim_forget_self(void);

SIM_HIDDEN uint64_t sim_now_ns(void);
SIM_HIDDEN void sim_sleep_until(uint64_t mono_ns);
SIM_HIDDEN uint64_t sim_env_u64(const char *name, uint64_t dflt);
SIM_HIDDEN uint64_t sim_hash(uint64_t x);
/* SIMGPU_NVML_PROC_BIAS in thousandths, or -1 when unset (or not a number,
 * said on stderr). */
SIM_HIDDEN int sim_env_bias_milli(void);

/* Static traits of a device model, by name (SM count, compute capability). */
struct sim_traits {
    int sm_count;
    int threads_per_sm;
    int cc_major;
    int cc_minor;
    int clock_khz;
    int mem_clock_khz;
    int bus_width;
    int l2_bytes;
};
SIM_HIDDEN void sim_traits_for(const char *name, struct sim_traits *out);

#endif
