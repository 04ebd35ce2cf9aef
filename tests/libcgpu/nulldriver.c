/*
 * nulldriver.c: a libcuda.so.1 whose calls do nothing, for measuring what
 * libcgpu itself adds to a launch or an allocation (the benchmark's baseline).
 */
#include <stdint.h>
#include <string.h>

#include "cuda.h"

#define EXPORT __attribute__((visibility("default")))

static uint64_t next_ptr = 0x100000;

EXPORT CUresult cuInit(unsigned int flags) { (void)flags; return CUDA_SUCCESS; }
EXPORT CUresult cuDeviceGet(CUdevice *d, int ordinal) { *d = ordinal; return CUDA_SUCCESS; }
EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d)
{
    (void)d;
    *c = (CUcontext)(uintptr_t)1;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuCtxSetCurrent(CUcontext c) { (void)c; return CUDA_SUCCESS; }
EXPORT CUresult cuCtxGetDevice(CUdevice *d) { *d = 0; return CUDA_SUCCESS; }
EXPORT CUresult cuCtxGetCurrent(CUcontext *c)
{
    *c = (CUcontext)(uintptr_t)1;
    return CUDA_SUCCESS;
}
/* Events for libcgpu's in-flight markers: nothing is ever outstanding. */
EXPORT CUresult cuEventCreate(CUevent *e, unsigned int flags)
{
    (void)flags;
    *e = (CUevent)(uintptr_t)next_ptr++;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuEventRecord(CUevent e, CUstream s) { (void)e, (void)s; return CUDA_SUCCESS; }
EXPORT CUresult cuEventSynchronize(CUevent e) { (void)e; return CUDA_SUCCESS; }
EXPORT CUresult cuEventQuery(CUevent e) { (void)e; return CUDA_SUCCESS; }
EXPORT CUresult cuStreamIsCapturing(CUstream s, CUstreamCaptureStatus *status)
{
    (void)s;
    *status = CU_STREAM_CAPTURE_STATUS_NONE;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuThreadExchangeStreamCaptureMode(CUstreamCaptureMode *mode)
{
    (void)mode;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuCtxSynchronize(void) { return CUDA_SUCCESS; }
EXPORT CUresult cuDeviceGetUuid_v2(CUuuid *u, CUdevice d)
{
    (void)d;
    memset(u, 0, sizeof *u);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuModuleLoadData(CUmodule *m, const void *image)
{
    (void)image;
    *m = (CUmodule)(uintptr_t)1;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuModuleGetFunction(CUfunction *f, CUmodule m, const char *name)
{
    (void)m;
    (void)name;
    *f = (CUfunction)(uintptr_t)1;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                               unsigned int bx, unsigned int by, unsigned int bz,
                               unsigned int shmem, CUstream s, void **params, void **extra)
{
    (void)f, (void)gx, (void)gy, (void)gz, (void)bx, (void)by, (void)bz, (void)shmem, (void)s;
    (void)params, (void)extra;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t bytes)
{
    *p = next_ptr;
    next_ptr += bytes + 256;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMemFree_v2(CUdeviceptr p) { (void)p; return CUDA_SUCCESS; }
