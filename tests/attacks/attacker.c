/*
 * attacker: a hostile process for tests/attacks, run inside a container.
 *
 *   attacker [COMMAND ...]     each argument is one command line; without
 *                              arguments, one command per line of stdin
 *
 * Every command prints exactly one line (its name first) and flushes, so a
 * test can drive it step by step through a pipe. It is an ordinary
 * dynamically linked CUDA driver-API program: libcgpu, preloaded through the
 * container's /etc/ld.so.preload, sees every call it makes.
 *
 *   ready                        pid, pid namespace inode, uid
 *   alloc BYTES                  cuMemAlloc (keeps the pointer); rc
 *   freeall                      cuMemFree of everything held
 *   info                         cuMemGetInfo: free, total
 *   nvml                         nvmlDeviceGetMemoryInfo of device 0 (dlopen): total, used
 *   launch N US                  N kernels sleep_US on the legacy stream, then synchronize
 *   ahead SECONDS US             with librawlaunch.so preloaded: kernels sleep_US for
 *                                SECONDS in its grants, keeping the gate's protocol itself
 *                                and answering each grant's close to come at once, with a
 *                                ring (cmd_ahead): launches, answers
 *   write PATH OFFSET HEX        open O_WRONLY and pwrite the bytes: "ok" or the errno name
 *   mapwrite PATH                open O_RDWR; mmap PROT_WRITE of an O_RDONLY descriptor;
 *                                mprotect PROT_WRITE of a read-only mapping: errno names
 *   control                      the region's control part as this process reads it
 *   slot                         this process's slot in the account part
 *   forge-own PID PIDNS MEM      rewrite this process's slot: pid, pid namespace, GPU 0 bytes
 *   rename HEX                   prctl(PR_SET_NAME) to these bytes (any, UTF-8 or not)
 *   forge I PID PIDNS START MEM  write slot I as a live slot of someone else
 *   zero                         every slot's bytes held set to 0 (the account "reset")
 *   syscalls                     unshare(CLONE_NEWUSER) and keyctl(GET_KEYRING_ID): "ok" or
 *                                the errno name of each
 *   fuzz SECONDS SEED [slots]    random bytes at random offsets of the account part; with
 *                                "slots", also slots made to look live, waiting, watching
 *                                and answering closes with random figures, the doorbell
 *                                rung each time; each round it also tries to write the
 *                                control part (which must refuse)
 *   sleep MS
 *   exit
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "cuda.h"
#include "region.h"

#define REGION_DIR CGPU_CONTAINER_REGION_DIR
#define MAX_HELD 256

static CUcontext context;
static CUmodule module;
static CUdeviceptr held[MAX_HELD];
static int nheld;

static const char *errno_name(int code)
{
    const char *name = strerrorname_np(code);
    return name != NULL ? name : "E?";
}

static double seconds_since(const struct timespec *t0)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)(now.tv_sec - t0->tv_sec) + (double)(now.tv_nsec - t0->tv_nsec) / 1e9;
}

static CUresult ensure_context(void)
{
    if (context != NULL)
        return CUDA_SUCCESS;
    CUresult rc = cuInit(0);
    CUdevice dev;
    if (rc == CUDA_SUCCESS)
        rc = cuDeviceGet(&dev, 0);
    if (rc == CUDA_SUCCESS)
        rc = cuCtxCreate(&context, 0, dev);
    return rc;
}

static uint64_t pidns_inode(void)
{
    struct stat st;
    return stat("/proc/self/ns/pid", &st) == 0 ? (uint64_t)st.st_ino : 0;
}

static void *map_part(const char *name, size_t size, int writable)
{
    char path[256];
    snprintf(path, sizeof path, "%s/%s", REGION_DIR, name);
    int fd = open(path, (writable ? O_RDWR : O_RDONLY) | O_CLOEXEC);
    if (fd < 0)
        return NULL;
    void *map = mmap(NULL, size, PROT_READ | (writable ? PROT_WRITE : 0), MAP_SHARED, fd, 0);
    close(fd);
    return map == MAP_FAILED ? NULL : map;
}

static struct cgpu_account *account(void)
{
    static struct cgpu_account *mapped;
    if (mapped == NULL)
        mapped = map_part(CGPU_ACCOUNT_NAME, sizeof *mapped, 1);
    return mapped;
}

static struct cgpu_proc *own_slot(void)
{
    struct cgpu_account *a = account();
    if (a == NULL)
        return NULL;
    for (int i = 0; i < CGPU_MAX_PROCS; i++)
        if (a->proc[i].state == CGPU_SLOT_LIVE && a->proc[i].pid == getpid())
            return &a->proc[i];
    return NULL;
}

static int hex_bytes(const char *hex, unsigned char *out, size_t max)
{
    size_t n = strlen(hex);
    if (n % 2 != 0 || n / 2 > max)
        return -1;
    for (size_t i = 0; i < n / 2; i++) {
        unsigned v;
        if (sscanf(hex + 2 * i, "%2x", &v) != 1)
            return -1;
        out[i] = (unsigned char)v;
    }
    return (int)(n / 2);
}

static void cmd_write(const char *path, const char *offset, const char *hex)
{
    unsigned char bytes[256];
    int n = hex_bytes(hex, bytes, sizeof bytes);
    if (n < 0) {
        printf("write bad-hex\n");
        return;
    }
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0) {
        printf("write %s\n", errno_name(errno));
        return;
    }
    ssize_t w = pwrite(fd, bytes, (size_t)n, strtoll(offset, NULL, 0));
    int code = errno;
    close(fd);
    printf("write %s\n", w == n ? "ok" : errno_name(code));
}

static void cmd_mapwrite(const char *path)
{
    const char *open_rdwr = "ok", *map_rw = "ok", *remap = "ok";
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0)
        open_rdwr = errno_name(errno);
    else
        close(fd);
    fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        printf("mapwrite open-rdonly %s\n", errno_name(errno));
        return;
    }
    void *map = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (map == MAP_FAILED)
        map_rw = errno_name(errno);
    else
        munmap(map, 4096);
    map = mmap(NULL, 4096, PROT_READ, MAP_SHARED, fd, 0);
    if (map == MAP_FAILED) {
        remap = "no-read-map";
    } else {
        if (mprotect(map, 4096, PROT_READ | PROT_WRITE) != 0)
            remap = errno_name(errno);
        munmap(map, 4096);
    }
    close(fd);
    printf("mapwrite open_rdwr=%s map_rw=%s mprotect=%s\n", open_rdwr, map_rw, remap);
}

static void cmd_control(void)
{
    const struct cgpu_control *c = map_part(CGPU_CONTROL_NAME, sizeof *c, 0);
    if (c == NULL) {
        printf("control %s\n", errno_name(errno));
        return;
    }
    printf("control limit=%llu gate=%u gate_timeout_ns=%llu mode=%u heartbeat_ns=%llu "
           "oom_script=%.*s\n",
           (unsigned long long)c->gpu[0].limit, c->gpu[0].gate,
           (unsigned long long)c->gate_timeout_ns, c->mode, (unsigned long long)c->heartbeat_ns,
           CGPU_PATH_LEN, c->oom_script);
    munmap((void *)c, sizeof *c);
}

static void cmd_slot(void)
{
    struct cgpu_proc *s = own_slot();
    if (s == NULL) {
        printf("slot none\n");
        return;
    }
    printf("slot index=%ld pid=%d mem=%llu ctx_bytes=%llu pending=%u contexts=%u\n",
           (long)(s - account()->proc), s->pid, (unsigned long long)s->gpu[0].mem,
           (unsigned long long)s->gpu[0].ctx_bytes, s->gpu[0].pending, s->gpu[0].contexts);
}

static void cmd_rename(const char *hex)
{
    char name[16] = {0};
    size_t n = 0;
    for (; n < sizeof name - 1 && hex[2 * n] && hex[2 * n + 1]; n++) {
        unsigned byte;
        if (sscanf(hex + 2 * n, "%2x", &byte) != 1) {
            printf("rename bad-hex\n");
            return;
        }
        name[n] = (char)byte;
    }
    if (prctl(PR_SET_NAME, name, 0, 0, 0) != 0)
        printf("rename %s\n", strerrorname_np(errno));
    else
        printf("rename ok\n");
}

static void cmd_forge_own(int pid, unsigned long long pidns, unsigned long long mem)
{
    struct cgpu_proc *s = own_slot();
    if (s == NULL) {
        printf("forge-own no-slot\n");
        return;
    }
    s->pidns = pidns;
    s->start_time = 0;
    s->gpu[0].mem = mem;
    __atomic_store_n(&s->pid, pid, __ATOMIC_SEQ_CST);
    printf("forge-own ok\n");
}

static void cmd_forge(int index, int pid, unsigned long long pidns, unsigned long long start,
                      unsigned long long mem)
{
    struct cgpu_account *a = account();
    if (a == NULL || index < 0 || index >= CGPU_MAX_PROCS) {
        printf("forge no-account\n");
        return;
    }
    struct cgpu_proc *s = &a->proc[index];
    s->pid = pid;
    s->pidns = pidns;
    s->start_time = start;
    s->gpu[0].mem = mem;
    snprintf(s->comm, sizeof s->comm, "forged");
    __atomic_store_n(&s->state, CGPU_SLOT_LIVE, __ATOMIC_SEQ_CST);
    if (a->slots_used < (uint32_t)index + 1)
        a->slots_used = (uint32_t)index + 1;
    printf("forge ok\n");
}

static void cmd_zero(void)
{
    struct cgpu_account *a = account();
    if (a == NULL) {
        printf("zero no-account\n");
        return;
    }
    int zeroed = 0;
    for (int i = 0; i < CGPU_MAX_PROCS; i++)
        for (int g = 0; g < CGPU_MAX_GPUS; g++)
            if (__atomic_exchange_n(&a->proc[i].gpu[g].mem, 0, __ATOMIC_SEQ_CST) != 0)
                zeroed++;
    printf("zero lines=%d\n", zeroed);
}

static void cmd_syscalls(void)
{
    const char *unshared = unshare(CLONE_NEWUSER) == 0 ? "ok" : errno_name(errno);
    /* KEYCTL_GET_KEYRING_ID (0) of KEY_SPEC_SESSION_KEYRING (-3), not creating it */
    const char *keyctl = syscall(SYS_keyctl, 0, -3, 0) >= 0 ? "ok" : errno_name(errno);
    printf("syscalls unshare=%s keyctl=%s\n", unshared, keyctl);
}

