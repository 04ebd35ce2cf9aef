/*
 * state.h: the simulated GPUs' shared device model.
 *
 * All processes of a host (and of containers that bind-mount the file) map
 * one file, SIMGPU_STATE (default /dev/shm/simgpu-state), that holds the
 * devices, every process's memory, contexts and busy time, and a log of the
 * kernels each device ran. Both libcuda.so.1 and libnvidia-ml.so.1 link
 * this module; its symbols are hidden.
 *
 * Locking uses fcntl byte locks on that file, which the kernel drops when a
 * process dies, so a SIGKILLed process never leaves anything held:
 *  - the state mutex: an open-file-description (OFD) write lock on one byte,
 *    plus a process-local pthread mutex (OFD locks do not exclude threads
 *    sharing the descriptor);
 *  - liveness: each process with a slot holds a classic POSIX lock on its
 *    slot's byte; a slot whose byte is unlocked belongs to a dead process
 *    and is reclaimed (its memory and contexts vanish). F_GETLK on that byte
 *    also yields the holder's PID as seen from the caller's PID namespace.
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

/* One kernel (or a merged run of back-to-back kernels of one process). */
struct sim_interval {
    uint64_t start_ns; /* CLOCK_MONOTONIC */
    uint64_t end_ns;
    int32_t slot;
    int32_t pid; /* recorded pid of the slot's owner */
};

struct sim_device {
    char name[SIM_NAME_LEN];
    char uuid[SIM_UUID_LEN];
    uint64_t total_bytes;
    uint64_t busy_until_ns; /* the engine's FIFO: end of the last queued kernel */
    uint64_t busy_total_ns;
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
};

struct sim_state {
    uint64_t magic;
    uint32_t layout_version;
    uint32_t device_count;
    uint64_t context_mem;
    char devices_spec[1024]; /* the SIMGPU_DEVICES text it was built from */
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
/* Under the lock: busy time of a device in [from, to): of all processes
 * (slot < 0), or of the process that held slot with that recorded pid. */
SIM_HIDDEN uint64_t sim_busy_in_locked(int dev, int slot, int32_t pid, uint64_t from_ns,
                                       uint64_t to_ns);
/* Under the lock: queue a kernel of dur_ns on dev, not before not_before_ns;
 * returns its completion time. */
SIM_HIDDEN uint64_t sim_enqueue_locked(int dev, int slot, uint64_t dur_ns, uint64_t not_before_ns);

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
