/*
 * cuda.c: the simulated CUDA driver (libcuda.so.1).
 *
 * Devices, memory, queues and busy time live in the shared state (state.c).
 * Device memory is real anonymous memory (mapped lazily, MAP_NORESERVE), so
 * copies and managed memory work. Kernels do nothing but occupy their
 * device's one engine for their duration: a function named sleep_<us> runs
 * for <us> microseconds, any other for SIMGPU_DEFAULT_KERNEL_US.
 *
 * A launch appends the kernel to the process's queue on the device and
 * returns a ticket (state.h): with the time-sliced engine its position in
 * that queue, with SIMGPU_SCHED=fifo its booked completion time. Streams and
 * contexts keep the ticket of their last kernel; events record one.
 * Synchronization waits for a ticket (sim_ticket_wait sleeps until the
 * predicted completion and looks again); queries look without waiting.
 * Each stream holds at most SIMGPU_QUEUE_DEPTH outstanding kernels; a
 * launch beyond that waits for the oldest.
 *
 * With SIMGPU_KERNEL_TRACE=FILE and the fifo engine, every kernel booked
 * appends a line to FILE: "kernel pid=P launch=L start=S end=E", the
 * recorded pid of its process, when it was launched and when it runs
 * (CLOCK_MONOTONIC ns), in booking order (so that a test can count what ran
 * ahead of a launch from the driver's own record).
 *
 * cuStreamWaitEvent on an event in the same queue (this process, this
 * device) needs nothing: the queue runs in order. On an event in another
 * queue (another device, or the parent's queue after fork) the stream's next
 * launch waits on the host until the event completes, which orders the
 * work correctly but blocks the caller, unlike a real driver.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#pragma GCC visibility push(default)
#include "cuda.h"
#pragma GCC visibility pop

#include "state.h"

#define EXPORT __attribute__((visibility("default")))

enum { MAGIC_CTX = 0x5c7c0001, MAGIC_STREAM, MAGIC_EVENT, MAGIC_MODULE, MAGIC_FUNC,
       MAGIC_GRAPH, MAGIC_EXEC, MAGIC_ARRAY, MAGIC_POOL, MAGIC_DEAD = 0 };

struct sim_ctx;

struct sim_graph {
    uint32_t magic;
    uint64_t *durations_ns;
    size_t count, cap;
};

struct sim_stream {
    uint32_t magic;
    struct sim_ctx *ctx;
    unsigned flags;
    struct sim_ticket *ring; /* where outstanding kernels end */
    unsigned head, count;
    struct sim_ticket last;
    uint64_t not_before;     /* fifo engine: cuStreamWaitEvent */
    struct sim_ticket after; /* timeslice engine: an event in another queue to wait for */
    struct sim_graph *capture;
    struct sim_stream *next;
};

/* All contexts (and streams) of a process on one device feed the same queue
 * of the engine, so their kernels run in launch order, as on one context. */
struct sim_ctx {
    uint32_t magic;
    int dev;          /* physical index */
    int ordinal;      /* CUdevice as the process sees it */
    unsigned flags;
    int primary;
    struct sim_ticket last;
    struct sim_stream null_stream;
    struct sim_stream *streams;
};

struct sim_event {
    uint32_t magic;
    unsigned flags;
    int recorded;
    struct sim_ticket work; /* what it waits for */
    uint64_t time;          /* when that completed (CLOCK_MONOTONIC); 0: not yet known */
};

struct sim_func {
    uint32_t magic;
    uint64_t duration_ns;
    struct sim_func *next;
    char name[];
};

struct sim_module {
    uint32_t magic;
    struct sim_func *funcs;
};

struct sim_array {
    uint32_t magic;
};

struct sim_pool {
    uint32_t magic;
    int dev;
};

enum alloc_kind { ALLOC_DEVICE, ALLOC_MANAGED, ALLOC_ARRAY, ALLOC_HANDLE, ALLOC_HOST };

struct sim_alloc {
    uintptr_t key;       /* device pointer, or the handle / array address */
    size_t size;         /* bytes charged to the device (0 for host memory) */
    size_t map_len;      /* bytes mapped at key (0: nothing mapped) */
    int dev;
    int fd;              /* cuMemCreate backing, else -1 */
    enum alloc_kind kind;
    struct sim_ctx *ctx; /* freed with this context (NULL: not tied) */
    struct sim_alloc *next;
};

#define ALLOC_BUCKETS 4096
#define CTX_STACK 32
#define VMM_GRANULARITY (2ULL << 20)

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static int g_initialized;
static int g_ndev;
static int g_map[SIM_MAX_DEVICES]; /* ordinal -> physical index */
static uint64_t g_default_kernel_ns;
static uint64_t g_copy_ns; /* engine time of a device-side copy or set */
static unsigned g_queue_depth;
static struct sim_alloc *g_allocs[ALLOC_BUCKETS];
static struct sim_ctx *g_primary[SIM_MAX_DEVICES];
static unsigned g_primary_refs[SIM_MAX_DEVICES];
static unsigned g_primary_flags[SIM_MAX_DEVICES];
static struct sim_pool g_default_pool[SIM_MAX_DEVICES];

static __thread struct sim_ctx *t_stack[CTX_STACK];
static __thread int t_depth;

/* ---------- small helpers ---------- */

static struct sim_ctx *current_ctx(void)
{
    struct sim_ctx *c = t_depth > 0 ? t_stack[t_depth - 1] : NULL;
    return (c && c->magic == MAGIC_CTX) ? c : NULL;
}

static int valid_ordinal(CUdevice dev)
{
    return dev >= 0 && dev < g_ndev;
}

#define REQUIRE_INIT()                        \
    do {                                      \
        if (!g_initialized)                   \
            return CUDA_ERROR_NOT_INITIALIZED; \
    } while (0)

static size_t hash_key(uintptr_t key)
{
    return (size_t)((key >> 12) ^ (key >> 24)) % ALLOC_BUCKETS;
}

static void alloc_insert(struct sim_alloc *a)
{
    size_t h = hash_key(a->key);
    a->next = g_allocs[h];
    g_allocs[h] = a;
}

static struct sim_alloc *alloc_take(uintptr_t key, int keep)
{
    struct sim_alloc **pp = &g_allocs[hash_key(key)];
    for (; *pp; pp = &(*pp)->next) {
        if ((*pp)->key == key) {
            struct sim_alloc *a = *pp;
            if (!keep)
                *pp = a->next;
            return a;
        }
    }
    return NULL;
}

/* Charge bytes (and optionally one context) to this process on dev. */
static CUresult charge(int dev, uint64_t bytes, int context)
{
    struct sim_state *s = sim_state();
    CUresult rc = CUDA_SUCCESS;
    sim_lock();
    int slot = sim_self_slot_locked();
    if (slot < 0) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
        sim_reap_locked();
        uint64_t used = sim_used_locked(dev);
        if (bytes > s->devices[dev].total_bytes || used > s->devices[dev].total_bytes - bytes) {
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            s->procs[slot].mem_bytes[dev] += bytes;
            s->procs[slot].contexts[dev] += (uint32_t)context;
        }
    }
    sim_unlock();
    return rc;
}

static void uncharge(int dev, uint64_t bytes, int context)
{
    struct sim_state *s = sim_state();
    sim_lock();
    int slot = sim_self_slot_locked();
    if (slot >= 0) {
        struct sim_proc *p = &s->procs[slot];
        p->mem_bytes[dev] = p->mem_bytes[dev] > bytes ? p->mem_bytes[dev] - bytes : 0;
        if (context && p->contexts[dev] > 0)
            p->contexts[dev]--;
    }
    sim_unlock();
}

static void release_alloc(struct sim_alloc *a)
{
    if (a->map_len)
        munmap((void *)a->key, a->map_len);
    if (a->fd >= 0)
        close(a->fd);
    if (a->size)
        uncharge(a->dev, a->size, 0);
    free(a);
}

static size_t page_round(size_t n)
{
    size_t pg = (size_t)sysconf(_SC_PAGESIZE);
    return (n + pg - 1) / pg * pg;
}

