/*
 * workload.c: a driver-API workload for libcgpu's tests and benchmarks.
 *
 *   workload [--getproc] [--device N] OP ...
 *
 * With --getproc every entry point is fetched through cuGetProcAddress (as
 * CUDA 12 runtimes do; --getproc-ptsz asks for the per-thread default stream
 * variants, the _ptsz functions); otherwise the exported symbols are called.
 * Each OP prints one line "OP ... rc=<CUresult>" so tests can assert on it.
 *
 *   alloc N | pitch W H | create N | async N | pool N | array W H | array3d W H D
 *   managed N | free | freeall | info | total | ctx | launch COUNT NAME
 *   coop COUNT NAME | launchex COUNT NAME | sync | sleep MS | hold   (wait for stdin EOF)
 *   wait (print "waiting", read one line from stdin) | graphprep (capture a sleep_0 graph)
 *   graph COUNT (launch the captured graph)
 *   race ITERATIONS MAXBYTES LIMIT  (random alloc/free; exits 3 if the device's own
 *                                    per-process accounting, read through NVML's
 *                                    process list which libcgpu does not intercept,
 *                                    ever shows more than LIMIT in use)
 *   bench-launch COUNT NAME  (prints ns per launch)   bench-alloc COUNT BYTES
 *   queue COUNT NAME WHERE   (COUNT launches without waiting, then a sync; prints the
 *                             milliseconds of both: the sync drains what was queued;
 *                             and queued=N, the launches not complete as the loop ended,
 *                             counted by an event recorded behind each.
 *                             WHERE: null, ptsz (cuLaunchKernel_ptsz, NULL), perthread
 *                             (CU_STREAM_PER_THREAD), stream (created), launchex, graph
 *                             (a one-kernel graph launched COUNT times))
 *   churn ROUNDS             (per round a stream created, used and destroyed; every
 *                             tenth round a context too)
 *   stamped COUNT NAME       (launch prints "returned K NS" as each launch returns,
 *                             CLOCK_MONOTONIC, then a sync)
 *   nomembarrier             (from here on membarrier(2) fails with EPERM, as under a
 *                             seccomp profile that refuses it; prints "membarrier
 *                             refused")
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <dlfcn.h>
#include <linux/filter.h>
#include <linux/membarrier.h>
#include <linux/seccomp.h>
#include <sys/prctl.h>
#include <sys/syscall.h>

#include "cuda.h"
#include "kernels.h"
#include "nvml.h"

#define MAX_HELD 4096

static struct {
    __typeof__(&cuInit) init;
    __typeof__(&cuDeviceGet) deviceGet;
    __typeof__(&cuDevicePrimaryCtxRetain) primaryRetain;
    __typeof__(&cuCtxSetCurrent) ctxSetCurrent;
    __typeof__(&cuMemAlloc_v2) memAlloc;
    __typeof__(&cuMemAllocPitch_v2) memAllocPitch;
    __typeof__(&cuMemFree_v2) memFree;
    __typeof__(&cuMemAllocManaged) memAllocManaged;
    __typeof__(&cuMemAllocAsync) memAllocAsync;
    __typeof__(&cuMemAllocFromPoolAsync) memAllocFromPool;
    __typeof__(&cuDeviceGetDefaultMemPool) defaultPool;
    __typeof__(&cuMemFreeAsync) memFreeAsync;
    __typeof__(&cuMemCreate) memCreate;
    __typeof__(&cuMemRelease) memRelease;
    __typeof__(&cuArrayCreate_v2) arrayCreate;
    __typeof__(&cuArray3DCreate_v2) array3DCreate;
    __typeof__(&cuArrayDestroy) arrayDestroy;
    __typeof__(&cuMemGetInfo_v2) memGetInfo;
    __typeof__(&cuDeviceTotalMem_v2) totalMem;
    __typeof__(&cuModuleLoadData) moduleLoadData;
    __typeof__(&cuModuleGetFunction) moduleGetFunction;
    __typeof__(&cuLaunchKernel) launchKernel;
    __typeof__(&cuLaunchKernelEx) launchKernelEx;
    __typeof__(&cuLaunchCooperativeKernel) launchCoop;
    __typeof__(&cuCtxSynchronize) ctxSynchronize;
    __typeof__(&cuStreamBeginCapture_v2) beginCapture;
    __typeof__(&cuStreamEndCapture) endCapture;
    __typeof__(&cuStreamCreate) streamCreate;
    __typeof__(&cuGraphInstantiateWithFlags) graphInstantiate;
    __typeof__(&cuGraphLaunch) graphLaunch;
} api;

static void bind_exported(void)
{
    api.init = cuInit;
    api.deviceGet = cuDeviceGet;
    api.primaryRetain = cuDevicePrimaryCtxRetain;
    api.ctxSetCurrent = cuCtxSetCurrent;
    api.memAlloc = cuMemAlloc_v2;
    api.memAllocPitch = cuMemAllocPitch_v2;
    api.memFree = cuMemFree_v2;
    api.memAllocManaged = cuMemAllocManaged;
    api.memAllocAsync = cuMemAllocAsync;
    api.memAllocFromPool = cuMemAllocFromPoolAsync;
    api.defaultPool = cuDeviceGetDefaultMemPool;
    api.memFreeAsync = cuMemFreeAsync;
    api.memCreate = cuMemCreate;
    api.memRelease = cuMemRelease;
    api.arrayCreate = cuArrayCreate_v2;
    api.array3DCreate = cuArray3DCreate_v2;
    api.arrayDestroy = cuArrayDestroy;
    api.memGetInfo = cuMemGetInfo_v2;
    api.totalMem = cuDeviceTotalMem_v2;
    api.moduleLoadData = cuModuleLoadData;
    api.moduleGetFunction = cuModuleGetFunction;
    api.launchKernel = cuLaunchKernel;
    api.launchKernelEx = cuLaunchKernelEx;
    api.launchCoop = cuLaunchCooperativeKernel;
    api.ctxSynchronize = cuCtxSynchronize;
    api.beginCapture = cuStreamBeginCapture_v2;
    api.endCapture = cuStreamEndCapture;
    api.streamCreate = cuStreamCreate;
    api.graphInstantiate = cuGraphInstantiateWithFlags;
    api.graphLaunch = cuGraphLaunch;
}

static cuuint64_t getproc_flags = CU_GET_PROC_ADDRESS_DEFAULT;

static void *getproc(const char *name)
{
    void *fn = NULL;
    CUdriverProcAddressQueryResult status;
    CUresult rc = cuGetProcAddress_v2(name, &fn, CUDA_VERSION, getproc_flags, &status);
    if (rc != CUDA_SUCCESS || fn == NULL) {
        fprintf(stderr, "cuGetProcAddress(%s) failed: %d\n", name, (int)rc);
        exit(2);
    }
    return fn;
}

/* The unversioned names, as the CUDA runtime asks for them. */
static void bind_getproc(void)
{
    cuInit(0);
    api.init = getproc("cuInit");
    api.deviceGet = getproc("cuDeviceGet");
    api.primaryRetain = getproc("cuDevicePrimaryCtxRetain");
    api.ctxSetCurrent = getproc("cuCtxSetCurrent");
    api.memAlloc = getproc("cuMemAlloc");
    api.memAllocPitch = getproc("cuMemAllocPitch");
    api.memFree = getproc("cuMemFree");
    api.memAllocManaged = getproc("cuMemAllocManaged");
    api.memAllocAsync = getproc("cuMemAllocAsync");
    api.memAllocFromPool = getproc("cuMemAllocFromPoolAsync");
    api.defaultPool = getproc("cuDeviceGetDefaultMemPool");
    api.memFreeAsync = getproc("cuMemFreeAsync");
    api.memCreate = getproc("cuMemCreate");
    api.memRelease = getproc("cuMemRelease");
    api.arrayCreate = getproc("cuArrayCreate");
    api.array3DCreate = getproc("cuArray3DCreate");
    api.arrayDestroy = getproc("cuArrayDestroy");
    api.memGetInfo = getproc("cuMemGetInfo");
    api.totalMem = getproc("cuDeviceTotalMem");
    api.moduleLoadData = getproc("cuModuleLoadData");
    api.moduleGetFunction = getproc("cuModuleGetFunction");
    api.launchKernel = getproc("cuLaunchKernel");
    api.launchKernelEx = getproc("cuLaunchKernelEx");
    api.launchCoop = getproc("cuLaunchCooperativeKernel");
    api.ctxSynchronize = getproc("cuCtxSynchronize");
    api.beginCapture = getproc("cuStreamBeginCapture");
    api.endCapture = getproc("cuStreamEndCapture");
    api.streamCreate = getproc("cuStreamCreate");
    api.graphInstantiate = getproc("cuGraphInstantiateWithFlags");
    api.graphLaunch = getproc("cuGraphLaunch");
}

