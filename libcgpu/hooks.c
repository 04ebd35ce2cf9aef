/*
 * hooks.c: the interposed driver and NVML entry points.
 *
 * Three ways in, one set of wrappers:
 *  - the exported symbols (programs linked against libcuda.so.1, LD_PRELOAD);
 *  - cuGetProcAddress / cuGetProcAddress_v2: the real driver answers, and a
 *    pointer that is one of the real functions we wrap is swapped for our
 *    wrapper (by address, so the driver's own name and version mapping and
 *    the _ptsz variants are honoured);
 *  - dlsym on a handle of libcuda or libnvidia-ml (the CUDA runtime, ctypes):
 *    same swap by address.
 * The real libraries are opened by us: $CGPU_REAL_LIBCUDA / $CGPU_REAL_LIBNVML,
 * else the usual sonames and paths, never this library itself.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#pragma GCC visibility push(default)
#include "cuda.h"
#include "nvml.h"
#pragma GCC visibility pop

#include "cgpu.h"
#include "flight.h"

/* ------------------------------------------------------------------ */
/* The list of wrapped functions: X(lib, name)                        */
/* ------------------------------------------------------------------ */

#define LIB_CUDA 0
#define LIB_NVML 1

#define CGPU_HOOKS(X)                                                                            \
    X(LIB_CUDA, cuMemAlloc_v2)                                                                   \
    X(LIB_CUDA, cuMemAllocPitch_v2)                                                              \
    X(LIB_CUDA, cuMemFree_v2)                                                                    \
    X(LIB_CUDA, cuMemAllocManaged)                                                               \
    X(LIB_CUDA, cuMemAllocAsync)                                                                 \
    X(LIB_CUDA, cuMemAllocAsync_ptsz)                                                            \
    X(LIB_CUDA, cuMemAllocFromPoolAsync)                                                         \
    X(LIB_CUDA, cuMemAllocFromPoolAsync_ptsz)                                                    \
    X(LIB_CUDA, cuMemFreeAsync)                                                                  \
    X(LIB_CUDA, cuMemFreeAsync_ptsz)                                                             \
    X(LIB_CUDA, cuMemCreate)                                                                     \
    X(LIB_CUDA, cuMemRelease)                                                                    \
    X(LIB_CUDA, cuArrayCreate_v2)                                                                \
    X(LIB_CUDA, cuArray3DCreate_v2)                                                              \
    X(LIB_CUDA, cuArrayDestroy)                                                                  \
    X(LIB_CUDA, cuMemGetInfo_v2)                                                                 \
    X(LIB_CUDA, cuDeviceTotalMem_v2)                                                             \
    X(LIB_CUDA, cuCtxCreate_v2)                                                                  \
    X(LIB_CUDA, cuCtxCreate_v3)                                                                  \
    X(LIB_CUDA, cuCtxCreate_v4)                                                                  \
    X(LIB_CUDA, cuCtxDestroy_v2)                                                                 \
    X(LIB_CUDA, cuDevicePrimaryCtxRetain)                                                        \
    X(LIB_CUDA, cuDevicePrimaryCtxRelease_v2)                                                    \
    X(LIB_CUDA, cuDevicePrimaryCtxReset_v2)                                                      \
    X(LIB_CUDA, cuStreamDestroy_v2)                                                              \
    X(LIB_CUDA, cuLaunchKernel)                                                                  \
    X(LIB_CUDA, cuLaunchKernel_ptsz)                                                             \
    X(LIB_CUDA, cuLaunchKernelEx)                                                                \
    X(LIB_CUDA, cuLaunchKernelEx_ptsz)                                                           \
    X(LIB_CUDA, cuLaunchCooperativeKernel)                                                       \
    X(LIB_CUDA, cuLaunchCooperativeKernel_ptsz)                                                  \
    X(LIB_CUDA, cuGraphLaunch)                                                                   \
    X(LIB_CUDA, cuGraphLaunch_ptsz)                                                              \
    X(LIB_CUDA, cuGetProcAddress_v2)                                                             \
    X(LIB_NVML, nvmlDeviceGetMemoryInfo)                                                         \
    X(LIB_NVML, nvmlDeviceGetMemoryInfo_v2)

/* The pre-CUDA-12 entry point, exported under its own name with its own arity. */
typedef CUresult (*legacy_getproc_fn)(const char *, void **, int, cuuint64_t);
CGPU_EXPORT CUresult cgpu_cuGetProcAddress_legacy(const char *symbol, void **pfn, int cudaVersion,
                                                  cuuint64_t flags) __asm__("cuGetProcAddress");
static legacy_getproc_fn real_cuGetProcAddress_legacy;

/* Unversioned exports with the same ABI as their _v2 (NVIDIA keeps both). */
CGPU_EXPORT CUresult cgpu_cuCtxCreate_legacy(CUcontext *pctx, unsigned int flags, CUdevice dev)
    __asm__("cuCtxCreate");
CGPU_EXPORT CUresult cgpu_cuCtxDestroy_legacy(CUcontext ctx) __asm__("cuCtxDestroy");
CGPU_EXPORT CUresult cgpu_cuDevicePrimaryCtxRelease_legacy(CUdevice dev)
    __asm__("cuDevicePrimaryCtxRelease");
CGPU_EXPORT CUresult cgpu_cuDevicePrimaryCtxReset_legacy(CUdevice dev)
    __asm__("cuDevicePrimaryCtxReset");
CGPU_EXPORT CUresult cgpu_cuStreamDestroy_legacy(CUstream stream) __asm__("cuStreamDestroy");
static __typeof__(&cuCtxCreate_v2) real_cuCtxCreate_legacy;
static __typeof__(&cuCtxDestroy_v2) real_cuCtxDestroy_legacy;
static __typeof__(&cuDevicePrimaryCtxRelease_v2) real_cuDevicePrimaryCtxRelease_legacy;
static __typeof__(&cuDevicePrimaryCtxReset_v2) real_cuDevicePrimaryCtxReset_legacy;
static __typeof__(&cuStreamDestroy_v2) real_cuStreamDestroy_legacy;

#define DECLARE_REAL(lib, name) static __typeof__(&name) real_##name;
CGPU_HOOKS(DECLARE_REAL)
static __typeof__(&cuCtxGetDevice) real_cuCtxGetDevice;
static __typeof__(&cuDeviceGetUuid_v2) real_cuDeviceGetUuid_v2;
static __typeof__(&cuDevicePrimaryCtxGetState) real_cuDevicePrimaryCtxGetState;
static __typeof__(&nvmlDeviceGetUUID) real_nvmlDeviceGetUUID;
static __typeof__(&nvmlDeviceGetIndex) real_nvmlDeviceGetIndex;
static __typeof__(&nvmlInit_v2) real_nvmlInit_v2;
static __typeof__(&nvmlDeviceGetHandleByUUID) real_nvmlDeviceGetHandleByUUID;
static __typeof__(&nvmlDeviceGetHandleByIndex_v2) real_nvmlDeviceGetHandleByIndex_v2;

