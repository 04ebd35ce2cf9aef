/*
 * nvml.c: the simulated NVML (libnvidia-ml.so.1), reading the shared
 * device model that the simulated driver writes (state.c).
 *
 * Process lists show every live process that holds a context on the
 * device, with its memory (allocations plus context memory). Process PIDs
 * are those seen from the caller's PID namespace (the kernel translates the
 * owner of the process's liveness lock), else the PID the process recorded.
 *
 * Utilization comes from the engine's log of what ran when, read the way
 * the driver samples it rather than exactly:
 *  - the device and each process are sampled every SIMGPU_NVML_SAMPLE_MS
 *    (default 167), each on its own phase (from the device index, or from
 *    the process's slot and pid), at instants of CLOCK_REALTIME; only
 *    completed samples are reported, so a reading lags by up to a period;
 *  - a device sample is the part of its period in which any kernel ran; a
 *    process sample is the part of its period in which its kernels ran,
 *    times the process's bias (SIMGPU_NVML_PROC_BIAS of the reader, else
 *    the factor stored in the process's slot: its own SIMGPU_NVML_PROC_BIAS,
 *    else one drawn between 0.7 and 1.4), integer percents capped at 100,
 *    so per-process figures need not add up to the engine's time (on an H200
 *    two identical processes at 1:1 read from 1:0.72 to 1:2.00);
 *  - nvmlDeviceGetProcessUtilization lists the samples newer than
 *    lastSeenTimeStamp (0: the latest of each process), at most
 *    SAMPLE_HISTORY per process, and only those with nonzero use.
 * SIMGPU_NVML_EXACT=1 reports exact figures instead: busy time since
 * lastSeenTimeStamp (0: the last SIMGPU_UTIL_WINDOW_MS) for every process
 * holding a context or that ran in that time, without bias, and over the
 * last SIMGPU_UTIL_WINDOW_MS for the device.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#define NVML_NO_UNVERSIONED_FUNCTION_DEFS
#pragma GCC visibility push(default)
#include "nvml.h"
#pragma GCC visibility pop

#include "state.h"

#define DEV_MAGIC 0x4e564d4cU
#define DRIVER_VERSION "570.124.06"
#define NVML_VERSION "12.570.124.06"
#define CUDA_DRIVER_VERSION 12080
#define NOT_AVAILABLE_U32 0xFFFFFFFFU

struct nvml_dev {
    uint32_t magic;
    int phys;
    unsigned index;
};

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static unsigned g_init_count;
static unsigned g_ndev;
static struct nvml_dev g_devs[SIM_MAX_DEVICES];
static uint64_t g_util_window_ns;
static uint64_t g_sample_ns;
static int g_exact;
static int g_bias_milli; /* the reader's SIMGPU_NVML_PROC_BIAS, -1: each process's own */

/* ---------- init and errors ---------- */

nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    (void)flags;
    nvmlReturn_t rc = NVML_SUCCESS;
    pthread_mutex_lock(&g_mu);
    if (sim_attach() != 0) {
        rc = NVML_ERROR_DRIVER_NOT_LOADED;
    } else {
        int map[SIM_MAX_DEVICES];
        g_ndev = (unsigned)sim_process_devices(map, SIM_MAX_DEVICES);
        for (unsigned i = 0; i < g_ndev; i++) {
            g_devs[i].magic = DEV_MAGIC;
            g_devs[i].phys = map[i];
            g_devs[i].index = i;
        }
        g_util_window_ns = sim_env_u64("SIMGPU_UTIL_WINDOW_MS", SIM_DEFAULT_UTIL_WINDOW_MS) * 1000000ULL;
        if (g_util_window_ns == 0)
            g_util_window_ns = 1000000ULL;
        g_sample_ns = sim_env_u64("SIMGPU_NVML_SAMPLE_MS", SIM_DEFAULT_NVML_SAMPLE_MS) * 1000000ULL;
        if (g_sample_ns == 0)
            g_sample_ns = 1000000ULL;
        const char *exact = getenv("SIMGPU_NVML_EXACT");
        g_exact = exact && strcmp(exact, "1") == 0;
        g_bias_milli = sim_env_bias_milli();
        g_init_count++;
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

nvmlReturn_t nvmlInit_v2(void)
{
    return nvmlInitWithFlags(0);
}

nvmlReturn_t nvmlInit(void)
{
    return nvmlInitWithFlags(0);
}

nvmlReturn_t nvmlShutdown(void)
{
    nvmlReturn_t rc = NVML_SUCCESS;
    pthread_mutex_lock(&g_mu);
    if (g_init_count == 0)
        rc = NVML_ERROR_UNINITIALIZED;
    else
        g_init_count--; /* the mapping stays: its descriptor must stay open */
    pthread_mutex_unlock(&g_mu);
    return rc;
}

static const struct {
    nvmlReturn_t code;
    const char *text;
} g_errors[] = {
    {NVML_SUCCESS, "Success"},
    {NVML_ERROR_UNINITIALIZED, "Uninitialized"},
    {NVML_ERROR_INVALID_ARGUMENT, "Invalid Argument"},
    {NVML_ERROR_NOT_SUPPORTED, "Not Supported"},
    {NVML_ERROR_NO_PERMISSION, "Insufficient Permissions"},
    {NVML_ERROR_ALREADY_INITIALIZED, "Already Initialized"},
    {NVML_ERROR_NOT_FOUND, "Not Found"},
    {NVML_ERROR_INSUFFICIENT_SIZE, "Insufficient Size"},
    {NVML_ERROR_INSUFFICIENT_POWER, "Insufficient External Power"},
    {NVML_ERROR_DRIVER_NOT_LOADED, "Driver Not Loaded"},
    {NVML_ERROR_TIMEOUT, "Timeout"},
    {NVML_ERROR_IRQ_ISSUE, "Interrupt Request Issue"},
    {NVML_ERROR_LIBRARY_NOT_FOUND, "NVML Shared Library Not Found"},
    {NVML_ERROR_FUNCTION_NOT_FOUND, "Function Not Found"},
    {NVML_ERROR_CORRUPTED_INFOROM, "Corrupted infoROM"},
    {NVML_ERROR_GPU_IS_LOST, "GPU is lost"},
    {NVML_ERROR_RESET_REQUIRED, "GPU requires restart"},
    {NVML_ERROR_OPERATING_SYSTEM, "The operating system has blocked the request."},
    {NVML_ERROR_LIB_RM_VERSION_MISMATCH, "RM has detected an NVML/RM version mismatch."},
    {NVML_ERROR_IN_USE, "In use by another client"},
    {NVML_ERROR_MEMORY, "Insufficient Memory"},
    {NVML_ERROR_NO_DATA, "No data"},
    {NVML_ERROR_VGPU_ECC_NOT_SUPPORTED, "The requested vgpu operation is not available on target device, becasue ECC is enabled"},
    {NVML_ERROR_INSUFFICIENT_RESOURCES, "Ran out of critical resources, other than memory"},
    {NVML_ERROR_FREQ_NOT_SUPPORTED, "Ran out of critical resources, other than memory"},
    {NVML_ERROR_ARGUMENT_VERSION_MISMATCH, "Argument version mismatch"},
    {NVML_ERROR_DEPRECATED, "Deprecated"},
    {NVML_ERROR_NOT_READY, "Not Ready"},
    {NVML_ERROR_GPU_NOT_FOUND, "GPU not found"},
    {NVML_ERROR_INVALID_STATE, "Invalid state"},
    {NVML_ERROR_UNKNOWN, "Unknown Error"},
};

const char *nvmlErrorString(nvmlReturn_t result)
{
    for (size_t i = 0; i < sizeof(g_errors) / sizeof(g_errors[0]); i++) {
        if (g_errors[i].code == result)
            return g_errors[i].text;
    }
    return "Unknown Error";
}

#define REQUIRE_INIT()                          \
    do {                                        \
        if (g_init_count == 0)                  \
            return NVML_ERROR_UNINITIALIZED;    \
    } while (0)

static struct nvml_dev *dev_of(nvmlDevice_t device)
{
    struct nvml_dev *d = (struct nvml_dev *)device;
    if (d < g_devs || d >= g_devs + g_ndev || d->magic != DEV_MAGIC)
        return NULL;
    return d;
}

#define REQUIRE_DEV(var, device)                 \
    REQUIRE_INIT();                              \
    struct nvml_dev *var = dev_of(device);       \
    if (!var)                                    \
        return NVML_ERROR_INVALID_ARGUMENT

static nvmlReturn_t copy_string(char *dst, unsigned int length, const char *src)
{
    if (!dst)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(src) >= length)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(dst, src);
    return NVML_SUCCESS;
}