enum kind { K_PTR, K_ASYNC, K_HANDLE, K_ARRAY };
static struct held {
    enum kind kind;
    unsigned long long value;
} held[MAX_HELD];
static int nheld;
static int device_ordinal;
static CUdevice device;
static int have_ctx;
static CUstream graph_stream;
static CUgraphExec graph_exec;

static unsigned long long arg_u64(char **argv, int i, int argc)
{
    if (i >= argc) {
        fprintf(stderr, "missing argument\n");
        exit(2);
    }
    return strtoull(argv[i], NULL, 0);
}

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static CUresult ensure_ctx(void)
{
    if (have_ctx)
        return CUDA_SUCCESS;
    CUcontext ctx;
    CUresult rc = api.init(0);
    if (rc == CUDA_SUCCESS)
        rc = api.deviceGet(&device, device_ordinal);
    if (rc == CUDA_SUCCESS)
        rc = api.primaryRetain(&ctx, device);
    if (rc == CUDA_SUCCESS)
        rc = api.ctxSetCurrent(ctx);
    have_ctx = rc == CUDA_SUCCESS;
    return rc;
}

static void hold(enum kind kind, unsigned long long value)
{
    if (nheld < MAX_HELD)
        held[nheld++] = (struct held){kind, value};
}

static CUresult release(struct held h)
{
    switch (h.kind) {
    case K_PTR:
        return api.memFree(h.value);
    case K_ASYNC:
        return api.memFreeAsync(h.value, NULL);
    case K_HANDLE:
        return api.memRelease(h.value);
    case K_ARRAY:
        return api.arrayDestroy((CUarray)(uintptr_t)h.value);
    }
    return CUDA_ERROR_INVALID_VALUE;
}