struct hook {
    const char *name;
    void *wrapper; /* NULL: resolved only */
    void **real;
    int lib;
};

#define HOOK_ENTRY(lib, name) {#name, (void *)&name, (void **)&real_##name, lib},
static struct hook hooks[] = {
    CGPU_HOOKS(HOOK_ENTRY)
    {"cuGetProcAddress", (void *)&cgpu_cuGetProcAddress_legacy,
     (void **)&real_cuGetProcAddress_legacy, LIB_CUDA},
    {"cuCtxCreate", (void *)&cgpu_cuCtxCreate_legacy, (void **)&real_cuCtxCreate_legacy, LIB_CUDA},
    {"cuCtxDestroy", (void *)&cgpu_cuCtxDestroy_legacy, (void **)&real_cuCtxDestroy_legacy,
     LIB_CUDA},
    {"cuDevicePrimaryCtxRelease", (void *)&cgpu_cuDevicePrimaryCtxRelease_legacy,
     (void **)&real_cuDevicePrimaryCtxRelease_legacy, LIB_CUDA},
    {"cuDevicePrimaryCtxReset", (void *)&cgpu_cuDevicePrimaryCtxReset_legacy,
     (void **)&real_cuDevicePrimaryCtxReset_legacy, LIB_CUDA},
    {"cuStreamDestroy", (void *)&cgpu_cuStreamDestroy_legacy, (void **)&real_cuStreamDestroy_legacy,
     LIB_CUDA},
    {"cuCtxGetDevice", NULL, (void **)&real_cuCtxGetDevice, LIB_CUDA},
    {"cuDeviceGetUuid_v2", NULL, (void **)&real_cuDeviceGetUuid_v2, LIB_CUDA},
    {"cuDevicePrimaryCtxGetState", NULL, (void **)&real_cuDevicePrimaryCtxGetState, LIB_CUDA},
    {"cuCtxGetCurrent", NULL, (void **)&cgpu_flight_cu.ctx_get_current, LIB_CUDA},
    {"cuEventCreate", NULL, (void **)&cgpu_flight_cu.event_create, LIB_CUDA},
    {"cuEventRecord", NULL, (void **)&cgpu_flight_cu.event_record, LIB_CUDA},
    {"cuEventSynchronize", NULL, (void **)&cgpu_flight_cu.event_synchronize, LIB_CUDA},
    {"cuEventQuery", NULL, (void **)&cgpu_flight_cu.event_query, LIB_CUDA},
    {"cuStreamIsCapturing", NULL, (void **)&cgpu_flight_cu.stream_is_capturing, LIB_CUDA},
    {"cuCtxPushCurrent_v2", NULL, (void **)&cgpu_flight_cu.ctx_push, LIB_CUDA},
    {"cuCtxPopCurrent_v2", NULL, (void **)&cgpu_flight_cu.ctx_pop, LIB_CUDA},
    {"cuThreadExchangeStreamCaptureMode", NULL, (void **)&cgpu_flight_cu.exchange_capture_mode,
     LIB_CUDA},
    {"nvmlDeviceGetUUID", NULL, (void **)&real_nvmlDeviceGetUUID, LIB_NVML},
    {"nvmlInit_v2", NULL, (void **)&real_nvmlInit_v2, LIB_NVML},
    {"nvmlDeviceGetHandleByUUID", NULL, (void **)&real_nvmlDeviceGetHandleByUUID, LIB_NVML},
    {"nvmlDeviceGetHandleByIndex_v2", NULL, (void **)&real_nvmlDeviceGetHandleByIndex_v2,
     LIB_NVML},
    {"nvmlDeviceGetIndex", NULL, (void **)&real_nvmlDeviceGetIndex, LIB_NVML},
};
#define NHOOKS (sizeof hooks / sizeof hooks[0])

/* ------------------------------------------------------------------ */
/* Finding the real libraries                                         */
/* ------------------------------------------------------------------ */

typedef void *(*dlsym_fn)(void *, const char *);
static dlsym_fn real_dlsym;
static __thread int in_resolve;

