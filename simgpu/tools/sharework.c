/*
 * sharework: a workload that counts the kernels it completes, for measuring
 * compute shares from the workloads' side.
 *
 *   sharework --us US --seconds S [--procs P] [--depth N] [--streams N]
 *             [--request-ms MS [--phase-ms MS]] [--bucket-ms MS] [--device N]
 *             [--go-stdin]
 *
 * The parent forks P processes before touching the driver; each creates its
 * own context and stream and loads a kernel "sleep_<US>". When all are
 * initialized the parent prints "ready pid=<pid> procs=<P>". With --go-stdin
 * it then waits for a line "go [T]" on stdin (T: a CLOCK_MONOTONIC time in
 * seconds to start at, so that several workloads share one clock grid);
 * without it, or without T, the run starts at once. The start is t0.
 *
 * Each process launches kernels back to back and keeps N (--depth, default
 * 2) of its own launches outstanding on each of its streams (--streams,
 * default 1, taken in turn): it records an event after every kernel, and
 * before launching more on a stream it waits on the event of that stream's
 * launch N back. A kernel counts as completed when the wait on its event
 * returns, in the bucket (--bucket-ms, default 10) of CLOCK_MONOTONIC since
 * t0 it returned in. A process stops launching at t0 + S or on SIGTERM (the
 * parent forwards it), waits for what it has outstanding, and exits;
 * completions after t0 + S are not counted.
 *
 * With --request-ms MS a process serves requests instead, as an inference
 * service does: at t0 + PHASE + i * MS / P + k * MS (process i of P,
 * --phase-ms PHASE, default 0; or at once, when the one before ran past
 * it) it launches N (--depth) kernels on its first stream and synchronizes
 * the stream; the request's latency is from its first launch (the gate's
 * wait included) to the end of that synchronize, and its N kernels count
 * as completed when the synchronize returns. Then the parent prints
 *
 *   counts t0=<s> bucket_ms=<ms> seconds=<S> procs=<P> kernels=<n> per_proc=<n>,...
 *   buckets <n> <n> ...
 *   latency_us <n> <n> ...     (--request-ms only: every request that ended by t0 + S)
 *
 * The module is PTX, loaded from memory: simgpu accepts any image and runs
 * sleep_<US> for US microseconds; NVIDIA's driver JIT-compiles it into a
 * kernel that runs until it has been on the GPU for US microseconds by
 * %globaltimer (gaps of 20 us or more, when its context was switched out,
 * do not count), so on either a completed kernel stands for US of GPU time.
 * Exit status: 0 success, 1 a driver call failed (named on stderr) or a
 * process died, 2 usage.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cuda.h"

#define MAX_PROCS 64
#define MAX_DEPTH 64
#define MAX_STREAMS 64
#define NS ((int64_t)1000000000)

struct options {
    unsigned us;
    double seconds;
    int procs, depth, streams, request_ms, phase_ms, bucket_ms, device, go_stdin;
};

/* Shared between the parent and its processes (an anonymous shared mapping). */
struct tally {
    int64_t t0_ns;
    uint64_t per_proc[MAX_PROCS];
    uint32_t requests[MAX_PROCS];  /* requests each process ended in time */
    uint32_t *latency_us;          /* [process][request]: max_requests per process */
    size_t max_requests;
    uint32_t buckets[]; /* completions per bucket since t0 */
};

static volatile sig_atomic_t stop;
static pid_t children[MAX_PROCS]; /* in the parent only: SIGTERM is passed on */
static int nchildren;

static void kill_all(int sig)
{
    for (int i = 0; i < nchildren; i++) {
        if (children[i] > 0)
            kill(children[i], sig);
    }
}

static void on_term(int sig)
{
    stop = 1;
    kill_all(sig);
}

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * NS + ts.tv_nsec;
}

static int check(CUresult rc, const char *what)
{
    if (rc == CUDA_SUCCESS)
        return 0;
    const char *name = NULL;
    cuGetErrorName(rc, &name);
    fprintf(stderr, "sharework: %s: %s\n", what, name ? name : "?");
    return 1;
}