static uint64_t next_random(uint64_t *state)
{
    uint64_t x = *state;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return *state = x;
}

/* Ring GPU g's doorbell, as libcgpu does: the daemon's dispatcher may wake. */
static void ring(int g)
{
    struct cgpu_account *a = account();
    __atomic_fetch_add(&a->doorbell[g], 1, __ATOMIC_SEQ_CST);
    syscall(SYS_futex, &a->doorbell[g], FUTEX_WAKE, INT32_MAX, NULL, NULL, 0);
}

/* A slot that looks like a live process that waits, launches and answers closes, with
 * random figures; then the doorbell rings (the daemon's dispatcher wakes). */
static void forge_random_slot(struct cgpu_account *a, uint64_t *state)
{
    struct cgpu_proc *s = &a->proc[next_random(state) % CGPU_MAX_PROCS];
    int g = (int)(next_random(state) % 2 == 0 ? 0 : next_random(state) % CGPU_MAX_GPUS);
    struct cgpu_proc_gpu *pg = &s->gpu[g];
    s->pid = (int32_t)next_random(state);
    s->pidns = next_random(state);
    s->start_time = next_random(state);
    pg->mem = next_random(state);
    pg->launches = next_random(state);
    pg->hijacked = next_random(state);
    pg->pending = (uint32_t)(next_random(state) % 3);
    pg->watching = (uint32_t)(next_random(state) % 2);
    pg->drained_seq = next_random(state) % 4 == 0 ? next_random(state) : pg->drained_seq + 1;
    pg->drained_ns = next_random(state);
    pg->ctx_bytes = next_random(state);
    s->state = CGPU_SLOT_LIVE;
    a->slots_used = (uint32_t)(next_random(state) % (2 * CGPU_MAX_PROCS));
    ring(g);
}