/* ---------- system ---------- */

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    REQUIRE_INIT();
    return copy_string(version, length, DRIVER_VERSION);
}

nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length)
{
    return copy_string(version, length, NVML_VERSION);
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *cudaDriverVersion)
{
    if (!cudaDriverVersion)
        return NVML_ERROR_INVALID_ARGUMENT;
    *cudaDriverVersion = CUDA_DRIVER_VERSION;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *cudaDriverVersion)
{
    return nvmlSystemGetCudaDriverVersion(cudaDriverVersion);
}

/* ---------- devices ---------- */

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount)
{
    REQUIRE_INIT();
    if (!deviceCount)
        return NVML_ERROR_INVALID_ARGUMENT;
    *deviceCount = g_ndev;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCount(unsigned int *deviceCount)
{
    return nvmlDeviceGetCount_v2(deviceCount);
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    REQUIRE_INIT();
    if (!device || index >= g_ndev)
        return NVML_ERROR_INVALID_ARGUMENT;
    *device = (nvmlDevice_t)&g_devs[index];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device)
{
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
    REQUIRE_INIT();
    if (!uuid || !device)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned i = 0; i < g_ndev; i++) {
        if (strcmp(sim_state()->devices[g_devs[i].phys].uuid, uuid) == 0) {
            *device = (nvmlDevice_t)&g_devs[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

static void bus_ids(int phys, char *full, size_t flen, char *legacy, size_t llen)
{
    if (full)
        snprintf(full, flen, "00000000:%02X:00.0", 0x10 + phys);
    if (legacy)
        snprintf(legacy, llen, "0000:%02X:00.0", 0x10 + phys);
}

nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *pciBusId, nvmlDevice_t *device)
{
    REQUIRE_INIT();
    if (!pciBusId || !device)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned i = 0; i < g_ndev; i++) {
        char full[NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE], legacy[NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE];
        bus_ids(g_devs[i].phys, full, sizeof(full), legacy, sizeof(legacy));
        if (strcasecmp(full, pciBusId) == 0 || strcasecmp(legacy, pciBusId) == 0) {
            *device = (nvmlDevice_t)&g_devs[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index)
{
    REQUIRE_DEV(d, device);
    if (!index)
        return NVML_ERROR_INVALID_ARGUMENT;
    *index = d->index;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    REQUIRE_DEV(d, device);
    return copy_string(name, length, sim_state()->devices[d->phys].name);
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    REQUIRE_DEV(d, device);
    return copy_string(uuid, length, sim_state()->devices[d->phys].uuid);
}

nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minorNumber)
{
    REQUIRE_DEV(d, device);
    if (!minorNumber)
        return NVML_ERROR_INVALID_ARGUMENT;
    *minorNumber = (unsigned)d->phys;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    REQUIRE_DEV(d, device);
    if (!pci)
        return NVML_ERROR_INVALID_ARGUMENT;
    memset(pci, 0, sizeof(*pci));
    bus_ids(d->phys, pci->busId, sizeof(pci->busId), pci->busIdLegacy, sizeof(pci->busIdLegacy));
    pci->bus = 0x10 + (unsigned)d->phys;
    pci->pciDeviceId = 0x1EB810DE;
    pci->pciSubSystemId = 0x12A210DE;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major, int *minor)
{
    REQUIRE_DEV(d, device);
    if (!major || !minor)
        return NVML_ERROR_INVALID_ARGUMENT;
    struct sim_traits t;
    sim_traits_for(sim_state()->devices[d->phys].name, &t);
    *major = t.cc_major;
    *minor = t.cc_minor;
    return NVML_SUCCESS;
}

/* ---------- memory ---------- */

static void memory_of(int phys, uint64_t *total, uint64_t *used)
{
    sim_lock();
    sim_reap_locked();
    *used = sim_used_locked(phys);
    *total = sim_state()->devices[phys].total_bytes;
    sim_unlock();
    if (*used > *total)
        *used = *total;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    REQUIRE_DEV(d, device);
    if (!memory)
        return NVML_ERROR_INVALID_ARGUMENT;
    uint64_t total, used;
    memory_of(d->phys, &total, &used);
    memory->total = total;
    memory->used = used;
    memory->free = total - used;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    REQUIRE_DEV(d, device);
    if (!memory)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (memory->version != nvmlMemory_v2)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    uint64_t total, used;
    memory_of(d->phys, &total, &used);
    memory->total = total;
    memory->reserved = 0;
    memory->used = used;
    memory->free = total - used;
    return NVML_SUCCESS;
}

/* ---------- processes ---------- */

struct proc_row {
    int slot;
    int32_t pid;        /* as seen from this process */
    int32_t recorded;   /* as recorded in the state */
    uint32_t gen;       /* the slot's generation (matches the log) */
    uint64_t mem;
};

/* Live processes holding a context on phys, one row per process slot.
 * Returns the count.
 *
 * A process has one slot per copy of this library it loaded: a second copy
 * of libcuda.so.1 (another path, opened with RTLD_DEEPBIND, so that its
 * calls stay inside it) has its own driver state and claims a slot of its
 * own with the same pid. Such a process is listed twice, each row with its
 * copy's memory. That is the assumption NVML's clients must hold: NVIDIA's
 * driver lists a process once per context on a GPU in some versions, and
 * NVML promises no one row per pid. */
static unsigned compute_procs(int phys, struct proc_row *rows)
{
    struct sim_state *s = sim_state();
    unsigned n = 0;
    sim_lock();
    sim_reap_locked();
    for (int i = 0; i < SIM_MAX_PROCS; i++) {
        int32_t pid;
        if (!s->procs[i].in_use || s->procs[i].contexts[phys] == 0 ||
            !sim_slot_alive_locked(i, &pid))
            continue;
        rows[n].slot = i;
        rows[n].pid = pid;
        rows[n].recorded = s->procs[i].pid;
        rows[n].gen = (uint32_t)s->procs[i].generation;
        rows[n].mem = s->procs[i].mem_bytes[phys];
        n++;
    }
    sim_unlock();
    return n;
}

enum proc_layout { LAYOUT_V1, LAYOUT_V2 };

/* The NVML_ERROR_INSUFFICIENT_SIZE contract: with *infoCount too small
 * (including 0 with infos NULL), set it to the number needed and say so. */
static nvmlReturn_t fill_procs(nvmlDevice_t device, unsigned int *infoCount, void *infos,
                               enum proc_layout layout, int graphics)
{
    REQUIRE_DEV(d, device);
    if (!infoCount)
        return NVML_ERROR_INVALID_ARGUMENT;
    struct proc_row rows[SIM_MAX_PROCS];
    unsigned n = graphics ? 0 : compute_procs(d->phys, rows);
    if (*infoCount < n) {
        *infoCount = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    if (n > 0 && !infos)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned i = 0; i < n; i++) {
        if (layout == LAYOUT_V1) {
            nvmlProcessInfo_v1_t *p = (nvmlProcessInfo_v1_t *)infos + i;
            p->pid = (unsigned)rows[i].pid;
            p->usedGpuMemory = rows[i].mem;
        } else {
            nvmlProcessInfo_v2_t *p = (nvmlProcessInfo_v2_t *)infos + i;
            p->pid = (unsigned)rows[i].pid;
            p->usedGpuMemory = rows[i].mem;
            p->gpuInstanceId = NOT_AVAILABLE_U32;
            p->computeInstanceId = NOT_AVAILABLE_U32;
        }
    }
    *infoCount = n;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t device, unsigned int *infoCount,
                                                  nvmlProcessInfo_v1_t *infos)
{
    return fill_procs(device, infoCount, infos, LAYOUT_V1, 0);
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount,
                                                     nvmlProcessInfo_v2_t *infos)
{
    return fill_procs(device, infoCount, infos, LAYOUT_V2, 0);
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                     nvmlProcessInfo_t *infos)
{
    return fill_procs(device, infoCount, infos, LAYOUT_V2, 0);
}

nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses(nvmlDevice_t device, unsigned int *infoCount,
                                                   nvmlProcessInfo_v1_t *infos)
{
    return fill_procs(device, infoCount, infos, LAYOUT_V1, 1);
}

nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount,
                                                      nvmlProcessInfo_v2_t *infos)
{
    return fill_procs(device, infoCount, infos, LAYOUT_V2, 1);
}

nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                      nvmlProcessInfo_t *infos)
{
    return fill_procs(device, infoCount, infos, LAYOUT_V2, 1);
}

nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses(nvmlDevice_t device, unsigned int *infoCount,
                                                     nvmlProcessInfo_v1_t *infos)
{
    return fill_procs(device, infoCount, infos, LAYOUT_V1, 1);
}

nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v2(nvmlDevice_t device,
                                                        unsigned int *infoCount,
                                                        nvmlProcessInfo_v2_t *infos)
{
    return fill_procs(device, infoCount, infos, LAYOUT_V2, 1);
}

nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v3(nvmlDevice_t device,
                                                        unsigned int *infoCount,
                                                        nvmlProcessInfo_t *infos)
{
    return fill_procs(device, infoCount, infos, LAYOUT_V2, 1);
}

/* ---------- utilization ---------- */

static uint64_t realtime_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000ULL + (uint64_t)ts.tv_nsec / 1000ULL;
}

static unsigned percent(uint64_t part, uint64_t whole)
{
    if (whole == 0)
        return 0;
    uint64_t p = (part * 100 + whole / 2) / whole;
    return p > 100 ? 100 : (unsigned)p;
}

/* The latest sampling instant (realtime microseconds) of a sampler with
 * this phase, at or before now_us. */
static uint64_t last_sample_us(uint64_t now_us, uint64_t phase_us)
{
    uint64_t period_us = g_sample_ns / 1000;
    return now_us - (now_us + period_us - phase_us % period_us) % period_us;
}

static uint64_t device_phase_us(int phys)
{
    return sim_hash(0xde0000ULL + (uint64_t)phys) % (g_sample_ns / 1000);
}

static uint64_t process_phase_us(int slot, int32_t pid)
{
    return sim_hash(((uint64_t)(uint32_t)pid << 20) ^ (uint64_t)slot ^ 0x5a3cULL) %
           (g_sample_ns / 1000);
}

static unsigned biased_percent(uint64_t busy, uint64_t whole, uint32_t bias_milli)
{
    if (whole == 0)
        return 0;
    uint64_t p = (busy * 100 * bias_milli + whole * 500) / (whole * 1000);
    return p > 100 ? 100 : (unsigned)p;
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization)
{
    REQUIRE_DEV(d, device);
    if (!utilization)
        return NVML_ERROR_INVALID_ARGUMENT;
    uint64_t now = sim_now_ns(), now_us = realtime_us();
    uint64_t window = g_exact ? g_util_window_ns : g_sample_ns;
    uint64_t to = now;
    if (!g_exact)
        to = now - (now_us - last_sample_us(now_us, device_phase_us(d->phys))) * 1000;
    uint64_t from = to > window ? to - window : 0;
    sim_lock();
    sim_advance_locked(d->phys);
    uint64_t busy = sim_busy_in_locked(d->phys, -1, 0, from, to);
    sim_unlock();
    utilization->gpu = percent(busy, to - from);
    utilization->memory = 0;
    return NVML_SUCCESS;
}

/* SIMGPU_NVML_EXACT=1: one sample per process, its share of the engine's
 * time since lastSeenTimeStamp (microseconds since the epoch; 0 means the
 * last SIMGPU_UTIL_WINDOW_MS), for every process holding a context on the
 * device and every process whose kernels ran in that window. */
static nvmlReturn_t exact_process_util(struct nvml_dev *d,
                                       nvmlProcessUtilizationSample_t *utilization,
                                       unsigned int *processSamplesCount,
                                       unsigned long long lastSeenTimeStamp)
{
    uint64_t now = sim_now_ns(), now_us = realtime_us();
    uint64_t from;
    if (lastSeenTimeStamp == 0)
        from = now > g_util_window_ns ? now - g_util_window_ns : 0;
    else if (lastSeenTimeStamp >= now_us)
        from = now;
    else {
        uint64_t back = (now_us - lastSeenTimeStamp) * 1000ULL;
        from = now > back ? now - back : 0;
    }
    struct proc_row rows[SIM_MAX_PROCS];
    unsigned n = compute_procs(d->phys, rows);
    uint64_t busy[SIM_MAX_PROCS];
    struct sim_state *s = sim_state();
    sim_lock();
    sim_advance_locked(d->phys);
    /* Processes that ran in the window but hold no context now (or died). */
    const struct sim_device *dv = &s->devices[d->phys];
    uint64_t logged = dv->log_count < SIM_LOG_LEN ? dv->log_count : SIM_LOG_LEN;
    for (uint64_t k = 0; k < logged && n < SIM_MAX_PROCS; k++) {
        const struct sim_interval *iv = &dv->log[(dv->log_count - 1 - k) % SIM_LOG_LEN];
        if (iv->end_ns <= from)
            break;
        if (iv->start_ns >= now)
            continue;
        unsigned j;
        for (j = 0; j < n; j++) {
            if (rows[j].slot == iv->slot && rows[j].gen == iv->gen)
                break;
        }
        if (j == n) {
            int32_t pid = iv->pid;
            if (s->procs[iv->slot].in_use && (uint32_t)s->procs[iv->slot].generation == iv->gen)
                sim_slot_alive_locked(iv->slot, &pid);
            rows[n].slot = iv->slot;
            rows[n].pid = pid;
            rows[n].recorded = iv->pid;
            rows[n].gen = iv->gen;
            rows[n].mem = 0;
            n++;
        }
    }
    for (unsigned j = 0; j < n; j++)
        busy[j] = sim_busy_in_locked(d->phys, rows[j].slot, rows[j].gen, from, now);
    sim_unlock();
    if (n == 0 || from >= now) {
        *processSamplesCount = 0;
        return NVML_ERROR_NOT_FOUND;
    }
    if (!utilization || *processSamplesCount < n) {
        *processSamplesCount = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (unsigned j = 0; j < n; j++) {
        utilization[j].pid = (unsigned)rows[j].pid;
        utilization[j].timeStamp = now_us;
        utilization[j].smUtil = percent(busy[j], now - from);
        utilization[j].memUtil = 0;
        utilization[j].encUtil = 0;
        utilization[j].decUtil = 0;
    }
    *processSamplesCount = n;
    return NVML_SUCCESS;
}

#define SAMPLE_HISTORY 32

/* The processes whose kernels ran on phys since from, with their bias
 * (under the lock). */
static unsigned recent_procs(int phys, uint64_t from, struct proc_row *rows, uint32_t *bias)
{
    struct sim_state *s = sim_state();
    const struct sim_device *dv = &s->devices[phys];
    uint64_t logged = dv->log_count < SIM_LOG_LEN ? dv->log_count : SIM_LOG_LEN;
    unsigned n = 0;
    for (uint64_t k = 0; k < logged && n < SIM_MAX_PROCS; k++) {
        const struct sim_interval *iv = &dv->log[(dv->log_count - 1 - k) % SIM_LOG_LEN];
        if (iv->end_ns <= from)
            break;
        unsigned j;
        for (j = 0; j < n; j++) {
            if (rows[j].slot == iv->slot && rows[j].gen == iv->gen)
                break;
        }
        if (j < n)
            continue;
        const struct sim_proc *p = &s->procs[iv->slot];
        int alive = p->in_use && (uint32_t)p->generation == iv->gen;
        rows[n].slot = iv->slot;
        rows[n].recorded = iv->pid;
        rows[n].gen = iv->gen;
        rows[n].pid = iv->pid;
        rows[n].mem = 0;
        if (alive)
            sim_slot_alive_locked(iv->slot, &rows[n].pid);
        if (g_bias_milli >= 0)
            bias[n] = (uint32_t)g_bias_milli;
        else
            bias[n] = alive ? p->nvml_bias_milli : sim_drawn_bias_milli(iv->slot, iv->pid);
        n++;
    }
    return n;
}

/*
 * pynvml asks for the size, then for the samples. A sample completing in
 * between would make the second call fail, so a call that repeats one
 * answered NVML_ERROR_INSUFFICIENT_SIZE (same device and lastSeenTimeStamp,
 * within a second) is answered as of that one.
 */
static struct {
    nvmlDevice_t device;
    unsigned long long last_seen;
    uint64_t now, now_us;
} g_asked;

static nvmlReturn_t sampled_process_util(struct nvml_dev *d,
                                         nvmlProcessUtilizationSample_t *utilization,
                                         unsigned int *processSamplesCount,
                                         unsigned long long lastSeenTimeStamp)
{
    uint64_t now = sim_now_ns(), now_us = realtime_us();
    const uint64_t period = g_sample_ns, period_us = g_sample_ns / 1000;
    pthread_mutex_lock(&g_mu);
    if (g_asked.device == (nvmlDevice_t)d && g_asked.last_seen == lastSeenTimeStamp &&
        now - g_asked.now < 1000000000ULL) {
        now = g_asked.now;
        now_us = g_asked.now_us;
    }
    g_asked.device = NULL;
    pthread_mutex_unlock(&g_mu);

    unsigned history = lastSeenTimeStamp ? SAMPLE_HISTORY : 1;
    uint64_t back = (history + 1) * period;
    struct proc_row rows[SIM_MAX_PROCS];
    uint32_t bias[SIM_MAX_PROCS];
    uint64_t busy[SAMPLE_HISTORY];
    nvmlProcessUtilizationSample_t *samples;
    unsigned count = 0;
    sim_lock();
    sim_advance_locked(d->phys);
    uint64_t logged_since = sim_log_since_locked(d->phys);
    unsigned n = recent_procs(d->phys, now > back ? now - back : 0, rows, bias);
    samples = calloc((size_t)n * history + 1, sizeof(*samples));
    if (!samples) {
        sim_unlock();
        return NVML_ERROR_MEMORY;
    }
    for (unsigned j = 0; j < n; j++) {
        uint64_t last_us = last_sample_us(now_us, process_phase_us(rows[j].slot, rows[j].recorded));
        uint64_t last_end = now - (now_us - last_us) * 1000;
        unsigned k = 0; /* its samples to report, the newest last */
        while (k < history && last_us - k * period_us > lastSeenTimeStamp &&
               last_end >= (k + 1) * period + logged_since)
            k++;
        sim_busy_periods_locked(d->phys, rows[j].slot, rows[j].gen, last_end, period, k,
                                busy);
        for (unsigned i = 0; i < k; i++) {
            unsigned util = biased_percent(busy[i], period, bias[j]);
            if (util == 0)
                continue;
            samples[count].pid = (unsigned)rows[j].pid;
            samples[count].timeStamp = last_us - (k - 1 - i) * period_us;
            samples[count].smUtil = util;
            count++;
        }
    }
    sim_unlock();

    nvmlReturn_t rc = NVML_SUCCESS;
    if (count == 0) {
        rc = NVML_ERROR_NOT_FOUND;
    } else if (!utilization || *processSamplesCount < count) {
        rc = NVML_ERROR_INSUFFICIENT_SIZE;
        pthread_mutex_lock(&g_mu);
        g_asked.device = (nvmlDevice_t)d;
        g_asked.last_seen = lastSeenTimeStamp;
        g_asked.now = now;
        g_asked.now_us = now_us;
        pthread_mutex_unlock(&g_mu);
    } else {
        memcpy(utilization, samples, sizeof(*samples) * count);
    }
    *processSamplesCount = count;
    free(samples);
    return rc;
}

nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t device,
                                             nvmlProcessUtilizationSample_t *utilization,
                                             unsigned int *processSamplesCount,
                                             unsigned long long lastSeenTimeStamp)
{
    REQUIRE_DEV(d, device);
    if (!processSamplesCount)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (g_exact)
        return exact_process_util(d, utilization, processSamplesCount, lastSeenTimeStamp);
    return sampled_process_util(d, utilization, processSamplesCount, lastSeenTimeStamp);
}

/* ---------- cosmetic readings ---------- */

static unsigned current_util(struct nvml_dev *d)
{
    nvmlUtilization_t u;
    nvmlDeviceGetUtilizationRates((nvmlDevice_t)d, &u);
    return u.gpu;
}

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, nvmlTemperatureSensors_t sensorType,
                                      unsigned int *temp)
{
    REQUIRE_DEV(d, device);
    if (!temp || sensorType != NVML_TEMPERATURE_GPU)
        return NVML_ERROR_INVALID_ARGUMENT;
    *temp = 35 + current_util(d) * 40 / 100;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *power)
{
    REQUIRE_DEV(d, device);
    if (!power)
        return NVML_ERROR_INVALID_ARGUMENT;
    *power = 25000 + current_util(d) * 450; /* milliwatts */
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPersistenceMode(nvmlDevice_t device, nvmlEnableState_t *mode)
{
    REQUIRE_DEV(d, device);
    (void)d;
    if (!mode)
        return NVML_ERROR_INVALID_ARGUMENT;
    *mode = NVML_FEATURE_ENABLED;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetComputeMode(nvmlDevice_t device, nvmlComputeMode_t *mode)
{
    REQUIRE_DEV(d, device);
    (void)d;
    if (!mode)
        return NVML_ERROR_INVALID_ARGUMENT;
    *mode = NVML_COMPUTEMODE_DEFAULT;
    return NVML_SUCCESS;
}

/* ---------- what a device without the feature answers ---------- */

#pragma GCC visibility push(default)

/* A simgpu device is never a MIG device (nor has MIG at all). */
nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device, unsigned int *isMigDevice);
nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device, unsigned int *isMigDevice)
{
    REQUIRE_DEV(d, device);
    (void)d;
    if (!isMigDevice)
        return NVML_ERROR_INVALID_ARGUMENT;
    *isMigDevice = 0;
    return NVML_SUCCESS;
}