/* Bytes that all processes hold on device 0, from NVML's process list. */
static unsigned long long device_used(void)
{
    static nvmlReturn_t (*list)(nvmlDevice_t, unsigned int *, nvmlProcessInfo_t *);
    static nvmlDevice_t dev;
    if (list == NULL) {
        void *h = dlopen("libnvidia-ml.so.1", RTLD_NOW);
        nvmlReturn_t (*init)(void) = h ? (nvmlReturn_t(*)(void))dlsym(h, "nvmlInit_v2") : NULL;
        nvmlReturn_t (*get)(unsigned int, nvmlDevice_t *) =
            h ? (nvmlReturn_t(*)(unsigned int, nvmlDevice_t *))dlsym(
                    h, "nvmlDeviceGetHandleByIndex_v2")
              : NULL;
        list = h ? (nvmlReturn_t(*)(nvmlDevice_t, unsigned int *, nvmlProcessInfo_t *))dlsym(
                       h, "nvmlDeviceGetComputeRunningProcesses_v3")
                 : NULL;
        if (!init || !get || !list || init() != NVML_SUCCESS || get(0, &dev) != NVML_SUCCESS) {
            fprintf(stderr, "NVML is not usable\n");
            exit(2);
        }
    }
    nvmlProcessInfo_t infos[512];
    unsigned int n = 512;
    if (list(dev, &n, infos) != NVML_SUCCESS) {
        fprintf(stderr, "NVML process list failed\n");
        exit(2);
    }
    unsigned long long sum = 0;
    for (unsigned int k = 0; k < n; k++)
        sum += infos[k].usedGpuMemory;
    return sum;
}

static CUfunction function_named(const char *name)
{
    static CUmodule module;
    CUfunction f = NULL;
    if (module == NULL && api.moduleLoadData(&module, kernels_ptx) != CUDA_SUCCESS)
        return NULL;
    if (api.moduleGetFunction(&f, module, name) != CUDA_SUCCESS)
        return NULL;
    return f;
}