/* Allocate device-visible memory on dev for ctx; caller holds g_mu. */
static CUresult alloc_mem(int dev, struct sim_ctx *ctx, size_t bytes, enum alloc_kind kind,
                          CUdeviceptr *out)
{
    if (!out)
        return CUDA_ERROR_INVALID_VALUE;
    if (bytes == 0)
        return CUDA_ERROR_INVALID_VALUE;
    struct sim_alloc *a = calloc(1, sizeof(*a));
    if (!a)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = charge(dev, bytes, 0);
    if (rc != CUDA_SUCCESS) {
        free(a);
        return rc;
    }
    size_t len = page_round(bytes);
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    if (p == MAP_FAILED) {
        uncharge(dev, bytes, 0);
        free(a);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    a->key = (uintptr_t)p;
    a->size = bytes;
    a->map_len = len;
    a->dev = dev;
    a->fd = -1;
    a->kind = kind;
    a->ctx = ctx;
    alloc_insert(a);
    *out = (CUdeviceptr)(uintptr_t)p;
    return CUDA_SUCCESS;
}

static struct sim_alloc *find_containing(uintptr_t ptr)
{
    for (size_t h = 0; h < ALLOC_BUCKETS; h++) {
        for (struct sim_alloc *a = g_allocs[h]; a; a = a->next) {
            if (a->map_len && ptr >= a->key && ptr < a->key + a->map_len)
                return a;
        }
    }
    return NULL;
}

/* ---------- init, version, errors ---------- */

static void after_fork_child(void)
{
    sim_forget_self();
}

CUresult cuInit(unsigned int Flags)
{
    if (Flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    if (!g_initialized) {
        if (sim_attach() != 0) {
            pthread_mutex_unlock(&g_mu);
            return CUDA_ERROR_INVALID_VALUE;
        }
        int base[SIM_MAX_DEVICES];
        int nbase = sim_process_devices(base, SIM_MAX_DEVICES);
        g_ndev = sim_visible_devices(getenv("CUDA_VISIBLE_DEVICES"), base, nbase, g_map,
                                     SIM_MAX_DEVICES);
        g_default_kernel_ns = sim_env_u64("SIMGPU_DEFAULT_KERNEL_US", SIM_DEFAULT_KERNEL_US) * 1000;
        g_copy_ns = sim_env_u64("SIMGPU_COPY_US", 1) * 1000;
        g_queue_depth = (unsigned)sim_env_u64("SIMGPU_QUEUE_DEPTH", SIM_DEFAULT_QUEUE_DEPTH);
        if (g_queue_depth == 0)
            g_queue_depth = 1;
        for (int i = 0; i < SIM_MAX_DEVICES; i++) {
            g_default_pool[i].magic = MAGIC_POOL;
            g_default_pool[i].dev = i;
        }
        pthread_atfork(NULL, NULL, after_fork_child);
        sim_lock();
        int slot = sim_self_slot_locked();
        sim_unlock();
        if (slot < 0)
            fprintf(stderr, "simgpu: all %d process slots of the shared state are in use\n",
                    SIM_MAX_PROCS);
        g_initialized = 1;
    }
    pthread_mutex_unlock(&g_mu);
    return g_ndev > 0 ? CUDA_SUCCESS : CUDA_ERROR_NO_DEVICE;
}

CUresult cuDriverGetVersion(int *driverVersion)
{
    if (!driverVersion)
        return CUDA_ERROR_INVALID_VALUE;
    *driverVersion = CUDA_VERSION;
    return CUDA_SUCCESS;
}

static const struct {
    CUresult code;
    const char *name;
    const char *text;
} g_errors[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {CUDA_ERROR_DEINITIALIZED, "CUDA_ERROR_DEINITIALIZED", "driver shutting down"},
    {CUDA_ERROR_STUB_LIBRARY, "CUDA_ERROR_STUB_LIBRARY", "CUDA driver is a stub library"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_INVALID_IMAGE, "CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {CUDA_ERROR_CONTEXT_ALREADY_CURRENT, "CUDA_ERROR_CONTEXT_ALREADY_CURRENT",
     "context already current"},
    {CUDA_ERROR_NO_BINARY_FOR_GPU, "CUDA_ERROR_NO_BINARY_FOR_GPU",
     "no kernel image is available for execution on the device"},
    {CUDA_ERROR_INVALID_SOURCE, "CUDA_ERROR_INVALID_SOURCE", "device kernel image is invalid"},
    {CUDA_ERROR_FILE_NOT_FOUND, "CUDA_ERROR_FILE_NOT_FOUND", "file not found"},
    {CUDA_ERROR_OPERATING_SYSTEM, "CUDA_ERROR_OPERATING_SYSTEM", "OS call failed or operation not supported on this OS"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {CUDA_ERROR_ILLEGAL_STATE, "CUDA_ERROR_ILLEGAL_STATE", "the operation cannot be performed in the present state"},
    {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {CUDA_ERROR_NOT_READY, "CUDA_ERROR_NOT_READY", "device not ready"},
    {CUDA_ERROR_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
    {CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES, "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES", "too many resources requested for launch"},
    {CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE, "CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE", "primary context active"},
    {CUDA_ERROR_CONTEXT_IS_DESTROYED, "CUDA_ERROR_CONTEXT_IS_DESTROYED", "context is destroyed"},
    {CUDA_ERROR_LAUNCH_FAILED, "CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"},
    {CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE, "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE",
     "too many blocks in cooperative launch"},
    {CUDA_ERROR_NOT_PERMITTED, "CUDA_ERROR_NOT_PERMITTED", "operation not permitted"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
     "operation not permitted when stream is capturing"},
    {CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
     "operation failed due to a previous error during capture"},
    {CUDA_ERROR_STREAM_CAPTURE_UNMATCHED, "CUDA_ERROR_STREAM_CAPTURE_UNMATCHED",
     "capture was not initiated in this stream"},
    {CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD, "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD",
     "attempt to terminate a thread-local capture sequence from another thread"},
    {CUDA_ERROR_TIMEOUT, "CUDA_ERROR_TIMEOUT", "wait operation timed out"},
    {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

static CUresult error_lookup(CUresult error, const char **pStr, int want_name)
{
    if (!pStr)
        return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof(g_errors) / sizeof(g_errors[0]); i++) {
        if (g_errors[i].code == error) {
            *pStr = want_name ? g_errors[i].name : g_errors[i].text;
            return CUDA_SUCCESS;
        }
    }
    *pStr = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

CUresult cuGetErrorString(CUresult error, const char **pStr)
{
    return error_lookup(error, pStr, 0);
}

CUresult cuGetErrorName(CUresult error, const char **pStr)
{
    return error_lookup(error, pStr, 1);
}

CUresult cuGetExportTable(const void **ppExportTable, const CUuuid *pExportTableId)
{
    (void)pExportTableId;
    if (ppExportTable)
        *ppExportTable = NULL;
    return CUDA_ERROR_NOT_SUPPORTED; /* NVIDIA's private tables: not simulated */
}

/* ---------- devices ---------- */

CUresult cuDeviceGetCount(int *count)
{
    REQUIRE_INIT();
    if (!count)
        return CUDA_ERROR_INVALID_VALUE;
    *count = g_ndev;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGet(CUdevice *device, int ordinal)
{
    REQUIRE_INIT();
    if (!device)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_ordinal(ordinal))
        return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetName(char *name, int len, CUdevice dev)
{
    REQUIRE_INIT();
    if (!name || len <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_ordinal(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    snprintf(name, (size_t)len, "%s", sim_state()->devices[g_map[dev]].name);
    return CUDA_SUCCESS;
}

static int hexval(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev)
{
    REQUIRE_INIT();
    if (!uuid)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_ordinal(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    const char *u = sim_state()->devices[g_map[dev]].uuid;
    unsigned char bytes[16] = {0};
    int nib = 0;
    if (strncmp(u, "GPU-", 4) == 0)
        u += 4;
    for (const char *p = u; *p && nib < 32; p++) {
        int v = hexval(*p);
        if (v < 0)
            continue;
        bytes[nib / 2] = (unsigned char)(bytes[nib / 2] | (v << ((nib % 2) ? 0 : 4)));
        nib++;
    }
    if (nib < 32) { /* not a hex UUID: derive bytes from the text */
        uint64_t h = 0xcbf29ce484222325ULL;
        for (int i = 0; i < 16; i++) {
            for (const char *p = u; *p; p++)
                h = (h ^ (unsigned char)*p) * 0x100000001b3ULL;
            h = (h ^ (uint64_t)i) * 0x100000001b3ULL;
            bytes[i] = (unsigned char)(h >> 56);
        }
    }
    memcpy(uuid->bytes, bytes, 16);
    return CUDA_SUCCESS;
}

CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    REQUIRE_INIT();
    if (!bytes)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_ordinal(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    *bytes = (size_t)sim_state()->devices[g_map[dev]].total_bytes;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev)
{
    REQUIRE_INIT();
    if (!pi)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_ordinal(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    struct sim_traits t;
    sim_traits_for(sim_state()->devices[g_map[dev]].name, &t);
    int v;
    switch (attrib) {
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: v = 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X: v = 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y: v = 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z: v = 64; break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X: v = 2147483647; break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y: v = 65535; break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z: v = 65535; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK: v = 49152; break;
    case CU_DEVICE_ATTRIBUTE_TOTAL_CONSTANT_MEMORY: v = 65536; break;
    case CU_DEVICE_ATTRIBUTE_WARP_SIZE: v = 32; break;
    case CU_DEVICE_ATTRIBUTE_MAX_PITCH: v = 2147483647; break;
    case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK: v = 65536; break;
    case CU_DEVICE_ATTRIBUTE_CLOCK_RATE: v = t.clock_khz; break;
    case CU_DEVICE_ATTRIBUTE_TEXTURE_ALIGNMENT: v = 512; break;
    case CU_DEVICE_ATTRIBUTE_GPU_OVERLAP: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: v = t.sm_count; break;
    case CU_DEVICE_ATTRIBUTE_KERNEL_EXEC_TIMEOUT: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_INTEGRATED: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_MODE: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_ECC_ENABLED: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_PCI_BUS_ID: v = 0x10 + g_map[dev]; break;
    case CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_TCC_DRIVER: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE: v = t.mem_clock_khz; break;
    case CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH: v = t.bus_width; break;
    case CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE: v = t.l2_bytes; break;
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR: v = t.threads_per_sm; break;
    case CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT: v = 3; break;
    case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: v = t.cc_major; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: v = t.cc_minor; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR: v = 65536; break;
    case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR: v = 65536; break;
    case CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_MULTI_GPU_BOARD: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: v = 65536; break;
    case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR: v = t.threads_per_sm / 64; break;
    case CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED: v = 1; break;
    default:
        if ((int)attrib <= 0 || attrib >= CU_DEVICE_ATTRIBUTE_MAX)
            return CUDA_ERROR_INVALID_VALUE;
        v = 0; /* features not simulated read as absent */
    }
    *pi = v;
    return CUDA_SUCCESS;
}

CUresult cuDeviceComputeCapability(int *major, int *minor, CUdevice dev)
{
    REQUIRE_INIT();
    if (!major || !minor)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_ordinal(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    struct sim_traits t;
    sim_traits_for(sim_state()->devices[g_map[dev]].name, &t);
    *major = t.cc_major;
    *minor = t.cc_minor;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetPCIBusId(char *pciBusId, int len, CUdevice dev)
{
    REQUIRE_INIT();
    if (!pciBusId || len <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_ordinal(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    snprintf(pciBusId, (size_t)len, "0000:%02x:00.0", 0x10 + g_map[dev]);
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool_out, CUdevice dev)
{
    REQUIRE_INIT();
    if (!pool_out)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_ordinal(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    *pool_out = (CUmemoryPool)&g_default_pool[g_map[dev]];
    return CUDA_SUCCESS;
}

/* ---------- contexts ---------- */

static void stream_init(struct sim_stream *s, struct sim_ctx *ctx, unsigned flags)
{
    memset(s, 0, sizeof(*s)); /* zeroed tickets: no work */
    s->magic = MAGIC_STREAM;
    s->ctx = ctx;
    s->flags = flags;
}

static CUresult ctx_new(CUdevice ordinal, unsigned flags, int primary, struct sim_ctx **out)
{
    struct sim_ctx *c = calloc(1, sizeof(*c));
    if (!c)
        return CUDA_ERROR_OUT_OF_MEMORY;
    int dev = g_map[ordinal];
    CUresult rc = charge(dev, sim_state()->context_mem, 1);
    if (rc != CUDA_SUCCESS) {
        free(c);
        return rc;
    }
    c->magic = MAGIC_CTX;
    c->dev = dev;
    c->ordinal = ordinal;
    c->flags = flags;
    c->primary = primary;
    stream_init(&c->null_stream, c, 0);
    *out = c;
    return CUDA_SUCCESS;
}

static void stream_free(struct sim_stream *s)
{
    s->magic = MAGIC_DEAD;
    free(s->ring);
    s->ring = NULL;
}

/* Tear down a context: its memory, streams and charge. Caller holds g_mu.
 * The struct itself stays (marked dead) so stale handles fail cleanly. */
static void ctx_teardown(struct sim_ctx *c)
{
    sim_ticket_wait(&c->last); /* like NVIDIA's driver, finish its work first */
    for (size_t h = 0; h < ALLOC_BUCKETS; h++) {
        struct sim_alloc **pp = &g_allocs[h];
        while (*pp) {
            struct sim_alloc *a = *pp;
            if (a->ctx == c) {
                *pp = a->next;
                release_alloc(a);
            } else {
                pp = &a->next;
            }
        }
    }
    while (c->streams) {
        struct sim_stream *s = c->streams;
        c->streams = s->next;
        stream_free(s);
        free(s);
    }
    stream_free(&c->null_stream);
    uncharge(c->dev, sim_state()->context_mem, 1);
    c->magic = MAGIC_DEAD;
    for (int i = 0; i < t_depth; i++) {
        if (t_stack[i] == c) {
            memmove(&t_stack[i], &t_stack[i + 1], (size_t)(t_depth - i - 1) * sizeof(t_stack[0]));
            t_depth--;
            i--;
        }
    }
}

static CUresult push_ctx(struct sim_ctx *c)
{
    if (t_depth == CTX_STACK)
        return CUDA_ERROR_OUT_OF_MEMORY;
    t_stack[t_depth++] = c;
    return CUDA_SUCCESS;
}

CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    REQUIRE_INIT();
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_ordinal(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    if (flags & ~(unsigned)CU_CTX_FLAGS_MASK)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    struct sim_ctx *c;
    CUresult rc = ctx_new(dev, flags, 0, &c);
    if (rc == CUDA_SUCCESS) {
        rc = push_ctx(c);
        if (rc != CUDA_SUCCESS)
            ctx_teardown(c);
        else
            *pctx = (CUcontext)c;
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

CUresult cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *paramsArray, int numParams,
                        unsigned int flags, CUdevice dev)
{
    if (numParams < 0 || (numParams > 0 && !paramsArray))
        return CUDA_ERROR_INVALID_VALUE;
    return cuCtxCreate_v2(pctx, flags, dev);
}

CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *ctxCreateParams, unsigned int flags,
                        CUdevice dev)
{
    if (ctxCreateParams && ctxCreateParams->numExecAffinityParams < 0)
        return CUDA_ERROR_INVALID_VALUE;
    return cuCtxCreate_v2(pctx, flags, dev);
}

CUresult cuCtxDestroy_v2(CUcontext ctx)
{
    REQUIRE_INIT();
    struct sim_ctx *c = (struct sim_ctx *)ctx;
    if (!c || c->magic != MAGIC_CTX || c->primary)
        return CUDA_ERROR_INVALID_CONTEXT;
    pthread_mutex_lock(&g_mu);
    ctx_teardown(c);
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

CUresult cuCtxPushCurrent_v2(CUcontext ctx)
{
    REQUIRE_INIT();
    struct sim_ctx *c = (struct sim_ctx *)ctx;
    if (!c || c->magic != MAGIC_CTX)
        return CUDA_ERROR_INVALID_CONTEXT;
    return push_ctx(c);
}

CUresult cuCtxPopCurrent_v2(CUcontext *pctx)
{
    REQUIRE_INIT();
    if (t_depth == 0)
        return CUDA_ERROR_INVALID_CONTEXT;
    struct sim_ctx *c = t_stack[--t_depth];
    if (pctx)
        *pctx = (CUcontext)c;
    return CUDA_SUCCESS;
}

CUresult cuCtxSetCurrent(CUcontext ctx)
{
    REQUIRE_INIT();
    struct sim_ctx *c = (struct sim_ctx *)ctx;
    if (c && c->magic != MAGIC_CTX)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (!c) {
        if (t_depth > 0)
            t_depth--;
        return CUDA_SUCCESS;
    }
    if (t_depth == 0)
        return push_ctx(c);
    t_stack[t_depth - 1] = c;
    return CUDA_SUCCESS;
}

CUresult cuCtxGetCurrent(CUcontext *pctx)
{
    REQUIRE_INIT();
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    *pctx = (CUcontext)current_ctx();
    return CUDA_SUCCESS;
}

CUresult cuCtxGetDevice(CUdevice *device)
{
    REQUIRE_INIT();
    struct sim_ctx *c = current_ctx();
    if (!device)
        return CUDA_ERROR_INVALID_VALUE;
    if (!c)
        return CUDA_ERROR_INVALID_CONTEXT;
    *device = c->ordinal;
    return CUDA_SUCCESS;
}

CUresult cuCtxGetFlags(unsigned int *flags)
{
    REQUIRE_INIT();
    struct sim_ctx *c = current_ctx();
    if (!flags)
        return CUDA_ERROR_INVALID_VALUE;
    if (!c)
        return CUDA_ERROR_INVALID_CONTEXT;
    *flags = c->flags;
    return CUDA_SUCCESS;
}

CUresult cuCtxGetApiVersion(CUcontext ctx, unsigned int *version)
{
    REQUIRE_INIT();
    struct sim_ctx *c = ctx ? (struct sim_ctx *)ctx : current_ctx();
    if (!version)
        return CUDA_ERROR_INVALID_VALUE;
    if (!c || c->magic != MAGIC_CTX)
        return CUDA_ERROR_INVALID_CONTEXT;
    *version = 3020;
    return CUDA_SUCCESS;
}

/* Copy a ticket that launches of other threads may be writing. */
static struct sim_ticket ticket_of(const struct sim_ticket *t)
{
    pthread_mutex_lock(&g_mu);
    struct sim_ticket copy = *t;
    pthread_mutex_unlock(&g_mu);
    return copy;
}

static void wait_for(const struct sim_ticket *t)
{
    struct sim_ticket copy = ticket_of(t);
    sim_ticket_wait(&copy);
}

/* Whether a ticket's work has run; t is the caller's own copy. */
static int work_done(const struct sim_ticket *t)
{
    if (t->kind != SIM_TICKET_QUEUE)
        return t->end_ns <= sim_now_ns();
    sim_lock();
    int done = sim_ticket_done_locked(t);
    sim_unlock();
    return done;
}

CUresult cuCtxSynchronize(void)
{
    REQUIRE_INIT();
    struct sim_ctx *c = current_ctx();
    if (!c)
        return CUDA_ERROR_INVALID_CONTEXT;
    wait_for(&c->last);
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    REQUIRE_INIT();
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_ordinal(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    CUresult rc = CUDA_SUCCESS;
    pthread_mutex_lock(&g_mu);
    int phys = g_map[dev];
    if (!g_primary[phys] || g_primary[phys]->magic != MAGIC_CTX)
        rc = ctx_new(dev, g_primary_flags[phys], 1, &g_primary[phys]);
    if (rc == CUDA_SUCCESS) {
        g_primary_refs[phys]++;
        *pctx = (CUcontext)g_primary[phys];
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

static CUresult primary_drop(CUdevice dev, int reset)
{
    REQUIRE_INIT();
    if (!valid_ordinal(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    CUresult rc = CUDA_SUCCESS;
    pthread_mutex_lock(&g_mu);
    int phys = g_map[dev];
    struct sim_ctx *c = g_primary[phys];
    if (!c || c->magic != MAGIC_CTX) {
        rc = reset ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
    } else if (reset || --g_primary_refs[phys] == 0) {
        ctx_teardown(c);
        g_primary[phys] = NULL;
        g_primary_refs[phys] = 0;
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)
{
    return primary_drop(dev, 0);
}

CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev)
{
    return primary_drop(dev, 1);
}

CUresult cuDevicePrimaryCtxSetFlags_v2(CUdevice dev, unsigned int flags)
{
    REQUIRE_INIT();
    if (!valid_ordinal(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    if (flags & ~(unsigned)CU_CTX_FLAGS_MASK)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    int phys = g_map[dev];
    g_primary_flags[phys] = flags;
    if (g_primary[phys] && g_primary[phys]->magic == MAGIC_CTX)
        g_primary[phys]->flags = flags;
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active)
{
    REQUIRE_INIT();
    if (!flags || !active)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_ordinal(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g_mu);
    int phys = g_map[dev];
    *flags = g_primary_flags[phys];
    *active = g_primary[phys] && g_primary[phys]->magic == MAGIC_CTX;
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

/* ---------- memory ---------- */

CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total)
{
    REQUIRE_INIT();
    struct sim_ctx *c = current_ctx();
    if (!free_bytes || !total)
        return CUDA_ERROR_INVALID_VALUE;
    if (!c)
        return CUDA_ERROR_INVALID_CONTEXT;
    struct sim_state *s = sim_state();
    sim_lock();
    sim_reap_locked();
    uint64_t used = sim_used_locked(c->dev);
    uint64_t tot = s->devices[c->dev].total_bytes;
    sim_unlock();
    *total = (size_t)tot;
    *free_bytes = (size_t)(used < tot ? tot - used : 0);
    return CUDA_SUCCESS;
}

static CUresult alloc_current(CUdeviceptr *dptr, size_t bytes, enum alloc_kind kind)
{
    REQUIRE_INIT();
    struct sim_ctx *c = current_ctx();
    if (!c)
        return CUDA_ERROR_INVALID_CONTEXT;
    pthread_mutex_lock(&g_mu);
    CUresult rc = alloc_mem(c->dev, c, bytes, kind, dptr);
    pthread_mutex_unlock(&g_mu);
    return rc;
}

CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    return alloc_current(dptr, bytesize, ALLOC_DEVICE);
}

CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes,
                            size_t Height, unsigned int ElementSizeBytes)
{
    if (!pPitch || WidthInBytes == 0 || Height == 0 ||
        (ElementSizeBytes != 4 && ElementSizeBytes != 8 && ElementSizeBytes != 16))
        return CUDA_ERROR_INVALID_VALUE;
    size_t pitch = (WidthInBytes + 511) / 512 * 512;
    if (Height > SIZE_MAX / pitch)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = alloc_current(dptr, pitch * Height, ALLOC_DEVICE);
    if (rc == CUDA_SUCCESS)
        *pPitch = pitch;
    return rc;
}

CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags)
{
    if (flags != CU_MEM_ATTACH_GLOBAL && flags != CU_MEM_ATTACH_HOST)
        return CUDA_ERROR_INVALID_VALUE;
    return alloc_current(dptr, bytesize, ALLOC_MANAGED);
}

static CUresult free_device_ptr(CUdeviceptr dptr)
{
    REQUIRE_INIT();
    if (dptr == 0)
        return CUDA_SUCCESS;
    pthread_mutex_lock(&g_mu);
    struct sim_alloc *a = alloc_take((uintptr_t)dptr, 1);
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    if (a && (a->kind == ALLOC_DEVICE || a->kind == ALLOC_MANAGED)) {
        alloc_take((uintptr_t)dptr, 0);
        release_alloc(a);
        rc = CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    return free_device_ptr(dptr);
}

CUresult cuMemGetAddressRange_v2(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr)
{
    REQUIRE_INIT();
    pthread_mutex_lock(&g_mu);
    struct sim_alloc *a = find_containing((uintptr_t)dptr);
    if (a) {
        if (pbase)
            *pbase = (CUdeviceptr)a->key;
        if (psize)
            *psize = a->size ? a->size : a->map_len;
    }
    pthread_mutex_unlock(&g_mu);
    return a ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}

CUresult cuMemHostAlloc(void **pp, size_t bytesize, unsigned int Flags)
{
    REQUIRE_INIT();
    (void)Flags;
    if (!pp || bytesize == 0)
        return CUDA_ERROR_INVALID_VALUE;
    void *p = mmap(NULL, page_round(bytesize), PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    struct sim_alloc *a = calloc(1, sizeof(*a));
    if (p == MAP_FAILED || !a) {
        if (p != MAP_FAILED)
            munmap(p, page_round(bytesize));
        free(a);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    a->key = (uintptr_t)p;
    a->map_len = page_round(bytesize);
    a->fd = -1;
    a->kind = ALLOC_HOST;
    pthread_mutex_lock(&g_mu);
    alloc_insert(a);
    pthread_mutex_unlock(&g_mu);
    *pp = p;
    return CUDA_SUCCESS;
}

CUresult cuMemAllocHost_v2(void **pp, size_t bytesize)
{
    return cuMemHostAlloc(pp, bytesize, 0);
}

CUresult cuMemFreeHost(void *p)
{
    REQUIRE_INIT();
    pthread_mutex_lock(&g_mu);
    struct sim_alloc *a = alloc_take((uintptr_t)p, 1);
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    if (a && a->kind == ALLOC_HOST) {
        alloc_take((uintptr_t)p, 0);
        release_alloc(a);
        rc = CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

/* Resolve a stream handle: NULL and the special handles mean the current
 * context's null stream. */
static struct sim_stream *stream_of(CUstream h)
{
    if (!h || h == CU_STREAM_LEGACY || h == CU_STREAM_PER_THREAD) {
        struct sim_ctx *c = current_ctx();
        return c ? &c->null_stream : NULL;
    }
    struct sim_stream *s = (struct sim_stream *)h;
    return (s->magic == MAGIC_STREAM && s->ctx->magic == MAGIC_CTX) ? s : NULL;
}

CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    REQUIRE_INIT();
    struct sim_stream *s = stream_of(hStream);
    if (!s)
        return hStream ? CUDA_ERROR_INVALID_HANDLE : CUDA_ERROR_INVALID_CONTEXT;
    pthread_mutex_lock(&g_mu);
    CUresult rc = alloc_mem(s->ctx->dev, s->ctx, bytesize, ALLOC_DEVICE, dptr);
    pthread_mutex_unlock(&g_mu);
    return rc;
}

CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                 CUstream hStream)
{
    REQUIRE_INIT();
    struct sim_pool *p = (struct sim_pool *)pool;
    struct sim_stream *s = stream_of(hStream);
    if (!p || p->magic != MAGIC_POOL)
        return CUDA_ERROR_INVALID_VALUE;
    if (!s)
        return hStream ? CUDA_ERROR_INVALID_HANDLE : CUDA_ERROR_INVALID_CONTEXT;
    pthread_mutex_lock(&g_mu);
    CUresult rc = alloc_mem(p->dev, s->ctx, bytesize, ALLOC_DEVICE, dptr);
    pthread_mutex_unlock(&g_mu);
    return rc;
}

CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream)
{
    REQUIRE_INIT();
    if (hStream && !stream_of(hStream))
        return CUDA_ERROR_INVALID_HANDLE;
    return free_device_ptr(dptr);
}

CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *poolProps)
{
    REQUIRE_INIT();
    if (!pool || !poolProps || poolProps->allocType != CU_MEM_ALLOCATION_TYPE_PINNED ||
        poolProps->location.type != CU_MEM_LOCATION_TYPE_DEVICE ||
        !valid_ordinal(poolProps->location.id))
        return CUDA_ERROR_INVALID_VALUE;
    struct sim_pool *p = calloc(1, sizeof(*p));
    if (!p)
        return CUDA_ERROR_OUT_OF_MEMORY;
    p->magic = MAGIC_POOL;
    p->dev = g_map[poolProps->location.id];
    *pool = (CUmemoryPool)p;
    return CUDA_SUCCESS;
}

CUresult cuMemPoolDestroy(CUmemoryPool pool)
{
    REQUIRE_INIT();
    struct sim_pool *p = (struct sim_pool *)pool;
    if (!p || p->magic != MAGIC_POOL)
        return CUDA_ERROR_INVALID_VALUE;
    if (p >= g_default_pool && p < g_default_pool + SIM_MAX_DEVICES)
        return CUDA_ERROR_INVALID_VALUE;
    p->magic = MAGIC_DEAD;
    free(p);
    return CUDA_SUCCESS;
}

CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep)
{
    REQUIRE_INIT();
    (void)minBytesToKeep;
    struct sim_pool *p = (struct sim_pool *)pool;
    return (p && p->magic == MAGIC_POOL) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* Virtual memory management: cuMemCreate charges the device; the handle's
 * backing is a memfd that cuMemMap maps into a reserved range. */
CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                     const CUmemAllocationProp *prop, unsigned long long flags)
{
    REQUIRE_INIT();
    if (!handle || !prop || flags != 0 || size == 0 || size % VMM_GRANULARITY != 0 ||
        prop->type != CU_MEM_ALLOCATION_TYPE_PINNED ||
        prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE || !valid_ordinal(prop->location.id))
        return CUDA_ERROR_INVALID_VALUE;
    int dev = g_map[prop->location.id];
    struct sim_alloc *a = calloc(1, sizeof(*a));
    if (!a)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = charge(dev, size, 0);
    if (rc != CUDA_SUCCESS) {
        free(a);
        return rc;
    }
    a->fd = memfd_create("simgpu-mem", MFD_CLOEXEC);
    if (a->fd < 0 || ftruncate(a->fd, (off_t)size) != 0) {
        if (a->fd >= 0)
            close(a->fd);
        uncharge(dev, size, 0);
        free(a);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    a->key = (uintptr_t)a;
    a->size = size;
    a->dev = dev;
    a->kind = ALLOC_HANDLE;
    pthread_mutex_lock(&g_mu);
    alloc_insert(a);
    pthread_mutex_unlock(&g_mu);
    *handle = (CUmemGenericAllocationHandle)(uintptr_t)a;
    return CUDA_SUCCESS;
}

CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    REQUIRE_INIT();
    pthread_mutex_lock(&g_mu);
    struct sim_alloc *a = alloc_take((uintptr_t)handle, 1);
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    if (a && a->kind == ALLOC_HANDLE) {
        alloc_take((uintptr_t)handle, 0);
        release_alloc(a);
        rc = CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                             unsigned long long flags)
{
    REQUIRE_INIT();
    (void)addr;
    if (!ptr || size == 0 || flags != 0 || size % VMM_GRANULARITY != 0)
        return CUDA_ERROR_INVALID_VALUE;
    size_t align = alignment > VMM_GRANULARITY ? alignment : VMM_GRANULARITY;
    size_t span = size + align;
    char *p = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED)
        return CUDA_ERROR_OUT_OF_MEMORY;
    uintptr_t base = ((uintptr_t)p + align - 1) / align * align;
    if (base > (uintptr_t)p)
        munmap(p, base - (uintptr_t)p);
    uintptr_t tail = base + size;
    if (tail < (uintptr_t)p + span)
        munmap((void *)tail, (uintptr_t)p + span - tail);
    *ptr = (CUdeviceptr)base;
    return CUDA_SUCCESS;
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size)
{
    REQUIRE_INIT();
    if (!ptr || size == 0)
        return CUDA_ERROR_INVALID_VALUE;
    return munmap((void *)(uintptr_t)ptr, size) == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags)
{
    REQUIRE_INIT();
    if (!ptr || size == 0 || flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    struct sim_alloc *a = alloc_take((uintptr_t)handle, 1);
    CUresult rc = CUDA_ERROR_INVALID_HANDLE;
    if (a && a->kind == ALLOC_HANDLE) {
        rc = CUDA_ERROR_INVALID_VALUE;
        if (offset <= a->size && size <= a->size - offset &&
            mmap((void *)(uintptr_t)ptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED,
                 a->fd, (off_t)offset) != MAP_FAILED)
            rc = CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    REQUIRE_INIT();
    if (!ptr || size == 0)
        return CUDA_ERROR_INVALID_VALUE;
    void *p = mmap((void *)(uintptr_t)ptr, size, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
    return p == MAP_FAILED ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count)
{
    REQUIRE_INIT();
    if (!ptr || size == 0 || !desc || count == 0)
        return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < count; i++) {
        if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE ||
            !valid_ordinal(desc[i].location.id))
            return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
                                       CUmemAllocationGranularity_flags option)
{
    REQUIRE_INIT();
    (void)option;
    if (!granularity || !prop)
        return CUDA_ERROR_INVALID_VALUE;
    *granularity = VMM_GRANULARITY;
    return CUDA_SUCCESS;
}

/* Arrays: charged like allocations; no storage is kept. */
static CUresult array_create(CUarray *pHandle, size_t w, size_t h, size_t d, CUarray_format f,
                             unsigned channels)
{
    REQUIRE_INIT();
    struct sim_ctx *c = current_ctx();
    size_t elem = cgpu_array_format_bytes(f);
    if (!pHandle || w == 0 || elem == 0 || (channels != 1 && channels != 2 && channels != 4))
        return CUDA_ERROR_INVALID_VALUE;
    if (!c)
        return CUDA_ERROR_INVALID_CONTEXT;
    h = h ? h : 1;
    d = d ? d : 1;
    size_t bytes = w * elem * channels;
    if (h > SIZE_MAX / bytes || d > SIZE_MAX / (bytes * h))
        return CUDA_ERROR_OUT_OF_MEMORY;
    bytes = bytes * h * d;
    struct sim_alloc *a = calloc(1, sizeof(*a) + sizeof(struct sim_array));
    if (!a)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = charge(c->dev, bytes, 0);
    if (rc != CUDA_SUCCESS) {
        free(a);
        return rc;
    }
    struct sim_array *arr = (struct sim_array *)(a + 1);
    arr->magic = MAGIC_ARRAY;
    a->key = (uintptr_t)arr;
    a->size = bytes;
    a->dev = c->dev;
    a->fd = -1;
    a->kind = ALLOC_ARRAY;
    a->ctx = c;
    pthread_mutex_lock(&g_mu);
    alloc_insert(a);
    pthread_mutex_unlock(&g_mu);
    *pHandle = (CUarray)arr;
    return CUDA_SUCCESS;
}

CUresult cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *pAllocateArray)
{
    if (!pAllocateArray)
        return CUDA_ERROR_INVALID_VALUE;
    return array_create(pHandle, pAllocateArray->Width, pAllocateArray->Height, 0,
                        pAllocateArray->Format, pAllocateArray->NumChannels);
}

CUresult cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *pAllocateArray)
{
    if (!pAllocateArray)
        return CUDA_ERROR_INVALID_VALUE;
    return array_create(pHandle, pAllocateArray->Width, pAllocateArray->Height,
                        pAllocateArray->Depth, pAllocateArray->Format,
                        pAllocateArray->NumChannels);
}

CUresult cuArrayDestroy(CUarray hArray)
{
    REQUIRE_INIT();
    pthread_mutex_lock(&g_mu);
    struct sim_alloc *a = alloc_take((uintptr_t)hArray, 1);
    CUresult rc = CUDA_ERROR_INVALID_HANDLE;
    if (a && a->kind == ALLOC_ARRAY) {
        alloc_take((uintptr_t)hArray, 0);
        ((struct sim_array *)hArray)->magic = MAGIC_DEAD;
        release_alloc(a);
        rc = CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

/* Copies and sets act on the backing memory at once; the synchronous forms
 * first wait for the current context's work, as the legacy stream does. */
static CUresult sync_current(void)
{
    struct sim_ctx *c = current_ctx();
    if (!c)
        return CUDA_ERROR_INVALID_CONTEXT;
    wait_for(&c->last);
    return CUDA_SUCCESS;
}

static CUresult copy_bytes(void *dst, const void *src, size_t n, int sync)
{
    REQUIRE_INIT();
    if (n && (!dst || !src))
        return CUDA_ERROR_INVALID_VALUE;
    if (sync) {
        CUresult rc = sync_current();
        if (rc != CUDA_SUCCESS)
            return rc;
    }
    memmove(dst, src, n);
    return CUDA_SUCCESS;
}

#define DPTR(x) ((void *)(uintptr_t)(x))

CUresult cuMemcpyHtoD_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount)
{
    return copy_bytes(DPTR(dstDevice), srcHost, ByteCount, 1);
}

CUresult cuMemcpyDtoH_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount)
{
    return copy_bytes(dstHost, DPTR(srcDevice), ByteCount, 1);
}

/* Device-side copies and sets (the forms a GPU runs as work, unlike the copies
 * from and to the host above) also take their device's engine for
 * SIMGPU_COPY_US (default 1), whatever their size, queued on their stream as a
 * kernel is. Their bytes move at once, as above. The _ptds / _ptsz forms use
 * the calling thread's default stream, which in simgpu is the legacy one. */
static CUresult enqueue_kernel(struct sim_stream *s, uint64_t dur_ns);

static CUresult engine_op(CUstream hStream)
{
    pthread_mutex_lock(&g_mu);
    struct sim_stream *s = stream_of(hStream);
    CUresult rc = s ? enqueue_kernel(s, g_copy_ns)
                    : hStream ? CUDA_ERROR_INVALID_HANDLE : CUDA_ERROR_INVALID_CONTEXT;
    pthread_mutex_unlock(&g_mu);
    return rc;
}

/* A copy on the device: the bytes, then the engine time. sync: the legacy
 * stream's ordering (after the context's work). */
static CUresult device_copy(void *dst, const void *src, size_t n, int sync, CUstream hStream)
{
    CUresult rc = copy_bytes(dst, src, n, sync);
    return rc == CUDA_SUCCESS ? engine_op(hStream) : rc;
}

/* Rows of elements of `elem` bytes, each set to the value at `val`. */
static CUresult set_rows(CUdeviceptr dst, size_t pitch, const void *val, size_t elem,
                         size_t width, size_t height, int sync, CUstream hStream)
{
    REQUIRE_INIT();
    if (width && height && (!dst || dst % elem || (height > 1 && pitch < width * elem)))
        return CUDA_ERROR_INVALID_VALUE;
    if (sync) {
        CUresult rc = sync_current();
        if (rc != CUDA_SUCCESS)
            return rc;
    }
    for (size_t y = 0; y < height; y++) {
        unsigned char *row = (unsigned char *)DPTR(dst) + y * pitch;
        if (elem == 1)
            memset(row, *(const unsigned char *)val, width);
        else
            for (size_t x = 0; x < width; x++)
                memcpy(row + x * elem, val, elem);
    }
    return engine_op(hStream);
}

/* One side of a 2D or 3D copy: its memory and where the box starts. */
struct copy_side {
    CUmemorytype type;
    const void *host;
    CUdeviceptr device;
    CUarray array;
    size_t x, y, z, pitch, height;
};

static unsigned char *side_base(const struct copy_side *c)
{
    const unsigned char *base;
    switch (c->type) {
    case CU_MEMORYTYPE_HOST:
        base = c->host;
        break;
    case CU_MEMORYTYPE_DEVICE:
    case CU_MEMORYTYPE_UNIFIED:
        base = DPTR(c->device);
        break;
    default:
        return NULL; /* arrays: not simulated */
    }
    if (!base)
        return NULL;
    return (unsigned char *)base + (c->z * c->height + c->y) * c->pitch + c->x;
}

static CUresult copy_box(const struct copy_side *src, const struct copy_side *dst, size_t width,
                         size_t height, size_t depth, int sync, CUstream hStream)
{
    REQUIRE_INIT();
    if (src->type == CU_MEMORYTYPE_ARRAY || dst->type == CU_MEMORYTYPE_ARRAY)
        return CUDA_ERROR_NOT_SUPPORTED;
    unsigned char *from = side_base(src), *to = side_base(dst);
    if (!width || !height || !depth)
        return engine_op(hStream);
    if (!from || !to || (height > 1 && (src->pitch < width || dst->pitch < width)) ||
        (depth > 1 && (src->height < height || dst->height < height)))
        return CUDA_ERROR_INVALID_VALUE;
    if (sync) {
        CUresult rc = sync_current();
        if (rc != CUDA_SUCCESS)
            return rc;
    }
    for (size_t z = 0; z < depth; z++)
        for (size_t y = 0; y < height; y++)
            memmove(to + (z * dst->height + y) * dst->pitch,
                    from + (z * src->height + y) * src->pitch, width);
    return engine_op(hStream);
}

#define SIDE_2D(p, s) {(p)->s##MemoryType, (p)->s##Host, (p)->s##Device, (p)->s##Array, \
                       (p)->s##XInBytes, (p)->s##Y, 0, (p)->s##Pitch, 0}
#define SIDE_3D(p, s) {(p)->s##MemoryType, (p)->s##Host, (p)->s##Device, (p)->s##Array, \
                       (p)->s##XInBytes, (p)->s##Y, (p)->s##Z, (p)->s##Pitch, (p)->s##Height}

static CUresult copy_2d(const CUDA_MEMCPY2D *p, int sync, CUstream hStream)
{
    if (!p)
        return CUDA_ERROR_INVALID_VALUE;
    struct copy_side src = SIDE_2D(p, src), dst = SIDE_2D(p, dst);
    return copy_box(&src, &dst, p->WidthInBytes, p->Height, 1, sync, hStream);
}

static CUresult copy_3d(const CUDA_MEMCPY3D *p, int sync, CUstream hStream)
{
    if (!p || p->srcLOD || p->dstLOD)
        return CUDA_ERROR_INVALID_VALUE;
    struct copy_side src = SIDE_3D(p, src), dst = SIDE_3D(p, dst);
    return copy_box(&src, &dst, p->WidthInBytes, p->Height, p->Depth, sync, hStream);
}

static CUresult copy_3d_peer(const CUDA_MEMCPY3D_PEER *p, int sync, CUstream hStream)
{
    if (!p || p->srcLOD || p->dstLOD)
        return CUDA_ERROR_INVALID_VALUE;
    struct copy_side src = SIDE_3D(p, src), dst = SIDE_3D(p, dst);
    return copy_box(&src, &dst, p->WidthInBytes, p->Height, p->Depth, sync, hStream);
}

static CUresult copy_peer(CUdeviceptr dst, CUcontext dstContext, CUdeviceptr src,
                          CUcontext srcContext, size_t n, int sync, CUstream hStream)
{
    const struct sim_ctx *d = (const struct sim_ctx *)dstContext;
    const struct sim_ctx *s = (const struct sim_ctx *)srcContext;
    if (!d || !s || d->magic != MAGIC_CTX || s->magic != MAGIC_CTX)
        return CUDA_ERROR_INVALID_CONTEXT;
    return device_copy(DPTR(dst), DPTR(src), n, sync, hStream);
}

#define PTDS CU_STREAM_PER_THREAD

CUresult cuMemcpyDtoD_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount)
{
    return device_copy(DPTR(dstDevice), DPTR(srcDevice), ByteCount, 1, NULL);
}

CUresult cuMemcpyDtoD_v2_ptds(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount)
{
    return device_copy(DPTR(dstDevice), DPTR(srcDevice), ByteCount, 1, PTDS);
}

CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount)
{
    return device_copy(DPTR(dst), DPTR(src), ByteCount, 1, NULL);
}

CUresult cuMemcpy_ptds(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount)
{
    return device_copy(DPTR(dst), DPTR(src), ByteCount, 1, PTDS);
}

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount,
                              CUstream hStream)
{
    (void)hStream;
    return copy_bytes(DPTR(dstDevice), srcHost, ByteCount, 0);
}

CUresult cuMemcpyDtoHAsync_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount,
                              CUstream hStream)
{
    (void)hStream;
    return copy_bytes(dstHost, DPTR(srcDevice), ByteCount, 0);
}

CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount,
                              CUstream hStream)
{
    return device_copy(DPTR(dstDevice), DPTR(srcDevice), ByteCount, 0, hStream);
}

CUresult cuMemcpyDtoDAsync_v2_ptsz(CUdeviceptr dstDevice, CUdeviceptr srcDevice,
                                   size_t ByteCount, CUstream hStream)
{
    return device_copy(DPTR(dstDevice), DPTR(srcDevice), ByteCount, 0, hStream ? hStream : PTDS);
}

CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount, CUstream hStream)
{
    return device_copy(DPTR(dst), DPTR(src), ByteCount, 0, hStream);
}

CUresult cuMemcpyAsync_ptsz(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount, CUstream hStream)
{
    return device_copy(DPTR(dst), DPTR(src), ByteCount, 0, hStream ? hStream : PTDS);
}

CUresult cuMemcpy2D_v2(const CUDA_MEMCPY2D *pCopy) { return copy_2d(pCopy, 1, NULL); }
CUresult cuMemcpy2D_v2_ptds(const CUDA_MEMCPY2D *pCopy) { return copy_2d(pCopy, 1, PTDS); }
CUresult cuMemcpy2DUnaligned_v2(const CUDA_MEMCPY2D *pCopy) { return copy_2d(pCopy, 1, NULL); }
CUresult cuMemcpy2DUnaligned_v2_ptds(const CUDA_MEMCPY2D *pCopy)
{
    return copy_2d(pCopy, 1, PTDS);
}
CUresult cuMemcpy2DAsync_v2(const CUDA_MEMCPY2D *pCopy, CUstream hStream)
{
    return copy_2d(pCopy, 0, hStream);
}
CUresult cuMemcpy2DAsync_v2_ptsz(const CUDA_MEMCPY2D *pCopy, CUstream hStream)
{
    return copy_2d(pCopy, 0, hStream ? hStream : PTDS);
}
CUresult cuMemcpy3D_v2(const CUDA_MEMCPY3D *pCopy) { return copy_3d(pCopy, 1, NULL); }
CUresult cuMemcpy3D_v2_ptds(const CUDA_MEMCPY3D *pCopy) { return copy_3d(pCopy, 1, PTDS); }
CUresult cuMemcpy3DAsync_v2(const CUDA_MEMCPY3D *pCopy, CUstream hStream)
{
    return copy_3d(pCopy, 0, hStream);
}
CUresult cuMemcpy3DAsync_v2_ptsz(const CUDA_MEMCPY3D *pCopy, CUstream hStream)
{
    return copy_3d(pCopy, 0, hStream ? hStream : PTDS);
}
CUresult cuMemcpy3DPeer(const CUDA_MEMCPY3D_PEER *pCopy) { return copy_3d_peer(pCopy, 1, NULL); }
CUresult cuMemcpy3DPeer_ptds(const CUDA_MEMCPY3D_PEER *pCopy)
{
    return copy_3d_peer(pCopy, 1, PTDS);
}
CUresult cuMemcpy3DPeerAsync(const CUDA_MEMCPY3D_PEER *pCopy, CUstream hStream)
{
    return copy_3d_peer(pCopy, 0, hStream);
}
CUresult cuMemcpy3DPeerAsync_ptsz(const CUDA_MEMCPY3D_PEER *pCopy, CUstream hStream)
{
    return copy_3d_peer(pCopy, 0, hStream ? hStream : PTDS);
}

CUresult cuMemcpyPeer(CUdeviceptr dstDevice, CUcontext dstContext, CUdeviceptr srcDevice,
                      CUcontext srcContext, size_t ByteCount)
{
    return copy_peer(dstDevice, dstContext, srcDevice, srcContext, ByteCount, 1, NULL);
}

CUresult cuMemcpyPeer_ptds(CUdeviceptr dstDevice, CUcontext dstContext, CUdeviceptr srcDevice,
                           CUcontext srcContext, size_t ByteCount)
{
    return copy_peer(dstDevice, dstContext, srcDevice, srcContext, ByteCount, 1, PTDS);
}

CUresult cuMemcpyPeerAsync(CUdeviceptr dstDevice, CUcontext dstContext, CUdeviceptr srcDevice,
                           CUcontext srcContext, size_t ByteCount, CUstream hStream)
{
    return copy_peer(dstDevice, dstContext, srcDevice, srcContext, ByteCount, 0, hStream);
}

CUresult cuMemcpyPeerAsync_ptsz(CUdeviceptr dstDevice, CUcontext dstContext,
                                CUdeviceptr srcDevice, CUcontext srcContext, size_t ByteCount,
                                CUstream hStream)
{
    return copy_peer(dstDevice, dstContext, srcDevice, srcContext, ByteCount, 0,
                     hStream ? hStream : PTDS);
}

/* The sets: (name, value type, sync, stream) in their 1D and 2D shapes. */
#define SET_1D(name, type, sync, stream_expr, ...)                                               \
    CUresult name(CUdeviceptr dstDevice, type v, size_t N __VA_ARGS__)                           \
    {                                                                                            \
        return set_rows(dstDevice, N * sizeof(type), &v, sizeof(type), N, 1, sync, stream_expr); \
    }
#define SET_2D(name, type, sync, stream_expr, ...)                                               \
    CUresult name(CUdeviceptr dstDevice, size_t dstPitch, type v, size_t Width,                  \
                  size_t Height __VA_ARGS__)                                                     \
    {                                                                                            \
        return set_rows(dstDevice, dstPitch, &v, sizeof(type), Width, Height, sync,              \
                        stream_expr);                                                            \
    }

SET_1D(cuMemsetD8_v2, unsigned char, 1, NULL)
SET_1D(cuMemsetD16_v2, unsigned short, 1, NULL)
SET_1D(cuMemsetD32_v2, unsigned int, 1, NULL)
SET_1D(cuMemsetD8_v2_ptds, unsigned char, 1, PTDS)
SET_1D(cuMemsetD16_v2_ptds, unsigned short, 1, PTDS)
SET_1D(cuMemsetD32_v2_ptds, unsigned int, 1, PTDS)
SET_1D(cuMemsetD8Async, unsigned char, 0, hStream, , CUstream hStream)
SET_1D(cuMemsetD16Async, unsigned short, 0, hStream, , CUstream hStream)
SET_1D(cuMemsetD32Async, unsigned int, 0, hStream, , CUstream hStream)
SET_1D(cuMemsetD8Async_ptsz, unsigned char, 0, hStream ? hStream : PTDS, , CUstream hStream)
SET_1D(cuMemsetD16Async_ptsz, unsigned short, 0, hStream ? hStream : PTDS, , CUstream hStream)
SET_1D(cuMemsetD32Async_ptsz, unsigned int, 0, hStream ? hStream : PTDS, , CUstream hStream)
SET_2D(cuMemsetD2D8_v2, unsigned char, 1, NULL)
SET_2D(cuMemsetD2D16_v2, unsigned short, 1, NULL)
SET_2D(cuMemsetD2D32_v2, unsigned int, 1, NULL)
SET_2D(cuMemsetD2D8_v2_ptds, unsigned char, 1, PTDS)
SET_2D(cuMemsetD2D16_v2_ptds, unsigned short, 1, PTDS)
SET_2D(cuMemsetD2D32_v2_ptds, unsigned int, 1, PTDS)
SET_2D(cuMemsetD2D8Async, unsigned char, 0, hStream, , CUstream hStream)
SET_2D(cuMemsetD2D16Async, unsigned short, 0, hStream, , CUstream hStream)
SET_2D(cuMemsetD2D32Async, unsigned int, 0, hStream, , CUstream hStream)
SET_2D(cuMemsetD2D8Async_ptsz, unsigned char, 0, hStream ? hStream : PTDS, , CUstream hStream)
SET_2D(cuMemsetD2D16Async_ptsz, unsigned short, 0, hStream ? hStream : PTDS, , CUstream hStream)
SET_2D(cuMemsetD2D32Async_ptsz, unsigned int, 0, hStream ? hStream : PTDS, , CUstream hStream)

/* ---------- modules, libraries, functions ---------- */

static CUresult module_new(CUmodule *module)
{
    REQUIRE_INIT();
    if (!module)
        return CUDA_ERROR_INVALID_VALUE;
    if (!current_ctx())
        return CUDA_ERROR_INVALID_CONTEXT;
    struct sim_module *m = calloc(1, sizeof(*m));
    if (!m)
        return CUDA_ERROR_OUT_OF_MEMORY;
    m->magic = MAGIC_MODULE;
    *module = (CUmodule)m;
    return CUDA_SUCCESS;
}

CUresult cuModuleLoad(CUmodule *module, const char *fname)
{
    if (!fname)
        return CUDA_ERROR_INVALID_VALUE;
    if (access(fname, R_OK) != 0)
        return CUDA_ERROR_FILE_NOT_FOUND;
    return module_new(module);
}

CUresult cuModuleLoadData(CUmodule *module, const void *image)
{
    if (!image)
        return CUDA_ERROR_INVALID_VALUE;
    return module_new(module);
}

CUresult cuModuleLoadDataEx(CUmodule *module, const void *image, unsigned int numOptions,
                            int *options, void **optionValues)
{
    (void)numOptions;
    (void)options;
    (void)optionValues;
    return cuModuleLoadData(module, image);
}

CUresult cuModuleLoadFatBinary(CUmodule *module, const void *fatCubin)
{
    return cuModuleLoadData(module, fatCubin);
}

CUresult cuModuleUnload(CUmodule hmod)
{
    REQUIRE_INIT();
    struct sim_module *m = (struct sim_module *)hmod;
    if (!m || m->magic != MAGIC_MODULE)
        return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&g_mu);
    while (m->funcs) {
        struct sim_func *f = m->funcs;
        m->funcs = f->next;
        f->magic = MAGIC_DEAD;
        free(f);
    }
    m->magic = MAGIC_DEAD;
    free(m);
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

/* sleep_<microseconds> runs that long; any other kernel the default. */
static uint64_t duration_of(const char *name)
{
    const char *p = strstr(name, "sleep_");
    if (p) {
        p += 6;
        uint64_t us = 0;
        int digits = 0;
        for (; *p >= '0' && *p <= '9' && digits < 12; p++, digits++)
            us = us * 10 + (uint64_t)(*p - '0');
        if (digits > 0)
            return us * 1000;
    }
    return g_default_kernel_ns;
}

CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name)
{
    REQUIRE_INIT();
    struct sim_module *m = (struct sim_module *)hmod;
    if (!hfunc || !name)
        return CUDA_ERROR_INVALID_VALUE;
    if (!m || m->magic != MAGIC_MODULE)
        return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&g_mu);
    struct sim_func *f;
    for (f = m->funcs; f; f = f->next) {
        if (strcmp(f->name, name) == 0)
            break;
    }
    if (!f) {
        f = calloc(1, sizeof(*f) + strlen(name) + 1);
        if (f) {
            f->magic = MAGIC_FUNC;
            f->duration_ns = duration_of(name);
            strcpy(f->name, name);
            f->next = m->funcs;
            m->funcs = f;
        }
    }
    pthread_mutex_unlock(&g_mu);
    if (!f)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *hfunc = (CUfunction)f;
    return CUDA_SUCCESS;
}

CUresult cuFuncGetName(const char **name, CUfunction hfunc)
{
    struct sim_func *f = (struct sim_func *)hfunc;
    if (!name)
        return CUDA_ERROR_INVALID_VALUE;
    if (!f || f->magic != MAGIC_FUNC)
        return CUDA_ERROR_INVALID_HANDLE;
    *name = f->name;
    return CUDA_SUCCESS;
}

/* A library is a module that needs no current context. */
CUresult cuLibraryLoadData(CUlibrary *library, const void *code, int *jitOptions,
                           void **jitOptionsValues, unsigned int numJitOptions,
                           int *libraryOptions, void **libraryOptionValues,
                           unsigned int numLibraryOptions)
{
    (void)jitOptions;
    (void)jitOptionsValues;
    (void)numJitOptions;
    (void)libraryOptions;
    (void)libraryOptionValues;
    (void)numLibraryOptions;
    REQUIRE_INIT();
    if (!library || !code)
        return CUDA_ERROR_INVALID_VALUE;
    struct sim_module *m = calloc(1, sizeof(*m));
    if (!m)
        return CUDA_ERROR_OUT_OF_MEMORY;
    m->magic = MAGIC_MODULE;
    *library = (CUlibrary)m;
    return CUDA_SUCCESS;
}

CUresult cuLibraryLoadFromFile(CUlibrary *library, const char *fileName, int *jitOptions,
                               void **jitOptionsValues, unsigned int numJitOptions,
                               int *libraryOptions, void **libraryOptionValues,
                               unsigned int numLibraryOptions)
{
    if (!fileName)
        return CUDA_ERROR_INVALID_VALUE;
    if (access(fileName, R_OK) != 0)
        return CUDA_ERROR_FILE_NOT_FOUND;
    return cuLibraryLoadData(library, fileName, jitOptions, jitOptionsValues, numJitOptions,
                             libraryOptions, libraryOptionValues, numLibraryOptions);
}

CUresult cuLibraryUnload(CUlibrary library)
{
    return cuModuleUnload((CUmodule)library);
}

CUresult cuLibraryGetKernel(CUkernel *pKernel, CUlibrary library, const char *name)
{
    return cuModuleGetFunction((CUfunction *)pKernel, (CUmodule)library, name);
}

CUresult cuKernelGetFunction(CUfunction *pFunc, CUkernel kernel)
{
    REQUIRE_INIT();
    struct sim_func *f = (struct sim_func *)kernel;
    if (!pFunc)
        return CUDA_ERROR_INVALID_VALUE;
    if (!f || f->magic != MAGIC_FUNC)
        return CUDA_ERROR_INVALID_HANDLE;
    if (!current_ctx())
        return CUDA_ERROR_INVALID_CONTEXT;
    *pFunc = (CUfunction)f;
    return CUDA_SUCCESS;
}

/* ---------- streams and events ---------- */

CUresult cuStreamCreateWithPriority(CUstream *phStream, unsigned int flags, int priority)
{
    REQUIRE_INIT();
    (void)priority;
    struct sim_ctx *c = current_ctx();
    if (!phStream || (flags & ~(unsigned)CU_STREAM_NON_BLOCKING))
        return CUDA_ERROR_INVALID_VALUE;
    if (!c)
        return CUDA_ERROR_INVALID_CONTEXT;
    struct sim_stream *s = malloc(sizeof(*s));
    if (!s)
        return CUDA_ERROR_OUT_OF_MEMORY;
    stream_init(s, c, flags);
    pthread_mutex_lock(&g_mu);
    s->next = c->streams;
    c->streams = s;
    pthread_mutex_unlock(&g_mu);
    *phStream = (CUstream)s;
    return CUDA_SUCCESS;
}

CUresult cuStreamCreate(CUstream *phStream, unsigned int Flags)
{
    return cuStreamCreateWithPriority(phStream, Flags, 0);
}

CUresult cuStreamDestroy_v2(CUstream hStream)
{
    REQUIRE_INIT();
    struct sim_stream *s = (struct sim_stream *)hStream;
    if (!s || s == (struct sim_stream *)CU_STREAM_LEGACY ||
        s == (struct sim_stream *)CU_STREAM_PER_THREAD || s->magic != MAGIC_STREAM ||
        s == &s->ctx->null_stream)
        return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&g_mu);
    struct sim_stream **pp = &s->ctx->streams;
    while (*pp && *pp != s)
        pp = &(*pp)->next;
    if (*pp)
        *pp = s->next;
    stream_free(s);
    free(s);
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

/* The end of everything queued so far on s (the legacy null stream also
 * waits for the context's other blocking streams). */
static const struct sim_ticket *stream_work(struct sim_stream *s)
{
    if (s == &s->ctx->null_stream)
        return &s->ctx->last;
    return &s->last;
}

CUresult cuStreamSynchronize(CUstream hStream)
{
    REQUIRE_INIT();
    struct sim_stream *s = stream_of(hStream);
    if (!s)
        return hStream ? CUDA_ERROR_INVALID_HANDLE : CUDA_ERROR_INVALID_CONTEXT;
    if (s->capture)
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    wait_for(stream_work(s));
    return CUDA_SUCCESS;
}

CUresult cuStreamQuery(CUstream hStream)
{
    REQUIRE_INIT();
    struct sim_stream *s = stream_of(hStream);
    if (!s)
        return hStream ? CUDA_ERROR_INVALID_HANDLE : CUDA_ERROR_INVALID_CONTEXT;
    struct sim_ticket work = ticket_of(stream_work(s));
    return work_done(&work) ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

CUresult cuStreamGetCtx(CUstream hStream, CUcontext *pctx)
{
    REQUIRE_INIT();
    struct sim_stream *s = stream_of(hStream);
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    if (!s)
        return hStream ? CUDA_ERROR_INVALID_HANDLE : CUDA_ERROR_INVALID_CONTEXT;
    *pctx = (CUcontext)s->ctx;
    return CUDA_SUCCESS;
}

CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags)
{
    REQUIRE_INIT();
    if (!phEvent || (Flags & ~0x7u))
        return CUDA_ERROR_INVALID_VALUE;
    if (!current_ctx())
        return CUDA_ERROR_INVALID_CONTEXT;
    struct sim_event *e = calloc(1, sizeof(*e));
    if (!e)
        return CUDA_ERROR_OUT_OF_MEMORY;
    e->magic = MAGIC_EVENT;
    e->flags = Flags;
    *phEvent = (CUevent)e;
    return CUDA_SUCCESS;
}

CUresult cuEventRecord(CUevent hEvent, CUstream hStream)
{
    REQUIRE_INIT();
    struct sim_event *e = (struct sim_event *)hEvent;
    struct sim_stream *s = stream_of(hStream);
    if (!e || e->magic != MAGIC_EVENT)
        return CUDA_ERROR_INVALID_HANDLE;
    if (!s)
        return hStream ? CUDA_ERROR_INVALID_HANDLE : CUDA_ERROR_INVALID_CONTEXT;
    if (s->capture)
        return CUDA_SUCCESS; /* an event node: nothing to time */
    struct sim_ticket work = ticket_of(stream_work(s));
    uint64_t now = sim_now_ns();
    e->recorded = 1;
    e->work = work;
    e->time = 0;
    if (work.kind == SIM_TICKET_FIFO) {
        e->time = work.end_ns > now ? work.end_ns : now;
        e->work.end_ns = e->time;
    } else if (work_done(&work)) {
        memset(&e->work, 0, sizeof(e->work));
        e->time = now;
    }
    return CUDA_SUCCESS;
}

CUresult cuEventRecordWithFlags(CUevent hEvent, CUstream hStream, unsigned int flags)
{
    (void)flags;
    return cuEventRecord(hEvent, hStream);
}

/* Whether the event's work has completed; its time is known from then on. */
static int event_done(struct sim_event *e)
{
    if (!e->recorded)
        return 1;
    if (e->work.kind != SIM_TICKET_QUEUE)
        return e->time <= sim_now_ns();
    if (e->time)
        return 1;
    sim_lock();
    int done = sim_ticket_done_locked(&e->work);
    if (done) {
        uint64_t at = sim_ticket_time_locked(&e->work);
        e->time = at ? at : sim_now_ns();
    }
    sim_unlock();
    return done;
}

CUresult cuEventQuery(CUevent hEvent)
{
    REQUIRE_INIT();
    struct sim_event *e = (struct sim_event *)hEvent;
    if (!e || e->magic != MAGIC_EVENT)
        return CUDA_ERROR_INVALID_HANDLE;
    return event_done(e) ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

CUresult cuEventSynchronize(CUevent hEvent)
{
    REQUIRE_INIT();
    struct sim_event *e = (struct sim_event *)hEvent;
    if (!e || e->magic != MAGIC_EVENT)
        return CUDA_ERROR_INVALID_HANDLE;
    if (e->recorded && !e->time)
        sim_ticket_wait(&e->work);
    else if (e->recorded)
        sim_sleep_until(e->time);
    event_done(e);
    return CUDA_SUCCESS;
}

CUresult cuEventDestroy_v2(CUevent hEvent)
{
    REQUIRE_INIT();
    struct sim_event *e = (struct sim_event *)hEvent;
    if (!e || e->magic != MAGIC_EVENT)
        return CUDA_ERROR_INVALID_HANDLE;
    e->magic = MAGIC_DEAD;
    free(e);
    return CUDA_SUCCESS;
}

CUresult cuEventElapsedTime(float *pMilliseconds, CUevent hStart, CUevent hEnd)
{
    REQUIRE_INIT();
    struct sim_event *a = (struct sim_event *)hStart, *b = (struct sim_event *)hEnd;
    if (!pMilliseconds)
        return CUDA_ERROR_INVALID_VALUE;
    if (!a || !b || a->magic != MAGIC_EVENT || b->magic != MAGIC_EVENT)
        return CUDA_ERROR_INVALID_HANDLE;
    if (!a->recorded || !b->recorded || ((a->flags | b->flags) & CU_EVENT_DISABLE_TIMING))
        return CUDA_ERROR_INVALID_HANDLE;
    if (!event_done(a) || !event_done(b))
        return CUDA_ERROR_NOT_READY;
    *pMilliseconds = (float)((double)((int64_t)(b->time - a->time)) / 1e6);
    return CUDA_SUCCESS;
}

CUresult cuStreamWaitEvent(CUstream hStream, CUevent hEvent, unsigned int Flags)
{
    REQUIRE_INIT();
    struct sim_stream *s = stream_of(hStream);
    struct sim_event *e = (struct sim_event *)hEvent;
    (void)Flags;
    if (!e || e->magic != MAGIC_EVENT)
        return CUDA_ERROR_INVALID_HANDLE;
    if (!s)
        return hStream ? CUDA_ERROR_INVALID_HANDLE : CUDA_ERROR_INVALID_CONTEXT;
    if (!e->recorded)
        return CUDA_SUCCESS;
    struct sim_ticket work = e->work;
    pthread_mutex_lock(&g_mu);
    if (work.kind == SIM_TICKET_FIFO && work.end_ns > s->not_before)
        s->not_before = work.end_ns;
    if (work.kind == SIM_TICKET_QUEUE) {
        /* One pending wait per stream: another queue's is waited for now. */
        struct sim_ticket old = s->after;
        int same = old.kind == SIM_TICKET_QUEUE && old.slot == work.slot &&
                   old.dev == work.dev && old.gen == work.gen;
        if (old.kind == SIM_TICKET_QUEUE && !same) {
            pthread_mutex_unlock(&g_mu);
            sim_ticket_wait(&old);
            pthread_mutex_lock(&g_mu);
        }
        if (!same || old.pos < work.pos)
            s->after = work;
    }
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

/* ---------- launches ---------- */

static CUresult graph_append(struct sim_graph *g, uint64_t dur)
{
    if (g->count == g->cap) {
        size_t cap = g->cap ? g->cap * 2 : 16;
        uint64_t *d = realloc(g->durations_ns, cap * sizeof(*d));
        if (!d)
            return CUDA_ERROR_OUT_OF_MEMORY;
        g->durations_ns = d;
        g->cap = cap;
    }
    g->durations_ns[g->count++] = dur;
    return CUDA_SUCCESS;
}

/* Under the state lock: append a booked fifo kernel to SIMGPU_KERNEL_TRACE. */
static void trace_kernel(int slot, const struct sim_ticket *t, uint64_t dur_ns)
{
    static int fd = -2;
    if (fd == -2) {
        const char *path = getenv("SIMGPU_KERNEL_TRACE");
        fd = path && path[0] ? open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644) : -1;
    }
    if (fd < 0 || t->kind != SIM_TICKET_FIFO)
        return;
    char line[160];
    int n = snprintf(line, sizeof line, "kernel pid=%d launch=%llu start=%llu end=%llu\n",
                     (int)sim_state()->procs[slot].pid, (unsigned long long)sim_now_ns(),
                     (unsigned long long)(t->end_ns - dur_ns), (unsigned long long)t->end_ns);
    if (n > 0 && write(fd, line, (size_t)n) != n)
        fd = -1; /* a trace that cannot be written is not kept */
}

/* Whether t is a position in this process's queue on dev (slot is its slot). */
static int in_own_queue(const struct sim_ticket *t, int slot, int dev)
{
    return t->slot == slot && t->dev == dev &&
           t->gen == sim_state()->procs[slot].generation;
}

/* Queue one kernel of dur_ns on the stream's device. Caller holds g_mu; it
 * is released while waiting for room in the stream's queue or for an event
 * in another queue (cuStreamWaitEvent). */
static CUresult enqueue_kernel(struct sim_stream *s, uint64_t dur_ns)
{
    if (s->capture)
        return graph_append(s->capture, dur_ns);
    if (!s->ring) {
        s->ring = calloc(g_queue_depth, sizeof(*s->ring));
        if (!s->ring)
            return CUDA_ERROR_OUT_OF_MEMORY;
    }
    for (;;) {
        struct sim_ctx *c = s->ctx;
        struct sim_ticket wait;
        sim_lock();
        int slot = sim_self_slot_locked();
        if (slot < 0) {
            sim_unlock();
            return CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES;
        }
        while (s->count > 0 && sim_ticket_done_locked(&s->ring[s->head])) {
            s->head = (s->head + 1) % g_queue_depth;
            s->count--;
        }
        if (s->after.kind == SIM_TICKET_QUEUE &&
            (in_own_queue(&s->after, slot, c->dev) || sim_ticket_done_locked(&s->after)))
            memset(&s->after, 0, sizeof(s->after));
        if (s->after.kind == SIM_TICKET_QUEUE) {
            wait = s->after;
        } else if (s->count == g_queue_depth) {
            wait = s->ring[s->head];
        } else {
            struct sim_ticket t;
            sim_enqueue_locked(c->dev, slot, dur_ns, s->not_before, &t);
            trace_kernel(slot, &t, dur_ns);
            sim_unlock();
            s->ring[(s->head + s->count) % g_queue_depth] = t;
            s->count++;
            s->last = t;
            if (t.kind != SIM_TICKET_FIFO || t.end_ns > c->last.end_ns)
                c->last = t;
            return CUDA_SUCCESS;
        }
        sim_unlock();
        pthread_mutex_unlock(&g_mu);
        sim_ticket_wait(&wait);
        pthread_mutex_lock(&g_mu);
        if (s->magic != MAGIC_STREAM)
            return CUDA_ERROR_INVALID_HANDLE;
    }
}

static CUresult launch(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                       unsigned by, unsigned bz, CUstream hStream, int cooperative)
{
    REQUIRE_INIT();
    struct sim_func *fn = (struct sim_func *)f;
    if (!fn || fn->magic != MAGIC_FUNC)
        return CUDA_ERROR_INVALID_HANDLE;
    if (!gx || !gy || !gz || !bx || !by || !bz || (uint64_t)bx * by * bz > 1024 || bz > 64)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    struct sim_stream *s = stream_of(hStream);
    CUresult rc;
    if (!s) {
        rc = hStream ? CUDA_ERROR_INVALID_HANDLE : CUDA_ERROR_INVALID_CONTEXT;
    } else {
        rc = CUDA_SUCCESS;
        if (cooperative) {
            struct sim_traits t;
            sim_traits_for(sim_state()->devices[s->ctx->dev].name, &t);
            uint64_t blocks = (uint64_t)gx * gy * gz;
            uint64_t per_sm = (uint64_t)t.threads_per_sm / ((uint64_t)bx * by * bz);
            if (blocks > (uint64_t)t.sm_count * (per_sm ? per_sm : 1))
                rc = CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE;
        }
        if (rc == CUDA_SUCCESS)
            rc = enqueue_kernel(s, fn->duration_ns);
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                        unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                        unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                        void **kernelParams, void **extra)
{
    (void)sharedMemBytes;
    (void)kernelParams;
    (void)extra;
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, hStream, 0);
}

CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                          void **extra)
{
    (void)kernelParams;
    (void)extra;
    if (!config || (config->numAttrs && !config->attrs))
        return CUDA_ERROR_INVALID_VALUE;
    int cooperative = 0;
    for (unsigned i = 0; i < config->numAttrs; i++) {
        if (config->attrs[i].id == CU_LAUNCH_ATTRIBUTE_COOPERATIVE)
            cooperative = config->attrs[i].value.cooperative != 0;
    }
    return launch(f, config->gridDimX, config->gridDimY, config->gridDimZ, config->blockDimX,
                  config->blockDimY, config->blockDimZ, config->hStream, cooperative);
}

CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                   unsigned int gridDimZ, unsigned int blockDimX,
                                   unsigned int blockDimY, unsigned int blockDimZ,
                                   unsigned int sharedMemBytes, CUstream hStream,
                                   void **kernelParams)
{
    (void)sharedMemBytes;
    (void)kernelParams;
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, hStream, 1);
}

/* The launches of CUDA 2, deprecated and still exported: the block shape is
 * the function's (not simulated: one thread). */
CUresult cuLaunch(CUfunction f)
{
    return launch(f, 1, 1, 1, 1, 1, 1, NULL, 0);
}

CUresult cuLaunchGrid(CUfunction f, int grid_width, int grid_height)
{
    if (grid_width <= 0 || grid_height <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    return launch(f, (unsigned)grid_width, (unsigned)grid_height, 1, 1, 1, 1, NULL, 0);
}

CUresult cuLaunchGridAsync(CUfunction f, int grid_width, int grid_height, CUstream hStream)
{
    if (grid_width <= 0 || grid_height <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    return launch(f, (unsigned)grid_width, (unsigned)grid_height, 1, 1, 1, 1, hStream, 0);
}

/* Each device's kernel on its stream (in simgpu one after the other, not as one). */
CUresult cuLaunchCooperativeKernelMultiDevice(CUDA_LAUNCH_PARAMS *launchParamsList,
                                              unsigned int numDevices, unsigned int flags)
{
    (void)flags;
    if (!launchParamsList || numDevices == 0)
        return CUDA_ERROR_INVALID_VALUE;
    for (unsigned int i = 0; i < numDevices; i++) {
        const CUDA_LAUNCH_PARAMS *p = &launchParamsList[i];
        CUresult rc = launch(p->function, p->gridDimX, p->gridDimY, p->gridDimZ, p->blockDimX,
                             p->blockDimY, p->blockDimZ, p->hStream, 1);
        if (rc != CUDA_SUCCESS)
            return rc;
    }
    return CUDA_SUCCESS;
}

struct host_call {
    struct sim_ticket after;
    CUhostFn fn;
    void *data;
};

static void *host_call_thread(void *arg)
{
    struct host_call *hc = arg;
    sim_ticket_wait(&hc->after);
    hc->fn(hc->data);
    free(hc);
    return NULL;
}

CUresult cuLaunchHostFunc(CUstream hStream, CUhostFn fn, void *userData)
{
    REQUIRE_INIT();
    struct sim_stream *s = stream_of(hStream);
    if (!fn)
        return CUDA_ERROR_INVALID_VALUE;
    if (!s)
        return hStream ? CUDA_ERROR_INVALID_HANDLE : CUDA_ERROR_INVALID_CONTEXT;
    struct host_call *hc = malloc(sizeof(*hc));
    pthread_t th;
    if (!hc)
        return CUDA_ERROR_OUT_OF_MEMORY;
    hc->after = ticket_of(stream_work(s));
    hc->fn = fn;
    hc->data = userData;
    if (pthread_create(&th, NULL, host_call_thread, hc) != 0) {
        free(hc);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    pthread_detach(th);
    return CUDA_SUCCESS;
}

/* ---------- graphs: stream capture records kernel durations ---------- */

static CUresult begin_capture(CUstream hStream)
{
    REQUIRE_INIT();
    struct sim_stream *s = stream_of(hStream);
    if (!s)
        return hStream ? CUDA_ERROR_INVALID_HANDLE : CUDA_ERROR_INVALID_CONTEXT;
    if (!hStream || hStream == CU_STREAM_LEGACY)
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    if (s->capture)
        return CUDA_ERROR_ILLEGAL_STATE;
    struct sim_graph *g = calloc(1, sizeof(*g));
    if (!g)
        return CUDA_ERROR_OUT_OF_MEMORY;
    g->magic = MAGIC_GRAPH;
    s->capture = g;
    return CUDA_SUCCESS;
}

CUresult cuStreamBeginCapture_v2(CUstream hStream, CUstreamCaptureMode mode)
{
    if ((unsigned)mode > CU_STREAM_CAPTURE_MODE_RELAXED)
        return CUDA_ERROR_INVALID_VALUE;
    return begin_capture(hStream);
}

CUresult cuStreamEndCapture(CUstream hStream, CUgraph *phGraph)
{
    REQUIRE_INIT();
    struct sim_stream *s = stream_of(hStream);
    if (!phGraph)
        return CUDA_ERROR_INVALID_VALUE;
    if (!s)
        return hStream ? CUDA_ERROR_INVALID_HANDLE : CUDA_ERROR_INVALID_CONTEXT;
    if (!s->capture)
        return CUDA_ERROR_ILLEGAL_STATE;
    *phGraph = (CUgraph)s->capture;
    s->capture = NULL;
    return CUDA_SUCCESS;
}

CUresult cuStreamIsCapturing(CUstream hStream, CUstreamCaptureStatus *captureStatus)
{
    REQUIRE_INIT();
    struct sim_stream *s = stream_of(hStream);
    if (!captureStatus)
        return CUDA_ERROR_INVALID_VALUE;
    if (!s)
        return hStream ? CUDA_ERROR_INVALID_HANDLE : CUDA_ERROR_INVALID_CONTEXT;
    *captureStatus = s->capture ? CU_STREAM_CAPTURE_STATUS_ACTIVE : CU_STREAM_CAPTURE_STATUS_NONE;
    return CUDA_SUCCESS;
}

CUresult cuGraphCreate(CUgraph *phGraph, unsigned int flags)
{
    REQUIRE_INIT();
    if (!phGraph || flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    struct sim_graph *g = calloc(1, sizeof(*g));
    if (!g)
        return CUDA_ERROR_OUT_OF_MEMORY;
    g->magic = MAGIC_GRAPH;
    *phGraph = (CUgraph)g;
    return CUDA_SUCCESS;
}

static CUresult graph_free(void *h, uint32_t magic)
{
    struct sim_graph *g = h;
    if (!g || g->magic != magic)
        return CUDA_ERROR_INVALID_VALUE;
    g->magic = MAGIC_DEAD;
    free(g->durations_ns);
    free(g);
    return CUDA_SUCCESS;
}

CUresult cuGraphDestroy(CUgraph hGraph)
{
    REQUIRE_INIT();
    return graph_free(hGraph, MAGIC_GRAPH);
}

CUresult cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph,
                                     unsigned long long flags)
{
    REQUIRE_INIT();
    (void)flags;
    struct sim_graph *g = (struct sim_graph *)hGraph;
    if (!phGraphExec || !g || g->magic != MAGIC_GRAPH)
        return CUDA_ERROR_INVALID_VALUE;
    struct sim_graph *x = calloc(1, sizeof(*x));
    if (!x)
        return CUDA_ERROR_OUT_OF_MEMORY;
    x->magic = MAGIC_EXEC;
    for (size_t i = 0; i < g->count; i++) {
        if (graph_append(x, g->durations_ns[i]) != CUDA_SUCCESS) {
            graph_free(x, MAGIC_EXEC);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    *phGraphExec = (CUgraphExec)x;
    return CUDA_SUCCESS;
}

CUresult cuGraphExecDestroy(CUgraphExec hGraphExec)
{
    REQUIRE_INIT();
    return graph_free(hGraphExec, MAGIC_EXEC);
}

CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream)
{
    REQUIRE_INIT();
    struct sim_graph *x = (struct sim_graph *)hGraphExec;
    if (!x || x->magic != MAGIC_EXEC)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    struct sim_stream *s = stream_of(hStream);
    CUresult rc = s ? CUDA_SUCCESS : (hStream ? CUDA_ERROR_INVALID_HANDLE : CUDA_ERROR_INVALID_CONTEXT);
    for (size_t i = 0; rc == CUDA_SUCCESS && i < x->count; i++)
        rc = enqueue_kernel(s, x->durations_ns[i]);
    pthread_mutex_unlock(&g_mu);
    return rc;
}

/* ---------- per-thread default stream variants ---------- */

static CUstream ptsz(CUstream h)
{
    return h ? h : CU_STREAM_PER_THREAD;
}

CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                             unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                             unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                             void **kernelParams, void **extra)
{
    return cuLaunchKernel(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ,
                          sharedMemBytes, ptsz(hStream), kernelParams, extra);
}

CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                               void **extra)
{
    if (!config)
        return CUDA_ERROR_INVALID_VALUE;
    CUlaunchConfig c = *config;
    c.hStream = ptsz(c.hStream);
    return cuLaunchKernelEx(&c, f, kernelParams, extra);
}

CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                        unsigned int gridDimZ, unsigned int blockDimX,
                                        unsigned int blockDimY, unsigned int blockDimZ,
                                        unsigned int sharedMemBytes, CUstream hStream,
                                        void **kernelParams)
{
    return cuLaunchCooperativeKernel(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY,
                                     blockDimZ, sharedMemBytes, ptsz(hStream), kernelParams);
}

CUresult cuGraphLaunch_ptsz(CUgraphExec hGraphExec, CUstream hStream)
{
    return cuGraphLaunch(hGraphExec, ptsz(hStream));
}

CUresult cuStreamSynchronize_ptsz(CUstream hStream)
{
    return cuStreamSynchronize(ptsz(hStream));
}

CUresult cuStreamQuery_ptsz(CUstream hStream)
{
    return cuStreamQuery(ptsz(hStream));
}

CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    return cuMemAllocAsync(dptr, bytesize, ptsz(hStream));
}

CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                      CUstream hStream)
{
    return cuMemAllocFromPoolAsync(dptr, bytesize, pool, ptsz(hStream));
}

CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream)
{
    return cuMemFreeAsync(dptr, ptsz(hStream));
}

CUresult cuEventRecord_ptsz(CUevent hEvent, CUstream hStream)
{
    return cuEventRecord(hEvent, ptsz(hStream));
}

CUresult cuStreamWaitEvent_ptsz(CUstream hStream, CUevent hEvent, unsigned int Flags)
{
    return cuStreamWaitEvent(ptsz(hStream), hEvent, Flags);
}

/* ---------- legacy (unversioned) exports with the same ABI ---------- */

#undef cuCtxCreate
#undef cuCtxDestroy
#undef cuCtxPopCurrent
#undef cuCtxPushCurrent
#undef cuDevicePrimaryCtxRelease
#undef cuDevicePrimaryCtxReset
#undef cuDevicePrimaryCtxSetFlags
#undef cuDeviceGetUuid
#undef cuStreamDestroy
#undef cuEventDestroy
#undef cuStreamBeginCapture
#undef cuGetProcAddress

#define ALIAS(name, target, ret, args) EXPORT ret name args __attribute__((alias(#target)))
ALIAS(cuCtxCreate, cuCtxCreate_v2, CUresult, (CUcontext *, unsigned int, CUdevice));
ALIAS(cuCtxDestroy, cuCtxDestroy_v2, CUresult, (CUcontext));
ALIAS(cuCtxPopCurrent, cuCtxPopCurrent_v2, CUresult, (CUcontext *));
ALIAS(cuCtxPushCurrent, cuCtxPushCurrent_v2, CUresult, (CUcontext));
ALIAS(cuDevicePrimaryCtxRelease, cuDevicePrimaryCtxRelease_v2, CUresult, (CUdevice));
ALIAS(cuDevicePrimaryCtxReset, cuDevicePrimaryCtxReset_v2, CUresult, (CUdevice));
ALIAS(cuDevicePrimaryCtxSetFlags, cuDevicePrimaryCtxSetFlags_v2, CUresult, (CUdevice, unsigned int));
ALIAS(cuDeviceGetUuid, cuDeviceGetUuid_v2, CUresult, (CUuuid *, CUdevice));
ALIAS(cuStreamDestroy, cuStreamDestroy_v2, CUresult, (CUstream));
ALIAS(cuEventDestroy, cuEventDestroy_v2, CUresult, (CUevent));

EXPORT CUresult cuStreamBeginCapture(CUstream hStream);
CUresult cuStreamBeginCapture(CUstream hStream)
{
    return begin_capture(hStream);
}

/* ---------- cuGetProcAddress ---------- */

/* Entry points that no exported symbol names: with SIMGPU_GETPROC_INTERNAL=1
 * cuGetProcAddress hands these out instead of the exported functions, as a
 * real driver may (so that only the name asked for says what one is). They
 * call the implementation directly, never an exported symbol (which a
 * preloaded library would interpose). */
static CUresult internal_cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    return alloc_current(dptr, bytesize, ALLOC_DEVICE);
}

static CUresult internal_cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy,
                                        unsigned int gz, unsigned int bx, unsigned int by,
                                        unsigned int bz, unsigned int shmem, CUstream hStream,
                                        void **params, void **extra)
{
    (void)shmem;
    (void)params;
    (void)extra;
    return launch(f, gx, gy, gz, bx, by, bz, hStream, 0);
}

static CUresult internal_cuLaunchKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy,
                                             unsigned int gz, unsigned int bx, unsigned int by,
                                             unsigned int bz, unsigned int shmem,
                                             CUstream hStream, void **params, void **extra)
{
    (void)shmem;
    (void)params;
    (void)extra;
    return launch(f, gx, gy, gz, bx, by, bz, ptsz(hStream), 0);
}

static CUresult internal_cuLaunchGrid(CUfunction f, int grid_width, int grid_height)
{
    if (grid_width <= 0 || grid_height <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    return launch(f, (unsigned)grid_width, (unsigned)grid_height, 1, 1, 1, 1, NULL, 0);
}

static CUresult internal_cuMemsetD8_v2(CUdeviceptr dstDevice, unsigned char uc, size_t N)
{
    return set_rows(dstDevice, N, &uc, 1, N, 1, 1, NULL);
}

static CUresult internal_cuMemcpyDtoDAsync_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice,
                                              size_t ByteCount, CUstream hStream)
{
    return device_copy(DPTR(dstDevice), DPTR(srcDevice), ByteCount, 0, hStream);
}

static const struct {
    void *exported;
    void *internal;
} g_internal[] = {
    {(void *)cuMemAlloc_v2, (void *)internal_cuMemAlloc_v2},
    {(void *)cuLaunchKernel, (void *)internal_cuLaunchKernel},
    {(void *)cuLaunchKernel_ptsz, (void *)internal_cuLaunchKernel_ptsz},
    {(void *)cuLaunchGrid, (void *)internal_cuLaunchGrid},
    {(void *)cuMemsetD8_v2, (void *)internal_cuMemsetD8_v2},
    {(void *)cuMemcpyDtoDAsync_v2, (void *)internal_cuMemcpyDtoDAsync_v2},
};

static void *internal_of(void *fn)
{
    const char *on = getenv("SIMGPU_GETPROC_INTERNAL");
    if (on == NULL || strcmp(on, "1") != 0)
        return fn;
    for (size_t i = 0; i < sizeof(g_internal) / sizeof(g_internal[0]); i++)
        if (g_internal[i].exported == fn)
            return g_internal[i].internal;
    return fn;
}

struct proc_entry {
    const char *name;    /* the name callers ask for (no _v2 suffix) */
    int version;         /* first CUDA version with this variant */
    void *fn;
    void *fn_ptsz;       /* per-thread default stream variant, or NULL */
    const char *symbol;  /* the exported symbol */
};

#define P(name, ver, fn) {name, ver, (void *)(fn), NULL, #fn}
#define PT(name, ver, fn) {name, ver, (void *)(fn), (void *)(fn##_ptsz), #fn}
#define PD(name, ver, fn) {name, ver, (void *)(fn), (void *)(fn##_ptds), #fn}

EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion,
                                 cuuint64_t flags);

static const struct proc_entry g_procs[] = {
    P("cuGetErrorString", 6000, cuGetErrorString),
    P("cuGetErrorName", 6000, cuGetErrorName),
    P("cuInit", 2000, cuInit),
    P("cuDriverGetVersion", 2020, cuDriverGetVersion),
    P("cuGetProcAddress", 11030, cuGetProcAddress),
    P("cuGetProcAddress", 12000, cuGetProcAddress_v2),
    P("cuGetExportTable", 3000, cuGetExportTable),
    P("cuDeviceGet", 2000, cuDeviceGet),
    P("cuDeviceGetCount", 2000, cuDeviceGetCount),
    P("cuDeviceGetName", 2000, cuDeviceGetName),
    P("cuDeviceGetUuid", 9020, cuDeviceGetUuid),
    P("cuDeviceGetUuid", 11040, cuDeviceGetUuid_v2),
    P("cuDeviceTotalMem", 3020, cuDeviceTotalMem_v2),
    P("cuDeviceGetAttribute", 2000, cuDeviceGetAttribute),
    P("cuDeviceComputeCapability", 2000, cuDeviceComputeCapability),
    P("cuDeviceGetPCIBusId", 4010, cuDeviceGetPCIBusId),
    P("cuDeviceGetDefaultMemPool", 11020, cuDeviceGetDefaultMemPool),
    P("cuDevicePrimaryCtxRetain", 7000, cuDevicePrimaryCtxRetain),
    P("cuDevicePrimaryCtxRelease", 7000, cuDevicePrimaryCtxRelease),
    P("cuDevicePrimaryCtxRelease", 11000, cuDevicePrimaryCtxRelease_v2),
    P("cuDevicePrimaryCtxReset", 7000, cuDevicePrimaryCtxReset),
    P("cuDevicePrimaryCtxReset", 11000, cuDevicePrimaryCtxReset_v2),
    P("cuDevicePrimaryCtxSetFlags", 7000, cuDevicePrimaryCtxSetFlags),
    P("cuDevicePrimaryCtxSetFlags", 11000, cuDevicePrimaryCtxSetFlags_v2),
    P("cuDevicePrimaryCtxGetState", 7000, cuDevicePrimaryCtxGetState),
    P("cuCtxCreate", 3020, cuCtxCreate_v2),
    P("cuCtxCreate", 11040, cuCtxCreate_v3),
    P("cuCtxCreate", 12050, cuCtxCreate_v4),
    P("cuCtxDestroy", 4000, cuCtxDestroy_v2),
    P("cuCtxPushCurrent", 4000, cuCtxPushCurrent_v2),
    P("cuCtxPopCurrent", 4000, cuCtxPopCurrent_v2),
    P("cuCtxSetCurrent", 4000, cuCtxSetCurrent),
    P("cuCtxGetCurrent", 4000, cuCtxGetCurrent),
    P("cuCtxGetDevice", 2000, cuCtxGetDevice),
    P("cuCtxGetFlags", 7000, cuCtxGetFlags),
    P("cuCtxGetApiVersion", 3020, cuCtxGetApiVersion),
    P("cuCtxSynchronize", 2000, cuCtxSynchronize),
    P("cuMemGetInfo", 3020, cuMemGetInfo_v2),
    P("cuMemAlloc", 3020, cuMemAlloc_v2),
    P("cuMemAllocPitch", 3020, cuMemAllocPitch_v2),
    P("cuMemFree", 3020, cuMemFree_v2),
    P("cuMemGetAddressRange", 3020, cuMemGetAddressRange_v2),
    P("cuMemAllocManaged", 6000, cuMemAllocManaged),
    P("cuMemAllocHost", 3020, cuMemAllocHost_v2),
    P("cuMemHostAlloc", 2020, cuMemHostAlloc),
    P("cuMemFreeHost", 2000, cuMemFreeHost),
    PT("cuMemAllocAsync", 11020, cuMemAllocAsync),
    PT("cuMemAllocFromPoolAsync", 11020, cuMemAllocFromPoolAsync),
    PT("cuMemFreeAsync", 11020, cuMemFreeAsync),
    P("cuMemPoolCreate", 11020, cuMemPoolCreate),
    P("cuMemPoolDestroy", 11020, cuMemPoolDestroy),
    P("cuMemPoolTrimTo", 11020, cuMemPoolTrimTo),
    P("cuMemCreate", 10020, cuMemCreate),
    P("cuMemRelease", 10020, cuMemRelease),
    P("cuMemAddressReserve", 10020, cuMemAddressReserve),
    P("cuMemAddressFree", 10020, cuMemAddressFree),
    P("cuMemMap", 10020, cuMemMap),
    P("cuMemUnmap", 10020, cuMemUnmap),
    P("cuMemSetAccess", 10020, cuMemSetAccess),
    P("cuMemGetAllocationGranularity", 10020, cuMemGetAllocationGranularity),
    P("cuArrayCreate", 3020, cuArrayCreate_v2),
    P("cuArray3DCreate", 3020, cuArray3DCreate_v2),
    P("cuArrayDestroy", 2000, cuArrayDestroy),
    P("cuMemcpyHtoD", 3020, cuMemcpyHtoD_v2),
    P("cuMemcpyDtoH", 3020, cuMemcpyDtoH_v2),
    PD("cuMemcpyDtoD", 3020, cuMemcpyDtoD_v2),
    P("cuMemcpyHtoDAsync", 3020, cuMemcpyHtoDAsync_v2),
    P("cuMemcpyDtoHAsync", 3020, cuMemcpyDtoHAsync_v2),
    PT("cuMemcpyDtoDAsync", 3020, cuMemcpyDtoDAsync_v2),
    PD("cuMemcpy", 4000, cuMemcpy),
    PT("cuMemcpyAsync", 4000, cuMemcpyAsync),
    PD("cuMemcpy2D", 3020, cuMemcpy2D_v2),
    PD("cuMemcpy2DUnaligned", 3020, cuMemcpy2DUnaligned_v2),
    PT("cuMemcpy2DAsync", 3020, cuMemcpy2DAsync_v2),
    PD("cuMemcpy3D", 3020, cuMemcpy3D_v2),
    PT("cuMemcpy3DAsync", 3020, cuMemcpy3DAsync_v2),
    PD("cuMemcpyPeer", 4000, cuMemcpyPeer),
    PT("cuMemcpyPeerAsync", 4000, cuMemcpyPeerAsync),
    PD("cuMemcpy3DPeer", 4000, cuMemcpy3DPeer),
    PT("cuMemcpy3DPeerAsync", 4000, cuMemcpy3DPeerAsync),
    PD("cuMemsetD8", 3020, cuMemsetD8_v2),
    PD("cuMemsetD16", 3020, cuMemsetD16_v2),
    PD("cuMemsetD32", 3020, cuMemsetD32_v2),
    PD("cuMemsetD2D8", 3020, cuMemsetD2D8_v2),
    PD("cuMemsetD2D16", 3020, cuMemsetD2D16_v2),
    PD("cuMemsetD2D32", 3020, cuMemsetD2D32_v2),
    PT("cuMemsetD8Async", 3020, cuMemsetD8Async),
    PT("cuMemsetD16Async", 3020, cuMemsetD16Async),
    PT("cuMemsetD32Async", 3020, cuMemsetD32Async),
    PT("cuMemsetD2D8Async", 3020, cuMemsetD2D8Async),
    PT("cuMemsetD2D16Async", 3020, cuMemsetD2D16Async),
    PT("cuMemsetD2D32Async", 3020, cuMemsetD2D32Async),
    P("cuModuleLoad", 2000, cuModuleLoad),
    P("cuModuleLoadData", 2000, cuModuleLoadData),
    P("cuModuleLoadDataEx", 2010, cuModuleLoadDataEx),
    P("cuModuleLoadFatBinary", 2000, cuModuleLoadFatBinary),
    P("cuModuleUnload", 2000, cuModuleUnload),
    P("cuModuleGetFunction", 2000, cuModuleGetFunction),
    P("cuFuncGetName", 12030, cuFuncGetName),
    P("cuLibraryLoadData", 12000, cuLibraryLoadData),
    P("cuLibraryLoadFromFile", 12000, cuLibraryLoadFromFile),
    P("cuLibraryUnload", 12000, cuLibraryUnload),
    P("cuLibraryGetKernel", 12000, cuLibraryGetKernel),
    P("cuKernelGetFunction", 12000, cuKernelGetFunction),
    P("cuStreamCreate", 2000, cuStreamCreate),
    P("cuStreamCreateWithPriority", 5050, cuStreamCreateWithPriority),
    P("cuStreamDestroy", 4000, cuStreamDestroy_v2),
    PT("cuStreamSynchronize", 2000, cuStreamSynchronize),
    PT("cuStreamQuery", 2000, cuStreamQuery),
    PT("cuStreamWaitEvent", 3020, cuStreamWaitEvent),
    P("cuStreamGetCtx", 9020, cuStreamGetCtx),
    P("cuStreamBeginCapture", 10000, cuStreamBeginCapture),
    P("cuStreamBeginCapture", 10010, cuStreamBeginCapture_v2),
    P("cuStreamEndCapture", 10000, cuStreamEndCapture),
    P("cuStreamIsCapturing", 10000, cuStreamIsCapturing),
    P("cuEventCreate", 2000, cuEventCreate),
    PT("cuEventRecord", 2000, cuEventRecord),
    P("cuEventRecordWithFlags", 11010, cuEventRecordWithFlags),
    P("cuEventQuery", 2000, cuEventQuery),
    P("cuEventSynchronize", 2000, cuEventSynchronize),
    P("cuEventDestroy", 4000, cuEventDestroy_v2),
    P("cuEventElapsedTime", 2000, cuEventElapsedTime),
    PT("cuLaunchKernel", 4000, cuLaunchKernel),
    PT("cuLaunchKernelEx", 11060, cuLaunchKernelEx),
    PT("cuLaunchCooperativeKernel", 9000, cuLaunchCooperativeKernel),
    P("cuLaunchCooperativeKernelMultiDevice", 9000, cuLaunchCooperativeKernelMultiDevice),
    P("cuLaunch", 2000, cuLaunch),
    P("cuLaunchGrid", 2000, cuLaunchGrid),
    P("cuLaunchGridAsync", 2000, cuLaunchGridAsync),
    P("cuLaunchHostFunc", 10000, cuLaunchHostFunc),
    P("cuGraphCreate", 10000, cuGraphCreate),
    P("cuGraphDestroy", 10000, cuGraphDestroy),
    P("cuGraphInstantiate", 12000, cuGraphInstantiateWithFlags),
    P("cuGraphInstantiateWithFlags", 11040, cuGraphInstantiateWithFlags),
    P("cuGraphExecDestroy", 10000, cuGraphExecDestroy),
    PT("cuGraphLaunch", 10000, cuGraphLaunch),
};

static CUresult proc_lookup(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                            CUdriverProcAddressQueryResult *status)
{
    const struct proc_entry *best = NULL;
    int found = 0;
    if (!symbol || !pfn)
        return CUDA_ERROR_INVALID_VALUE;
    *pfn = NULL;
    for (size_t i = 0; i < sizeof(g_procs) / sizeof(g_procs[0]); i++) {
        const struct proc_entry *e = &g_procs[i];
        if (strcmp(e->name, symbol) != 0)
            continue;
        found = 1;
        if (e->version <= cudaVersion && (!best || e->version > best->version))
            best = e;
    }
    if (!found) { /* callers sometimes ask for the exported name itself */
        size_t len = strlen(symbol);
        int per_thread = len > 5 && (strcmp(symbol + len - 5, "_ptsz") == 0 ||
                                     strcmp(symbol + len - 5, "_ptds") == 0);
        for (size_t i = 0; i < sizeof(g_procs) / sizeof(g_procs[0]); i++) {
            const struct proc_entry *e = &g_procs[i];
            if (strcmp(e->symbol, symbol) == 0 ||
                (per_thread && e->fn_ptsz && strlen(e->symbol) == len - 5 &&
                 strncmp(e->symbol, symbol, len - 5) == 0)) {
                best = e;
                found = 1;
                if (per_thread)
                    flags |= CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;
                break;
            }
        }
    }
    if (!best) {
        if (status)
            *status = found ? CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT
                            : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
        return CUDA_ERROR_NOT_FOUND;
    }
    *pfn = internal_of(((flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) && best->fn_ptsz)
                           ? best->fn_ptsz
                           : best->fn);
    if (status)
        *status = CU_GET_PROC_ADDRESS_SUCCESS;
    return CUDA_SUCCESS;
}

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                             CUdriverProcAddressQueryResult *symbolStatus)
{
    return proc_lookup(symbol, pfn, cudaVersion, flags, symbolStatus);
}

CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags)
{
    return proc_lookup(symbol, pfn, cudaVersion, flags, NULL);
}