static void cmd_fuzz(double seconds, unsigned long long seed, int slots)
{
    unsigned char *a = (unsigned char *)account();
    if (a == NULL) {
        printf("fuzz no-account %s\n", errno_name(errno));
        return;
    }
    char control[256];
    snprintf(control, sizeof control, "%s/%s", REGION_DIR, CGPU_CONTROL_NAME);
    uint64_t state = seed | 1, writes = 0, control_writes = 0;
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (;;) {
        for (int i = 0; i < 4096; i++) {
            uint64_t r = next_random(&state);
            size_t offset = (size_t)(r % sizeof(struct cgpu_account));
            size_t len = 1 + (size_t)((r >> 40) % 8);
            if (offset + len > sizeof(struct cgpu_account))
                len = sizeof(struct cgpu_account) - offset;
            uint64_t bytes = next_random(&state);
            memcpy(a + offset, &bytes, len);
            writes++;
            if (slots && i % 64 == 0) {
                forge_random_slot((struct cgpu_account *)a, &state);
                writes++;
            }
        }
        int fd = open(control, O_RDWR | O_CLOEXEC);
        if (fd >= 0) {
            uint64_t bytes = next_random(&state);
            if (pwrite(fd, &bytes, sizeof bytes,
                       (off_t)(bytes % sizeof(struct cgpu_control))) > 0)
                control_writes++;
            close(fd);
        }
        struct timespec pause = {0, 1000000}; /* leave the host's two cores some air */
        nanosleep(&pause, NULL);
        if (seconds_since(&t0) >= seconds)
            break;
    }
    printf("fuzz writes=%llu control_writes=%llu\n", (unsigned long long)writes,
           (unsigned long long)control_writes);
}