static dlsym_fn get_real_dlsym(void)
{
    dlsym_fn f = __atomic_load_n(&real_dlsym, __ATOMIC_ACQUIRE);
    if (cgpu_likely(f != NULL))
        return f;
    static const char *const libs[] = {"libc.so.6", "libdl.so.2"};
    static const char *const versions[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17"};
    for (size_t i = 0; f == NULL && i < sizeof libs / sizeof *libs; i++) {
        void *h = dlopen(libs[i], RTLD_LAZY | RTLD_NOLOAD);
        for (size_t v = 0; h != NULL && f == NULL && v < sizeof versions / sizeof *versions; v++)
            f = (dlsym_fn)dlvsym(h, "dlsym", versions[v]);
    }
    for (size_t v = 0; f == NULL && v < sizeof versions / sizeof *versions; v++)
        f = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", versions[v]);
    if (f == NULL) {
        cgpu_log("cannot find the C library's dlsym; aborting");
        abort();
    }
    __atomic_store_n(&real_dlsym, f, __ATOMIC_RELEASE);
    return f;
}

static void *open_real(const char *env, const char *const *candidates, const char *probe,
                       void *own)
{
    const char *forced = getenv(env);
    dlsym_fn ds = get_real_dlsym();
    for (size_t i = 0; forced != NULL || candidates[i] != NULL; i++) {
        const char *path = forced != NULL ? forced : candidates[i];
        void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        if (h != NULL) {
            void *p = ds(h, probe);
            if (p != NULL && p != own)
                return h;
            dlclose(h);
        }
        if (forced != NULL) {
            cgpu_log("%s=%s cannot be used as the real library", env, forced);
            return NULL;
        }
    }
    return NULL;
}

static const char *const cuda_paths[] = {
    "libcuda.so.1",
    "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
    "/usr/lib64/libcuda.so.1",
    "/usr/lib/aarch64-linux-gnu/libcuda.so.1",
    "/usr/local/nvidia/lib64/libcuda.so.1",
    "/usr/lib/wsl/lib/libcuda.so.1",
    "/usr/lib/libcuda.so.1",
    NULL,
};
static const char *const nvml_paths[] = {
    "libnvidia-ml.so.1",
    "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1",
    "/usr/lib64/libnvidia-ml.so.1",
    "/usr/lib/aarch64-linux-gnu/libnvidia-ml.so.1",
    "/usr/local/nvidia/lib64/libnvidia-ml.so.1",
    "/usr/lib/wsl/lib/libnvidia-ml.so.1",
    "/usr/lib/libnvidia-ml.so.1",
    NULL,
};

static void *lib_handle[2];
static pthread_once_t lib_once[2] = {PTHREAD_ONCE_INIT, PTHREAD_ONCE_INIT};

static void resolve_lib(int lib)
{
    in_resolve = 1;
    void *h = lib == LIB_CUDA
                  ? open_real("CGPU_REAL_LIBCUDA", cuda_paths, "cuInit", (void *)&cuMemAlloc_v2)
                  : open_real("CGPU_REAL_LIBNVML", nvml_paths, "nvmlInit_v2",
                              (void *)&nvmlDeviceGetMemoryInfo);
    if (h == NULL) {
        cgpu_log("cannot load the real %s", lib == LIB_CUDA ? "libcuda.so.1" : "libnvidia-ml.so.1");
    } else {
        dlsym_fn ds = get_real_dlsym();
        for (size_t i = 0; i < NHOOKS; i++)
            if (hooks[i].lib == lib)
                __atomic_store_n(hooks[i].real, ds(h, hooks[i].name), __ATOMIC_RELEASE);
    }
    __atomic_store_n(&lib_handle[lib], h, __ATOMIC_RELEASE);
    in_resolve = 0;
}
static void resolve_cuda(void) { resolve_lib(LIB_CUDA); }
static void resolve_nvml(void) { resolve_lib(LIB_NVML); }

static void resolve(int lib)
{
    pthread_once(&lib_once[lib], lib == LIB_CUDA ? resolve_cuda : resolve_nvml);
}

static CUresult cuda_missing(const char *name)
{
    cgpu_log("%s is not available in the real driver", name);
    return CUDA_ERROR_NOT_FOUND;
}

#define ENSURE_CUDA(name)                                                                        \
    do {                                                                                         \
        if (cgpu_unlikely(real_##name == NULL)) {                                                \
            resolve(LIB_CUDA);                                                                   \
            if (real_##name == NULL)                                                             \
                return cuda_missing(#name);                                                      \
        }                                                                                        \
    } while (0)

#define ENSURE_NVML(name)                                                                        \
    do {                                                                                         \
        if (cgpu_unlikely(real_##name == NULL)) {                                                \
            resolve(LIB_NVML);                                                                   \
            if (real_##name == NULL)                                                             \
                return NVML_ERROR_FUNCTION_NOT_FOUND;                                            \
        }                                                                                        \
    } while (0)

/* The wrapper standing for a real function pointer, or the pointer itself. */
static void *wrapper_for(void *real_fn)
{
    if (real_fn == NULL)
        return NULL;
    for (size_t i = 0; i < NHOOKS; i++)
        if (hooks[i].wrapper != NULL &&
            __atomic_load_n(hooks[i].real, __ATOMIC_ACQUIRE) == real_fn)
            return hooks[i].wrapper;
    return real_fn;
}

static const struct hook *hook_named(const char *name)
{
    for (size_t i = 0; i < NHOOKS; i++)
        if (hooks[i].wrapper != NULL && strcmp(hooks[i].name, name) == 0)
            return &hooks[i];
    return NULL;
}

/* ------------------------------------------------------------------ */
/* dlsym                                                              */
/* ------------------------------------------------------------------ */

/* RTLD_NEXT is relative to the caller (glibc takes it from the return
 * address, which would be ours), so search the objects loaded after the
 * caller ourselves, each through a proper handle. */
static void *dlsym_next(const void *caller, const char *name)
{
    Dl_info info;
    struct link_map *lm = NULL;
    if (dladdr1(caller, &info, (void **)&lm, RTLD_DL_LINKMAP) == 0 || lm == NULL)
        return NULL;
    dlsym_fn ds = get_real_dlsym();
    for (lm = lm->l_next; lm != NULL; lm = lm->l_next) {
        if (lm->l_name == NULL || lm->l_name[0] == '\0')
            continue;
        void *h = dlopen(lm->l_name, RTLD_LAZY | RTLD_NOLOAD);
        if (h == NULL)
            continue; /* the vDSO */
        void *p = ds(h, name);
        dlclose(h);
        if (p != NULL)
            return p;
    }
    return NULL;
}

CGPU_EXPORT void *dlsym(void *restrict handle, const char *restrict name)
{
    void *p = handle == RTLD_NEXT ? dlsym_next(__builtin_return_address(0), name)
                                  : get_real_dlsym()(handle, name);
    if (p == NULL || (name[0] != 'c' && name[0] != 'n') || in_resolve)
        return p;
    const struct hook *h = hook_named(name);
    if (h == NULL || cgpu_region() == NULL)
        return p;
    resolve(h->lib);
    return wrapper_for(p);
}

/* ------------------------------------------------------------------ */
/* Which container GPU                                                */
/* ------------------------------------------------------------------ */

#define DEV_CACHE 64
#define GPU_UNKNOWN (-3)
#define GPU_NO_CONTEXT (-2)
#define GPU_NOT_OURS (-1)
static int dev_map[DEV_CACHE] = {[0 ... DEV_CACHE - 1] = GPU_UNKNOWN};

static void format_uuid(const unsigned char *b, char *out, size_t len)
{
    snprintf(out, len,
             "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
             b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
             b[14], b[15]);
}

static int gpu_by_uuid(const struct cgpu_control *r, const char *uuid)
{
    for (uint32_t k = 0; k < r->ngpus; k++)
        if (strncasecmp(r->gpu[k].uuid, uuid, CGPU_UUID_LEN) == 0)
            return (int)k;
    return GPU_NOT_OURS;
}

static int region_has_uuids(const struct cgpu_control *r)
{
    return r->gpu[0].uuid[0] != '\0';
}

/* Container GPU of a driver device ordinal: by UUID when the region has them. */
static int gpu_of_device(const struct cgpu_control *r, CUdevice dev)
{
    if (dev < 0)
        return GPU_NOT_OURS;
    if (dev < DEV_CACHE) {
        int cached = __atomic_load_n(&dev_map[dev], __ATOMIC_RELAXED);
        if (cached != GPU_UNKNOWN)
            return cached;
    }
    int g;
    if (region_has_uuids(r)) {
        CUuuid u;
        char s[64];
        resolve(LIB_CUDA);
        if (real_cuDeviceGetUuid_v2 == NULL || real_cuDeviceGetUuid_v2(&u, dev) != CUDA_SUCCESS)
            return GPU_NOT_OURS;
        format_uuid((const unsigned char *)u.bytes, s, sizeof s);
        g = gpu_by_uuid(r, s);
    } else {
        g = (uint32_t)dev < r->ngpus ? dev : GPU_NOT_OURS;
    }
    if (dev < DEV_CACHE)
        __atomic_store_n(&dev_map[dev], g, __ATOMIC_RELAXED);
    return g;
}

static int current_gpu(const struct cgpu_control *r)
{
    CUdevice dev;
    resolve(LIB_CUDA);
    if (real_cuCtxGetDevice == NULL || real_cuCtxGetDevice(&dev) != CUDA_SUCCESS)
        return GPU_NO_CONTEXT;
    return gpu_of_device(r, dev);
}

static int gpu_of_nvml(const struct cgpu_control *r, nvmlDevice_t dev)
{
    resolve(LIB_NVML);
    if (region_has_uuids(r)) {
        char s[NVML_DEVICE_UUID_V2_BUFFER_SIZE];
        if (real_nvmlDeviceGetUUID == NULL ||
            real_nvmlDeviceGetUUID(dev, s, sizeof s) != NVML_SUCCESS)
            return GPU_NOT_OURS;
        return gpu_by_uuid(r, s);
    }
    unsigned int index;
    if (real_nvmlDeviceGetIndex == NULL || real_nvmlDeviceGetIndex(dev, &index) != NVML_SUCCESS)
        return GPU_NOT_OURS;
    for (uint32_t k = 0; k < r->ngpus; k++)
        if (r->gpu[k].host_index == index)
            return (int)k;
    return GPU_NOT_OURS;
}

static void not_ours(int g)
{
    static int said;
    if (g == GPU_NOT_OURS && !__atomic_exchange_n(&said, 1, __ATOMIC_RELAXED))
        cgpu_log("this GPU is not assigned to the container; allocations on it are refused");
}

/* ------------------------------------------------------------------ */
/* Memory                                                             */
/* ------------------------------------------------------------------ */

/* Admit an allocation of `size` on container GPU g: CUDA_SUCCESS with the
 * bytes reserved (or g < 0 when there is nothing to count), else the error
 * the caller returns. */
static CUresult admit(int g, uint64_t size)
{
    if (g == GPU_NO_CONTEXT)
        return CUDA_SUCCESS; /* the driver will refuse it */
    if (g < 0) {
        not_ours(g);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (cgpu_reserve(g, size) == 0)
        return CUDA_SUCCESS;
    cgpu_over_limit(g, size); /* eGPU mode does not return */
    return CUDA_ERROR_OUT_OF_MEMORY;
}

/* After the real call: keep the reservation and remember it, or give it back. */
static void settle(CUresult rc, enum cgpu_track_kind kind, uint64_t key, uint64_t size, int g)
{
    if (g < 0)
        return;
    if (rc == CUDA_SUCCESS)
        cgpu_track_put(kind, key, size, g);
    else
        cgpu_unreserve(g, size);
}

/* Forget a tracked object just before the real free; put it back if that fails. */
#define RELEASE_TRACKED(kind, key, call)                                                         \
    do {                                                                                         \
        uint64_t size_ = 0;                                                                      \
        int g_ = -1;                                                                             \
        int known_ = cgpu_region() != NULL && cgpu_track_take(kind, key, &size_, &g_);           \
        CUresult rc_ = (call);                                                                   \
        if (known_) {                                                                            \
            if (rc_ == CUDA_SUCCESS)                                                             \
                cgpu_unreserve(g_, size_);                                                       \
            else                                                                                 \
                cgpu_track_put(kind, key, size_, g_);                                            \
        }                                                                                        \
        return rc_;                                                                              \
    } while (0)

CGPU_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    ENSURE_CUDA(cuMemAlloc_v2);
    const struct cgpu_control *r = cgpu_region();
    if (r == NULL)
        return real_cuMemAlloc_v2(dptr, bytesize);
    int g = current_gpu(r);
    CUresult rc = admit(g, bytesize);
    if (rc != CUDA_SUCCESS)
        return rc;
    rc = real_cuMemAlloc_v2(dptr, bytesize);
    settle(rc, CGPU_TRACK_PTR, rc == CUDA_SUCCESS ? *dptr : 0, bytesize, g);
    return rc;
}

CGPU_EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width,
                                        size_t height, unsigned int elem)
{
    ENSURE_CUDA(cuMemAllocPitch_v2);
    const struct cgpu_control *r = cgpu_region();
    if (r == NULL)
        return real_cuMemAllocPitch_v2(dptr, pitch, width, height, elem);
    uint64_t estimate;
    if (__builtin_mul_overflow((uint64_t)width, (uint64_t)height, &estimate))
        return CUDA_ERROR_INVALID_VALUE;
    int g = current_gpu(r);
    CUresult rc = admit(g, estimate);
    if (rc != CUDA_SUCCESS)
        return rc;
    rc = real_cuMemAllocPitch_v2(dptr, pitch, width, height, elem);
    if (rc != CUDA_SUCCESS || g < 0) {
        settle(rc, CGPU_TRACK_PTR, 0, estimate, g);
        return rc;
    }
    uint64_t actual = (uint64_t)*pitch * height;
    if (actual > estimate && cgpu_reserve(g, actual - estimate) != 0) {
        real_cuMemFree_v2(*dptr);
        cgpu_unreserve(g, estimate);
        cgpu_over_limit(g, actual);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (actual < estimate)
        cgpu_unreserve(g, estimate - actual);
    cgpu_track_put(CGPU_TRACK_PTR, *dptr, actual, g);
    return rc;
}

CGPU_EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    ENSURE_CUDA(cuMemFree_v2);
    RELEASE_TRACKED(CGPU_TRACK_PTR, dptr, real_cuMemFree_v2(dptr));
}

CGPU_EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags)
{
    ENSURE_CUDA(cuMemAllocManaged);
    if (cgpu_region() == NULL)
        return real_cuMemAllocManaged(dptr, bytesize, flags);
    cgpu_log("cuMemAllocManaged refused: managed (unified) memory is not supported in a cGPU "
             "container, because its GPU memory use cannot be limited");
    return CUDA_ERROR_NOT_SUPPORTED;
}

typedef CUresult (*alloc_async_fn)(CUdeviceptr *, size_t, CUstream);
typedef CUresult (*alloc_pool_fn)(CUdeviceptr *, size_t, CUmemoryPool, CUstream);

static CUresult alloc_async(alloc_async_fn fn, alloc_pool_fn pool_fn, CUdeviceptr *dptr,
                            size_t bytesize, CUmemoryPool pool, CUstream stream)
{
    const struct cgpu_control *r = cgpu_region();
    if (r == NULL)
        return fn ? fn(dptr, bytesize, stream) : pool_fn(dptr, bytesize, pool, stream);
    int g = current_gpu(r);
    CUresult rc = admit(g, bytesize);
    if (rc != CUDA_SUCCESS)
        return rc;
    rc = fn ? fn(dptr, bytesize, stream) : pool_fn(dptr, bytesize, pool, stream);
    settle(rc, CGPU_TRACK_PTR, rc == CUDA_SUCCESS ? *dptr : 0, bytesize, g);
    return rc;
}

CGPU_EXPORT CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream stream)
{
    ENSURE_CUDA(cuMemAllocAsync);
    return alloc_async(real_cuMemAllocAsync, NULL, dptr, bytesize, NULL, stream);
}

CGPU_EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream stream)
{
    ENSURE_CUDA(cuMemAllocAsync_ptsz);
    return alloc_async(real_cuMemAllocAsync_ptsz, NULL, dptr, bytesize, NULL, stream);
}

CGPU_EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize,
                                             CUmemoryPool pool, CUstream stream)
{
    ENSURE_CUDA(cuMemAllocFromPoolAsync);
    return alloc_async(NULL, real_cuMemAllocFromPoolAsync, dptr, bytesize, pool, stream);
}

CGPU_EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize,
                                                  CUmemoryPool pool, CUstream stream)
{
    ENSURE_CUDA(cuMemAllocFromPoolAsync_ptsz);
    return alloc_async(NULL, real_cuMemAllocFromPoolAsync_ptsz, dptr, bytesize, pool, stream);
}

