/*
 * region.c: the container's shared region seen from one process.
 *
 * Attach (the hook's /run/cgpu, else $CGPU_REGION), claim and release this
 * process's slot, reclaim the slots of dead processes, the exact
 * container-wide limit check, the eGPU OOM path and the gate. See region.h
 * for the rules that keep it lock free.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cgpu.h"

extern char **environ;

const struct cgpu_control *cgpu_region_ptr;
struct cgpu_account *cgpu_account_ptr;
struct cgpu_proc *cgpu_slot_ptr;

static pthread_once_t region_once = PTHREAD_ONCE_INIT;
static pthread_mutex_t claim_lock = PTHREAD_MUTEX_INITIALIZER; /* process-local */
static uint64_t my_pidns;
static pid_t my_pid;                 /* this process's pid and start time, read at its */
static uint64_t my_start;            /* slot's claim */
/* What this process holds per GPU by its own count: the account part can be
 * rewritten by the container, this copy only by the process itself. */
static uint64_t my_bytes[CGPU_MAX_GPUS];

void cgpu_log(const char *fmt, ...)
{
    char buf[512];
    int n = snprintf(buf, sizeof buf, "libcgpu[%d]: ", (int)getpid());
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(buf + n, sizeof buf - (size_t)n - 1, fmt, ap);
    va_end(ap);
    size_t len = (size_t)n + (m < 0 ? 0 : (size_t)m);
    if (len > sizeof buf - 2)
        len = sizeof buf - 2;
    buf[len++] = '\n';
    ssize_t w = write(2, buf, len);
    (void)w;
}

uint64_t cgpu_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static uint64_t pidns_inode(void)
{
    struct stat st;
    return stat("/proc/self/ns/pid", &st) == 0 ? (uint64_t)st.st_ino : 0;
}

/* State letter and start time (field 22) of a process from /proc (pid 0:
 * this one); 0 on success. */
static int proc_stat(pid_t pid, char *state, uint64_t *start_time)
{
    char path[64], buf[1024];
    if (pid == 0)
        snprintf(path, sizeof path, "/proc/self/stat");
    else
        snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -errno;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return -EIO;
    buf[n] = '\0';
    char *p = strrchr(buf, ')'); /* comm may contain spaces and parentheses */
    if (p == NULL || p[1] != ' ')
        return -EIO;
    p += 2;
    *state = *p;
    /* p is at field 3; skip to field 22 */
    for (int field = 3; field < 22; field++) {
        p = strchr(p, ' ');
        if (p == NULL)
            return -EIO;
        p++;
    }
    *start_time = strtoull(p, NULL, 10);
    return 0;
}

/* Whether this /proc shows our own pid namespace (a job given a pid namespace
 * without a /proc of its own sees the host's): only then do its pids mean
 * what ours do. Looked at once. */
static int proc_is_ours(void)
{
    static int known = -1;
    if (known < 0) {
        char link[32];
        ssize_t n = readlink("/proc/self", link, sizeof link - 1);
        if (n > 0)
            link[n] = '\0';
        known = n > 0 && strtol(link, NULL, 10) == (long)getpid();
    }
    return known;
}

/* Is the process (pid in pid namespace ns, started at `want`) still running?
 * Unknown counts as alive (the daemon, which asks the kernel, reclaims what
 * is left). */
static int process_alive(pid_t pid, uint64_t ns, uint64_t want)
{
    if (pid <= 0 || !proc_is_ours())
        return 1;
    if (ns != 0 && my_pidns != 0 && ns != my_pidns)
        return 1; /* another pid namespace: its pids mean nothing here */
    char state;
    uint64_t start;
    int rc = proc_stat(pid, &state, &start);
    if (rc == -ENOENT)
        return 0;
    if (rc == 0) {
        if (state == 'Z' || state == 'X')
            return 0;
        return want == 0 || start == want;
    }
    return kill(pid, 0) == 0 || errno == EPERM;
}

static int slot_owner_alive(const struct cgpu_proc *s)
{
    pid_t pid = __atomic_load_n(&s->pid, __ATOMIC_ACQUIRE);
    return process_alive(pid, __atomic_load_n(&s->pidns, __ATOMIC_RELAXED),
                         __atomic_load_n(&s->start_time, __ATOMIC_RELAXED));
}