/* The context, and simgpu's kernel that sleeps `us` microseconds. */
static CUresult sleep_kernel(const char *us, CUfunction *f)
{
    CUresult rc = ensure_context();
    char name[64];
    snprintf(name, sizeof name, "sleep_%s", us);
    if (rc == CUDA_SUCCESS && module == NULL)
        rc = cuModuleLoadData(&module, "attacker");
    if (rc == CUDA_SUCCESS)
        rc = cuModuleGetFunction(f, module, name);
    return rc;
}

static void cmd_launch(int n, const char *us)
{
    CUfunction f = NULL;
    CUresult rc = sleep_kernel(us, &f);
    int done = 0;
    for (; rc == CUDA_SUCCESS && done < n; done++)
        rc = cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
    if (rc == CUDA_SUCCESS)
        rc = cuCtxSynchronize();
    printf("launch n=%d rc=%d\n", done, (int)rc);
}

static uint64_t now_ns(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (uint64_t)now.tv_sec * 1000000000ULL + (uint64_t)now.tv_nsec;
}

/* Run with LD_PRELOAD=/librawlaunch.so, so that its launches pass libcgpu's gate and
 * no libcgpu watcher answers for it: it keeps the gate's protocol itself, as a liar.
 * Its slot says it watches closes and closes itself at the slice's end. While its
 * gate is closed it asks for the GPU (pending, one ring); at each grant it answers
 * the close to come at once, as drained, with a ring; it launches `us` kernels one at
 * a time until the end it was told, then stops and says it waits (pending), with no
 * ring. For `seconds`. */