static CUresult launch(const char *how, CUfunction f)
{
    if (strcmp(how, "launchex") == 0) {
        CUlaunchConfig cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.gridDimX = cfg.gridDimY = cfg.gridDimZ = 1;
        cfg.blockDimX = cfg.blockDimY = cfg.blockDimZ = 1;
        return api.launchKernelEx(&cfg, f, NULL, NULL);
    }
    if (strcmp(how, "coop") == 0)
        return api.launchCoop(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL);
    return api.launchKernel(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
}

/* A seccomp filter under which membarrier(2) fails with EPERM: 0 once it does. */
static int refuse_membarrier(void)
{
    struct sock_filter code[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_membarrier, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EPERM),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    struct sock_fprog prog = {sizeof code / sizeof code[0], code};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 ||
        prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) != 0)
        return -1;
    return syscall(__NR_membarrier, MEMBARRIER_CMD_QUERY, 0, 0) == -1 && errno == EPERM ? 0 : -1;
}

/* An event recorded behind the launch just made on WHERE's stream. */
static CUresult mark(CUevent *event, const char *where, CUstream stream)
{
    CUresult rc = cuEventCreate(event, CU_EVENT_DISABLE_TIMING);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (strcmp(where, "ptsz") == 0)
        return cuEventRecord_ptsz(*event, NULL);
    return cuEventRecord(*event, strcmp(where, "perthread") == 0 ? CU_STREAM_PER_THREAD : stream);
}

/* COUNT launches of NAME on WHERE, timed and counted; then the sync, timed. Exported
 * symbols. */
static CUresult queue_op(unsigned long long count, const char *name, const char *where)
{
    CUfunction f = function_named(name);
    CUstream stream = NULL;
    CUgraphExec exec = NULL;
    CUevent *marks = calloc(count ? count : 1, sizeof(*marks));
    unsigned long long queued = 0;
    CUresult rc = f && marks ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
    if (rc == CUDA_SUCCESS && (strcmp(where, "stream") == 0 || strcmp(where, "graph") == 0))
        rc = cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING);
    if (rc == CUDA_SUCCESS && strcmp(where, "graph") == 0) {
        CUgraph graph;
        rc = cuStreamBeginCapture_v2(stream, CU_STREAM_CAPTURE_MODE_GLOBAL);
        if (rc == CUDA_SUCCESS)
            rc = cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, stream, NULL, NULL);
        if (rc == CUDA_SUCCESS)
            rc = cuStreamEndCapture(stream, &graph);
        if (rc == CUDA_SUCCESS)
            rc = cuGraphInstantiateWithFlags(&exec, graph, 0);
    }
    uint64_t t0 = now_ns();
    for (unsigned long long k = 0; k < count && rc == CUDA_SUCCESS; k++) {
        if (strcmp(where, "ptsz") == 0) {
            rc = cuLaunchKernel_ptsz(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
        } else if (strcmp(where, "launchex") == 0) {
            rc = launch("launchex", f);
        } else if (strcmp(where, "graph") == 0) {
            rc = cuGraphLaunch(exec, stream);
        } else {
            CUstream s = strcmp(where, "perthread") == 0 ? CU_STREAM_PER_THREAD : stream;
            rc = cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, s, NULL, NULL);
        }
        if (rc == CUDA_SUCCESS)
            rc = mark(&marks[k], where, stream);
    }
    uint64_t t1 = now_ns();
    for (unsigned long long k = count; k-- > 0 && marks != NULL && marks[k] != NULL;)
        queued += cuEventQuery(marks[k]) == CUDA_ERROR_NOT_READY;
    if (rc == CUDA_SUCCESS)
        rc = stream != NULL ? cuStreamSynchronize(stream) : cuCtxSynchronize();
    uint64_t t2 = now_ns();
    if (stream != NULL && rc == CUDA_SUCCESS)
        rc = cuStreamDestroy(stream);
    for (unsigned long long k = 0; k < count && marks != NULL && marks[k] != NULL; k++)
        cuEventDestroy(marks[k]);
    free(marks);
    printf("queue %llu %s issue_ms=%.1f sync_ms=%.1f queued=%llu rc=%d\n", count, where,
           (double)(t1 - t0) / 1e6, (double)(t2 - t1) / 1e6, queued, (int)rc);
    return rc;
}