/* The kernel sleep_<us> as PTX (see the top of the file). */
static void kernel_ptx(char *out, size_t size, unsigned us)
{
    snprintf(out, size,
             ".version 7.0\n"
             ".target sm_52\n"
             ".address_size 64\n"
             ".visible .entry sleep_%u()\n"
             "{\n"
             "    .reg .pred %%p<3>;\n"
             "    .reg .b64 %%rd<5>;\n"
             "    mov.u64 %%rd4, 0;\n"
             "    mov.u64 %%rd1, %%globaltimer;\n"
             "$L_spin:\n"
             "    mov.u64 %%rd2, %%globaltimer;\n"
             "    sub.s64 %%rd3, %%rd2, %%rd1;\n"
             "    mov.u64 %%rd1, %%rd2;\n"
             "    setp.lt.u64 %%p1, %%rd3, 20000;\n"
             "    @%%p1 add.u64 %%rd4, %%rd4, %%rd3;\n"
             "    setp.lt.u64 %%p2, %%rd4, %" PRIu64 ";\n"
             "    @%%p2 bra $L_spin;\n"
             "    ret;\n"
             "}\n",
             us, (uint64_t)us * 1000);
}

struct gpu {
    CUfunction fn;
    CUstream stream[MAX_STREAMS];
    CUevent events[MAX_STREAMS][MAX_DEPTH];
    uint64_t launched[MAX_STREAMS], done[MAX_STREAMS];
};

static int gpu_init(const struct options *o, struct gpu *g)
{
    CUdevice dev;
    CUcontext ctx;
    CUmodule mod;
    char ptx[1024], name[32];
    kernel_ptx(ptx, sizeof(ptx), o->us);
    snprintf(name, sizeof(name), "sleep_%u", o->us);
    if (check(cuInit(0), "cuInit") || check(cuDeviceGet(&dev, o->device), "cuDeviceGet") ||
        check(cuCtxCreate(&ctx, CU_CTX_SCHED_BLOCKING_SYNC, dev), "cuCtxCreate") ||
        check(cuModuleLoadData(&mod, ptx), "cuModuleLoadData") ||
        check(cuModuleGetFunction(&g->fn, mod, name), "cuModuleGetFunction"))
        return 1;
    for (int s = 0; s < o->streams; s++) {
        g->launched[s] = g->done[s] = 0;
        if (check(cuStreamCreate(&g->stream[s], CU_STREAM_NON_BLOCKING), "cuStreamCreate"))
            return 1;
        for (int i = 0; i < o->depth; i++) {
            if (check(cuEventCreate(&g->events[s][i],
                                    CU_EVENT_DISABLE_TIMING | CU_EVENT_BLOCKING_SYNC),
                      "cuEventCreate"))
                return 1;
        }
    }
    return 0;
}

/* Count n kernels completed at `now` (if inside the run). */
static void tally_add(const struct options *o, struct tally *t, int me, int64_t now,
                      int64_t end_ns, size_t nbuckets, unsigned n)
{
    if (now < t->t0_ns || now >= end_ns)
        return;
    size_t bucket = (size_t)((now - t->t0_ns) / ((int64_t)o->bucket_ms * 1000000));
    if (bucket < nbuckets) {
        __atomic_add_fetch(&t->buckets[bucket], n, __ATOMIC_RELAXED);
        t->per_proc[me] += n;
    }
}

/* Wait for the oldest outstanding launch of stream s and count it; 0, or 1
 * when the wait failed. */
static int complete(const struct options *o, struct gpu *g, struct tally *t, int me, int s,
                    int64_t end_ns, size_t nbuckets)
{
    uint64_t k = g->done[s]++;
    if (check(cuEventSynchronize(g->events[s][k % (uint64_t)o->depth]), "cuEventSynchronize"))
        return 1;
    tally_add(o, t, me, now_ns(), end_ns, nbuckets, 1);
    return 0;
}

