/*
 * hooks.c: the interposed driver and NVML entry points.
 *
 * Every way in reaches the same wrappers (one table, CGPU_HOOKS below):
 *  - the exported symbols (programs linked against libcuda.so.1, LD_PRELOAD);
 *  - cuGetProcAddress / cuGetProcAddress_v2 (and so cudaGetDriverEntryPoint):
 *    the real driver answers; a pointer that is one of the real functions we
 *    wrap is swapped for its wrapper, and a name we wrap gets our wrapper of
 *    the variant its version and flags pick (by the table), whatever pointer
 *    the driver gave (a real driver may hand out entry points that no
 *    exported symbol names);
 *  - dlsym and dlvsym on a handle of libcuda or libnvidia-ml (the CUDA
 *    runtime, ctypes): the same swap by address. Both answer "dlsym" and
 *    "dlvsym" with libcgpu's own, on any handle and at any version, so that
 *    the C library's cannot be taken to look past the wrappers.
 * Calls that put work on the GPU (launches, device-side copies and sets) wait
 * at the gate and are counted (LAUNCH).
 *
 * A self-check (selfcheck) looks, at start and after objects were loaded,
 * whether each wrapped name still resolves to libcgpu in the global scope; an
 * object ahead of it that defines one (a library LD_PRELOAD names first, the
 * program itself) is reported in the process slot (`hijacked`) and logged.
 *
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
/* The wrapped functions: X(lib, name, proc, since, pt)               */
/* ------------------------------------------------------------------ */

/* name: the exported symbol. proc, since, pt: how cuGetProcAddress asks for
 * it: by the name `proc` (NULL: it does not), from CUDA version `since`, and
 * pt = 1 for the per-thread default stream variant (the _ptsz / _ptds names,
 * CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM). Of the variants of one proc
 * name, the one with the highest `since` not above the caller's version
 * answers, as the driver maps them (tests/gpu/procaddr_probe.c compares the
 * two on a real driver). */
#define LIB_CUDA 0
#define LIB_NVML 1