/* Streams and contexts created, used and destroyed, as long-running servers do. */
static CUresult churn_op(unsigned long long rounds)
{
    CUfunction f = function_named("sleep_0");
    CUresult rc = f ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
    const char *step = "function";
    for (unsigned long long k = 0; k < rounds && rc == CUDA_SUCCESS; k++) {
        CUcontext ctx = NULL, popped;
        CUfunction fn = f;
        CUstream stream;
        if (k % 10 == 0) {
            step = "cuCtxCreate";
            rc = cuCtxCreate(&ctx, 0, device);
            if (rc == CUDA_SUCCESS) { /* a function belongs to its context's module */
                CUmodule mod;
                step = "module";
                rc = api.moduleLoadData(&mod, kernels_ptx);
                if (rc == CUDA_SUCCESS)
                    rc = api.moduleGetFunction(&fn, mod, "sleep_0");
            }
        }
        if (rc == CUDA_SUCCESS) {
            step = "cuStreamCreate";
            rc = cuStreamCreate(&stream, 0);
        }
        for (int i = 0; i < 20 && rc == CUDA_SUCCESS; i++) {
            step = "cuLaunchKernel";
            rc = cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, i % 2 ? stream : NULL, NULL, NULL);
        }
        if (rc == CUDA_SUCCESS) {
            step = "cuStreamDestroy";
            rc = cuStreamDestroy(stream);
        }
        if (rc == CUDA_SUCCESS && ctx != NULL) {
            step = "cuCtxDestroy";
            rc = cuCtxPopCurrent(&popped);
            if (rc == CUDA_SUCCESS)
                rc = cuCtxDestroy(ctx);
        }
    }
    if (rc != CUDA_SUCCESS)
        printf("churn failed at %s\n", step);
    printf("churn %llu rc=%d\n", rounds, (int)rc);
    return rc;
}

