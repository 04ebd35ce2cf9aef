/*
 * deepbind.c: one process that holds GPU memory through two copies of the
 * driver (issue 36, item 2).
 *
 * The process is linked against libcuda.so.1, so its calls go through
 * libcgpu (preloaded), which claims its process slot and counts what it
 * allocates. It also copies libcuda.so.1 to a folder of its own and opens
 * the copy with RTLD_DEEPBIND: the loader takes a file of another path and
 * inode for another object, and the copy's calls bind inside the copy, so
 * neither libcgpu's exported wrappers nor its dlsym see them. The copy has
 * its own driver state: on a real GPU its own contexts, on simgpu a second
 * process slot with the same pid. NVML lists the process once per context.
 *
 * Commands, one a line on stdin, each answered with one line on stdout:
 *   ready            -> ready pid=N              (its pid in its namespace)
 *   init             -> init rc=N                (cuInit in the copy, then a
 *                                                  context through libcgpu)
 *   deep-alloc BYTES -> deep-alloc rc=N          (a context and BYTES in the copy)
 *   alloc BYTES      -> alloc rc=N               (BYTES through libcgpu)
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef unsigned long long CUdeviceptr;

/* The driver's own entry points, linked as any CUDA program links them. */
extern CUresult cuInit(unsigned int flags);
extern CUresult cuDeviceGet(CUdevice *dev, int ordinal);
extern CUresult cuCtxCreate_v2(CUcontext *ctx, unsigned int flags, CUdevice dev);
extern CUresult cuCtxSetCurrent(CUcontext ctx);
extern CUresult cuMemAlloc_v2(CUdeviceptr *ptr, size_t bytes);

/* The driver file to copy: argv[1], else where an image holds it. */
static const char *driver = "/usr/lib/x86_64-linux-gnu/libcuda.so.1";

struct copy {
    void *handle;
    CUresult (*init)(unsigned int);
    CUresult (*device_get)(CUdevice *, int);
    CUresult (*ctx_create)(CUcontext *, unsigned int, CUdevice);
    CUresult (*ctx_set)(CUcontext);
    CUresult (*mem_alloc)(CUdeviceptr *, size_t);
    CUcontext ctx;
};

static struct copy deep;
static CUcontext own_ctx;

static int copy_file(const char *from, const char *to)
{
    int in = open(from, O_RDONLY | O_CLOEXEC);
    if (in < 0)
        return -1;
    int out = open(to, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0700);
    if (out < 0) {
        close(in);
        return -1;
    }
    char buf[65536];
    ssize_t n;
    int rc = 0;
    while ((n = read(in, buf, sizeof(buf))) > 0) {
        if (write(out, buf, (size_t)n) != n) {
            rc = -1;
            break;
        }
    }
    if (n < 0)
        rc = -1;
    close(in);
    if (close(out) != 0)
        rc = -1;
    return rc;
}

/* The copy, opened once; -1 when it cannot be. */
static int open_copy(void)
{
    if (deep.handle != NULL)
        return 0;
    char folder[] = "/tmp/deepbind-XXXXXX";
    char path[PATH_MAX];
    if (mkdtemp(folder) == NULL)
        return -1;
    snprintf(path, sizeof(path), "%s/libcuda-copy.so.1", folder);
    if (copy_file(driver, path) != 0)
        return -1;
    deep.handle = dlopen(path, RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
    if (deep.handle == NULL) {
        fprintf(stderr, "deepbind: %s\n", dlerror());
        return -1;
    }
    /* dlsym is libcgpu's: it swaps only the addresses of the libcuda it opened. */
    *(void **)&deep.init = dlsym(deep.handle, "cuInit");
    *(void **)&deep.device_get = dlsym(deep.handle, "cuDeviceGet");
    *(void **)&deep.ctx_create = dlsym(deep.handle, "cuCtxCreate_v2");
    *(void **)&deep.ctx_set = dlsym(deep.handle, "cuCtxSetCurrent");
    *(void **)&deep.mem_alloc = dlsym(deep.handle, "cuMemAlloc_v2");
    if (!deep.init || !deep.device_get || !deep.ctx_create || !deep.ctx_set || !deep.mem_alloc)
        return -1;
    return 0;
}

static int command_init(void)
{
    CUdevice dev;
    CUresult rc;
    if (open_copy() != 0)
        return -1;
    rc = deep.init(0);
    if (rc != 0)
        return (int)rc;
    if ((rc = cuInit(0)) != 0 || (rc = cuDeviceGet(&dev, 0)) != 0)
        return (int)rc;
    return (int)cuCtxCreate_v2(&own_ctx, 0, dev);
}

static int command_deep_alloc(size_t bytes)
{
    CUdevice dev;
    CUdeviceptr ptr;
    CUresult rc;
    if (open_copy() != 0)
        return -1;
    if ((rc = deep.init(0)) != 0 || (rc = deep.device_get(&dev, 0)) != 0)
        return (int)rc;
    if (deep.ctx == NULL && (rc = deep.ctx_create(&deep.ctx, 0, dev)) != 0)
        return (int)rc;
    if ((rc = deep.ctx_set(deep.ctx)) != 0)
        return (int)rc;
    return (int)deep.mem_alloc(&ptr, bytes);
}

static int command_alloc(size_t bytes)
{
    CUdevice dev;
    CUdeviceptr ptr;
    CUresult rc;
    if ((rc = cuInit(0)) != 0 || (rc = cuDeviceGet(&dev, 0)) != 0)
        return (int)rc;
    if (own_ctx == NULL && (rc = cuCtxCreate_v2(&own_ctx, 0, dev)) != 0)
        return (int)rc;
    if ((rc = cuCtxSetCurrent(own_ctx)) != 0)
        return (int)rc;
    return (int)cuMemAlloc_v2(&ptr, bytes);
}

int main(int argc, char **argv)
{
    char line[256];
    if (argc > 1)
        driver = argv[1];
    setvbuf(stdout, NULL, _IOLBF, 0);
    while (fgets(line, sizeof(line), stdin) != NULL) {
        char word[32];
        unsigned long long bytes = 0;
        if (sscanf(line, "%31s %llu", word, &bytes) < 1)
            continue;
        if (strcmp(word, "ready") == 0)
            printf("ready pid=%d\n", (int)getpid());
        else if (strcmp(word, "init") == 0)
            printf("init rc=%d\n", command_init());
        else if (strcmp(word, "deep-alloc") == 0)
            printf("deep-alloc rc=%d\n", command_deep_alloc((size_t)bytes));
        else if (strcmp(word, "alloc") == 0)
            printf("alloc rc=%d\n", command_alloc((size_t)bytes));
        else
            printf("%s unknown\n", word);
    }
    return 0;
}