CGPU_EXPORT CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream stream)
{
    ENSURE_CUDA(cuMemFreeAsync);
    RELEASE_TRACKED(CGPU_TRACK_PTR, dptr, real_cuMemFreeAsync(dptr, stream));
}

CGPU_EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream stream)
{
    ENSURE_CUDA(cuMemFreeAsync_ptsz);
    RELEASE_TRACKED(CGPU_TRACK_PTR, dptr, real_cuMemFreeAsync_ptsz(dptr, stream));
}

CGPU_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                                 const CUmemAllocationProp *prop, unsigned long long flags)
{
    ENSURE_CUDA(cuMemCreate);
    const struct cgpu_control *r = cgpu_region();
    if (r == NULL || prop == NULL || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return real_cuMemCreate(handle, size, prop, flags);
    int g = gpu_of_device(r, prop->location.id);
    CUresult rc = admit(g, size);
    if (rc != CUDA_SUCCESS)
        return rc;
    rc = real_cuMemCreate(handle, size, prop, flags);
    settle(rc, CGPU_TRACK_HANDLE, rc == CUDA_SUCCESS ? *handle : 0, size, g);
    return rc;
}

CGPU_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    ENSURE_CUDA(cuMemRelease);
    RELEASE_TRACKED(CGPU_TRACK_HANDLE, handle, real_cuMemRelease(handle));
}

