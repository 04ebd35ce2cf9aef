/*
 * routes.c: each call that puts work on the GPU, reached by each route a
 * program (or a hostile one) has to the driver, for libcgpu's tests.
 *
 *   routes [--bind ROUTE] OP ...
 *   routes --list          (every OP)
 *
 * ROUTE is how the program gets each entry point:
 *   exported        the linked symbols (libcgpu's, when it is preloaded)
 *   dlsym           dlsym on its own handle of libcuda.so.1
 *   dlvsym          the C library's dlsym, taken with dlvsym(RTLD_DEFAULT,
 *                   "dlsym", "GLIBC_2.34"), on that handle (the attack of
 *                   issue 36); dlvsym-old asks for GLIBC_2.2.5, dlvsym-next
 *                   uses RTLD_NEXT, dlvsym-dlvsym first takes dlvsym itself
 *                   with dlvsym, libc-dlsym asks a handle of libc.so.6 for
 *                   "dlsym"
 *   getproc         cuGetProcAddress_v2 by the name callers ask for (no _v2
 *                   suffix; _ptsz/_ptds names with
 *                   CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM);
 *                   getproc-legacy: the CUDA 11 cuGetProcAddress
 * OP is the exported name of a call (cuLaunch, cuMemsetD8_v2_ptds, ...; see
 * OPS), made once and answered with "NAME rc=N"; "where NAME" prints
 * "where NAME FILE SYMBOL", the object and exported symbol the route's
 * pointer lies at ("-": no exported symbol starts there); "wait" prints
 * "waiting" and reads one line from stdin; "libc" prints "libc malloc same"
 * when dlvsym finds the C library's first malloc where the program's is.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda.h"
#include "kernels.h"

enum kind {
    K_LAUNCH, K_GRID, K_GRID_ASYNC, K_MULTI, K_KERNEL, K_ALLOC,
    K_COPY, K_COPY_ASYNC, K_2D, K_2D_ASYNC, K_3D, K_3D_ASYNC, K_3DPEER, K_3DPEER_ASYNC,
    K_PEER, K_PEER_ASYNC, K_SET, K_SET_ASYNC, K_SET2D, K_SET2D_ASYNC,
};

struct op {
    const char *name;
    enum kind kind;
    int bits;     /* sets: element size */
    void *linked; /* the program's own reference to it */
};