static void slot_zero_usage(struct cgpu_proc *s)
{
    for (int g = 0; g < CGPU_MAX_GPUS; g++) {
        struct cgpu_proc_gpu *pg = &s->gpu[g];
        __atomic_store_n(&pg->mem, 0, __ATOMIC_SEQ_CST);
        __atomic_store_n(&pg->inflight, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&pg->pending, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&pg->contexts, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&pg->watching, 0, __ATOMIC_RELAXED);
        pg->launches = pg->hijacked = pg->gate_wait_ns = 0;
        pg->allocs = pg->oom_refusals = pg->ctx_bytes = 0;
        pg->drained_seq = pg->drained_ns = 0;
    }
}

static uint32_t slots_used(const struct cgpu_account *a)
{
    uint32_t n = __atomic_load_n(&a->slots_used, __ATOMIC_ACQUIRE);
    return n > CGPU_MAX_PROCS ? CGPU_MAX_PROCS : n;
}

/* Free the live slots (other than this process's) that `gone` picks. */
static int reclaim_if(int (*gone)(const struct cgpu_proc *s, const void *arg), const void *arg)
{
    struct cgpu_account *a = cgpu_account_ptr;
    if (a == NULL)
        return 0;
    int reclaimed = 0;
    uint32_t n = slots_used(a);
    for (uint32_t i = 0; i < n; i++) {
        struct cgpu_proc *s = &a->proc[i];
        if (s == cgpu_slot_ptr || __atomic_load_n(&s->state, __ATOMIC_ACQUIRE) != CGPU_SLOT_LIVE)
            continue;
        int32_t pid = __atomic_load_n(&s->pid, __ATOMIC_ACQUIRE);
        uint64_t start = __atomic_load_n(&s->start_time, __ATOMIC_ACQUIRE);
        if (!gone(s, arg))
            continue;
        uint32_t expect = CGPU_SLOT_LIVE;
        if (!__atomic_compare_exchange_n(&s->state, &expect, CGPU_SLOT_RECLAIMING, 0,
                                         __ATOMIC_SEQ_CST, __ATOMIC_ACQUIRE))
            continue;
        /* The slot may have been reclaimed and claimed by a new process since
         * we looked (ABA): then it is not ours to zero. */
        if (__atomic_load_n(&s->pid, __ATOMIC_SEQ_CST) != pid ||
            __atomic_load_n(&s->start_time, __ATOMIC_SEQ_CST) != start) {
            __atomic_store_n(&s->state, CGPU_SLOT_LIVE, __ATOMIC_SEQ_CST);
            continue;
        }
        slot_zero_usage(s);
        __atomic_store_n(&s->pid, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&s->state, CGPU_SLOT_FREE, __ATOMIC_RELEASE);
        reclaimed++;
    }
    return reclaimed;
}

static int owner_gone(const struct cgpu_proc *s, const void *arg)
{
    (void)arg;
    return !slot_owner_alive(s);
}

int cgpu_reclaim_dead(void)
{
    return reclaim_if(owner_gone, NULL);
}

/* A slot of this very process before it called exec (same pid, namespace and
 * start time): its memory went with the old image. */
static int before_exec(const struct cgpu_proc *s, const void *arg)
{
    const struct cgpu_proc *me = arg;
    return __atomic_load_n(&s->pid, __ATOMIC_ACQUIRE) == me->pid &&
           __atomic_load_n(&s->pidns, __ATOMIC_RELAXED) == me->pidns &&
           __atomic_load_n(&s->start_time, __ATOMIC_RELAXED) == me->start_time;
}

/* A forked child starts without a slot: the parent's belongs to the parent. */
static void after_fork_child(void)
{
    __atomic_store_n(&cgpu_slot_ptr, NULL, __ATOMIC_RELEASE);
    pthread_mutex_init(&claim_lock, NULL);
    memset(my_bytes, 0, sizeof my_bytes); /* the parent's memory is the parent's */
    my_pid = 0;
    my_start = 0;
    cgpu_launch_after_fork();
    cgpu_watch_after_fork();
    cgpu_track_after_fork();
    cgpu_hooks_after_fork();
}

/* No slot is released at exit: the driver frees a process's memory only as
 * it dies, so its bytes leave the total when it is gone (reclaim), never
 * before. */