static uint64_t array_bytes(size_t w, size_t h, size_t d, CUarray_format f, unsigned int ch)
{
    uint64_t n = (uint64_t)w * (h ? h : 1);
    n *= d ? d : 1;
    uint64_t elem = cgpu_array_format_bytes(f);
    return n * (ch ? ch : 1) * (elem ? elem : 4); /* formats not declared here: 4 bytes */
}

static CUresult array_create(CUarray *out, uint64_t size, const void *desc, int three_d)
{
    const struct cgpu_control *r = cgpu_region();
    CUresult rc;
#define CALL_ARRAY()                                                                             \
    (three_d ? real_cuArray3DCreate_v2(out, (const CUDA_ARRAY3D_DESCRIPTOR *)desc)               \
             : real_cuArrayCreate_v2(out, (const CUDA_ARRAY_DESCRIPTOR *)desc))
    if (r == NULL)
        return CALL_ARRAY();
    int g = current_gpu(r);
    rc = admit(g, size);
    if (rc != CUDA_SUCCESS)
        return rc;
    rc = CALL_ARRAY();
    settle(rc, CGPU_TRACK_ARRAY, rc == CUDA_SUCCESS ? (uint64_t)(uintptr_t)*out : 0, size, g);
    return rc;
#undef CALL_ARRAY
}

CGPU_EXPORT CUresult cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *desc)
{
    ENSURE_CUDA(cuArrayCreate_v2);
    if (desc == NULL)
        return real_cuArrayCreate_v2(pHandle, desc);
    return array_create(pHandle, array_bytes(desc->Width, desc->Height, 1, desc->Format,
                                             desc->NumChannels),
                        desc, 0);
}

CGPU_EXPORT CUresult cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *desc)
{
    ENSURE_CUDA(cuArray3DCreate_v2);
    ENSURE_CUDA(cuArrayCreate_v2);
    if (desc == NULL)
        return real_cuArray3DCreate_v2(pHandle, desc);
    return array_create(pHandle, array_bytes(desc->Width, desc->Height, desc->Depth,
                                             desc->Format, desc->NumChannels),
                        desc, 1);
}

CGPU_EXPORT CUresult cuArrayDestroy(CUarray hArray)
{
    ENSURE_CUDA(cuArrayDestroy);
    RELEASE_TRACKED(CGPU_TRACK_ARRAY, (uint64_t)(uintptr_t)hArray, real_cuArrayDestroy(hArray));
}

/* ------------------------------------------------------------------ */
/* Views of memory                                                    */
/* ------------------------------------------------------------------ */

/* Limit and free bytes of container GPU g; 0 when the GPU has no limit. */
static uint64_t view(const struct cgpu_control *r, int g, uint64_t *used, uint64_t *free_bytes)
{
    uint64_t limit = __atomic_load_n(&r->gpu[g].limit, __ATOMIC_RELAXED);
    cgpu_reclaim_dead(); /* processes that exited no longer count */
    *used = cgpu_usage(g);
    if (*used > limit)
        *used = limit;
    *free_bytes = limit - *used;
    return limit;
}

CGPU_EXPORT CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total)
{
    ENSURE_CUDA(cuMemGetInfo_v2);
    CUresult rc = real_cuMemGetInfo_v2(free_bytes, total);
    const struct cgpu_control *r = cgpu_region();
    if (rc != CUDA_SUCCESS || r == NULL)
        return rc;
    int g = current_gpu(r);
    uint64_t used, avail;
    if (g < 0 || view(r, g, &used, &avail) == 0)
        return rc;
    if (free_bytes != NULL && avail < *free_bytes)
        *free_bytes = avail;
    if (total != NULL)
        *total = r->gpu[g].limit;
    return rc;
}

