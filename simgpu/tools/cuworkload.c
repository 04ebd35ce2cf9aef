/*
 * cuworkload: a small CUDA driver-API workload for tests and demos.
 *
 *   cuworkload [--device N] [--primary] [--alloc BYTES]... [--managed BYTES]
 *              [--kernels N] [--us MICROSECONDS] [--stream] [--graph]
 *              [--report N] [--go-stdin] [--hold SECONDS | --hold-stdin]
 *
 * It initializes the driver, makes a context (cuCtxCreate, or the primary
 * context with --primary), allocates, prints "ready pid=<pid>", optionally
 * waits for a line on stdin (--go-stdin), launches N kernels "sleep_<us>"
 * (on a created stream with --stream, captured into a graph and launched
 * with --graph), synchronizes, prints "done elapsed_ms=<ms>", then holds
 * its memory for SECONDS or until stdin closes. Sizes take KiB/MiB/GiB.
 * --report N (without --graph) synchronizes after every N launches and prints
 * "kernels=<completed> ms=<since the first launch>": a throughput that the
 * workload itself counted.
 * Exit status: 0 success, 1 a CUDA call failed (named on stdout), 2 usage.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cuda.h"

#define MAX_ALLOCS 64

static int check(CUresult rc, const char *what)
{
    if (rc == CUDA_SUCCESS)
        return 0;
    const char *name = NULL;
    cuGetErrorName(rc, &name);
    printf("error %s: %s\n", what, name ? name : "?");
    fflush(stdout);
    return 1;
}

static int parse_bytes(const char *s, size_t *out)
{
    char *end;
    unsigned long long v = strtoull(s, &end, 10);
    if (end == s)
        return -1;
    if (strcmp(end, "KiB") == 0)
        v <<= 10;
    else if (strcmp(end, "MiB") == 0)
        v <<= 20;
    else if (strcmp(end, "GiB") == 0)
        v <<= 30;
    else if (*end != '\0')
        return -1;
    *out = (size_t)v;
    return 0;
}

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static int usage(void)
{
    fprintf(stderr, "usage: cuworkload [--device N] [--primary] [--alloc BYTES]... "
                    "[--managed BYTES] [--kernels N] [--us US] [--stream] [--graph] "
                    "[--report N] [--go-stdin] [--hold SECONDS | --hold-stdin]\n");
    return 2;
}

int main(int argc, char **argv)
{
    int device = 0, primary = 0, kernels = 0, use_stream = 0, use_graph = 0, go_stdin = 0;
    int hold_stdin = 0, nallocs = 0, report = 0;
    unsigned us = 1000;
    double hold = 0;
    size_t allocs[MAX_ALLOCS], managed = 0;

    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--primary") == 0) {
            primary = 1;
        } else if (strcmp(a, "--stream") == 0) {
            use_stream = 1;
        } else if (strcmp(a, "--graph") == 0) {
            use_graph = use_stream = 1;
        } else if (strcmp(a, "--go-stdin") == 0) {
            go_stdin = 1;
        } else if (strcmp(a, "--hold-stdin") == 0) {
            hold_stdin = 1;
        } else if (v && strcmp(a, "--device") == 0) {
            device = atoi(v), i++;
        } else if (v && strcmp(a, "--kernels") == 0) {
            kernels = atoi(v), i++;
        } else if (v && strcmp(a, "--report") == 0) {
            report = atoi(v), i++;
        } else if (v && strcmp(a, "--us") == 0) {
            us = (unsigned)strtoul(v, NULL, 10), i++;
        } else if (v && strcmp(a, "--hold") == 0) {
            hold = atof(v), i++;
        } else if (v && strcmp(a, "--alloc") == 0 && nallocs < MAX_ALLOCS) {
            if (parse_bytes(v, &allocs[nallocs++]) != 0)
                return usage();
            i++;
        } else if (v && strcmp(a, "--managed") == 0) {
            if (parse_bytes(v, &managed) != 0)
                return usage();
            i++;
        } else {
            return usage();
        }
    }

    CUdevice dev;
    CUcontext ctx;
    if (check(cuInit(0), "cuInit") || check(cuDeviceGet(&dev, device), "cuDeviceGet"))
        return 1;
    if (primary) {
        if (check(cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain") ||
            check(cuCtxSetCurrent(ctx), "cuCtxSetCurrent"))
            return 1;
    } else if (check(cuCtxCreate(&ctx, 0, dev), "cuCtxCreate")) {
        return 1;
    }
    int failed = 0;
    for (int i = 0; i < nallocs; i++) {
        CUdeviceptr p;
        CUresult rc = cuMemAlloc(&p, allocs[i]);
        const char *name = NULL;
        cuGetErrorName(rc, &name);
        printf("alloc %zu %s\n", allocs[i], rc == CUDA_SUCCESS ? "ok" : name);
        failed |= rc != CUDA_SUCCESS;
    }
    if (managed) {
        CUdeviceptr p;
        failed |= check(cuMemAllocManaged(&p, managed, CU_MEM_ATTACH_GLOBAL), "cuMemAllocManaged");
    }
    size_t free_b, total_b;
    if (check(cuMemGetInfo(&free_b, &total_b), "cuMemGetInfo"))
        return 1;
    printf("ready pid=%d free=%zu total=%zu\n", (int)getpid(), free_b, total_b);
    fflush(stdout);

    char line[64];
    if (go_stdin && !fgets(line, sizeof(line), stdin))
        return 0;

    if (kernels > 0) {
        CUmodule mod;
        CUfunction fn;
        CUstream stream = NULL;
        char name[32];
        snprintf(name, sizeof(name), "sleep_%u", us);
        if (check(cuModuleLoadData(&mod, "simgpu"), "cuModuleLoadData") ||
            check(cuModuleGetFunction(&fn, mod, name), "cuModuleGetFunction") ||
            (use_stream && check(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate")))
            return 1;
        double t0 = now_ms();
        if (use_graph) {
            CUgraph graph;
            CUgraphExec exec;
            if (check(cuStreamBeginCapture(stream, CU_STREAM_CAPTURE_MODE_GLOBAL), "cuStreamBeginCapture"))
                return 1;
            for (int i = 0; i < kernels; i++) {
                if (check(cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, stream, NULL, NULL), "cuLaunchKernel"))
                    return 1;
            }
            if (check(cuStreamEndCapture(stream, &graph), "cuStreamEndCapture") ||
                check(cuGraphInstantiate(&exec, graph, 0), "cuGraphInstantiate") ||
                check(cuGraphLaunch(exec, stream), "cuGraphLaunch"))
                return 1;
        } else {
            for (int i = 0; i < kernels; i++) {
                if (check(cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, stream, NULL, NULL), "cuLaunchKernel"))
                    return 1;
                if (report > 0 && (i + 1) % report == 0) {
                    if (check(stream ? cuStreamSynchronize(stream) : cuCtxSynchronize(), "synchronize"))
                        return 1;
                    printf("kernels=%d ms=%.3f\n", i + 1, now_ms() - t0);
                    fflush(stdout);
                }
            }
        }
        if (check(stream ? cuStreamSynchronize(stream) : cuCtxSynchronize(), "synchronize"))
            return 1;
        printf("done elapsed_ms=%.3f\n", now_ms() - t0);
        fflush(stdout);
    }

    if (hold_stdin) {
        while (fgets(line, sizeof(line), stdin))
            ;
    } else if (hold > 0) {
        usleep((useconds_t)(hold * 1e6));
    }
    return failed;
}