/* Map one file of the region: 0 on success, else a reason has been logged. */
static void *map_file(const char *dir, const char *name, size_t size, int writable)
{
    char path[CGPU_PATH_LEN + 16];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    int fd = open(path, (writable ? O_RDWR : O_RDONLY) | O_CLOEXEC);
    if (fd < 0) {
        if (errno != ENOENT || writable) /* no region there at all: pass-through, silently */
            cgpu_log("cannot open %s: %s", path, strerror(errno));
        return NULL;
    }
    struct stat st;
    void *map = MAP_FAILED;
    if (fstat(fd, &st) == 0 && (size_t)st.st_size >= size)
        map = mmap(NULL, size, PROT_READ | (writable ? PROT_WRITE : 0), MAP_SHARED, fd, 0);
    close(fd);
    if (map == MAP_FAILED) {
        cgpu_log("%s is too small or cannot be mapped", path);
        return NULL;
    }
    return map;
}

/* Whether `path` is the root of a mount: 1 yes, 0 no, -1 when the kernel
 * cannot tell (statx without STATX_ATTR_MOUNT_ROOT, before Linux 5.8, or
 * statx refused by a seccomp filter). The last link of `path` is followed,
 * as the hook's walk followed it when it mounted the file. */
#ifndef STATX_ATTR_MOUNT_ROOT
#define STATX_ATTR_MOUNT_ROOT 0x00002000 /* linux/stat.h of Linux 5.8 */
#endif
static int mount_root(const char *path)
{
    struct statx sx;
    if (statx(AT_FDCWD, path, 0, STATX_INO, &sx) != 0)
        return errno == ENOENT || errno == ENOTDIR ? 0 : -1;
    if (!(sx.stx_attributes_mask & STATX_ATTR_MOUNT_ROOT))
        return -1;
    return (sx.stx_attributes & STATX_ATTR_MOUNT_ROOT) != 0;
}

/* The region directory, by one rule (docs/design.md, "Which region"):
 *
 * 1. /run/cgpu when /run/cgpu/control is a mount point: the hook's bind
 *    mount, so this process runs in a container the hook started, and no
 *    environment can take it out of its region (an empty or forged
 *    $CGPU_REGION changes nothing). Only the hook, or root on the host,
 *    mounts a file there: the hook never mounts onto a filesystem that the
 *    host also has mounted.
 * 2. Else $CGPU_REGION when it is set and not empty (cgpu-run sets it): a
 *    host job's region is the one it was given, whatever lies at /run/cgpu.
 * 3. Else none: pass-through. A /run/cgpu/control that is a plain file (left
 *    on a host's /run by anything) is no region.
 *
 * When the kernel cannot tell a mount point, an existing /run/cgpu/control
 * counts as one (the rule before statx could tell): a container stays in
 * its region. */
static const char *region_dir(void)
{
    static const char control[] = CGPU_CONTAINER_REGION_DIR "/" CGPU_CONTROL_NAME;
    int mounted = mount_root(control);
    if (mounted < 0)
        mounted = access(control, F_OK) == 0;
    if (mounted)
        return CGPU_CONTAINER_REGION_DIR;
    const char *dir = getenv("CGPU_REGION");
    return dir != NULL && dir[0] != '\0' ? dir : NULL;
}

static void region_attach(void)
{
    const char *dir = region_dir();
    if (dir == NULL)
        return;
    const struct cgpu_control *c = map_file(dir, CGPU_CONTROL_NAME, sizeof *c, 0);
    if (c == NULL) {
        if (errno != ENOENT)
            cgpu_log("region %s unusable; running without limits", dir);
        return;
    }
    if (c->magic != CGPU_CONTROL_MAGIC || c->version != CGPU_REGION_VERSION ||
        c->size != sizeof *c || c->ngpus == 0 || c->ngpus > CGPU_MAX_GPUS) {
        cgpu_log("region %s has an unknown layout (version %u, want %u); running without limits",
                 dir, c->version, CGPU_REGION_VERSION);
        munmap((void *)c, sizeof *c);
        return;
    }
    /* Without its account a process cannot charge what it allocates: then it
     * allocates nothing (no slot), but gates and views still apply. */
    struct cgpu_account *a = map_file(dir, CGPU_ACCOUNT_NAME, sizeof *a, 1);
    if (a != NULL && (a->magic != CGPU_ACCOUNT_MAGIC || a->version != CGPU_REGION_VERSION ||
                      a->size != sizeof *a)) {
        cgpu_log("account of region %s has an unknown layout", dir);
        munmap(a, sizeof *a);
        a = NULL;
    }
    if (a == NULL)
        cgpu_log("no process accounting in region %s: GPU allocations are refused", dir);
    my_pidns = pidns_inode();
    pthread_atfork(NULL, NULL, after_fork_child);
    __atomic_store_n(&cgpu_account_ptr, a, __ATOMIC_RELEASE);
    __atomic_store_n(&cgpu_region_ptr, c, __ATOMIC_RELEASE);
}