CGPU_EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    ENSURE_CUDA(cuDeviceTotalMem_v2);
    CUresult rc = real_cuDeviceTotalMem_v2(bytes, dev);
    const struct cgpu_control *r = cgpu_region();
    if (rc != CUDA_SUCCESS || r == NULL || bytes == NULL)
        return rc;
    int g = gpu_of_device(r, dev);
    if (g >= 0 && r->gpu[g].limit != 0)
        *bytes = r->gpu[g].limit;
    return rc;
}

/* The container's view of NVML's memory figures of `device`, after the real
 * call succeeded: 1 with total (the limit), used and free filled in. */
static int nvml_view(nvmlDevice_t device, unsigned long long *total, unsigned long long *used,
                     unsigned long long *free_bytes)
{
    const struct cgpu_control *r = cgpu_region();
    if (r == NULL)
        return 0;
    int g = gpu_of_nvml(r, device);
    uint64_t in_use, avail;
    if (g < 0 || view(r, g, &in_use, &avail) == 0)
        return 0;
    *total = r->gpu[g].limit;
    *used = in_use;
    *free_bytes = avail;
    return 1;
}

CGPU_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    ENSURE_NVML(nvmlDeviceGetMemoryInfo);
    nvmlReturn_t rc = real_nvmlDeviceGetMemoryInfo(device, memory);
    if (rc == NVML_SUCCESS && memory != NULL)
        nvml_view(device, &memory->total, &memory->used, &memory->free);
    return rc;
}

CGPU_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    ENSURE_NVML(nvmlDeviceGetMemoryInfo_v2);
    nvmlReturn_t rc = real_nvmlDeviceGetMemoryInfo_v2(device, memory);
    if (rc == NVML_SUCCESS && memory != NULL &&
        nvml_view(device, &memory->total, &memory->used, &memory->free))
        memory->reserved = 0;
    return rc;
}

/* ------------------------------------------------------------------ */
/* Contexts: ctx_bytes charged while the process holds any context    */
/* ------------------------------------------------------------------ */

static pthread_mutex_t ctx_lock = PTHREAD_MUTEX_INITIALIZER;
static unsigned ctx_refs[CGPU_MAX_GPUS];      /* created + retained primary */
static unsigned primary_refs[CGPU_MAX_GPUS];  /* retained primary only */
static uint64_t ctx_charged[CGPU_MAX_GPUS];
static uint64_t measure_base[CGPU_MAX_GPUS]; /* NVML used before the first context */
static int measuring[CGPU_MAX_GPUS];          /* measure_base holds a reading */
static CUcontext primary_ctx[DEV_CACHE];      /* by device ordinal, as last retained */

void cgpu_hooks_after_fork(void)
{
    pthread_mutex_init(&ctx_lock, NULL);
    memset(ctx_refs, 0, sizeof ctx_refs);
    memset(primary_refs, 0, sizeof primary_refs);
    memset(ctx_charged, 0, sizeof ctx_charged);
    memset(measure_base, 0, sizeof measure_base);
    memset(measuring, 0, sizeof measuring);
    memset(primary_ctx, 0, sizeof primary_ctx);
    cgpu_flight_after_fork();
}

static void publish_contexts(int g)
{
    struct cgpu_proc *s = cgpu_slot_ptr;
    if (s != NULL)
        __atomic_store_n(&s->gpu[g].contexts, ctx_refs[g], __ATOMIC_RELAXED);
}

/* The device's used memory from the real NVML, by the container GPU's UUID
 * (else its host index): 1 with *used set, 0 when NVML cannot tell. */
static int nvml_used(const struct cgpu_control *r, int g, uint64_t *used)
{
    static int inited;
    resolve(LIB_NVML);
    if (real_nvmlInit_v2 == NULL || real_nvmlDeviceGetMemoryInfo == NULL)
        return 0;
    if (!__atomic_load_n(&inited, __ATOMIC_ACQUIRE)) {
        if (real_nvmlInit_v2() != NVML_SUCCESS)
            return 0;
        __atomic_store_n(&inited, 1, __ATOMIC_RELEASE);
    }
    nvmlDevice_t dev;
    nvmlReturn_t rc = r->gpu[g].uuid[0] != '\0' && real_nvmlDeviceGetHandleByUUID != NULL
                          ? real_nvmlDeviceGetHandleByUUID(r->gpu[g].uuid, &dev)
                      : real_nvmlDeviceGetHandleByIndex_v2 != NULL
                          ? real_nvmlDeviceGetHandleByIndex_v2(r->gpu[g].host_index, &dev)
                          : NVML_ERROR_FUNCTION_NOT_FOUND;
    nvmlMemory_t mem;
    if (rc != NVML_SUCCESS || real_nvmlDeviceGetMemoryInfo(dev, &mem) != NVML_SUCCESS)
        return 0;
    *used = mem.used;
    return 1;
}

/* A context's memory is measured as the device's used memory before and
 * after it is made; more than this is not a context (another process
 * allocated meanwhile) and is not charged. */
#define CTX_MEASURE_MAX (8ull << 30)