static void cmd_ahead(double seconds, const char *us)
{
    CUfunction f = NULL;
    CUresult rc = sleep_kernel(us, &f);
    const struct cgpu_control *c = map_part(CGPU_CONTROL_NAME, sizeof *c, 0);
    struct cgpu_proc *s = rc == CUDA_SUCCESS ? own_slot() : NULL;
    if (c == NULL || s == NULL) {
        printf("ahead no-region rc=%d\n", (int)rc);
        return;
    }
    const struct cgpu_gpu *g = &c->gpu[0];
    struct cgpu_proc_gpu *mine = &s->gpu[0];
    __atomic_store_n(&mine->closes_itself, 1, __ATOMIC_SEQ_CST);
    __atomic_store_n(&mine->watching, 1, __ATOMIC_SEQ_CST);
    uint64_t answered_grant = 0, launches = 0, answers = 0;
    int asked = 0;
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    while (rc == CUDA_SUCCESS && seconds_since(&t0) < seconds) {
        uint64_t grant = __atomic_load_n(&g->grant_ns, __ATOMIC_SEQ_CST);
        uint32_t gate = __atomic_load_n(&g->gate, __ATOMIC_SEQ_CST);
        uint64_t end = __atomic_load_n(&g->close_at_ns, __ATOMIC_SEQ_CST);
        int closed = gate != CGPU_GATE_OPEN || grant == 0;
        if (closed || (grant == answered_grant && end != 0 && now_ns() >= end)) {
            if (!asked) { /* it wants more, but says so with a ring only at a closed gate */
                __atomic_store_n(&mine->pending, 1, __ATOMIC_SEQ_CST);
                if (closed)
                    ring(0);
                asked = 1;
            }
            struct timespec pause = {0, 100000};
            nanosleep(&pause, NULL);
            continue;
        }
        if (grant != answered_grant) {
            __atomic_store_n(&mine->pending, 0, __ATOMIC_SEQ_CST);
            asked = 0;
            __atomic_store_n(&mine->drained_ns, now_ns(), __ATOMIC_SEQ_CST);
            __atomic_store_n(&mine->drained_seq, __atomic_load_n(&g->close_seq,
                                                                 __ATOMIC_SEQ_CST) + 1,
                             __ATOMIC_SEQ_CST);
            ring(0);
            answered_grant = grant;
            answers++;
        }
        rc = cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
        __atomic_fetch_add(&mine->launches, 1, __ATOMIC_SEQ_CST);
        launches++;
        if (rc == CUDA_SUCCESS)
            rc = cuCtxSynchronize();
    }
    __atomic_store_n(&mine->pending, 0, __ATOMIC_SEQ_CST);
    printf("ahead launches=%llu answers=%llu rc=%d\n", (unsigned long long)launches,
           (unsigned long long)answers, (int)rc);
}

static void cmd_nvml(void)
{
    typedef int (*init_fn)(void);
    typedef int (*handle_fn)(unsigned, void **);
    typedef int (*memory_fn)(void *, unsigned long long *);
    void *lib = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    if (lib == NULL) {
        printf("nvml no-library\n");
        return;
    }
    init_fn init = (init_fn)dlsym(lib, "nvmlInit_v2");
    handle_fn handle = (handle_fn)dlsym(lib, "nvmlDeviceGetHandleByIndex_v2");
    memory_fn memory = (memory_fn)dlsym(lib, "nvmlDeviceGetMemoryInfo");
    unsigned long long info[3] = {0, 0, 0}; /* nvmlMemory_t: total, free, used */
    void *dev = NULL;
    int rc = init && handle && memory ? init() : -1;
    if (rc == 0)
        rc = handle(0, &dev);
    if (rc == 0)
        rc = memory(dev, info);
    printf("nvml total=%llu used=%llu rc=%d\n", info[0], info[2], rc);
}

