/*
 * bench.c: the driver-API loop of libcgpu's benchmark (tests/bench/libcgpu_bench.py).
 *
 *   bench launch COUNT NAME   ns per launch to issue, and per launch including the sync
 *   bench alloc COUNT BYTES   ns per cuMemAlloc + cuMemFree pair
 *
 * Uses only a handful of entry points so that it also runs on the null driver.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cuda.h"
#include "kernels.h"

static double now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

int main(int argc, char **argv)
{
    if (argc != 4) {
        fprintf(stderr, "usage: bench launch COUNT NAME | bench alloc COUNT BYTES\n");
        return 2;
    }
    long count = atol(argv[2]);
    CUdevice dev;
    CUcontext ctx;
    if (cuInit(0) || cuDeviceGet(&dev, 0) || cuDevicePrimaryCtxRetain(&ctx, dev) ||
        cuCtxSetCurrent(ctx)) {
        fprintf(stderr, "no context\n");
        return 1;
    }
    if (strcmp(argv[1], "launch") == 0) {
        CUmodule mod;
        CUfunction f;
        if (cuModuleLoadData(&mod, kernels_ptx) || cuModuleGetFunction(&f, mod, argv[3]))
            return 1;
        for (int i = 0; i < 100; i++) /* warm up */
            cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
        cuCtxSynchronize();
        double t0 = now_ns();
        for (long i = 0; i < count; i++)
            if (cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL) != CUDA_SUCCESS)
                return 1;
        double t1 = now_ns();
        cuCtxSynchronize();
        double t2 = now_ns();
        printf("%.2f %.2f\n", (t1 - t0) / (double)count, (t2 - t0) / (double)count);
    } else {
        size_t bytes = strtoull(argv[3], NULL, 0);
        CUdeviceptr p;
        double t0 = now_ns();
        for (long i = 0; i < count; i++)
            if (cuMemAlloc_v2(&p, bytes) != CUDA_SUCCESS || cuMemFree_v2(p) != CUDA_SUCCESS)
                return 1;
        printf("%.2f\n", (now_ns() - t0) / (double)count);
    }
    return 0;
}