/* Before a context is created or retained on container GPU g. */
static CUresult ctx_acquire(const struct cgpu_control *r, int g, int primary)
{
    if (g < 0) {
        cgpu_log("this GPU is not assigned to the container; no context is created on it");
        return CUDA_ERROR_INVALID_DEVICE;
    }
    /* The slot before the context: the daemon stops a process that holds a
     * context without one (it bypassed libcgpu), and it looks for the slot
     * only after it saw the context. */
    (void)cgpu_slot();
    pthread_mutex_lock(&ctx_lock);
    if (ctx_refs[g] == 0) {
        uint64_t bytes = __atomic_load_n(&r->gpu[g].ctx_bytes, __ATOMIC_RELAXED);
        measuring[g] = 0;
        if (bytes == CGPU_CTX_MEASURE) {
            measuring[g] = nvml_used(r, g, &measure_base[g]);
            bytes = 0;
        }
        if (bytes != 0 && cgpu_reserve(g, bytes) != 0) {
            pthread_mutex_unlock(&ctx_lock);
            cgpu_over_limit(g, bytes);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        ctx_charged[g] = bytes;
    }
    ctx_refs[g]++;
    primary_refs[g] += primary ? 1 : 0;
    publish_contexts(g);
    pthread_mutex_unlock(&ctx_lock);
    return CUDA_SUCCESS;
}

/* After the context was made: charge what it measured. -1 when that is over
 * the limit (the caller undoes the context and fails with out of memory). */
static int ctx_settle(const struct cgpu_control *r, int g)
{
    pthread_mutex_lock(&ctx_lock);
    uint64_t base = measure_base[g], used, bytes = 0;
    if (measuring[g] && nvml_used(r, g, &used) && used > base && used - base <= CTX_MEASURE_MAX)
        bytes = used - base;
    measuring[g] = 0;
    int rc = 0;
    if (bytes != 0) {
        if (cgpu_reserve(g, bytes) == 0)
            ctx_charged[g] += bytes;
        else
            rc = -1;
    }
    struct cgpu_proc *s = cgpu_slot_ptr;
    if (s != NULL)
        __atomic_store_n(&s->gpu[g].ctx_bytes, ctx_charged[g], __ATOMIC_RELAXED);
    pthread_mutex_unlock(&ctx_lock);
    if (rc != 0)
        cgpu_over_limit(g, bytes); /* eGPU mode does not return */
    return rc;
}

static void ctx_drop(int g, unsigned n, int primary)
{
    if (g < 0)
        return;
    pthread_mutex_lock(&ctx_lock);
    if (primary)
        n = n < primary_refs[g] ? n : primary_refs[g];
    if (n > ctx_refs[g])
        n = ctx_refs[g];
    ctx_refs[g] -= n;
    if (primary)
        primary_refs[g] -= n;
    if (n > 0 && ctx_refs[g] == 0) {
        cgpu_unreserve(g, ctx_charged[g]);
        ctx_charged[g] = 0;
    }
    publish_contexts(g);
    pthread_mutex_unlock(&ctx_lock);
}

#define CTX_CREATE(realcall)                                                                     \
    do {                                                                                         \
        const struct cgpu_control *r = cgpu_region();                                            \
        if (r == NULL)                                                                           \
            return (realcall);                                                                   \
        int g = gpu_of_device(r, dev);                                                           \
        CUresult rc = ctx_acquire(r, g, 0);                                                      \
        if (rc != CUDA_SUCCESS)                                                                  \
            return rc;                                                                           \
        rc = (realcall);                                                                         \
        if (rc == CUDA_SUCCESS && ctx_settle(r, g) != 0) {                                       \
            real_cuCtxDestroy_v2(*pctx);                                                         \
            rc = CUDA_ERROR_OUT_OF_MEMORY;                                                       \
        }                                                                                        \
        if (rc == CUDA_SUCCESS)                                                                  \
            cgpu_track_put(CGPU_TRACK_CTX, (uint64_t)(uintptr_t)*pctx, 0, g);                    \
        else                                                                                     \
            ctx_drop(g, 1, 0);                                                                   \
        return rc;                                                                               \
    } while (0)

CGPU_EXPORT CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    ENSURE_CUDA(cuCtxCreate_v2);
    CTX_CREATE(real_cuCtxCreate_v2(pctx, flags, dev));
}

CGPU_EXPORT CUresult cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *params, int n,
                                    unsigned int flags, CUdevice dev)
{
    ENSURE_CUDA(cuCtxCreate_v3);
    CTX_CREATE(real_cuCtxCreate_v3(pctx, params, n, flags, dev));
}

CGPU_EXPORT CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *params,
                                    unsigned int flags, CUdevice dev)
{
    ENSURE_CUDA(cuCtxCreate_v4);
    CTX_CREATE(real_cuCtxCreate_v4(pctx, params, flags, dev));
}

static CUresult ctx_destroy(__typeof__(&cuCtxDestroy_v2) real, CUcontext ctx)
{
    uint64_t unused;
    int g = -1;
    int known = cgpu_region() != NULL &&
                cgpu_track_take(CGPU_TRACK_CTX, (uint64_t)(uintptr_t)ctx, &unused, &g);
    CUresult rc = real(ctx);
    if (rc == CUDA_SUCCESS)
        cgpu_flight_forget_ctx(ctx);
    if (known) {
        if (rc == CUDA_SUCCESS)
            ctx_drop(g, 1, 0);
        else
            cgpu_track_put(CGPU_TRACK_CTX, (uint64_t)(uintptr_t)ctx, 0, g);
    }
    return rc;
}

CGPU_EXPORT CUresult cuCtxDestroy_v2(CUcontext ctx)
{
    ENSURE_CUDA(cuCtxDestroy_v2);
    return ctx_destroy(real_cuCtxDestroy_v2, ctx);
}

CUresult cgpu_cuCtxDestroy_legacy(CUcontext ctx)
{
    ENSURE_CUDA(cuCtxDestroy_legacy);
    return ctx_destroy(real_cuCtxDestroy_legacy, ctx);
}

CUresult cgpu_cuCtxCreate_legacy(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    ENSURE_CUDA(cuCtxCreate_legacy);
    CTX_CREATE(real_cuCtxCreate_legacy(pctx, flags, dev));
}

CGPU_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    ENSURE_CUDA(cuDevicePrimaryCtxRetain);
    const struct cgpu_control *r = cgpu_region();
    if (r == NULL)
        return real_cuDevicePrimaryCtxRetain(pctx, dev);
    int g = gpu_of_device(r, dev);
    CUresult rc = ctx_acquire(r, g, 1);
    if (rc != CUDA_SUCCESS)
        return rc;
    rc = real_cuDevicePrimaryCtxRetain(pctx, dev);
    if (rc == CUDA_SUCCESS && ctx_settle(r, g) != 0) {
        real_cuDevicePrimaryCtxRelease_v2(dev);
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (rc != CUDA_SUCCESS)
        ctx_drop(g, 1, 1);
    else if (dev >= 0 && dev < DEV_CACHE && pctx != NULL)
        __atomic_store_n(&primary_ctx[dev], *pctx, __ATOMIC_RELAXED);
    return rc;
}

/* After a primary context release (n = 1) or reset (n = all). */
static CUresult primary_drop(CUresult rc, CUdevice dev, unsigned n)
{
    const struct cgpu_control *r = cgpu_region();
    if (rc != CUDA_SUCCESS || r == NULL)
        return rc;
    ctx_drop(gpu_of_device(r, dev), n, 1);
    /* the context is gone after a reset, or a release of the last reference */
    unsigned flags;
    int active = 0;
    if (dev >= 0 && dev < DEV_CACHE &&
        (n != 1 || real_cuDevicePrimaryCtxGetState == NULL ||
         real_cuDevicePrimaryCtxGetState(dev, &flags, &active) != CUDA_SUCCESS || !active))
        cgpu_flight_forget_ctx(__atomic_load_n(&primary_ctx[dev], __ATOMIC_RELAXED));
    return rc;
}

/* ------------------------------------------------------------------ */
/* Streams: a destroyed stream's in-flight entry serves the next one  */
/* ------------------------------------------------------------------ */

static CUresult stream_destroyed(CUresult rc, CUstream stream)
{
    if (rc == CUDA_SUCCESS && cgpu_region() != NULL)
        cgpu_flight_forget_stream(stream);
    return rc;
}