static void run(char *line)
{
    char *argv[8] = {0};
    int argc = 0;
    for (char *save = NULL, *word = strtok_r(line, " \t\n", &save); word && argc < 8;
         word = strtok_r(NULL, " \t\n", &save))
        argv[argc++] = word;
    if (argc == 0)
        return;
    const char *op = argv[0];
#define ARG(i) (argc > (i) ? argv[i] : "0")
    if (strcmp(op, "ready") == 0) {
        printf("ready pid=%d pidns=%llu uid=%d\n", (int)getpid(),
               (unsigned long long)pidns_inode(), (int)getuid());
    } else if (strcmp(op, "alloc") == 0) {
        CUresult rc = ensure_context();
        CUdeviceptr p = 0;
        if (rc == CUDA_SUCCESS)
            rc = cuMemAlloc(&p, strtoull(ARG(1), NULL, 0));
        if (rc == CUDA_SUCCESS && nheld < MAX_HELD)
            held[nheld++] = p;
        printf("alloc rc=%d\n", (int)rc);
    } else if (strcmp(op, "freeall") == 0) {
        while (nheld > 0)
            cuMemFree(held[--nheld]);
        printf("freeall ok\n");
    } else if (strcmp(op, "info") == 0) {
        size_t free_bytes = 0, total = 0;
        CUresult rc = ensure_context();
        if (rc == CUDA_SUCCESS)
            rc = cuMemGetInfo(&free_bytes, &total);
        printf("info free=%zu total=%zu rc=%d\n", free_bytes, total, (int)rc);
    } else if (strcmp(op, "nvml") == 0) {
        cmd_nvml();
    } else if (strcmp(op, "launch") == 0) {
        cmd_launch(atoi(ARG(1)), ARG(2));
    } else if (strcmp(op, "ahead") == 0) {
        cmd_ahead(atof(ARG(1)), ARG(2));
    } else if (strcmp(op, "write") == 0) {
        cmd_write(ARG(1), ARG(2), ARG(3));
    } else if (strcmp(op, "mapwrite") == 0) {
        cmd_mapwrite(ARG(1));
    } else if (strcmp(op, "control") == 0) {
        cmd_control();
    } else if (strcmp(op, "slot") == 0) {
        cmd_slot();
    } else if (strcmp(op, "forge-own") == 0) {
        cmd_forge_own(atoi(ARG(1)), strtoull(ARG(2), NULL, 0), strtoull(ARG(3), NULL, 0));
    } else if (strcmp(op, "rename") == 0) {
        cmd_rename(ARG(1));
    } else if (strcmp(op, "forge") == 0) {
        cmd_forge(atoi(ARG(1)), atoi(ARG(2)), strtoull(ARG(3), NULL, 0),
                  strtoull(ARG(4), NULL, 0), strtoull(ARG(5), NULL, 0));
    } else if (strcmp(op, "syscalls") == 0) {
        cmd_syscalls();
    } else if (strcmp(op, "zero") == 0) {
        cmd_zero();
    } else if (strcmp(op, "fuzz") == 0) {
        cmd_fuzz(atof(ARG(1)), strtoull(ARG(2), NULL, 0), strcmp(ARG(3), "slots") == 0);
    } else if (strcmp(op, "sleep") == 0) {
        usleep((useconds_t)atoi(ARG(1)) * 1000);
        printf("sleep ok\n");
    } else if (strcmp(op, "exit") == 0) {
        exit(0);
    } else {
        printf("unknown %s\n", op);
    }
#undef ARG
    fflush(stdout);
}

int main(int argc, char **argv)
{
    if (argc > 1) {
        for (int i = 1; i < argc; i++)
            run(argv[i]);
        return 0;
    }
    char line[1024];
    while (fgets(line, sizeof line, stdin) != NULL)
        run(line);
    return 0;
}