#define OP(name, kind, bits) {#name, kind, bits, (void *)&name}
#define SETS(b)                                                                                  \
    OP(cuMemsetD##b##_v2, K_SET, b), OP(cuMemsetD##b##_v2_ptds, K_SET, b),                      \
    OP(cuMemsetD##b##Async, K_SET_ASYNC, b), OP(cuMemsetD##b##Async_ptsz, K_SET_ASYNC, b),      \
    OP(cuMemsetD2D##b##_v2, K_SET2D, b), OP(cuMemsetD2D##b##_v2_ptds, K_SET2D, b),              \
    OP(cuMemsetD2D##b##Async, K_SET2D_ASYNC, b),                                                 \
    OP(cuMemsetD2D##b##Async_ptsz, K_SET2D_ASYNC, b)

static const struct op OPS[] = {
    OP(cuLaunch, K_LAUNCH, 0),
    OP(cuLaunchGrid, K_GRID, 0),
    OP(cuLaunchGridAsync, K_GRID_ASYNC, 0),
    OP(cuLaunchCooperativeKernelMultiDevice, K_MULTI, 0),
    OP(cuLaunchKernel, K_KERNEL, 0),
    OP(cuLaunchKernel_ptsz, K_KERNEL, 0),
    OP(cuMemAlloc_v2, K_ALLOC, 0),
    OP(cuMemcpy, K_COPY, 0),
    OP(cuMemcpy_ptds, K_COPY, 0),
    OP(cuMemcpyAsync, K_COPY_ASYNC, 0),
    OP(cuMemcpyAsync_ptsz, K_COPY_ASYNC, 0),
    OP(cuMemcpyDtoD_v2, K_COPY, 0),
    OP(cuMemcpyDtoD_v2_ptds, K_COPY, 0),
    OP(cuMemcpyDtoDAsync_v2, K_COPY_ASYNC, 0),
    OP(cuMemcpyDtoDAsync_v2_ptsz, K_COPY_ASYNC, 0),
    OP(cuMemcpy2D_v2, K_2D, 0),
    OP(cuMemcpy2D_v2_ptds, K_2D, 0),
    OP(cuMemcpy2DUnaligned_v2, K_2D, 0),
    OP(cuMemcpy2DUnaligned_v2_ptds, K_2D, 0),
    OP(cuMemcpy2DAsync_v2, K_2D_ASYNC, 0),
    OP(cuMemcpy2DAsync_v2_ptsz, K_2D_ASYNC, 0),
    OP(cuMemcpy3D_v2, K_3D, 0),
    OP(cuMemcpy3D_v2_ptds, K_3D, 0),
    OP(cuMemcpy3DAsync_v2, K_3D_ASYNC, 0),
    OP(cuMemcpy3DAsync_v2_ptsz, K_3D_ASYNC, 0),
    OP(cuMemcpyPeer, K_PEER, 0),
    OP(cuMemcpyPeer_ptds, K_PEER, 0),
    OP(cuMemcpyPeerAsync, K_PEER_ASYNC, 0),
    OP(cuMemcpyPeerAsync_ptsz, K_PEER_ASYNC, 0),
    OP(cuMemcpy3DPeer, K_3DPEER, 0),
    OP(cuMemcpy3DPeer_ptds, K_3DPEER, 0),
    OP(cuMemcpy3DPeerAsync, K_3DPEER_ASYNC, 0),
    OP(cuMemcpy3DPeerAsync_ptsz, K_3DPEER_ASYNC, 0),
    SETS(8),
    SETS(16),
    SETS(32),
};
#define NOPS (sizeof OPS / sizeof OPS[0])

typedef void *(*dlsym_fn)(void *, const char *);
typedef void *(*dlvsym_fn)(void *, const char *, const char *);
typedef CUresult (*getproc_legacy_fn)(const char *, void **, int, cuuint64_t);

static const char *route = "exported";
static void *libcuda;

static void fail(const char *what)
{
    fprintf(stderr, "routes: %s\n", what);
    exit(2);
}

/* The dlsym the route takes, for the routes that take one. */
static dlsym_fn route_dlsym(void)
{
    if (strcmp(route, "dlsym") == 0)
        return dlsym;
    if (strcmp(route, "dlvsym") == 0)
        return (dlsym_fn)dlvsym(RTLD_DEFAULT, "dlsym", "GLIBC_2.34");
    if (strcmp(route, "dlvsym-old") == 0)
        return (dlsym_fn)dlvsym(RTLD_DEFAULT, "dlsym", "GLIBC_2.2.5");
    if (strcmp(route, "dlvsym-next") == 0)
        return (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
    if (strcmp(route, "dlvsym-dlvsym") == 0) {
        dlvsym_fn dv = (dlvsym_fn)dlvsym(RTLD_DEFAULT, "dlvsym", "GLIBC_2.34");
        return dv != NULL ? (dlsym_fn)dv(RTLD_DEFAULT, "dlsym", "GLIBC_2.34") : NULL;
    }
    if (strcmp(route, "libc-dlsym") == 0) {
        void *libc = dlopen("libc.so.6", RTLD_NOW | RTLD_NOLOAD);
        return libc != NULL ? (dlsym_fn)dlsym(libc, "dlsym") : NULL;
    }
    return NULL;
}

/* The name cuGetProcAddress is asked for: without _ptsz/_ptds (*pt says it had
 * one) and without a _v2 suffix. */
static void proc_name(const char *exported, char *out, size_t len, int *pt)
{
    snprintf(out, len, "%s", exported);
    size_t n = strlen(out);
    *pt = n > 5 && (strcmp(out + n - 5, "_ptsz") == 0 || strcmp(out + n - 5, "_ptds") == 0);
    if (*pt)
        out[n -= 5] = '\0';
    if (n > 3 && strcmp(out + n - 3, "_v2") == 0)
        out[n - 3] = '\0';
}

/* The entry point the route gives for an op. */
static void *entry(const struct op *op)
{
    const char *name = op->name;
    void *fn = NULL;
    if (strcmp(route, "exported") == 0) {
        fn = op->linked;
    } else if (strncmp(route, "getproc", 7) == 0) {
        char proc[128];
        int pt;
        proc_name(name, proc, sizeof proc, &pt);
        cuuint64_t flags = pt ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM
                              : CU_GET_PROC_ADDRESS_DEFAULT;
        CUresult rc;
        if (strcmp(route, "getproc-legacy") == 0) {
            getproc_legacy_fn legacy = (getproc_legacy_fn)dlsym(RTLD_DEFAULT, "cuGetProcAddress");
            if (legacy == NULL)
                fail("no cuGetProcAddress");
            rc = legacy(proc, &fn, CUDA_VERSION, flags);
        } else {
            CUdriverProcAddressQueryResult status;
            rc = cuGetProcAddress_v2(proc, &fn, CUDA_VERSION, flags, &status);
        }
        if (rc != CUDA_SUCCESS)
            fn = NULL;
    } else {
        dlsym_fn ds = route_dlsym();
        if (ds == NULL)
            fail("the route gave no dlsym");
        fn = ds(libcuda, name);
    }
    if (fn == NULL) {
        fprintf(stderr, "routes: %s: no entry point by route %s\n", name, route);
        exit(2);
    }
    return fn;
}

static CUfunction func;
static CUstream stream;
static CUcontext ctx;
static CUdeviceptr src, dst;
#define BYTES 4096

static void setup(void)
{
    CUdevice dev;
    CUmodule mod;
    if (cuInit(0) != CUDA_SUCCESS || cuDeviceGet(&dev, 0) != CUDA_SUCCESS ||
        cuDevicePrimaryCtxRetain(&ctx, dev) != CUDA_SUCCESS || cuCtxSetCurrent(ctx) != CUDA_SUCCESS)
        fail("no context");
    if (cuModuleLoadData(&mod, kernels_ptx) != CUDA_SUCCESS ||
        cuModuleGetFunction(&func, mod, "sleep_0") != CUDA_SUCCESS)
        fail("no kernel");
    if (cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS)
        fail("no stream");
    if (cuMemAlloc_v2(&src, BYTES) != CUDA_SUCCESS || cuMemAlloc_v2(&dst, BYTES) != CUDA_SUCCESS)
        fail("no memory");
}

static CUresult call(const struct op *op, void *fn)
{
    CUDA_MEMCPY2D c2 = {0};
    c2.srcMemoryType = c2.dstMemoryType = CU_MEMORYTYPE_DEVICE;
    c2.srcDevice = src;
    c2.dstDevice = dst;
    c2.srcPitch = c2.dstPitch = 64;
    c2.WidthInBytes = 64;
    c2.Height = 4;
    CUDA_MEMCPY3D c3 = {0};
    c3.srcMemoryType = c3.dstMemoryType = CU_MEMORYTYPE_DEVICE;
    c3.srcDevice = src;
    c3.dstDevice = dst;
    c3.srcPitch = c3.dstPitch = 64;
    c3.srcHeight = c3.dstHeight = 4;
    c3.WidthInBytes = 64;
    c3.Height = 4;
    c3.Depth = 2;
    CUDA_MEMCPY3D_PEER cp = {0};
    cp.srcMemoryType = cp.dstMemoryType = CU_MEMORYTYPE_DEVICE;
    cp.srcDevice = src;
    cp.dstDevice = dst;
    cp.srcContext = cp.dstContext = ctx;
    cp.srcPitch = cp.dstPitch = 64;
    cp.srcHeight = cp.dstHeight = 4;
    cp.WidthInBytes = 64;
    cp.Height = 4;
    cp.Depth = 2;
    CUDA_LAUNCH_PARAMS lp = {func, 1, 1, 1, 1, 1, 1, 0, stream, NULL};
    CUdeviceptr p;
    unsigned int v = 7;
    size_t n = BYTES / 4, pitch = 64, w = 16, h = 4; /* in elements of up to 4 bytes */
    switch (op->kind) {
    case K_LAUNCH:
        return ((CUresult(*)(CUfunction))fn)(func);
    case K_GRID:
        return ((CUresult(*)(CUfunction, int, int))fn)(func, 1, 1);
    case K_GRID_ASYNC:
        return ((CUresult(*)(CUfunction, int, int, CUstream))fn)(func, 1, 1, stream);
    case K_MULTI:
        return ((__typeof__(&cuLaunchCooperativeKernelMultiDevice))fn)(&lp, 1, 0);
    case K_KERNEL:
        return ((__typeof__(&cuLaunchKernel))fn)(func, 1, 1, 1, 1, 1, 1, 0, stream, NULL, NULL);
    case K_ALLOC:
        return ((__typeof__(&cuMemAlloc_v2))fn)(&p, 1 << 20);
    case K_COPY:
        return ((__typeof__(&cuMemcpy))fn)(dst, src, BYTES);
    case K_COPY_ASYNC:
        return ((__typeof__(&cuMemcpyAsync))fn)(dst, src, BYTES, stream);
    case K_2D:
        return ((__typeof__(&cuMemcpy2D_v2))fn)(&c2);
    case K_2D_ASYNC:
        return ((__typeof__(&cuMemcpy2DAsync_v2))fn)(&c2, stream);
    case K_3D:
        return ((__typeof__(&cuMemcpy3D_v2))fn)(&c3);
    case K_3D_ASYNC:
        return ((__typeof__(&cuMemcpy3DAsync_v2))fn)(&c3, stream);
    case K_3DPEER:
        return ((__typeof__(&cuMemcpy3DPeer))fn)(&cp);
    case K_3DPEER_ASYNC:
        return ((__typeof__(&cuMemcpy3DPeerAsync))fn)(&cp, stream);
    case K_PEER:
        return ((__typeof__(&cuMemcpyPeer))fn)(dst, ctx, src, ctx, BYTES);
    case K_PEER_ASYNC:
        return ((__typeof__(&cuMemcpyPeerAsync))fn)(dst, ctx, src, ctx, BYTES, stream);
    case K_SET:
        if (op->bits == 8)
            return ((__typeof__(&cuMemsetD8_v2))fn)(dst, (unsigned char)v, n);
        if (op->bits == 16)
            return ((__typeof__(&cuMemsetD16_v2))fn)(dst, (unsigned short)v, n);
        return ((__typeof__(&cuMemsetD32_v2))fn)(dst, v, n);
    case K_SET_ASYNC:
        if (op->bits == 8)
            return ((__typeof__(&cuMemsetD8Async))fn)(dst, (unsigned char)v, n, stream);
        if (op->bits == 16)
            return ((__typeof__(&cuMemsetD16Async))fn)(dst, (unsigned short)v, n, stream);
        return ((__typeof__(&cuMemsetD32Async))fn)(dst, v, n, stream);
    case K_SET2D:
        if (op->bits == 8)
            return ((__typeof__(&cuMemsetD2D8_v2))fn)(dst, pitch, (unsigned char)v, w, h);
        if (op->bits == 16)
            return ((__typeof__(&cuMemsetD2D16_v2))fn)(dst, pitch, (unsigned short)v, w, h);
        return ((__typeof__(&cuMemsetD2D32_v2))fn)(dst, pitch, v, w, h);
    case K_SET2D_ASYNC:
        if (op->bits == 8)
            return ((__typeof__(&cuMemsetD2D8Async))fn)(dst, pitch, (unsigned char)v, w, h,
                                                        stream);
        if (op->bits == 16)
            return ((__typeof__(&cuMemsetD2D16Async))fn)(dst, pitch, (unsigned short)v, w, h,
                                                         stream);
        return ((__typeof__(&cuMemsetD2D32Async))fn)(dst, pitch, v, w, h, stream);
    }
    return CUDA_ERROR_UNKNOWN;
}

static const struct op *op_named(const char *name)
{
    for (size_t i = 0; i < NOPS; i++)
        if (strcmp(OPS[i].name, name) == 0)
            return &OPS[i];
    return NULL;
}

static void where(const struct op *op)
{
    const char *name = op->name;
    void *fn = entry(op);
    Dl_info info;
    if (dladdr(fn, &info) == 0 || info.dli_fname == NULL) {
        printf("where %s ? -\n", name);
        return;
    }
    const char *file = strrchr(info.dli_fname, '/');
    printf("where %s %s %s\n", name, file != NULL ? file + 1 : info.dli_fname,
           info.dli_saddr == fn && info.dli_sname != NULL ? info.dli_sname : "-");
}

int main(int argc, char **argv)
{
    int i = 1;
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (i < argc && strcmp(argv[i], "--list") == 0) {
        for (size_t k = 0; k < NOPS; k++)
            printf("%s\n", OPS[k].name);
        return 0;
    }
    if (i + 1 < argc && strcmp(argv[i], "--bind") == 0) {
        route = argv[i + 1];
        i += 2;
    }
    libcuda = dlopen("libcuda.so.1", RTLD_NOW);
    if (libcuda == NULL)
        fail("no libcuda.so.1");
    setup();
    for (; i < argc; i++) {
        if (strcmp(argv[i], "libc") == 0) { /* other names still found as the C library has them */
            void *v = dlvsym(RTLD_DEFAULT, "malloc", "GLIBC_2.2.5"); /* x86_64 */
            if (v == NULL)
                v = dlvsym(RTLD_DEFAULT, "malloc", "GLIBC_2.17"); /* aarch64 */
            printf("libc malloc %s\n", v == (void *)&malloc ? "same" : "other");
            continue;
        }
        if (strcmp(argv[i], "wait") == 0) {
            char line[64];
            printf("waiting\n");
            if (fgets(line, sizeof line, stdin) == NULL)
                fail("stdin closed");
            continue;
        }
        int show = strcmp(argv[i], "where") == 0 && i + 1 < argc;
        const struct op *op = op_named(argv[i + show]);
        if (op == NULL)
            fail("unknown op");
        if (show) {
            where(op);
            i++;
            continue;
        }
        void *fn = entry(op);
        printf("%s rc=%d\n", op->name, (int)call(op, fn));
    }
    if (cuCtxSynchronize() != CUDA_SUCCESS)
        fail("synchronize failed");
    return 0;
}