CGPU_EXPORT CUresult cuStreamDestroy_v2(CUstream stream)
{
    ENSURE_CUDA(cuStreamDestroy_v2);
    return stream_destroyed(real_cuStreamDestroy_v2(stream), stream);
}

CUresult cgpu_cuStreamDestroy_legacy(CUstream stream)
{
    ENSURE_CUDA(cuStreamDestroy_legacy);
    return stream_destroyed(real_cuStreamDestroy_legacy(stream), stream);
}

CGPU_EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)
{
    ENSURE_CUDA(cuDevicePrimaryCtxRelease_v2);
    return primary_drop(real_cuDevicePrimaryCtxRelease_v2(dev), dev, 1);
}

CUresult cgpu_cuDevicePrimaryCtxRelease_legacy(CUdevice dev)
{
    ENSURE_CUDA(cuDevicePrimaryCtxRelease_legacy);
    return primary_drop(real_cuDevicePrimaryCtxRelease_legacy(dev), dev, 1);
}

CGPU_EXPORT CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev)
{
    ENSURE_CUDA(cuDevicePrimaryCtxReset_v2);
    return primary_drop(real_cuDevicePrimaryCtxReset_v2(dev), dev, ~0u);
}

CUresult cgpu_cuDevicePrimaryCtxReset_legacy(CUdevice dev)
{
    ENSURE_CUDA(cuDevicePrimaryCtxReset_legacy);
    return primary_drop(real_cuDevicePrimaryCtxReset_legacy(dev), dev, ~0u);
}

/* ------------------------------------------------------------------ */
/* Launches: wait at the gate, count, bound what is queued            */
/* ------------------------------------------------------------------ */

/* The container GPU of a launch, or -1 when there is nothing to do (no
 * region, not one of the container's GPUs). */
static inline int launch_gpu(const struct cgpu_control **region)
{
    const struct cgpu_control *r = cgpu_region();
    *region = r;
    if (r == NULL)
        return -1;
    return r->ngpus > 1 ? current_gpu(r) : 0;
}

/* Gate, the real launch counted in progress, then the in-flight bound on its
 * stream (outside the launch: a drain must not wait for the bound's wait). */
#define LAUNCH(realcall, stream, ptsz)                                                           \
    do {                                                                                         \
        const struct cgpu_control *r_;                                                           \
        int g_ = launch_gpu(&r_);                                                                \
        if (g_ < 0)                                                                              \
            return (realcall);                                                                   \
        cgpu_launch_enter(r_, g_);                                                               \
        CUresult rc_ = (realcall);                                                               \
        struct flight *f_ = rc_ == CUDA_SUCCESS ? cgpu_flight_count(g_, (stream), (ptsz)) : NULL; \
        cgpu_launch_exit(g_);                                                                    \
        if (f_ != NULL)                                                                          \
            cgpu_flight_bound(f_, r_, g_);                                                       \
        return rc_;                                                                              \
    } while (0)

#define LAUNCH_ARGS                                                                              \
    CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,            \
        unsigned int by, unsigned int bz, unsigned int shmem, CUstream stream
#define LAUNCH_PASS f, gx, gy, gz, bx, by, bz, shmem, stream

CGPU_EXPORT CUresult cuLaunchKernel(LAUNCH_ARGS, void **params, void **extra)
{
    ENSURE_CUDA(cuLaunchKernel);
    LAUNCH(real_cuLaunchKernel(LAUNCH_PASS, params, extra), stream, 0);
}

CGPU_EXPORT CUresult cuLaunchKernel_ptsz(LAUNCH_ARGS, void **params, void **extra)
{
    ENSURE_CUDA(cuLaunchKernel_ptsz);
    LAUNCH(real_cuLaunchKernel_ptsz(LAUNCH_PASS, params, extra), stream, 1);
}

CGPU_EXPORT CUresult cuLaunchCooperativeKernel(LAUNCH_ARGS, void **params)
{
    ENSURE_CUDA(cuLaunchCooperativeKernel);
    LAUNCH(real_cuLaunchCooperativeKernel(LAUNCH_PASS, params), stream, 0);
}

CGPU_EXPORT CUresult cuLaunchCooperativeKernel_ptsz(LAUNCH_ARGS, void **params)
{
    ENSURE_CUDA(cuLaunchCooperativeKernel_ptsz);
    LAUNCH(real_cuLaunchCooperativeKernel_ptsz(LAUNCH_PASS, params), stream, 1);
}

CGPU_EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **params,
                                      void **extra)
{
    ENSURE_CUDA(cuLaunchKernelEx);
    LAUNCH(real_cuLaunchKernelEx(config, f, params, extra), config->hStream, 0);
}

CGPU_EXPORT CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f,
                                           void **params, void **extra)
{
    ENSURE_CUDA(cuLaunchKernelEx_ptsz);
    LAUNCH(real_cuLaunchKernelEx_ptsz(config, f, params, extra), config->hStream, 1);
}

CGPU_EXPORT CUresult cuGraphLaunch(CUgraphExec exec, CUstream stream)
{
    ENSURE_CUDA(cuGraphLaunch);
    LAUNCH(real_cuGraphLaunch(exec, stream), stream, 0);
}

CGPU_EXPORT CUresult cuGraphLaunch_ptsz(CUgraphExec exec, CUstream stream)
{
    ENSURE_CUDA(cuGraphLaunch_ptsz);
    LAUNCH(real_cuGraphLaunch_ptsz(exec, stream), stream, 1);
}

/* ------------------------------------------------------------------ */
/* cuGetProcAddress                                                   */
/* ------------------------------------------------------------------ */

CGPU_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion,
                                         cuuint64_t flags, CUdriverProcAddressQueryResult *status)
{
    ENSURE_CUDA(cuGetProcAddress_v2);
    CUresult rc = real_cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags, status);
    if (rc == CUDA_SUCCESS && pfn != NULL && cgpu_region() != NULL)
        *pfn = wrapper_for(*pfn);
    return rc;
}

CUresult cgpu_cuGetProcAddress_legacy(const char *symbol, void **pfn, int cudaVersion,
                                      cuuint64_t flags)
{
    if (real_cuGetProcAddress_legacy == NULL)
        resolve(LIB_CUDA);
    if (real_cuGetProcAddress_legacy == NULL)
        return cuda_missing("cuGetProcAddress");
    CUresult rc = real_cuGetProcAddress_legacy(symbol, pfn, cudaVersion, flags);
    if (rc == CUDA_SUCCESS && pfn != NULL && cgpu_region() != NULL)
        *pfn = wrapper_for(*pfn);
    return rc;
}