/* Count the launches of every stream that have completed, oldest first, without
 * waiting; 0, or 1 when a query failed. */
static int reap(const struct options *o, struct gpu *g, struct tally *t, int me,
                int64_t end_ns, size_t nbuckets)
{
    for (int s = 0; s < o->streams; s++) {
        while (g->done[s] < g->launched[s]) {
            CUresult r = cuEventQuery(g->events[s][g->done[s] % (uint64_t)o->depth]);
            if (r == CUDA_ERROR_NOT_READY)
                break;
            if (check(r, "cuEventQuery"))
                return 1;
            g->done[s]++;
            tally_add(o, t, me, now_ns(), end_ns, nbuckets, 1);
        }
    }
    return 0;
}

/* Kernels back to back, --depth outstanding on each stream in turn. */
static int busy_loop(const struct options *o, struct gpu *g, struct tally *t, int me,
                     int64_t end_ns, size_t nbuckets)
{
    for (int s = 0; !stop && now_ns() < end_ns; s = (s + 1) % o->streams) {
        /* With many streams a stream comes round again only after the others'
         * launches: count what completed meanwhile when it completed, not then. */
        if (o->streams > 1 && reap(o, g, t, me, end_ns, nbuckets))
            return 1;
        if (g->launched[s] - g->done[s] == (uint64_t)o->depth &&
            complete(o, g, t, me, s, end_ns, nbuckets))
            return 1;
        if (check(cuLaunchKernel(g->fn, 1, 1, 1, 1, 1, 1, 0, g->stream[s], NULL, NULL),
                  "cuLaunchKernel") ||
            check(cuEventRecord(g->events[s][g->launched[s] % (uint64_t)o->depth],
                                g->stream[s]),
                  "cuEventRecord"))
            return 1;
        g->launched[s]++;
    }
    for (int s = 0; s < o->streams; s++) {
        while (g->done[s] < g->launched[s]) {
            if (complete(o, g, t, me, s, end_ns, nbuckets))
                return 1;
        }
    }
    return 0;
}

/* A request of --depth kernels every --request-ms, each timed to its synchronize. */
static int request_loop(const struct options *o, struct gpu *g, struct tally *t, int me,
                        int64_t end_ns, size_t nbuckets)
{
    const int64_t every = (int64_t)o->request_ms * 1000000;
    int64_t next = t->t0_ns + (int64_t)o->phase_ms * 1000000 + every * me / o->procs;
    while (!stop) {
        struct timespec ts = {.tv_sec = next / NS, .tv_nsec = next % NS};
        while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR && !stop)
            ;
        int64_t start = now_ns();
        if (stop || start >= end_ns)
            break;
        for (int i = 0; i < o->depth; i++) {
            if (check(cuLaunchKernel(g->fn, 1, 1, 1, 1, 1, 1, 0, g->stream[0], NULL, NULL),
                      "cuLaunchKernel"))
                return 1;
        }
        if (check(cuStreamSynchronize(g->stream[0]), "cuStreamSynchronize"))
            return 1;
        int64_t end = now_ns();
        tally_add(o, t, me, end, end_ns, nbuckets, (unsigned)o->depth);
        uint32_t n = t->requests[me];
        if (end < end_ns && n < t->max_requests) {
            t->latency_us[(size_t)me * t->max_requests + n] = (uint32_t)((end - start) / 1000);
            t->requests[me] = n + 1;
        }
        while (next <= end) /* a late request makes the missed ones wait for the next tick */
            next += every;
    }
    return 0;
}