int main(int argc, char **argv)
{
    int i = 1;
    int use_getproc = 0;
    for (; i < argc && strncmp(argv[i], "--", 2) == 0; i++) {
        if (strcmp(argv[i], "--getproc") == 0) {
            use_getproc = 1;
        } else if (strcmp(argv[i], "--getproc-ptsz") == 0) {
            use_getproc = 1;
            getproc_flags = CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;
        }
        else if (strcmp(argv[i], "--device") == 0)
            device_ordinal = (int)arg_u64(argv, ++i, argc);
    }
    if (use_getproc)
        bind_getproc();
    else
        bind_exported();
    setvbuf(stdout, NULL, _IOLBF, 0);
    srand((unsigned)(getpid() ^ (unsigned)now_ns()));

    for (; i < argc; i++) {
        const char *op = argv[i];
        CUresult rc = ensure_ctx();
        if (strcmp(op, "ctx") == 0) {
            printf("ctx rc=%d\n", (int)rc);
            continue;
        }
        if (rc != CUDA_SUCCESS) {
            printf("%s rc=%d (no context)\n", op, (int)rc);
            return 1;
        }
        if (strcmp(op, "alloc") == 0) {
            unsigned long long n = arg_u64(argv, ++i, argc);
            CUdeviceptr p = 0;
            rc = api.memAlloc(&p, n);
            if (rc == CUDA_SUCCESS)
                hold(K_PTR, p);
            printf("alloc %llu rc=%d\n", n, (int)rc);
        } else if (strcmp(op, "pitch") == 0) {
            unsigned long long w = arg_u64(argv, ++i, argc), h = arg_u64(argv, ++i, argc);
            CUdeviceptr p = 0;
            size_t pitch = 0;
            rc = api.memAllocPitch(&p, &pitch, w, h, 4);
            if (rc == CUDA_SUCCESS)
                hold(K_PTR, p);
            printf("pitch %llu %llu pitch=%zu rc=%d\n", w, h, pitch, (int)rc);
        } else if (strcmp(op, "create") == 0) {
            unsigned long long n = arg_u64(argv, ++i, argc);
            CUmemAllocationProp prop;
            memset(&prop, 0, sizeof prop);
            prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
            prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
            prop.location.id = device;
            CUmemGenericAllocationHandle h = 0;
            rc = api.memCreate(&h, n, &prop, 0);
            if (rc == CUDA_SUCCESS)
                hold(K_HANDLE, h);
            printf("create %llu rc=%d\n", n, (int)rc);
        } else if (strcmp(op, "async") == 0 || strcmp(op, "pool") == 0) {
            unsigned long long n = arg_u64(argv, ++i, argc);
            CUdeviceptr p = 0;
            if (op[0] == 'a') {
                rc = api.memAllocAsync(&p, n, NULL);
            } else {
                CUmemoryPool pool;
                rc = api.defaultPool(&pool, device);
                if (rc == CUDA_SUCCESS)
                    rc = api.memAllocFromPool(&p, n, pool, NULL);
            }
            if (rc == CUDA_SUCCESS)
                hold(K_ASYNC, p);
            printf("%s %llu rc=%d\n", op, n, (int)rc);
        } else if (strcmp(op, "array") == 0 || strcmp(op, "array3d") == 0) {
            CUarray a = NULL;
            unsigned long long w = arg_u64(argv, ++i, argc), h = arg_u64(argv, ++i, argc);
            if (op[5] == '3') {
                CUDA_ARRAY3D_DESCRIPTOR d = {w, h, arg_u64(argv, ++i, argc),
                                             CU_AD_FORMAT_UNSIGNED_INT8, 1, 0};
                rc = api.array3DCreate(&a, &d);
            } else {
                CUDA_ARRAY_DESCRIPTOR d = {w, h, CU_AD_FORMAT_UNSIGNED_INT8, 1};
                rc = api.arrayCreate(&a, &d);
            }
            if (rc == CUDA_SUCCESS)
                hold(K_ARRAY, (unsigned long long)(uintptr_t)a);
            printf("%s rc=%d\n", op, (int)rc);
        } else if (strcmp(op, "managed") == 0) {
            CUdeviceptr p = 0;
            rc = api.memAllocManaged(&p, arg_u64(argv, ++i, argc), CU_MEM_ATTACH_GLOBAL);
            printf("managed rc=%d\n", (int)rc);
        } else if (strcmp(op, "free") == 0) {
            rc = nheld > 0 ? release(held[--nheld]) : CUDA_ERROR_INVALID_VALUE;
            printf("free rc=%d\n", (int)rc);
        } else if (strcmp(op, "freeall") == 0) {
            rc = CUDA_SUCCESS;
            while (nheld > 0 && rc == CUDA_SUCCESS)
                rc = release(held[--nheld]);
            printf("freeall rc=%d\n", (int)rc);
        } else if (strcmp(op, "info") == 0) {
            size_t f = 0, t = 0;
            rc = api.memGetInfo(&f, &t);
            printf("info free=%zu total=%zu rc=%d\n", f, t, (int)rc);
        } else if (strcmp(op, "total") == 0) {
            size_t t = 0;
            rc = api.totalMem(&t, device);
            printf("total %zu rc=%d\n", t, (int)rc);
        } else if (strcmp(op, "launch") == 0 || strcmp(op, "coop") == 0 ||
                   strcmp(op, "launchex") == 0 || strcmp(op, "stamped") == 0) {
            int stamped = strcmp(op, "stamped") == 0; /* a plain launch, timed */
            unsigned long long n = arg_u64(argv, ++i, argc);
            CUfunction f = function_named(argv[++i < argc ? i : argc - 1]);
            rc = f ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
            for (unsigned long long k = 0; k < n && rc == CUDA_SUCCESS; k++) {
                rc = launch(op, f);
                if (stamped)
                    printf("returned %llu %llu\n", k, (unsigned long long)now_ns());
            }
            if (rc == CUDA_SUCCESS)
                rc = api.ctxSynchronize();
            printf("%s %llu rc=%d\n", op, n, (int)rc);
        } else if (strcmp(op, "nomembarrier") == 0) {
            if (refuse_membarrier() != 0)
                return 1;
            printf("membarrier refused\n");
        } else if (strcmp(op, "graphprep") == 0) {
            CUgraph g;
            CUfunction f = function_named("sleep_0");
            rc = api.streamCreate(&graph_stream, 0);
            if (rc == CUDA_SUCCESS)
                rc = api.beginCapture(graph_stream, CU_STREAM_CAPTURE_MODE_GLOBAL);
            if (rc == CUDA_SUCCESS)
                rc = api.launchKernel(f, 1, 1, 1, 1, 1, 1, 0, graph_stream, NULL, NULL);
            if (rc == CUDA_SUCCESS)
                rc = api.endCapture(graph_stream, &g);
            if (rc == CUDA_SUCCESS)
                rc = api.graphInstantiate(&graph_exec, g, 0);
            printf("graphprep rc=%d\n", (int)rc);
        } else if (strcmp(op, "graph") == 0) {
            unsigned long long n = arg_u64(argv, ++i, argc);
            rc = graph_exec ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
            for (unsigned long long k = 0; k < n && rc == CUDA_SUCCESS; k++)
                rc = api.graphLaunch(graph_exec, graph_stream);
            if (rc == CUDA_SUCCESS)
                rc = api.ctxSynchronize();
            printf("graph %llu rc=%d\n", n, (int)rc);
        } else if (strcmp(op, "wait") == 0) {
            char line[64];
            printf("waiting\n");
            if (fgets(line, sizeof line, stdin) == NULL)
                return 1;
        } else if (strcmp(op, "sync") == 0) {
            printf("sync rc=%d\n", (int)api.ctxSynchronize());
        } else if (strcmp(op, "sleep") == 0) {
            usleep((useconds_t)(arg_u64(argv, ++i, argc) * 1000));
        } else if (strcmp(op, "hold") == 0) {
            printf("holding\n");
            char buf[64];
            while (fread(buf, 1, sizeof buf, stdin) > 0)
                ;
        } else if (strcmp(op, "race") == 0) {
            unsigned long long iters = arg_u64(argv, ++i, argc);
            unsigned long long maxb = arg_u64(argv, ++i, argc);
            unsigned long long limit = arg_u64(argv, ++i, argc);
            unsigned long long ok = 0, refused = 0;
            for (unsigned long long k = 0; k < iters; k++) {
                if (nheld > 0 && (rand() % 3 == 0 || nheld == MAX_HELD)) {
                    int j = rand() % nheld;
                    api.memFree(held[j].value);
                    held[j] = held[--nheld];
                    continue;
                }
                CUdeviceptr p = 0;
                unsigned long long n = 1 + (unsigned long long)rand() % maxb;
                rc = api.memAlloc(&p, n);
                if (rc == CUDA_SUCCESS) {
                    hold(K_PTR, p);
                    ok++;
                } else {
                    refused++;
                }
                unsigned long long used = device_used();
                if (used > limit) {
                    printf("race over limit: the device holds %llu > %llu\n", used, limit);
                    return 3;
                }
            }
            printf("race ok=%llu refused=%llu\n", ok, refused);
        } else if (strcmp(op, "queue") == 0) {
            unsigned long long n = arg_u64(argv, ++i, argc);
            const char *name = argv[++i < argc ? i : argc - 1];
            queue_op(n, name, argv[++i < argc ? i : argc - 1]);
        } else if (strcmp(op, "churn") == 0) {
            churn_op(arg_u64(argv, ++i, argc));
        } else if (strcmp(op, "bench-launch") == 0) {
            unsigned long long n = arg_u64(argv, ++i, argc);
            CUfunction f = function_named(argv[++i < argc ? i : argc - 1]);
            if (f == NULL)
                return 1;
            uint64_t t0 = now_ns();
            for (unsigned long long k = 0; k < n; k++)
                api.launchKernel(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
            uint64_t t1 = now_ns();
            api.ctxSynchronize();
            uint64_t t2 = now_ns();
            printf("bench-launch issue_ns=%.1f total_ns=%.1f\n", (double)(t1 - t0) / (double)n,
                   (double)(t2 - t0) / (double)n);
        } else if (strcmp(op, "bench-alloc") == 0) {
            unsigned long long n = arg_u64(argv, ++i, argc), bytes = arg_u64(argv, ++i, argc);
            uint64_t t0 = now_ns();
            for (unsigned long long k = 0; k < n; k++) {
                CUdeviceptr p;
                if (api.memAlloc(&p, bytes) == CUDA_SUCCESS)
                    api.memFree(p);
            }
            printf("bench-alloc ns=%.1f\n", (double)(now_ns() - t0) / (double)n);
        } else {
            fprintf(stderr, "unknown op %s\n", op);
            return 2;
        }
    }
    return 0;
}