const struct cgpu_control *cgpu_region_attach(void)
{
    pthread_once(&region_once, region_attach);
    return __atomic_load_n(&cgpu_region_ptr, __ATOMIC_ACQUIRE);
}

static void read_comm(char *out, size_t len)
{
    memset(out, 0, len);
    int fd = open("/proc/self/comm", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return;
    ssize_t n = read(fd, out, len - 1);
    close(fd);
    if (n > 0 && out[n - 1] == '\n')
        out[n - 1] = '\0';
}

/* What hooks.c's self-check found (cgpu_report_hijacked), on each GPU line. */
static uint64_t my_hijacked;

static void put_hijacked(struct cgpu_proc *s)
{
    uint32_t n = cgpu_region_ptr != NULL ? cgpu_region_ptr->ngpus : 0;
    uint64_t v = __atomic_load_n(&my_hijacked, __ATOMIC_RELAXED);
    for (uint32_t g = 0; g < n && g < CGPU_MAX_GPUS; g++)
        __atomic_store_n(&s->gpu[g].hijacked, v, __ATOMIC_RELAXED);
}

void cgpu_report_hijacked(uint64_t n)
{
    __atomic_store_n(&my_hijacked, n, __ATOMIC_RELAXED);
    struct cgpu_proc *s = cgpu_region() != NULL ? cgpu_slot() : NULL;
    if (s != NULL)
        put_hijacked(s);
}

struct cgpu_proc *cgpu_slot_claim(void)
{
    struct cgpu_account *r = cgpu_region() != NULL ? cgpu_account_ptr : NULL;
    if (r == NULL)
        return NULL;
    pthread_mutex_lock(&claim_lock);
    struct cgpu_proc *mine = cgpu_slot_ptr;
    if (mine != NULL) {
        pthread_mutex_unlock(&claim_lock);
        return mine;
    }
    cgpu_reclaim_dead();
    pid_t pid = getpid();
    char state;
    uint64_t start = 0;
    if (proc_stat(0, &state, &start) != 0) /* /proc/self: right whatever /proc shows */
        start = 0;
    for (uint32_t i = 0; i < CGPU_MAX_PROCS; i++) {
        struct cgpu_proc *s = &r->proc[i];
        uint32_t expect = CGPU_SLOT_FREE;
        if (!__atomic_compare_exchange_n(&s->state, &expect, CGPU_SLOT_CLAIMING, 0,
                                         __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
            continue;
        slot_zero_usage(s);
        put_hijacked(s);
        s->start_time = start;
        my_pid = pid;
        my_start = start;
        s->pidns = my_pidns;
        s->attach_ns = cgpu_now_ns();
        read_comm(s->comm, sizeof s->comm);
        __atomic_store_n(&s->pid, pid, __ATOMIC_RELEASE);
        /* raise the high-water mark before anything is counted in this slot */
        uint32_t hwm = __atomic_load_n(&r->slots_used, __ATOMIC_ACQUIRE);
        while (hwm < i + 1 &&
               !__atomic_compare_exchange_n(&r->slots_used, &hwm, i + 1, 0, __ATOMIC_ACQ_REL,
                                            __ATOMIC_ACQUIRE))
            ;
        __atomic_store_n(&s->state, CGPU_SLOT_LIVE, __ATOMIC_RELEASE);
        __atomic_store_n(&cgpu_slot_ptr, s, __ATOMIC_RELEASE);
        mine = s;
        reclaim_if(before_exec, s);
        break;
    }
    pthread_mutex_unlock(&claim_lock);
    if (mine == NULL)
        cgpu_log("no free process slot in the region (%d in use); allocations are refused",
                 CGPU_MAX_PROCS);
    return mine;
}

static uint64_t seen_others(const struct cgpu_control *c, int g, int living);

uint64_t cgpu_usage(int g)
{
    struct cgpu_account *r = cgpu_account_ptr;
    if (r == NULL)
        return 0;
    uint64_t total = 0;
    uint32_t n = slots_used(r);
    for (uint32_t i = 0; i < n; i++)
        total += __atomic_load_n(&r->proc[i].gpu[g].mem, __ATOMIC_SEQ_CST);
    /* what the daemon saw, when the account says less (it was rewritten) */
    const struct cgpu_control *c = cgpu_region_ptr;
    uint64_t seen = c != NULL ? seen_others(c, g, 1) + __atomic_load_n(&my_bytes[g],
                                                                       __ATOMIC_RELAXED)
                              : 0;
    return seen > total ? seen : total;
}

/* Sum of all slots and of the other slots' in-flight reservations. */
static void usage_scan(const struct cgpu_account *r, const struct cgpu_proc *me, int g,
                       uint64_t *total, uint64_t *others_inflight)
{
    uint64_t t = 0, f = 0;
    uint32_t n = slots_used(r);
    for (uint32_t i = 0; i < n; i++) {
        const struct cgpu_proc_gpu *pg = &r->proc[i].gpu[g];
        t += __atomic_load_n(&pg->mem, __ATOMIC_SEQ_CST);
        if (&r->proc[i] != me)
            f += __atomic_load_n(&pg->inflight, __ATOMIC_SEQ_CST);
    }
    *total = t;
    *others_inflight = f;
}

static void sub_clamped(uint64_t *p, uint64_t v)
{
    uint64_t cur = __atomic_load_n(p, __ATOMIC_RELAXED), next;
    do {
        next = cur > v ? cur - v : 0;
    } while (!__atomic_compare_exchange_n(p, &cur, next, 1, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED));
}

/* Randomised backoff, seeded per process so forked racers do not move in step. */
static void backoff(unsigned attempt)
{
    static __thread uint64_t seed;
    if (attempt < 4) {
        sched_yield();
        return;
    }
    if (seed == 0)
        seed = cgpu_now_ns() ^ ((uint64_t)getpid() << 32) ^ (uint64_t)(uintptr_t)&seed;
    seed ^= seed << 13;
    seed ^= seed >> 7;
    seed ^= seed << 17;
    uint64_t spread = attempt < 64 ? attempt : 64;
    struct timespec ts = {0, (long)(1000 + seed % (spread * 1000))};
    nanosleep(&ts, NULL);
}

/* The bytes of the container's other processes on GPU g as the daemon last
 * saw them; with `living`, only of those still running. 0 when the daemon
 * has published nothing for CGPU_SEEN_MAX_AGE_NS. A seqlock read: retried
 * while the daemon writes (a few microseconds), then taken as it is. */
static uint64_t seen_others(const struct cgpu_control *c, int g, int living)
{
    uint64_t total = 0;
    for (unsigned attempt = 0; attempt < 1000; attempt++) {
        uint64_t seq = __atomic_load_n(&c->seen_seq, __ATOMIC_ACQUIRE);
        if (seq & 1) {
            sched_yield();
            continue;
        }
        uint32_t n = __atomic_load_n(&c->nseen, __ATOMIC_RELAXED);
        total = __atomic_load_n(&c->seen_rest[g], __ATOMIC_RELAXED);
        if (n == 0 && total == 0)
            return 0; /* nothing seen: no need to ask the clock */
        uint64_t at = __atomic_load_n(&c->seen_ns, __ATOMIC_RELAXED), now = cgpu_now_ns();
        if (at == 0 || (now > at && now - at > CGPU_SEEN_MAX_AGE_NS))
            return 0;
        for (uint32_t i = 0; i < n && i < CGPU_MAX_SEEN; i++) {
            const struct cgpu_seen *e = &c->seen[i];
            if (e->gpu != (uint32_t)g)
                continue;
            if (e->pid == my_pid && e->pidns == my_pidns && e->start_time == my_start)
                continue; /* this process: counted by its own count */
            if (living && !process_alive(e->pid, e->pidns, e->start_time))
                continue;
            total += e->bytes;
        }
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (__atomic_load_n(&c->seen_seq, __ATOMIC_RELAXED) == seq)
            break;
    }
    return total;
}

/* Whether `size` more bytes on GPU g fit the limit by what the daemon saw the
 * others hold plus this process's own count (which already includes `size`). */
static int seen_room(const struct cgpu_control *c, int g, uint64_t limit)
{
    uint64_t mine = __atomic_load_n(&my_bytes[g], __ATOMIC_RELAXED);
    if (seen_others(c, g, 0) + mine <= limit)
        return 1;
    return seen_others(c, g, 1) + mine <= limit; /* some of them may be gone */
}

int cgpu_reserve(int g, uint64_t size)
{
    const struct cgpu_control *c = cgpu_region_ptr;
    if (c == NULL)
        return 0;
    struct cgpu_account *r = cgpu_account_ptr;
    struct cgpu_proc *me = cgpu_slot();
    if (r == NULL || me == NULL)
        return -1;
    struct cgpu_proc_gpu *pg = &me->gpu[g];
    uint64_t limit = __atomic_load_n(&c->gpu[g].limit, __ATOMIC_ACQUIRE);
    if (limit == 0) { /* the whole device: count, never refuse */
        __atomic_add_fetch(&pg->mem, size, __ATOMIC_SEQ_CST);
        __atomic_add_fetch(&my_bytes[g], size, __ATOMIC_SEQ_CST);
        __atomic_fetch_add(&pg->allocs, 1, __ATOMIC_RELAXED);
        return 0;
    }
    if (size > limit)
        return -1;
    /* this process's own claim first, as for the slots: racing threads each see the other */
    __atomic_add_fetch(&my_bytes[g], size, __ATOMIC_SEQ_CST);
    if (!seen_room(c, g, limit)) {
        sub_clamped(&my_bytes[g], size);
        return -1;
    }
    int reclaimed_once = 0;
    for (unsigned attempt = 0; attempt < 2000; attempt++) {
        /* publish first, then look: whoever of two racers looks last sees both */
        __atomic_add_fetch(&pg->inflight, size, __ATOMIC_SEQ_CST);
        __atomic_add_fetch(&pg->mem, size, __ATOMIC_SEQ_CST);
        uint64_t total, others_inflight;
        usage_scan(r, me, g, &total, &others_inflight);
        if (total <= limit) {
            sub_clamped(&pg->inflight, size);
            __atomic_fetch_add(&pg->allocs, 1, __ATOMIC_RELAXED);
            return 0;
        }
        sub_clamped(&pg->mem, size);
        sub_clamped(&pg->inflight, size);
        int contended = others_inflight > 0 && total - others_inflight <= limit;
        if (!contended) {
            if (!reclaimed_once) {
                reclaimed_once = 1;
                if (cgpu_reclaim_dead() > 0)
                    continue;
            }
            break;
        }
        backoff(attempt); /* another process's check is in flight: try again */
    }
    sub_clamped(&my_bytes[g], size);
    return -1;
}

void cgpu_unreserve(int g, uint64_t size)
{
    struct cgpu_proc *me = cgpu_slot_ptr;
    if (me != NULL && size > 0) {
        sub_clamped(&me->gpu[g].mem, size);
        sub_clamped(&my_bytes[g], size);
    }
}

#define OOM_SCRIPT_NS 5000000000ull

static void set_env_u64(char **slot, const char *name, uint64_t v)
{
    if (asprintf(slot, "%s=%llu", name, (unsigned long long)v) < 0)
        *slot = NULL;
}

/* Run the eGPU OOM script with its information in the environment; wait for it. */
static void run_oom_script(const char *script, const struct cgpu_control *r, int g,
                           uint64_t limit, uint64_t usage, uint64_t request)
{
    size_t n = 0;
    while (environ[n] != NULL)
        n++;
    char **envp = calloc(n + 8, sizeof *envp);
    if (envp == NULL)
        return;
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (strncmp(environ[i], "LD_PRELOAD=", 11) != 0 && strncmp(environ[i], "CGPU_OOM_", 9) != 0)
            envp[k++] = environ[i];
    char *extra[6] = {0};
    if (asprintf(&extra[0], "CGPU_OOM_CONTAINER=%.*s", CGPU_ID_LEN, r->container_id) < 0)
        extra[0] = NULL;
    set_env_u64(&extra[1], "CGPU_OOM_GPU", (uint64_t)g);
    set_env_u64(&extra[2], "CGPU_OOM_LIMIT", limit);
    set_env_u64(&extra[3], "CGPU_OOM_USAGE", usage);
    set_env_u64(&extra[4], "CGPU_OOM_REQUEST", request);
    set_env_u64(&extra[5], "CGPU_OOM_PID", (uint64_t)getpid());
    for (int i = 0; i < 6; i++)
        if (extra[i] != NULL)
            envp[k++] = extra[i];
    envp[k] = NULL;
    char *argv[] = {(char *)script, NULL};
    pid_t child;
    int rc = posix_spawn(&child, script, NULL, NULL, argv, envp);
    if (rc != 0) {
        cgpu_log("cannot run the OOM script %s: %s", script, strerror(rc));
    } else {
        /* It runs in this process's namespaces, as its user; for OOM_SCRIPT_NS at most. */
        uint64_t deadline = cgpu_now_ns() + OOM_SCRIPT_NS;
        int status;
        pid_t done;
        while ((done = waitpid(child, &status, WNOHANG)) == 0 || (done < 0 && errno == EINTR)) {
            if (cgpu_now_ns() >= deadline) {
                cgpu_log("the OOM script %s ran longer than %llu s and was killed", script,
                         (unsigned long long)(OOM_SCRIPT_NS / 1000000000ull));
                kill(child, SIGKILL);
                waitpid(child, &status, 0);
                break;
            }
            struct timespec tick = {0, 10000000};
            nanosleep(&tick, NULL);
        }
    }
    for (int i = 0; i < 6; i++)
        free(extra[i]);
    free(envp);
}

void cgpu_over_limit(int g, uint64_t request)
{
    const struct cgpu_control *r = cgpu_region_ptr;
    struct cgpu_proc *me = cgpu_slot_ptr;
    if (r == NULL)
        return;
    if (me != NULL)
        __atomic_fetch_add(&me->gpu[g].oom_refusals, 1, __ATOMIC_RELAXED);
    if (__atomic_load_n(&r->mode, __ATOMIC_RELAXED) != CGPU_MODE_EGPU)
        return;
    uint64_t limit = r->gpu[g].limit;
    uint64_t usage = cgpu_usage(g);
    char script[CGPU_PATH_LEN + 1];
    const char *env_script = getenv("ALIYUN_COM_GPU_OOM_SCRIPT");
    if (env_script != NULL && env_script[0] != '\0') {
        snprintf(script, sizeof script, "%s", env_script);
    } else {
        memcpy(script, r->oom_script, CGPU_PATH_LEN);
        script[CGPU_PATH_LEN] = '\0';
    }
    cgpu_log("container %.*s GPU %d: out of GPU memory (limit %llu bytes, in use %llu, "
             "requested %llu)%s%s",
             CGPU_ID_LEN, r->container_id, g, (unsigned long long)limit,
             (unsigned long long)usage, (unsigned long long)request,
             script[0] ? "; running OOM script " : "", script);
    if (script[0] != '\0')
        run_oom_script(script, r, g, limit, usage, request);
    cgpu_log("stopping process %d: eGPU memory limit exceeded", (int)getpid());
    kill(getpid(), SIGKILL);
    _exit(137);
}

static long futex_wait(const uint32_t *addr, uint32_t val, uint64_t timeout_ns)
{
    struct timespec ts = {(time_t)(timeout_ns / 1000000000ull), (long)(timeout_ns % 1000000000ull)};
    return syscall(SYS_futex, addr, FUTEX_WAIT, val, &ts, NULL, 0);
}

long cgpu_futex_wait(const uint32_t *addr, uint32_t val, uint64_t timeout_ns)
{
    return futex_wait(addr, val, timeout_ns);
}

void cgpu_ring(int g)
{
    struct cgpu_account *a = cgpu_account_ptr;
    if (a == NULL)
        return;
    __atomic_fetch_add(&a->doorbell[g], 1, __ATOMIC_SEQ_CST);
    syscall(SYS_futex, &a->doorbell[g], FUTEX_WAKE, INT32_MAX, NULL, NULL, 0);
}

/* The gate_changes of the arming each GPU's armed gate last rang for. */
static uint64_t armed_rung[CGPU_MAX_GPUS];

void cgpu_armed_ring(int g)
{
    uint64_t arming = __atomic_load_n(&cgpu_region_ptr->gpu[g].gate_changes, __ATOMIC_ACQUIRE);
    if (__atomic_exchange_n(&armed_rung[g], arming, __ATOMIC_RELAXED) != arming)
        cgpu_ring(g);
}

#define GATE_MAX_SLEEP_NS 100000000ull /* re-check at least every 100 ms */

#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "gate_changes_word: the futex word is the low half of gate_changes"
#endif

/* The futex word a gate's waiters sleep on: the low 32 bits of gate_changes,
 * which the daemon bumps at every change of the gate and wakes. */
static const uint32_t *gate_changes_word(const struct cgpu_control *r, int g)
{
    return (const uint32_t *)&r->gpu[g].gate_changes;
}

/* At the slice's end this process's watcher answers the close to come
 * (close_seq + 1) and rings; the daemon steps on that ring and sees what
 * waits then. A wait that starts before the answer need not ring too: the
 * pending count is stored before this load, the answer before the ring. */
static int answered_ahead(const struct cgpu_control *r, const struct cgpu_proc *me, int g)
{
    uint64_t seq = __atomic_load_n(&r->gpu[g].close_seq, __ATOMIC_SEQ_CST);
    return __atomic_load_n(&me->gpu[g].drained_seq, __ATOMIC_SEQ_CST) == seq + 1;
}

enum cgpu_pass cgpu_gate_wait(int g)
{
    const struct cgpu_control *r = cgpu_region_ptr;
    struct cgpu_proc *me = cgpu_slot();
    const uint32_t *gate = &r->gpu[g].gate;
    uint64_t t0 = cgpu_now_ns();
    uint64_t wake = 0; /* when the last timed wait was to end; 0 = none yet */
    int counted = 0;
    enum cgpu_pass pass = CGPU_PASS_OPENED;
    for (;;) {
        int ended = 0; /* open, but past the slice's end: closed by this process itself */
        /* The count of changes is read before the gate and is the word slept on:
         * a gate that opened and closed again between the gate's load and the
         * sleep (the same value, so a sleep on the gate would miss that grant)
         * changed the count, and the sleep returns at once. */
        uint32_t changes = __atomic_load_n(gate_changes_word(r, g), __ATOMIC_ACQUIRE);
        uint32_t closed = __atomic_load_n(gate, __ATOMIC_ACQUIRE);
        if (closed == CGPU_GATE_OPEN && !(ended = cgpu_past_close(r, g)))
            break;
        if (closed == CGPU_GATE_ARMED) {
            pass = CGPU_PASS_ARMED;
            break;
        }
        uint64_t hb = __atomic_load_n(&r->heartbeat_ns, __ATOMIC_ACQUIRE);
        uint64_t timeout = __atomic_load_n(&r->gate_timeout_ns, __ATOMIC_RELAXED);
        if (timeout == 0)
            timeout = CGPU_DEFAULT_GATE_TIMEOUT_NS;
        uint64_t now = cgpu_now_ns();
        uint64_t age = now > hb ? now - hb : 0;
        if (hb == 0 || age >= timeout) {
            pass = CGPU_PASS_FAILED_OPEN; /* the daemon is gone */
            if (wake != 0 && me != NULL) {
                /* what it judged, for the tests and views: the figures, then when */
                __atomic_store_n(&me->gpu[g].stale_heartbeat_ns, hb, __ATOMIC_RELAXED);
                __atomic_store_n(&me->gpu[g].gate_wake_ns, wake, __ATOMIC_RELAXED);
                __atomic_store_n(&me->gpu[g].failed_open_ns, now, __ATOMIC_RELEASE);
            }
            break;
        }
        /* until the heartbeat is stale, re-checking it at least every 100 ms */
        uint64_t wait = timeout - age;
        if (wait > GATE_MAX_SLEEP_NS)
            wait = GATE_MAX_SLEEP_NS;
        wake = now + wait;
        if (!counted && me != NULL) {
            /* the first waiter of this process tells the daemon it wants the GPU */
            if (__atomic_fetch_add(&me->gpu[g].pending, 1, __ATOMIC_SEQ_CST) == 0 &&
                !(ended && !answered_ahead(r, me, g)))
                cgpu_ring(g);
            counted = 1;
        }
        futex_wait(gate_changes_word(r, g), changes, wait);
    }
    if (counted) {
        __atomic_fetch_sub(&me->gpu[g].pending, 1, __ATOMIC_RELAXED);
        __atomic_fetch_add(&me->gpu[g].gate_wait_ns, cgpu_now_ns() - t0, __ATOMIC_RELAXED);
    }
    return pass;
}