/* One process: initialize, say ready, wait for the go, launch and count. */
static int worker(const struct options *o, struct tally *t, size_t nbuckets, int me,
                  int ready_fd, int go_fd)
{
    static struct gpu g; /* 64 streams of events: not on the stack */
    if (gpu_init(o, &g))
        return 1;
    char byte = 'r';
    if (write(ready_fd, &byte, 1) != 1)
        return 1;
    close(ready_fd);
    for (;;) { /* the parent closes it to start */
        ssize_t n = read(go_fd, &byte, 1);
        if (stop)
            return 0;
        if (n == 0)
            break;
        if (n < 0 && errno != EINTR)
            return 1;
    }
    int64_t end_ns = t->t0_ns + (int64_t)(o->seconds * NS);
    return o->request_ms > 0 ? request_loop(o, &g, t, me, end_ns, nbuckets)
                             : busy_loop(o, &g, t, me, end_ns, nbuckets);
}

/* Wait until every process said ready; 0, or 1 when one died first. */
static int wait_ready(int ready_fd, int procs)
{
    int ready = 0;
    while (ready < procs) {
        if (stop)
            return 1;
        struct pollfd p = {.fd = ready_fd, .events = POLLIN};
        if (poll(&p, 1, 100) > 0) {
            char buf[MAX_PROCS];
            ssize_t n = read(ready_fd, buf, sizeof(buf));
            if (n > 0)
                ready += (int)n;
        }
        for (int i = 0; i < procs; i++) {
            int status;
            if (children[i] > 0 && waitpid(children[i], &status, WNOHANG) == children[i]) {
                children[i] = 0;
                fprintf(stderr, "sharework: process %d exited before it was ready\n", i);
                return 1;
            }
        }
    }
    return 0;
}

/* t0 in ns: "go T" gives it (slept until), "go" or no --go-stdin gives now; -1 on EOF. */
static int64_t wait_go(const struct options *o)
{
    char line[128];
    if (!o->go_stdin)
        return now_ns();
    if (!fgets(line, sizeof(line), stdin))
        return -1;
    double at = strncmp(line, "go", 2) == 0 ? strtod(line + 2, NULL) : 0;
    if (at <= 0)
        return now_ns();
    int64_t t0 = (int64_t)(at * NS);
    struct timespec ts = {.tv_sec = t0 / NS, .tv_nsec = t0 % NS};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR && !stop)
        ;
    return t0;
}

static void report(const struct options *o, const struct tally *t, size_t nbuckets)
{
    uint64_t total = 0;
    for (int i = 0; i < o->procs; i++)
        total += t->per_proc[i];
    printf("counts t0=%" PRId64 ".%09" PRId64 " bucket_ms=%d seconds=%g procs=%d kernels=%" PRIu64
           " per_proc=",
           t->t0_ns / NS, t->t0_ns % NS, o->bucket_ms, o->seconds, o->procs, total);
    for (int i = 0; i < o->procs; i++)
        printf("%s%" PRIu64, i ? "," : "", t->per_proc[i]);
    printf("\nbuckets");
    for (size_t b = 0; b < nbuckets; b++)
        printf(" %" PRIu32, t->buckets[b]);
    if (o->request_ms > 0) {
        printf("\nlatency_us");
        for (int i = 0; i < o->procs; i++) {
            for (uint32_t n = 0; n < t->requests[i]; n++)
                printf(" %" PRIu32, t->latency_us[(size_t)i * t->max_requests + n]);
        }
    }
    printf("\n");
    fflush(stdout);
}

static int usage(void)
{
    fprintf(stderr, "usage: sharework --us US --seconds S [--procs P] [--depth N] "
                    "[--streams N] [--request-ms MS] [--phase-ms MS] [--bucket-ms MS] [--device N] "
                    "[--go-stdin]\n");
    return 2;
}