/* nvmlTemperature_v1_t, which NVML 12.8 clients (nvitop) ask for before the
 * deprecated nvmlDeviceGetTemperature. */
struct nvml_temperature_v1 {
    unsigned int version;
    nvmlTemperatureSensors_t sensorType;
    int temperature;
};
#define NVML_TEMPERATURE_V1 ((unsigned int)sizeof(struct nvml_temperature_v1) | 1U << 24)

nvmlReturn_t nvmlDeviceGetTemperatureV(nvmlDevice_t device, struct nvml_temperature_v1 *reading);
nvmlReturn_t nvmlDeviceGetTemperatureV(nvmlDevice_t device, struct nvml_temperature_v1 *reading)
{
    unsigned int celsius;
    nvmlReturn_t rc;

    if (!reading)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (reading->version != NVML_TEMPERATURE_V1)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    rc = nvmlDeviceGetTemperature(device, reading->sensorType, &celsius);
    if (rc == NVML_SUCCESS)
        reading->temperature = (int)celsius;
    return rc;
}

/*
 * Entry points that NVML clients (nvitop, gpustat, nvidia-ml-py's own
 * wrappers) call and that simgpu has no model for: they answer
 * NVML_ERROR_NOT_SUPPORTED for a valid handle, as the driver does for a
 * feature the device lacks, and the clients show N/A. Each is defined with
 * the device handle alone, the first parameter of every one of them: the
 * rest are the caller's to pass and to clean up (NVML's ABIs are all
 * caller-cleanup), and this answer never reads them.
 */
