/*
 * hijack.c: an LD_PRELOAD library named before libcgpu (issue 36, item 3).
 *
 * It defines cuLaunchKernel, so the program's launches bind to it rather
 * than to libcgpu's wrapper, and forwards them to the driver through the C
 * library's own dlsym, taken with dlvsym(RTLD_DEFAULT, "dlsym", "GLIBC_2.34")
 * (GLIBC_2.2.5 before glibc 2.34), on its own handle of libcuda.so.1. Before
 * libcgpu answered dlvsym, that reached the real cuLaunchKernel past the gate.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>

#include "cuda.h"

typedef void *(*dlsym_fn)(void *, const char *);

__attribute__((visibility("default"))) CUresult
cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,
               unsigned int by, unsigned int bz, unsigned int shmem, CUstream stream,
               void **params, void **extra)
{
    static __typeof__(&cuLaunchKernel) driver;
    if (driver == NULL) {
        dlsym_fn ds = (dlsym_fn)dlvsym(RTLD_DEFAULT, "dlsym", "GLIBC_2.34");
        if (ds == NULL)
            ds = (dlsym_fn)dlvsym(RTLD_DEFAULT, "dlsym", "GLIBC_2.2.5");
        void *libcuda = dlopen("libcuda.so.1", RTLD_NOW);
        if (ds == NULL || libcuda == NULL)
            return CUDA_ERROR_NOT_FOUND;
        *(void **)&driver = ds(libcuda, "cuLaunchKernel");
        if (driver == NULL)
            return CUDA_ERROR_NOT_FOUND;
    }
    return driver(f, gx, gy, gz, bx, by, bz, shmem, stream, params, extra);
}