static int parse(int argc, char **argv, struct options *o)
{
    *o = (struct options){.procs = 1, .depth = 2, .streams = 1, .bucket_ms = 10};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--go-stdin") == 0)
            o->go_stdin = 1;
        else if (v && strcmp(a, "--us") == 0)
            o->us = (unsigned)strtoul(v, NULL, 10), i++;
        else if (v && strcmp(a, "--seconds") == 0)
            o->seconds = strtod(v, NULL), i++;
        else if (v && strcmp(a, "--procs") == 0)
            o->procs = atoi(v), i++;
        else if (v && strcmp(a, "--depth") == 0)
            o->depth = atoi(v), i++;
        else if (v && strcmp(a, "--streams") == 0)
            o->streams = atoi(v), i++;
        else if (v && strcmp(a, "--request-ms") == 0)
            o->request_ms = atoi(v), i++;
        else if (v && strcmp(a, "--phase-ms") == 0)
            o->phase_ms = atoi(v), i++;
        else if (v && strcmp(a, "--bucket-ms") == 0)
            o->bucket_ms = atoi(v), i++;
        else if (v && strcmp(a, "--device") == 0)
            o->device = atoi(v), i++;
        else
            return -1;
    }
    if (o->seconds <= 0 || o->seconds > 86400 || o->procs < 1 || o->procs > MAX_PROCS ||
        o->depth < 1 || o->depth > MAX_DEPTH || o->streams < 1 || o->streams > MAX_STREAMS ||
        o->request_ms < 0 || o->phase_ms < 0 || o->bucket_ms < 1 || o->device < 0)
        return -1;
    return 0;
}

int main(int argc, char **argv)
{
    struct options o;
    if (parse(argc, argv, &o) != 0)
        return usage();
    size_t nbuckets = (size_t)(o.seconds * 1000 / o.bucket_ms) + 1;
    size_t max_requests = o.request_ms > 0 ? (size_t)(o.seconds * 1000 / o.request_ms) + 1 : 0;
    size_t size = sizeof(struct tally) + nbuckets * sizeof(uint32_t);
    size_t lat_size = (size_t)o.procs * max_requests * sizeof(uint32_t) + 1;
    struct tally *t = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    uint32_t *lat = mmap(NULL, lat_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1,
                         0);
    int ready_pipe[2], go_pipe[2];
    if (t == MAP_FAILED || lat == MAP_FAILED || pipe(ready_pipe) != 0 || pipe(go_pipe) != 0) {
        perror("sharework");
        return 1;
    }
    t->latency_us = lat;
    t->max_requests = max_requests;
    struct sigaction sa = {.sa_handler = on_term}; /* no SA_RESTART: waits return EINTR */
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);

    sigset_t term, old;
    sigemptyset(&term);
    sigaddset(&term, SIGTERM);
    sigaddset(&term, SIGINT);
    fflush(stdout);
    for (int i = 0; i < o.procs; i++) {
        sigprocmask(SIG_BLOCK, &term, &old); /* the handler sees the table whole */
        pid_t pid = fork();
        if (pid == 0) {
            nchildren = 0;
            sigprocmask(SIG_SETMASK, &old, NULL);
            close(ready_pipe[0]);
            close(go_pipe[1]);
            _exit(worker(&o, t, nbuckets, i, ready_pipe[1], go_pipe[0]));
        }
        if (pid > 0)
            children[nchildren++] = pid;
        sigprocmask(SIG_SETMASK, &old, NULL);
        if (pid < 0) {
            perror("sharework: fork");
            kill_all(SIGKILL);
            return 1;
        }
    }
    close(ready_pipe[1]);
    close(go_pipe[0]);
    int failed = wait_ready(ready_pipe[0], o.procs);
    if (!failed) {
        printf("ready pid=%d procs=%d\n", (int)getpid(), o.procs);
        fflush(stdout);
        t->t0_ns = wait_go(&o);
        failed = t->t0_ns < 0;
    }
    if (failed)
        kill_all(SIGKILL);
    close(go_pipe[1]); /* go: every process starts now */

    for (int i = 0; i < o.procs; i++) {
        int status = 0;
        while (children[i] > 0 && waitpid(children[i], &status, 0) < 0) {
            if (errno != EINTR)
                return 1;
        }
        if (children[i] > 0 && (!WIFEXITED(status) || WEXITSTATUS(status) != 0))
            failed = 1;
    }
    if (t->t0_ns > 0)
        report(&o, t, nbuckets);
    return failed;
}