#define UNMODELLED(X) \
    X(nvmlDeviceGetBAR1MemoryInfo) \
    X(nvmlDeviceGetClockInfo) \
    X(nvmlDeviceGetComputeInstanceId) \
    X(nvmlDeviceGetConfComputeMemSizeInfo) \
    X(nvmlDeviceGetDecoderUtilization) \
    X(nvmlDeviceGetDeviceHandleFromMigDeviceHandle) \
    X(nvmlDeviceGetDisplayActive) \
    X(nvmlDeviceGetDisplayMode) \
    X(nvmlDeviceGetDriverModel_v2) \
    X(nvmlDeviceGetEncoderUtilization) \
    X(nvmlDeviceGetEnforcedPowerLimit) \
    X(nvmlDeviceGetFanSpeed) \
    X(nvmlDeviceGetFieldValues) \
    X(nvmlDeviceGetGpuInstanceId) \
    X(nvmlDeviceGetMaxClockInfo) \
    X(nvmlDeviceGetMaxMigDeviceCount) \
    X(nvmlDeviceGetMigDeviceHandleByIndex) \
    X(nvmlDeviceGetMigMode) \
    X(nvmlDeviceGetPcieThroughput) \
    X(nvmlDeviceGetPerformanceState) \
    X(nvmlDeviceGetPowerManagementLimit) \
    X(nvmlDeviceGetRunningProcessDetailList) \
    X(nvmlDeviceGetSerial) \
    X(nvmlDeviceGetTotalEccErrors)

#define DEFINE_NOT_SUPPORTED(name)          \
    nvmlReturn_t name(nvmlDevice_t device); \
    nvmlReturn_t name(nvmlDevice_t device)  \
    {                                       \
        REQUIRE_DEV(d, device);             \
        (void)d;                            \
        return NVML_ERROR_NOT_SUPPORTED;    \
    }

UNMODELLED(DEFINE_NOT_SUPPORTED)

#pragma GCC visibility pop