#define CGPU_HOOKS(X)                                                                            \
    X(LIB_CUDA, cuMemAlloc_v2, "cuMemAlloc", 3020, 0)                                            \
    X(LIB_CUDA, cuMemAllocPitch_v2, "cuMemAllocPitch", 3020, 0)                                  \
    X(LIB_CUDA, cuMemFree_v2, "cuMemFree", 3020, 0)                                              \
    X(LIB_CUDA, cuMemAllocManaged, "cuMemAllocManaged", 6000, 0)                                 \
    X(LIB_CUDA, cuMemAllocAsync, "cuMemAllocAsync", 11020, 0)                                    \
    X(LIB_CUDA, cuMemAllocAsync_ptsz, "cuMemAllocAsync", 11020, 1)                               \
    X(LIB_CUDA, cuMemAllocFromPoolAsync, "cuMemAllocFromPoolAsync", 11020, 0)                    \
    X(LIB_CUDA, cuMemAllocFromPoolAsync_ptsz, "cuMemAllocFromPoolAsync", 11020, 1)               \
    X(LIB_CUDA, cuMemFreeAsync, "cuMemFreeAsync", 11020, 0)                                      \
    X(LIB_CUDA, cuMemFreeAsync_ptsz, "cuMemFreeAsync", 11020, 1)                                 \
    X(LIB_CUDA, cuMemCreate, "cuMemCreate", 10020, 0)                                            \
    X(LIB_CUDA, cuMemRelease, "cuMemRelease", 10020, 0)                                          \
    X(LIB_CUDA, cuArrayCreate_v2, "cuArrayCreate", 3020, 0)                                      \
    X(LIB_CUDA, cuArray3DCreate_v2, "cuArray3DCreate", 3020, 0)                                  \
    X(LIB_CUDA, cuArrayDestroy, "cuArrayDestroy", 2000, 0)                                       \
    X(LIB_CUDA, cuMemGetInfo_v2, "cuMemGetInfo", 3020, 0)                                        \
    X(LIB_CUDA, cuDeviceTotalMem_v2, "cuDeviceTotalMem", 3020, 0)                                \
    X(LIB_CUDA, cuCtxCreate_v2, "cuCtxCreate", 3020, 0)                                          \
    X(LIB_CUDA, cuCtxCreate_v3, "cuCtxCreate", 11040, 0)                                         \
    X(LIB_CUDA, cuCtxCreate_v4, "cuCtxCreate", 12050, 0)                                         \
    X(LIB_CUDA, cuCtxDestroy_v2, "cuCtxDestroy", 4000, 0)                                        \
    X(LIB_CUDA, cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", 7000, 0)                   \
    X(LIB_CUDA, cuDevicePrimaryCtxRelease_v2, "cuDevicePrimaryCtxRelease", 11000, 0)             \
    X(LIB_CUDA, cuDevicePrimaryCtxReset_v2, "cuDevicePrimaryCtxReset", 11000, 0)                 \
    X(LIB_CUDA, cuStreamDestroy_v2, "cuStreamDestroy", 4000, 0)                                  \
    X(LIB_CUDA, cuLaunchKernel, "cuLaunchKernel", 4000, 0)                                       \
    X(LIB_CUDA, cuLaunchKernel_ptsz, "cuLaunchKernel", 7000, 1)                                  \
    X(LIB_CUDA, cuLaunchKernelEx, "cuLaunchKernelEx", 11060, 0)                                  \
    X(LIB_CUDA, cuLaunchKernelEx_ptsz, "cuLaunchKernelEx", 11060, 1)                             \
    X(LIB_CUDA, cuLaunchCooperativeKernel, "cuLaunchCooperativeKernel", 9000, 0)                 \
    X(LIB_CUDA, cuLaunchCooperativeKernel_ptsz, "cuLaunchCooperativeKernel", 9000, 1)            \
    X(LIB_CUDA, cuLaunchCooperativeKernelMultiDevice, "cuLaunchCooperativeKernelMultiDevice",    \
      9000, 0)                                                                                   \
    X(LIB_CUDA, cuLaunch, "cuLaunch", 2000, 0)                                                   \
    X(LIB_CUDA, cuLaunchGrid, "cuLaunchGrid", 2000, 0)                                           \
    X(LIB_CUDA, cuLaunchGridAsync, "cuLaunchGridAsync", 2000, 0)                                 \
    X(LIB_CUDA, cuGraphLaunch, "cuGraphLaunch", 10000, 0)                                        \
    X(LIB_CUDA, cuGraphLaunch_ptsz, "cuGraphLaunch", 10000, 1)                                   \
    X(LIB_CUDA, cuMemcpy, "cuMemcpy", 4000, 0)                                                   \
    X(LIB_CUDA, cuMemcpy_ptds, "cuMemcpy", 7000, 1)                                              \
    X(LIB_CUDA, cuMemcpyAsync, "cuMemcpyAsync", 4000, 0)                                         \
    X(LIB_CUDA, cuMemcpyAsync_ptsz, "cuMemcpyAsync", 7000, 1)                                    \
    X(LIB_CUDA, cuMemcpyDtoD_v2, "cuMemcpyDtoD", 3020, 0)                                        \
    X(LIB_CUDA, cuMemcpyDtoD_v2_ptds, "cuMemcpyDtoD", 7000, 1)                                   \
    X(LIB_CUDA, cuMemcpyDtoDAsync_v2, "cuMemcpyDtoDAsync", 3020, 0)                              \
    X(LIB_CUDA, cuMemcpyDtoDAsync_v2_ptsz, "cuMemcpyDtoDAsync", 7000, 1)                         \
    X(LIB_CUDA, cuMemcpy2D_v2, "cuMemcpy2D", 3020, 0)                                            \
    X(LIB_CUDA, cuMemcpy2D_v2_ptds, "cuMemcpy2D", 7000, 1)                                       \
    X(LIB_CUDA, cuMemcpy2DUnaligned_v2, "cuMemcpy2DUnaligned", 3020, 0)                          \
    X(LIB_CUDA, cuMemcpy2DUnaligned_v2_ptds, "cuMemcpy2DUnaligned", 7000, 1)                     \
    X(LIB_CUDA, cuMemcpy2DAsync_v2, "cuMemcpy2DAsync", 3020, 0)                                  \
    X(LIB_CUDA, cuMemcpy2DAsync_v2_ptsz, "cuMemcpy2DAsync", 7000, 1)                             \
    X(LIB_CUDA, cuMemcpy3D_v2, "cuMemcpy3D", 3020, 0)                                            \
    X(LIB_CUDA, cuMemcpy3D_v2_ptds, "cuMemcpy3D", 7000, 1)                                       \
    X(LIB_CUDA, cuMemcpy3DAsync_v2, "cuMemcpy3DAsync", 3020, 0)                                  \
    X(LIB_CUDA, cuMemcpy3DAsync_v2_ptsz, "cuMemcpy3DAsync", 7000, 1)                             \
    X(LIB_CUDA, cuMemcpyPeer, "cuMemcpyPeer", 4000, 0)                                           \
    X(LIB_CUDA, cuMemcpyPeer_ptds, "cuMemcpyPeer", 7000, 1)                                      \
    X(LIB_CUDA, cuMemcpyPeerAsync, "cuMemcpyPeerAsync", 4000, 0)                                 \
    X(LIB_CUDA, cuMemcpyPeerAsync_ptsz, "cuMemcpyPeerAsync", 7000, 1)                            \
    X(LIB_CUDA, cuMemcpy3DPeer, "cuMemcpy3DPeer", 4000, 0)                                       \
    X(LIB_CUDA, cuMemcpy3DPeer_ptds, "cuMemcpy3DPeer", 7000, 1)                                  \
    X(LIB_CUDA, cuMemcpy3DPeerAsync, "cuMemcpy3DPeerAsync", 4000, 0)                             \
    X(LIB_CUDA, cuMemcpy3DPeerAsync_ptsz, "cuMemcpy3DPeerAsync", 7000, 1)                        \
    CGPU_SET_HOOKS(X, 8)                                                                         \
    CGPU_SET_HOOKS(X, 16)                                                                        \
    CGPU_SET_HOOKS(X, 32)                                                                        \
    X(LIB_CUDA, cuGetProcAddress_v2, "cuGetProcAddress", 12000, 0)                               \
    X(LIB_NVML, nvmlDeviceGetMemoryInfo, NULL, 0, 0)                                             \
    X(LIB_NVML, nvmlDeviceGetMemoryInfo_v2, NULL, 0, 0)

/* The sets of one element size: 1D and 2D, synchronous and stream-ordered. */
#define CGPU_SET_HOOKS(X, bits)                                                                  \
    X(LIB_CUDA, cuMemsetD##bits##_v2, "cuMemsetD" #bits, 3020, 0)                               \
    X(LIB_CUDA, cuMemsetD##bits##_v2_ptds, "cuMemsetD" #bits, 7000, 1)                          \
    X(LIB_CUDA, cuMemsetD##bits##Async, "cuMemsetD" #bits "Async", 3020, 0)                     \
    X(LIB_CUDA, cuMemsetD##bits##Async_ptsz, "cuMemsetD" #bits "Async", 7000, 1)                \
    X(LIB_CUDA, cuMemsetD2D##bits##_v2, "cuMemsetD2D" #bits, 3020, 0)                           \
    X(LIB_CUDA, cuMemsetD2D##bits##_v2_ptds, "cuMemsetD2D" #bits, 7000, 1)                      \
    X(LIB_CUDA, cuMemsetD2D##bits##Async, "cuMemsetD2D" #bits "Async", 3020, 0)                 \
    X(LIB_CUDA, cuMemsetD2D##bits##Async_ptsz, "cuMemsetD2D" #bits "Async", 7000, 1)

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

#define DECLARE_REAL(lib, name, proc, since, pt) static __typeof__(&name) real_##name;
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
    const char *proc; /* cuGetProcAddress's name for it, or NULL */
    int since;        /* from this CUDA version */
    int pt;           /* the per-thread default stream variant */
};

/* Resolved in the real library only (libcgpu calls it), not wrapped. */
#define RESOLVED(name, real, lib) {name, NULL, (void **)(real), lib, NULL, 0, 0}
#define HOOK_ENTRY(lib, name, proc, since, pt)                                                   \
    {#name, (void *)&name, (void **)&real_##name, lib, proc, since, pt},
static struct hook hooks[] = {
    CGPU_HOOKS(HOOK_ENTRY)
    /* the unversioned exports, which older versions' callers get */
    {"cuGetProcAddress", (void *)&cgpu_cuGetProcAddress_legacy,
     (void **)&real_cuGetProcAddress_legacy, LIB_CUDA, "cuGetProcAddress", 11030, 0},
    {"cuCtxCreate", (void *)&cgpu_cuCtxCreate_legacy, (void **)&real_cuCtxCreate_legacy, LIB_CUDA,
     "cuCtxCreate", 2000, 0},
    {"cuCtxDestroy", (void *)&cgpu_cuCtxDestroy_legacy, (void **)&real_cuCtxDestroy_legacy,
     LIB_CUDA, "cuCtxDestroy", 2000, 0},
    {"cuDevicePrimaryCtxRelease", (void *)&cgpu_cuDevicePrimaryCtxRelease_legacy,
     (void **)&real_cuDevicePrimaryCtxRelease_legacy, LIB_CUDA, "cuDevicePrimaryCtxRelease", 7000,
     0},
    {"cuDevicePrimaryCtxReset", (void *)&cgpu_cuDevicePrimaryCtxReset_legacy,
     (void **)&real_cuDevicePrimaryCtxReset_legacy, LIB_CUDA, "cuDevicePrimaryCtxReset", 7000, 0},
    {"cuStreamDestroy", (void *)&cgpu_cuStreamDestroy_legacy, (void **)&real_cuStreamDestroy_legacy,
     LIB_CUDA, "cuStreamDestroy", 2000, 0},
    RESOLVED("cuCtxGetDevice", &real_cuCtxGetDevice, LIB_CUDA),
    RESOLVED("cuDeviceGetUuid_v2", &real_cuDeviceGetUuid_v2, LIB_CUDA),
    RESOLVED("cuDevicePrimaryCtxGetState", &real_cuDevicePrimaryCtxGetState, LIB_CUDA),
    RESOLVED("cuCtxGetCurrent", &cgpu_flight_cu.ctx_get_current, LIB_CUDA),
    RESOLVED("cuEventCreate", &cgpu_flight_cu.event_create, LIB_CUDA),
    RESOLVED("cuEventRecord", &cgpu_flight_cu.event_record, LIB_CUDA),
    RESOLVED("cuEventSynchronize", &cgpu_flight_cu.event_synchronize, LIB_CUDA),
    RESOLVED("cuEventQuery", &cgpu_flight_cu.event_query, LIB_CUDA),
    RESOLVED("cuStreamIsCapturing", &cgpu_flight_cu.stream_is_capturing, LIB_CUDA),
    RESOLVED("cuCtxPushCurrent_v2", &cgpu_flight_cu.ctx_push, LIB_CUDA),
    RESOLVED("cuCtxPopCurrent_v2", &cgpu_flight_cu.ctx_pop, LIB_CUDA),
    RESOLVED("cuThreadExchangeStreamCaptureMode", &cgpu_flight_cu.exchange_capture_mode, LIB_CUDA),
    RESOLVED("nvmlDeviceGetUUID", &real_nvmlDeviceGetUUID, LIB_NVML),
    RESOLVED("nvmlInit_v2", &real_nvmlInit_v2, LIB_NVML),
    RESOLVED("nvmlDeviceGetHandleByUUID", &real_nvmlDeviceGetHandleByUUID, LIB_NVML),
    RESOLVED("nvmlDeviceGetHandleByIndex_v2", &real_nvmlDeviceGetHandleByIndex_v2, LIB_NVML),
    RESOLVED("nvmlDeviceGetIndex", &real_nvmlDeviceGetIndex, LIB_NVML),
};
#define NHOOKS (sizeof hooks / sizeof hooks[0])

/* ------------------------------------------------------------------ */
/* Finding the real libraries                                         */
/* ------------------------------------------------------------------ */

typedef void *(*dlsym_fn)(void *, const char *);
typedef void *(*dlvsym_fn)(void *, const char *, const char *);
static dlsym_fn real_dlsym;
static dlvsym_fn real_dlvsym;
static __thread int in_resolve;

/* The address of the default version of `name` defined in the object behind
 * `handle`, read from its dynamic symbol table: libcgpu defines dlsym and
 * dlvsym itself, and -Bsymbolic binds its own calls to those, so the C
 * library's are found the way the loader would find them. */
static void *elf_default_symbol(void *handle, const char *name)
{
    struct link_map *lm = NULL;
    if (dlinfo(handle, RTLD_DI_LINKMAP, &lm) != 0 || lm == NULL || lm->l_ld == NULL)
        return NULL;
    const ElfW(Sym) *symtab = NULL;
    const char *strtab = NULL;
    const uint32_t *gnu = NULL, *sysv = NULL;
    const ElfW(Half) *versym = NULL;
    for (const ElfW(Dyn) *d = lm->l_ld; d->d_tag != DT_NULL; d++) {
        uintptr_t at = (uintptr_t)d->d_un.d_ptr;
        if (at < lm->l_addr)
            at += lm->l_addr; /* a read-only dynamic section, left unrelocated */
        switch (d->d_tag) {
        case DT_SYMTAB:
            symtab = (const ElfW(Sym) *)at;
            break;
        case DT_STRTAB:
            strtab = (const char *)at;
            break;
        case DT_GNU_HASH:
            gnu = (const uint32_t *)at;
            break;
        case DT_HASH:
            sysv = (const uint32_t *)at;
            break;
        case DT_VERSYM:
            versym = (const ElfW(Half) *)at;
            break;
        }
    }
    if (symtab == NULL || strtab == NULL)
        return NULL;
#define ELF_MATCH(i)                                                                             \
    (symtab[i].st_shndx != SHN_UNDEF && symtab[i].st_value != 0 &&                               \
     (symtab[i].st_info & 0xf) == STT_FUNC && (versym == NULL || !(versym[i] & 0x8000)) && \
     strcmp(strtab + symtab[i].st_name, name) == 0)
    if (gnu != NULL) {
        uint32_t h = 5381;
        for (const unsigned char *c = (const unsigned char *)name; *c; c++)
            h = h * 33 + *c;
        uint32_t nbuckets = gnu[0], symoffset = gnu[1], bloom_words = gnu[2];
        const uint32_t *buckets = (const uint32_t *)((const ElfW(Addr) *)&gnu[4] + bloom_words);
        const uint32_t *chain = buckets + nbuckets;
        for (uint32_t i = nbuckets ? buckets[h % nbuckets] : 0; i >= symoffset && i != 0; i++) {
            uint32_t link = chain[i - symoffset];
            if ((link | 1) == (h | 1) && ELF_MATCH(i))
                return (void *)(lm->l_addr + symtab[i].st_value);
            if (link & 1)
                break;
        }
    } else if (sysv != NULL) {
        uint32_t h = 0;
        for (const unsigned char *c = (const unsigned char *)name; *c; c++) {
            h = (h << 4) + *c;
            uint32_t high = h & 0xf0000000u;
            h ^= high >> 24;
            h &= ~high;
        }
        uint32_t nbuckets = sysv[0];
        const uint32_t *buckets = &sysv[2], *chain = buckets + nbuckets;
        for (uint32_t i = nbuckets ? buckets[h % nbuckets] : 0; i != STN_UNDEF; i = chain[i])
            if (ELF_MATCH(i))
                return (void *)(lm->l_addr + symtab[i].st_value);
    }
#undef ELF_MATCH
    return NULL;
}

static pthread_once_t libdl_once = PTHREAD_ONCE_INIT;

/* The C library's dlsym and dlvsym (glibc 2.34 and later: libc.so.6; before:
 * libdl.so.2, which libcgpu links). */
static void find_libdl(void)
{
    static const char *const libs[] = {"libc.so.6", "libdl.so.2"};
    void *ds = NULL, *dvs = NULL;
    for (size_t i = 0; i < sizeof libs / sizeof *libs; i++) {
        void *h = dlopen(libs[i], RTLD_LAZY | RTLD_NOLOAD);
        if (h == NULL)
            continue;
        if (ds == NULL)
            ds = elf_default_symbol(h, "dlsym");
        if (dvs == NULL)
            dvs = elf_default_symbol(h, "dlvsym");
    }
    if (ds == NULL) {
        cgpu_log("cannot find the C library's dlsym; aborting");
        abort();
    }
    __atomic_store_n(&real_dlvsym, (dlvsym_fn)dvs, __ATOMIC_RELEASE);
    __atomic_store_n(&real_dlsym, (dlsym_fn)ds, __ATOMIC_RELEASE);
}

static dlsym_fn get_real_dlsym(void)
{
    dlsym_fn f = __atomic_load_n(&real_dlsym, __ATOMIC_ACQUIRE);
    if (cgpu_likely(f != NULL))
        return f;
    pthread_once(&libdl_once, find_libdl);
    return real_dlsym;
}

/* NULL where the C library has none. */
static dlvsym_fn get_real_dlvsym(void)
{
    (void)get_real_dlsym();
    return __atomic_load_n(&real_dlvsym, __ATOMIC_ACQUIRE);
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

/* The wrapper standing for a real function pointer, or the pointer itself.
 * Where one function has several names (aliases), a variant of `proc`
 * (cuGetProcAddress's name, or NULL) is preferred. */
static void *wrapper_of(void *real_fn, const char *proc)
{
    void *found = real_fn;
    if (real_fn == NULL)
        return NULL;
    for (size_t i = 0; i < NHOOKS; i++)
        if (hooks[i].wrapper != NULL &&
            __atomic_load_n(hooks[i].real, __ATOMIC_ACQUIRE) == real_fn) {
            if (proc == NULL || (hooks[i].proc != NULL && strcmp(hooks[i].proc, proc) == 0))
                return hooks[i].wrapper;
            if (found == real_fn)
                found = hooks[i].wrapper;
        }
    return found;
}

static void *wrapper_for(void *real_fn)
{
    return wrapper_of(real_fn, NULL);
}

static const struct hook *hook_named(const char *name)
{
    for (size_t i = 0; i < NHOOKS; i++)
        if (hooks[i].wrapper != NULL && strcmp(hooks[i].name, name) == 0)
            return &hooks[i];
    return NULL;
}

/* The wrapper cuGetProcAddress hands out for `symbol` at `version` with
 * `flags`, by the table: of the variants named `symbol` that the driver
 * exports, the newest the version has, the per-thread one where the flags ask
 * for it and there is one. NULL when we wrap no variant of that name, or none
 * the version and the driver have; *family says whether we wrap any. */
static const struct hook *hook_for_proc(const char *symbol, int version, cuuint64_t flags,
                                        int *family)
{
    int pt = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;
    const struct hook *best = NULL;
    *family = 0;
    for (size_t i = 0; i < NHOOKS; i++) {
        const struct hook *h = &hooks[i];
        if (h->wrapper == NULL || h->proc == NULL || strcmp(h->proc, symbol) != 0)
            continue;
        *family = 1;
        if (h->since > version || (h->pt && !pt) ||
            __atomic_load_n(h->real, __ATOMIC_ACQUIRE) == NULL) /* a variant this driver lacks */
            continue;
        if (best == NULL || h->since > best->since || (h->since == best->since && h->pt))
            best = h;
    }
    return best;
}

/* ------------------------------------------------------------------ */
/* Self-check: every wrapped name resolves to libcgpu                 */
/* ------------------------------------------------------------------ */

/* libcgpu's own link map when it is preloaded (LD_PRELOAD, ld.so.preload):
 * loaded ahead of the C library, so that only the program and the objects
 * preloaded before it come before it in the global scope, in the order of the
 * loader's list. NULL otherwise (opened later with dlopen, libcgpu is no
 * wrapper of anything there, and nothing is taken from it). */
static struct link_map *preloaded_self(void)
{
    Dl_info info;
    struct link_map *self = NULL, *libc = NULL;
    void *h = dlopen("libc.so.6", RTLD_LAZY | RTLD_NOLOAD);
    if (h == NULL || dlinfo(h, RTLD_DI_LINKMAP, &libc) != 0 || libc == NULL ||
        dladdr1((const void *)&preloaded_self, &info, (void **)&self, RTLD_DL_LINKMAP) == 0 ||
        self == NULL)
        self = NULL;
    if (h != NULL)
        dlclose(h);
    for (const struct link_map *m = self != NULL ? self->l_next : NULL; m != NULL; m = m->l_next)
        if (m == libc)
            return self;
    return NULL;
}

/* Whether `at` lies in an object ahead of `self` in the loader's list. */
static int ahead_of(const struct link_map *self, const void *at)
{
    Dl_info info;
    struct link_map *other = NULL;
    if (dladdr1(at, &info, (void **)&other, RTLD_DL_LINKMAP) == 0 || other == NULL)
        return 0;
    for (const struct link_map *m = self->l_prev; m != NULL; m = m->l_prev)
        if (m == other)
            return 1;
    return 0;
}

/* How many of libcgpu's entry points (each wrapper, dlsym, dlvsym) a lookup in
 * the global scope finds in an object ahead of libcgpu, which then takes the
 * program's calls by that name (0 when libcgpu is not preloaded). The first
 * few are named in `why`. */
static uint64_t count_hijacked(char *why, size_t len)
{
    dlsym_fn ds = get_real_dlsym();
    /* Through the program's handle, which searches the global scope in its
     * order: RTLD_DEFAULT would search libcgpu's own scope, where -Bsymbolic
     * puts libcgpu first. */
    struct link_map *self = preloaded_self();
    void *program = self != NULL ? dlopen(NULL, RTLD_LAZY) : NULL;
    if (program == NULL)
        return 0;
    uint64_t n = 0;
    size_t used = 0;
    why[0] = '\0';
    for (size_t i = 0; i < NHOOKS + 2; i++) {
        const char *name;
        void *own;
        if (i < NHOOKS) {
            if (hooks[i].wrapper == NULL)
                continue;
            name = hooks[i].name;
            own = hooks[i].wrapper;
        } else {
            name = i == NHOOKS ? "dlsym" : "dlvsym";
            own = i == NHOOKS ? (void *)&dlsym : (void *)&dlvsym;
        }
        void *found = ds(program, name);
        if (found == NULL || found == own || !ahead_of(self, found))
            continue;
        if (n++ < 3 && used + 1 < len) {
            Dl_info info;
            const char *where = dladdr(found, &info) != 0 && info.dli_fname != NULL &&
                                        info.dli_fname[0] != '\0'
                                    ? info.dli_fname
                                    : "the program";
            int w = snprintf(why + used, len - used, "%s%s in %s", used ? ", " : "", name, where);
            used = w < 0 ? used : used + (size_t)w < len ? used + (size_t)w : len - 1;
        }
    }
    dlclose(program);
    return n;
}

static pthread_mutex_t check_lock = PTHREAD_MUTEX_INITIALIZER;
static int checked;                    /* a check ran */
static unsigned long long checked_adds; /* objects loaded so far, at that check */
static uint64_t hijacked_said;

static int objects_loaded(struct dl_phdr_info *info, size_t size, void *data)
{
    if (size >= offsetof(struct dl_phdr_info, dlpi_adds) + sizeof info->dlpi_adds)
        *(unsigned long long *)data = info->dlpi_adds;
    return 1; /* the first object says it for all */
}

/* At start, and at the next lookup after an object was loaded (the loader's
 * count of loads moved): look again, report a change in the process slot
 * (region.c) and in one line on stderr. A thread that finds another one
 * checking goes on: the other may wait for the loader's lock, which this one
 * may hold (a constructor that looks a name up while dlopen runs it). */
static void selfcheck(void)
{
    unsigned long long adds = 0;
    dl_iterate_phdr(objects_loaded, &adds);
    if (__atomic_load_n(&checked, __ATOMIC_ACQUIRE) &&
        (adds == 0 || adds == __atomic_load_n(&checked_adds, __ATOMIC_RELAXED)))
        return; /* nothing new (0: the loader does not count, looked at once) */
    if (pthread_mutex_trylock(&check_lock) != 0)
        return;
    if (!checked || (adds != 0 && adds != checked_adds)) {
        char why[256];
        uint64_t n = count_hijacked(why, sizeof why);
        __atomic_store_n(&checked_adds, adds, __ATOMIC_RELAXED);
        __atomic_store_n(&checked, 1, __ATOMIC_RELEASE);
        if (n != hijacked_said) {
            hijacked_said = n;
            if (n != 0)
                cgpu_log("%llu of libcgpu's entry points resolve to other code first (%s%s): "
                         "calls by those names can bypass its limits and gate; reported to the "
                         "daemon",
                         (unsigned long long)n, why, n > 3 ? ", ..." : "");
            cgpu_report_hijacked(n);
        }
    }
    pthread_mutex_unlock(&check_lock);
}

__attribute__((constructor)) static void hooks_start(void)
{
    selfcheck();
}

/* ------------------------------------------------------------------ */
/* dlsym and dlvsym                                                   */
/* ------------------------------------------------------------------ */

/* RTLD_NEXT is relative to the caller (glibc takes it from the return
 * address, which would be ours), so search the objects loaded after the
 * caller ourselves, each through a proper handle. version: dlvsym's, or NULL
 * for dlsym. */
static void *lookup_next(const void *caller, const char *name, const char *version)
{
    Dl_info info;
    struct link_map *lm = NULL;
    if (dladdr1(caller, &info, (void **)&lm, RTLD_DL_LINKMAP) == 0 || lm == NULL)
        return NULL;
    dlsym_fn ds = get_real_dlsym();
    dlvsym_fn dvs = get_real_dlvsym();
    if (version != NULL && dvs == NULL)
        return NULL;
    for (lm = lm->l_next; lm != NULL; lm = lm->l_next) {
        if (lm->l_name == NULL || lm->l_name[0] == '\0')
            continue;
        void *h = dlopen(lm->l_name, RTLD_LAZY | RTLD_NOLOAD);
        if (h == NULL)
            continue; /* the vDSO */
        void *p = version != NULL ? dvs(h, name, version) : ds(h, name);
        dlclose(h);
        if (p != NULL)
            return p;
    }
    return NULL;
}

/* What dlsym and dlvsym hand out for `name`, found at p: libcgpu's own dlsym
 * and dlvsym for those names (from any object, at any version: the C
 * library's would look past every wrapper), a wrapper for a real function we
 * wrap, else p. */
static void *lookup_answer(const char *name, void *p)
{
    if (p == NULL)
        return NULL;
    if (name[0] == 'd' || name[0] == '_') {
        if (strcmp(name, "dlsym") == 0 || strcmp(name, "__libc_dlsym") == 0)
            return (void *)&dlsym;
        if (strcmp(name, "dlvsym") == 0 || strcmp(name, "__libc_dlvsym") == 0)
            return (void *)&dlvsym;
        return p;
    }
    if ((name[0] != 'c' && name[0] != 'n') || in_resolve)
        return p;
    const struct hook *h = hook_named(name);
    if (h == NULL || cgpu_region() == NULL)
        return p;
    resolve(h->lib);
    if (__atomic_load_n(h->real, __ATOMIC_ACQUIRE) == p)
        return h->wrapper; /* the wrapper of that name, where names alias */
    return wrapper_for(p);
}

CGPU_EXPORT void *dlsym(void *restrict handle, const char *restrict name)
{
    void *p = handle == RTLD_NEXT ? lookup_next(__builtin_return_address(0), name, NULL)
                                  : get_real_dlsym()(handle, name);
    if (!in_resolve)
        selfcheck();
    return lookup_answer(name, p);
}

CGPU_EXPORT void *dlvsym(void *restrict handle, const char *restrict name,
                         const char *restrict version)
{
    void *p;
    if (handle == RTLD_NEXT) {
        p = lookup_next(__builtin_return_address(0), name, version);
    } else {
        dlvsym_fn dvs = get_real_dlvsym();
        p = dvs != NULL ? dvs(handle, name, version) : NULL;
    }
    if (!in_resolve)
        selfcheck();
    return lookup_answer(name, p);
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
    pthread_mutex_init(&check_lock, NULL); /* a thread that checked at the fork is gone */
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

/* The launches of CUDA 2 (deprecated, still exported): on the legacy stream,
 * or cuLaunchGridAsync's. */
CGPU_EXPORT CUresult cuLaunch(CUfunction f)
{
    ENSURE_CUDA(cuLaunch);
    LAUNCH(real_cuLaunch(f), NULL, 0);
}

CGPU_EXPORT CUresult cuLaunchGrid(CUfunction f, int grid_width, int grid_height)
{
    ENSURE_CUDA(cuLaunchGrid);
    LAUNCH(real_cuLaunchGrid(f, grid_width, grid_height), NULL, 0);
}

CGPU_EXPORT CUresult cuLaunchGridAsync(CUfunction f, int grid_width, int grid_height,
                                       CUstream stream)
{
    ENSURE_CUDA(cuLaunchGridAsync);
    LAUNCH(real_cuLaunchGridAsync(f, grid_width, grid_height, stream), stream, 0);
}

/* One kernel per device on streams of several contexts: gated and counted on
 * the current context's GPU as one launch; its streams are not bounded. */
CGPU_EXPORT CUresult cuLaunchCooperativeKernelMultiDevice(CUDA_LAUNCH_PARAMS *list,
                                                          unsigned int numDevices,
                                                          unsigned int flags)
{
    ENSURE_CUDA(cuLaunchCooperativeKernelMultiDevice);
    const struct cgpu_control *r;
    int g = launch_gpu(&r);
    if (g < 0)
        return real_cuLaunchCooperativeKernelMultiDevice(list, numDevices, flags);
    cgpu_launch_enter(r, g);
    CUresult rc = real_cuLaunchCooperativeKernelMultiDevice(list, numDevices, flags);
    cgpu_launch_exit(g);
    return rc;
}

/* Copies and sets the GPU runs (device to device, generic, 2D, 3D, peer) are
 * launches: the gate, the count, the in-flight bound of their stream (the
 * synchronous forms: the legacy stream, or with _ptds the thread's). Copies
 * from and to the host are not gated. */
#define GATED(name, params, args, stream, ptsz)                                                  \
    CGPU_EXPORT CUresult name params                                                             \
    {                                                                                            \
        ENSURE_CUDA(name);                                                                       \
        LAUNCH(real_##name args, stream, ptsz);                                                  \
    }

#define COPY_ARGS CUdeviceptr dst, CUdeviceptr src, size_t n
#define PEER_ARGS CUdeviceptr dst, CUcontext dctx, CUdeviceptr src, CUcontext sctx, size_t n
GATED(cuMemcpy, (COPY_ARGS), (dst, src, n), NULL, 0)
GATED(cuMemcpy_ptds, (COPY_ARGS), (dst, src, n), NULL, 1)
GATED(cuMemcpyAsync, (COPY_ARGS, CUstream s), (dst, src, n, s), s, 0)
GATED(cuMemcpyAsync_ptsz, (COPY_ARGS, CUstream s), (dst, src, n, s), s, 1)
GATED(cuMemcpyDtoD_v2, (COPY_ARGS), (dst, src, n), NULL, 0)
GATED(cuMemcpyDtoD_v2_ptds, (COPY_ARGS), (dst, src, n), NULL, 1)
GATED(cuMemcpyDtoDAsync_v2, (COPY_ARGS, CUstream s), (dst, src, n, s), s, 0)
GATED(cuMemcpyDtoDAsync_v2_ptsz, (COPY_ARGS, CUstream s), (dst, src, n, s), s, 1)
GATED(cuMemcpy2D_v2, (const CUDA_MEMCPY2D *c), (c), NULL, 0)
GATED(cuMemcpy2D_v2_ptds, (const CUDA_MEMCPY2D *c), (c), NULL, 1)
GATED(cuMemcpy2DUnaligned_v2, (const CUDA_MEMCPY2D *c), (c), NULL, 0)
GATED(cuMemcpy2DUnaligned_v2_ptds, (const CUDA_MEMCPY2D *c), (c), NULL, 1)
GATED(cuMemcpy2DAsync_v2, (const CUDA_MEMCPY2D *c, CUstream s), (c, s), s, 0)
GATED(cuMemcpy2DAsync_v2_ptsz, (const CUDA_MEMCPY2D *c, CUstream s), (c, s), s, 1)
GATED(cuMemcpy3D_v2, (const CUDA_MEMCPY3D *c), (c), NULL, 0)
GATED(cuMemcpy3D_v2_ptds, (const CUDA_MEMCPY3D *c), (c), NULL, 1)
GATED(cuMemcpy3DAsync_v2, (const CUDA_MEMCPY3D *c, CUstream s), (c, s), s, 0)
GATED(cuMemcpy3DAsync_v2_ptsz, (const CUDA_MEMCPY3D *c, CUstream s), (c, s), s, 1)
GATED(cuMemcpyPeer, (PEER_ARGS), (dst, dctx, src, sctx, n), NULL, 0)
GATED(cuMemcpyPeer_ptds, (PEER_ARGS), (dst, dctx, src, sctx, n), NULL, 1)
GATED(cuMemcpyPeerAsync, (PEER_ARGS, CUstream s), (dst, dctx, src, sctx, n, s), s, 0)
GATED(cuMemcpyPeerAsync_ptsz, (PEER_ARGS, CUstream s), (dst, dctx, src, sctx, n, s), s, 1)
GATED(cuMemcpy3DPeer, (const CUDA_MEMCPY3D_PEER *c), (c), NULL, 0)
GATED(cuMemcpy3DPeer_ptds, (const CUDA_MEMCPY3D_PEER *c), (c), NULL, 1)
GATED(cuMemcpy3DPeerAsync, (const CUDA_MEMCPY3D_PEER *c, CUstream s), (c, s), s, 0)
GATED(cuMemcpy3DPeerAsync_ptsz, (const CUDA_MEMCPY3D_PEER *c, CUstream s), (c, s), s, 1)

/* The sets of one element type, as CGPU_SET_HOOKS lists them. */
#define GATED_SETS(bits, type)                                                                   \
    GATED(cuMemsetD##bits##_v2, (CUdeviceptr d, type v, size_t n), (d, v, n), NULL, 0)          \
    GATED(cuMemsetD##bits##_v2_ptds, (CUdeviceptr d, type v, size_t n), (d, v, n), NULL, 1)     \
    GATED(cuMemsetD##bits##Async, (CUdeviceptr d, type v, size_t n, CUstream s), (d, v, n, s),  \
          s, 0)                                                                                  \
    GATED(cuMemsetD##bits##Async_ptsz, (CUdeviceptr d, type v, size_t n, CUstream s),           \
          (d, v, n, s), s, 1)                                                                    \
    GATED(cuMemsetD2D##bits##_v2, (CUdeviceptr d, size_t p, type v, size_t w, size_t h),       \
          (d, p, v, w, h), NULL, 0)                                                              \
    GATED(cuMemsetD2D##bits##_v2_ptds, (CUdeviceptr d, size_t p, type v, size_t w, size_t h),  \
          (d, p, v, w, h), NULL, 1)                                                              \
    GATED(cuMemsetD2D##bits##Async,                                                              \
          (CUdeviceptr d, size_t p, type v, size_t w, size_t h, CUstream s),                     \
          (d, p, v, w, h, s), s, 0)                                                              \
    GATED(cuMemsetD2D##bits##Async_ptsz,                                                         \
          (CUdeviceptr d, size_t p, type v, size_t w, size_t h, CUstream s),                     \
          (d, p, v, w, h, s), s, 1)
GATED_SETS(8, unsigned char)
GATED_SETS(16, unsigned short)
GATED_SETS(32, unsigned int)

/* ------------------------------------------------------------------ */
/* cuGetProcAddress                                                   */
/* ------------------------------------------------------------------ */

/* The driver's answer to a lookup of `symbol`, as the caller gets it: where
 * the name is one we wrap, our wrapper of the variant the version and flags
 * pick (the driver's own pick where its pointer is one we know), whatever
 * pointer the driver gave. A name we wrap, at a version older than every
 * variant we have (an older ABI, which we do not gate), is refused. */
static CUresult proc_answer(CUresult rc, const char *symbol, void **pfn, int cudaVersion,
                            cuuint64_t flags, CUdriverProcAddressQueryResult *status)
{
    selfcheck();
    if (rc != CUDA_SUCCESS || pfn == NULL || *pfn == NULL || symbol == NULL ||
        cgpu_region() == NULL)
        return rc;
    void *known = wrapper_of(*pfn, symbol);
    if (known != *pfn) {
        *pfn = known;
        return rc;
    }
    int family;
    const struct hook *h = hook_for_proc(symbol, cudaVersion, flags, &family);
    if (h == NULL && !family)
        h = hook_named(symbol); /* asked by its exported name */
    if (h != NULL) {
        *pfn = h->wrapper;
        return rc;
    }
    if (!family)
        return rc;
    static int said;
    if (!__atomic_exchange_n(&said, 1, __ATOMIC_RELAXED))
        cgpu_log("cuGetProcAddress(%s) for CUDA %d refused: an older variant libcgpu does not "
                 "wrap",
                 symbol, cudaVersion);
    *pfn = NULL;
    if (status != NULL)
        *status = CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
    return CUDA_ERROR_NOT_FOUND;
}

CGPU_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion,
                                         cuuint64_t flags, CUdriverProcAddressQueryResult *status)
{
    ENSURE_CUDA(cuGetProcAddress_v2);
    CUresult rc = real_cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags, status);
    return proc_answer(rc, symbol, pfn, cudaVersion, flags, status);
}

CUresult cgpu_cuGetProcAddress_legacy(const char *symbol, void **pfn, int cudaVersion,
                                      cuuint64_t flags)
{
    if (real_cuGetProcAddress_legacy == NULL)
        resolve(LIB_CUDA);
    if (real_cuGetProcAddress_legacy == NULL)
        return cuda_missing("cuGetProcAddress");
    CUresult rc = real_cuGetProcAddress_legacy(symbol, pfn, cudaVersion, flags);
    return proc_answer(rc, symbol, pfn, cudaVersion, flags, NULL);
}
