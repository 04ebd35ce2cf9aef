/*
 * state.c: the shared device model (see state.h for the locking scheme).
 */
#define _GNU_SOURCE
#include "state.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define SIM_MAGIC 0x53494d4750553032ULL /* "SIMGPU02" */
#define SIM_LAYOUT_VERSION 3U
/* Lock bytes live far beyond the mapped data (locks may cover bytes past EOF). */
#define SIM_LOCK_MUTEX_OFF (1LL << 32)
#define SIM_LOCK_SLOT_OFF ((1LL << 32) + 16)

static pthread_mutex_t g_local = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t g_attach = PTHREAD_MUTEX_INITIALIZER;
static struct sim_state *g_state;
static int g_fd = -1;
static int g_self_slot = -1;
static uint64_t g_self_generation;
static int32_t g_self_pid;

/* ---------- time and environment ---------- */

uint64_t sim_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

void sim_sleep_until(uint64_t mono_ns)
{
    if (mono_ns <= sim_now_ns())
        return;
    struct timespec ts = {(time_t)(mono_ns / 1000000000ULL), (long)(mono_ns % 1000000000ULL)};
    /* Wake on time, as a spinning CUDA synchronize would: the default 50 us
     * timer slack would leave the engine idle between dependent kernels. */
    int slack = prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0);
    if (slack > 1)
        prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR)
        ;
    if (slack > 1)
        prctl(PR_SET_TIMERSLACK, (unsigned long)slack, 0, 0, 0);
}

uint64_t sim_env_u64(const char *name, uint64_t dflt)
{
    const char *v = getenv(name);
    uint64_t out;
    if (!v || !*v)
        return dflt;
    if (sim_parse_size(v, &out) != 0) {
        fprintf(stderr, "simgpu: %s=%s is not a number; using %llu\n", name, v,
                (unsigned long long)dflt);
        return dflt;
    }
    return out;
}

uint64_t sim_hash(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ULL; /* splitmix64 */
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

int sim_env_bias_milli(void)
{
    const char *v = getenv("SIMGPU_NVML_PROC_BIAS");
    char *end;
    if (!v || !*v)
        return -1;
    double f = strtod(v, &end);
    if (*end != '\0' || !(f >= 0.0 && f <= 1000.0)) {
        fprintf(stderr, "simgpu: SIMGPU_NVML_PROC_BIAS=%s is not a factor; drawing one per process\n",
                v);
        return -1;
    }
    return (int)(f * 1000.0 + 0.5);
}

/* ---------- parsing (pure) ---------- */

/* "15109MiB", "16GiB", "1073741824", "512B", "64KiB", "1TiB". */
int sim_parse_size(const char *text, uint64_t *out)
{
    static const struct { const char *suffix; unsigned shift; } units[] = {
        {"", 0}, {"B", 0}, {"KiB", 10}, {"MiB", 20}, {"GiB", 30}, {"TiB", 40},
    };
    const char *p = text;
    uint64_t value = 0;
    while (*p == ' ')
        p++;
    if (!isdigit((unsigned char)*p))
        return -1;
    for (; isdigit((unsigned char)*p); p++) {
        uint64_t digit = (uint64_t)(*p - '0');
        if (value > (UINT64_MAX - digit) / 10)
            return -1;
        value = value * 10 + digit;
    }
    size_t len = strlen(p);
    while (len > 0 && p[len - 1] == ' ')
        len--;
    for (size_t i = 0; i < sizeof(units) / sizeof(units[0]); i++) {
        if (strlen(units[i].suffix) == len && strncmp(p, units[i].suffix, len) == 0) {
            if (units[i].shift && value > (UINT64_MAX >> units[i].shift))
                return -1;
            *out = value << units[i].shift;
            return 0;
        }
    }
    return -1;
}

static uint64_t fnv1a(const char *s, uint64_t h)
{
    for (; *s; s++) {
        h ^= (unsigned char)*s;
        h *= 0x100000001b3ULL;
    }
    return h;
}

static void default_uuid(int index, const char *name, char *out, size_t len)
{
    char seed[SIM_NAME_LEN + 16];
    snprintf(seed, sizeof(seed), "%d/%s", index, name);
    uint64_t a = fnv1a(seed, 0xcbf29ce484222325ULL);
    uint64_t b = fnv1a(seed, a ^ 0x9e3779b97f4a7c15ULL);
    snprintf(out, len, "GPU-%08x-%04x-%04x-%04x-%012llx", (unsigned)(a >> 32),
             (unsigned)((a >> 16) & 0xffff), (unsigned)(a & 0xffff), (unsigned)(b >> 48),
             (unsigned long long)(b & 0xffffffffffffULL));
}

static int copy_field(char *dst, size_t dstlen, const char *src, size_t n)
{
    while (n > 0 && *src == ' ') {
        src++;
        n--;
    }
    while (n > 0 && src[n - 1] == ' ')
        n--;
    if (n == 0 || n >= dstlen)
        return -1;
    memcpy(dst, src, n);
    dst[n] = '\0';
    return 0;
}

/* SIMGPU_DEVICES: comma list of NAME:MEMORY[:UUID]. Returns the count, or -1
 * with a one-line reason in err. */
int sim_parse_devices(const char *spec, struct sim_device_spec *out, int max, char *err,
                      size_t errlen)
{
    int count = 0;
    const char *p = spec;
    if (!spec || !*spec) {
        snprintf(err, errlen, "empty device list");
        return -1;
    }
    for (;;) {
        const char *end = strchr(p, ',');
        size_t n = end ? (size_t)(end - p) : strlen(p);
        char item[512], memtext[64];
        if (count == max) {
            snprintf(err, errlen, "more than %d devices", max);
            return -1;
        }
        if (n >= sizeof(item)) {
            snprintf(err, errlen, "device %d: entry too long", count);
            return -1;
        }
        memcpy(item, p, n);
        item[n] = '\0';
        char *c1 = strchr(item, ':');
        char *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
        struct sim_device_spec *d = &out[count];
        memset(d, 0, sizeof(*d));
        if (!c1 || copy_field(d->name, sizeof(d->name), item, (size_t)(c1 - item)) != 0) {
            snprintf(err, errlen, "device %d: '%s' is not NAME:MEMORY[:UUID]", count, item);
            return -1;
        }
        size_t memlen = c2 ? (size_t)(c2 - c1 - 1) : strlen(c1 + 1);
        if (copy_field(memtext, sizeof(memtext), c1 + 1, memlen) != 0 ||
            sim_parse_size(memtext, &d->total_bytes) != 0 || d->total_bytes == 0) {
            snprintf(err, errlen, "device %d: bad memory '%.*s' (use bytes, or a number with KiB/MiB/GiB/TiB)",
                     count, (int)memlen, c1 + 1);
            return -1;
        }
        if (c2) {
            if (copy_field(d->uuid, sizeof(d->uuid), c2 + 1, strlen(c2 + 1)) != 0 ||
                strchr(d->uuid, ':')) {
                snprintf(err, errlen, "device %d: bad UUID '%s'", count, c2 + 1);
                return -1;
            }
        } else {
            default_uuid(count, d->name, d->uuid, sizeof(d->uuid));
        }
        for (int i = 0; i < count; i++) {
            if (strcmp(out[i].uuid, d->uuid) == 0) {
                snprintf(err, errlen, "device %d: UUID %s repeats device %d", count, d->uuid, i);
                return -1;
            }
        }
        count++;
        if (!end)
            return count;
        p = end + 1;
    }
}

void sim_traits_for(const char *name, struct sim_traits *out)
{
    static const struct { const char *key; struct sim_traits t; } table[] = {
        {"H200", {132, 2048, 9, 0, 1980000, 3201000, 6144, 52428800}},
        {"H100", {132, 2048, 9, 0, 1980000, 2619000, 5120, 52428800}},
        {"A100", {108, 2048, 8, 0, 1410000, 1215000, 5120, 41943040}},
        {"A10", {72, 1536, 8, 6, 1695000, 6251000, 384, 6291456}},
        {"V100", {80, 2048, 7, 0, 1530000, 877000, 4096, 6291456}},
        {"P100", {56, 2048, 6, 0, 1328000, 715000, 4096, 4194304}},
        {"P4", {20, 2048, 6, 1, 1531000, 3003000, 256, 2097152}},
        {"T4", {40, 1024, 7, 5, 1590000, 5001000, 256, 4194304}},
    };
    for (size_t i = 0; i < sizeof(table) / sizeof(table[0]); i++) {
        if (strstr(name, table[i].key)) {
            *out = table[i].t;
            return;
        }
    }
    *out = table[sizeof(table) / sizeof(table[0]) - 1].t; /* T4-like */
}

/* ---------- locks ---------- */

static int byte_lock(int cmd, short type, off_t off)
{
    struct flock fl;
    memset(&fl, 0, sizeof(fl));
    fl.l_type = type;
    fl.l_whence = SEEK_SET;
    fl.l_start = off;
    fl.l_len = 1;
    int rc;
    do {
        rc = fcntl(g_fd, cmd, &fl);
    } while (rc != 0 && errno == EINTR);
    return rc;
}

void sim_lock(void)
{
    pthread_mutex_lock(&g_local);
    if (byte_lock(F_OFD_SETLKW, F_WRLCK, SIM_LOCK_MUTEX_OFF) != 0) {
        /* Kernels without OFD locks: fall back to the process lock. */
        byte_lock(F_SETLKW, F_WRLCK, SIM_LOCK_MUTEX_OFF);
    }
}

void sim_unlock(void)
{
    if (byte_lock(F_OFD_SETLK, F_UNLCK, SIM_LOCK_MUTEX_OFF) != 0)
        byte_lock(F_SETLK, F_UNLCK, SIM_LOCK_MUTEX_OFF);
    pthread_mutex_unlock(&g_local);
}

/* ---------- processes ---------- */

static int32_t recorded_pid(void)
{
    const char *env = getenv("SIMGPU_PID");
    if (env && *env) {
        long v = strtol(env, NULL, 10);
        if (v > 0)
            return (int32_t)v;
    }
    /* NSpid lists the pid from the outermost namespace visible through this
     * /proc down to our own: the first field is the most host-like one. */
    FILE *f = fopen("/proc/self/status", "re");
    int32_t pid = (int32_t)getpid();
    if (f) {
        char line[256];
        while (fgets(line, sizeof(line), f)) {
            long v;
            if (sscanf(line, "NSpid: %ld", &v) == 1 && v > 0) {
                pid = (int32_t)v;
                break;
            }
        }
        fclose(f);
    }
    return pid;
}

int sim_slot_alive_locked(int slot, int32_t *pid_out)
{
    struct sim_proc *p = &g_state->procs[slot];
    if (!p->in_use)
        return 0;
    if (slot == g_self_slot && p->generation == g_self_generation) {
        if (pid_out)
            *pid_out = (int32_t)getpid();
        return 1;
    }
    struct flock fl;
    memset(&fl, 0, sizeof(fl));
    fl.l_type = F_WRLCK;
    fl.l_whence = SEEK_SET;
    fl.l_start = SIM_LOCK_SLOT_OFF + slot;
    fl.l_len = 1;
    /* OFD F_GETLK also sees POSIX locks of this very process (held by the
     * other library's copy of this module), which plain F_GETLK would not. */
    if (fcntl(g_fd, F_OFD_GETLK, &fl) != 0) {
        fl.l_type = F_WRLCK;
        fl.l_pid = 0;
        if (fcntl(g_fd, F_GETLK, &fl) != 0)
            return 1; /* cannot tell: keep it */
    }
    if (fl.l_type == F_UNLCK)
        return 0;
    if (pid_out)
        *pid_out = fl.l_pid > 0 ? (int32_t)fl.l_pid : p->pid;
    return 1;
}

static void engine_drop_slot(int slot);

void sim_reap_locked(void)
{
    for (int i = 0; i < SIM_MAX_PROCS; i++) {
        struct sim_proc *p = &g_state->procs[i];
        if (p->in_use && !sim_slot_alive_locked(i, NULL)) {
            uint64_t gen = p->generation;
            engine_drop_slot(i);
            memset(p, 0, sizeof(*p));
            p->generation = gen;
        }
    }
}

int sim_self_slot_locked(void)
{
    if (g_self_slot >= 0 && g_state->procs[g_self_slot].in_use &&
        g_state->procs[g_self_slot].generation == g_self_generation)
        return g_self_slot;
    sim_reap_locked();
    for (int i = 0; i < SIM_MAX_PROCS; i++) {
        struct sim_proc *p = &g_state->procs[i];
        if (p->in_use)
            continue;
        if (byte_lock(F_SETLK, F_WRLCK, SIM_LOCK_SLOT_OFF + i) != 0)
            continue; /* a process is just dying or claiming it */
        uint64_t gen = p->generation + 1;
        memset(p, 0, sizeof(*p));
        p->generation = gen;
        p->in_use = 1;
        p->pid = g_self_pid;
        int bias = sim_env_bias_milli();
        p->nvml_bias_milli = bias >= 0 ? (uint32_t)bias : sim_drawn_bias_milli(i, p->pid);
        g_self_slot = i;
        g_self_generation = gen;
        return i;
    }
    return -1;
}

uint64_t sim_used_locked(int dev)
{
    uint64_t used = 0;
    for (int i = 0; i < SIM_MAX_PROCS; i++) {
        if (g_state->procs[i].in_use)
            used += g_state->procs[i].mem_bytes[dev];
    }
    return used;
}

/* ---------- the engine ---------- */

static void log_append(int dev, int slot, uint64_t start, uint64_t end, uint64_t done)
{
    struct sim_device *d = &g_state->devices[dev];
    int32_t pid = g_state->procs[slot].pid;
    uint32_t gen = (uint32_t)g_state->procs[slot].generation;
    d->busy_total_ns += end - start;
    g_state->procs[slot].busy_ns[dev] += end - start;
    if (end == start)
        return;
    if (d->log_count > 0) {
        struct sim_interval *last = &d->log[(d->log_count - 1) % SIM_LOG_LEN];
        if (last->slot == slot && last->gen == gen && last->end_ns == start) {
            last->end_ns = end;
            last->done_ns = done;
            return;
        }
    }
    struct sim_interval *iv = &d->log[d->log_count % SIM_LOG_LEN];
    iv->start_ns = start;
    iv->end_ns = end;
    iv->done_ns = done;
    iv->slot = slot;
    iv->pid = pid;
    iv->gen = gen;
    iv->reserved = 0;
    d->log_count++;
}

static void fifo_enqueue(int dev, int slot, uint64_t dur_ns, uint64_t not_before_ns,
                         struct sim_ticket *t)
{
    struct sim_device *d = &g_state->devices[dev];
    uint64_t start = sim_now_ns();
    if (d->busy_until_ns > start)
        start = d->busy_until_ns;
    if (not_before_ns > start)
        start = not_before_ns;
    d->busy_until_ns = start + dur_ns;
    log_append(dev, slot, start, start + dur_ns, 0);
    memset(t, 0, sizeof(*t));
    t->kind = SIM_TICKET_FIFO;
    t->dev = dev;
    t->end_ns = start + dur_ns;
}

static int is_active(const struct sim_engine *e, int slot)
{
    return (e->active[slot / 64] >> (slot % 64)) & 1;
}

static void set_active(struct sim_engine *e, int slot, int on)
{
    if (on)
        e->active[slot / 64] |= 1ULL << (slot % 64);
    else
        e->active[slot / 64] &= ~(1ULL << (slot % 64));
}

static int others_active(const struct sim_engine *e, int slot)
{
    for (int w = 0; w < SIM_PROC_WORDS; w++) {
        uint64_t bits = e->active[w];
        if (slot / 64 == w)
            bits &= ~(1ULL << (slot % 64));
        if (bits)
            return 1;
    }
    return 0;
}

/* The first slot with queued work after slot in round-robin order (slot
 * itself comes last); -1 when there is none. */
static int next_active(const struct sim_engine *e, int slot)
{
    int from = (slot + 1) % SIM_MAX_PROCS;
    for (int k = 0; k <= SIM_PROC_WORDS; k++) {
        int w = (from / 64 + k) % SIM_PROC_WORDS;
        uint64_t bits = e->active[w];
        if (k == 0)
            bits &= ~0ULL << (from % 64);
        else if (k == SIM_PROC_WORDS)
            bits &= (1ULL << (from % 64)) - 1;
        if (bits)
            return w * 64 + __builtin_ctzll(bits);
    }
    return -1;
}

/* Hand the engine to slot at time t: a new slice, after a context switch
 * unless its context is the one loaded. */
static void engine_start(struct sim_engine *e, int slot, uint64_t t)
{
    e->run = slot;
    e->switch_end_ns = t + (slot != e->last ? g_state->switch_ns : 0);
    e->slice_end_ns = e->switch_end_ns + g_state->timeslice_ns;
    e->last = slot;
}

static void engine_next(struct sim_engine *e, uint64_t t)
{
    int next = next_active(e, e->run);
    if (next >= 0)
        engine_start(e, next, t);
    else
        e->run = -1;
}

/*
 * Replay the round robin on e from e->at_ns up to until, in at most
 * max_steps stretches. With dev >= 0, e is that device's engine and what
 * runs goes to its log and busy counters; with dev < 0, e is a scratch copy.
 * With watch >= 0 (whose done_ns must be below pos), it stops when the
 * watched slot's done_ns reaches pos and returns that time. Otherwise, or
 * when it stops short, it returns 0; e->at_ns says how far it got.
 */
static uint64_t engine_run(struct sim_engine *e, int dev, uint64_t until, int watch,
                           uint64_t pos, unsigned max_steps)
{
    const uint64_t slice = g_state->timeslice_ns;
    uint64_t t = e->at_ns;
    for (; t < until && max_steps > 0; max_steps--) {
        int r = e->run;
        if (r < 0) {
            t = until;
            break;
        }
        if (t < e->switch_end_ns) {
            t = e->switch_end_ns < until ? e->switch_end_ns : until;
            continue;
        }
        int others = others_active(e, r);
        uint64_t stop = until;
        if (others) {
            if (e->slice_end_ns <= t) {
                engine_start(e, next_active(e, r), t); /* preempt r */
                continue;
            }
            if (e->slice_end_ns < stop)
                stop = e->slice_end_ns;
        }
        uint64_t before = e->done_ns[r];
        uint64_t span = e->queued_ns[r] - before;
        if (span > stop - t)
            span = stop - t;
        e->done_ns[r] += span;
        if (dev >= 0)
            log_append(dev, r, t, t + span, e->done_ns[r]);
        if (r == watch && e->done_ns[r] >= pos) {
            e->at_ns = t + (pos - before);
            return e->at_ns;
        }
        t += span;
        if (e->done_ns[r] == e->queued_ns[r]) {
            set_active(e, r, 0); /* ran dry: the rest of its slice goes */
            engine_next(e, t);
        } else if (!others && e->slice_end_ns <= t) {
            /* Alone, it runs on; the next waiter takes over at a slice boundary. */
            e->slice_end_ns = t + slice - (t - e->slice_end_ns) % slice;
        }
    }
    e->at_ns = t;
    return 0;
}

void sim_advance_locked(int dev)
{
    struct sim_engine *e = &g_state->devices[dev].engine;
    uint64_t now = sim_now_ns();
    if (g_state->sched == SIM_SCHED_TIMESLICE && now > e->at_ns)
        engine_run(e, dev, now, -1, 0, UINT_MAX);
}

void sim_enqueue_locked(int dev, int slot, uint64_t dur_ns, uint64_t not_before_ns,
                        struct sim_ticket *t)
{
    if (g_state->sched == SIM_SCHED_FIFO) {
        fifo_enqueue(dev, slot, dur_ns, not_before_ns, t);
        return;
    }
    struct sim_engine *e = &g_state->devices[dev].engine;
    sim_advance_locked(dev);
    e->queued_ns[slot] += dur_ns;
    t->pos = e->queued_ns[slot];
    t->gen = g_state->procs[slot].generation;
    t->end_ns = 0;
    t->slot = slot;
    t->dev = dev;
    t->kind = SIM_TICKET_QUEUE;
    if (dur_ns > 0 && !is_active(e, slot)) {
        set_active(e, slot, 1);
        if (e->run < 0)
            engine_start(e, slot, e->at_ns);
    }
}

/* Reaping a slot: its queued work vanishes, as a real driver kills a dead
 * process's work. */
static void engine_drop_slot(int slot)
{
    if (g_state->sched == SIM_SCHED_FIFO)
        return;
    for (uint32_t dev = 0; dev < g_state->device_count; dev++) {
        struct sim_engine *e = &g_state->devices[dev].engine;
        sim_advance_locked((int)dev);
        e->queued_ns[slot] = e->done_ns[slot] = 0;
        set_active(e, slot, 0);
        if (e->run == slot)
            engine_next(e, e->at_ns);
        if (e->last == slot)
            e->last = -1;
    }
}

int sim_ticket_done_locked(const struct sim_ticket *t)
{
    if (t->kind != SIM_TICKET_QUEUE)
        return t->end_ns <= sim_now_ns();
    const struct sim_proc *p = &g_state->procs[t->slot];
    if (!p->in_use || p->generation != t->gen)
        return 1;
    sim_advance_locked(t->dev);
    return g_state->devices[t->dev].engine.done_ns[t->slot] >= t->pos;
}

uint64_t sim_ticket_time_locked(const struct sim_ticket *t)
{
    if (t->kind != SIM_TICKET_QUEUE)
        return t->end_ns;
    const struct sim_proc *p = &g_state->procs[t->slot];
    const struct sim_device *d = &g_state->devices[t->dev];
    uint64_t n = d->log_count < SIM_LOG_LEN ? d->log_count : SIM_LOG_LEN;
    if (!p->in_use || p->generation != t->gen)
        return 0;
    /* The stretch in which the slot's done_ns crossed pos. */
    for (uint64_t k = 0; k < n; k++) {
        const struct sim_interval *iv = &d->log[(d->log_count - 1 - k) % SIM_LOG_LEN];
        if (iv->slot != t->slot || iv->gen != (uint32_t)p->generation)
            continue;
        if (iv->done_ns < t->pos)
            break;
        uint64_t done_at_start = iv->done_ns - (iv->end_ns - iv->start_ns);
        if (done_at_start < t->pos)
            return iv->start_ns + (t->pos - done_at_start);
    }
    return 0;
}

#define PREDICT_STEPS (1U << 16)

/* The earliest time the ticket's work can be done if no new work comes. */
static uint64_t predict_locked(const struct sim_ticket *t)
{
    struct sim_engine *e = &g_state->devices[t->dev].engine;
    struct sim_engine copy;
    if (others_active(e, t->slot)) {
        sim_reap_locked(); /* a dead process's queue would hold us up */
        if (sim_ticket_done_locked(t))
            return 0;
    }
    memcpy(&copy, e, sizeof(copy));
    uint64_t at = engine_run(&copy, -1, UINT64_MAX, t->slot, t->pos, PREDICT_STEPS);
    if (at)
        return at;
    if (copy.at_ns == UINT64_MAX) /* cannot happen: an active queue keeps the engine busy */
        return sim_now_ns() + 1000000;
    return copy.at_ns; /* a lower bound: look again from there */
}

void sim_ticket_wait(const struct sim_ticket *t)
{
    if (t->kind != SIM_TICKET_QUEUE) {
        sim_sleep_until(t->end_ns);
        return;
    }
    for (;;) {
        uint64_t at = 0;
        sim_lock();
        if (!sim_ticket_done_locked(t))
            at = predict_locked(t);
        sim_unlock();
        if (!at)
            return;
        sim_sleep_until(at);
    }
}

uint64_t sim_busy_in_locked(int dev, int slot, uint32_t gen, uint64_t from_ns, uint64_t to_ns)
{
    uint64_t busy = 0;
    if (to_ns > from_ns)
        sim_busy_periods_locked(dev, slot, gen, to_ns, to_ns - from_ns, 1, &busy);
    return busy;
}

void sim_busy_periods_locked(int dev, int slot, uint32_t gen, uint64_t last_end_ns,
                             uint64_t period_ns, unsigned n, uint64_t *out)
{
    const struct sim_device *d = &g_state->devices[dev];
    uint64_t logged = d->log_count < SIM_LOG_LEN ? d->log_count : SIM_LOG_LEN;
    memset(out, 0, n * sizeof(*out));
    if (n == 0 || period_ns == 0 || last_end_ns / period_ns < n)
        return;
    uint64_t base = last_end_ns - n * period_ns;
    for (uint64_t k = 0; k < logged; k++) {
        const struct sim_interval *iv = &d->log[(d->log_count - 1 - k) % SIM_LOG_LEN];
        if (iv->end_ns <= base)
            break;
        if (slot >= 0 && (iv->slot != slot || iv->gen != gen))
            continue;
        uint64_t a = iv->start_ns > base ? iv->start_ns : base;
        uint64_t b = iv->end_ns < last_end_ns ? iv->end_ns : last_end_ns;
        while (a < b) {
            uint64_t i = (a - base) / period_ns;
            uint64_t period_end = base + (i + 1) * period_ns;
            uint64_t upto = b < period_end ? b : period_end;
            out[i] += upto - a;
            a = upto;
        }
    }
}

uint64_t sim_log_since_locked(int dev)
{
    const struct sim_device *d = &g_state->devices[dev];
    if (d->log_count <= SIM_LOG_LEN)
        return 0;
    return d->log[d->log_count % SIM_LOG_LEN].start_ns;
}

uint32_t sim_drawn_bias_milli(int slot, int32_t pid)
{
    uint64_t h = sim_hash(((uint64_t)(uint32_t)pid << 16) ^ (uint64_t)slot ^ 0xb1a5ULL);
    return 700 + (uint32_t)(h % 701);
}

/* ---------- attach ---------- */

/* The engine settings asked for by this process's environment. */
struct engine_env {
    uint32_t sched;
    uint64_t timeslice_ns;
    uint64_t switch_ns;
    int sched_given, timeslice_given, switch_given;
};

static int env_given(const char *name)
{
    const char *v = getenv(name);
    return v && *v;
}

static void read_engine_env(struct engine_env *env)
{
    const char *sched = getenv("SIMGPU_SCHED");
    env->sched = SIM_SCHED_TIMESLICE;
    env->sched_given = 0;
    if (sched && strcmp(sched, "fifo") == 0) {
        env->sched = SIM_SCHED_FIFO;
        env->sched_given = 1;
    } else if (sched && strcmp(sched, "timeslice") == 0) {
        env->sched_given = 1;
    } else if (sched && *sched) {
        fprintf(stderr, "simgpu: SIMGPU_SCHED=%s is neither fifo nor timeslice; using timeslice\n",
                sched);
    }
    env->timeslice_ns = sim_env_u64("SIMGPU_TIMESLICE_US", SIM_DEFAULT_TIMESLICE_US) * 1000;
    if (env->timeslice_ns == 0)
        env->timeslice_ns = 1000; /* the engine needs slices that advance time */
    env->timeslice_given = env_given("SIMGPU_TIMESLICE_US");
    env->switch_ns = sim_env_u64("SIMGPU_CTX_SWITCH_US", SIM_DEFAULT_CTX_SWITCH_US) * 1000;
    env->switch_given = env_given("SIMGPU_CTX_SWITCH_US");
}

static int engine_differs(const struct sim_state *s, const struct engine_env *env)
{
    return (env->sched_given && env->sched != s->sched) ||
           (env->timeslice_given && env->timeslice_ns != s->timeslice_ns) ||
           (env->switch_given && env->switch_ns != s->switch_ns);
}

static void build_state(struct sim_state *s, const struct sim_device_spec *specs, int n,
                        const char *spec_text, const struct engine_env *env)
{
    memset(s, 0, sizeof(*s));
    s->layout_version = SIM_LAYOUT_VERSION;
    s->device_count = (uint32_t)n;
    s->context_mem = sim_env_u64("SIMGPU_CONTEXT_MEM", SIM_DEFAULT_CONTEXT_MEM);
    snprintf(s->devices_spec, sizeof(s->devices_spec), "%s", spec_text);
    s->sched = env->sched;
    s->timeslice_ns = env->timeslice_ns;
    s->switch_ns = env->switch_ns;
    for (int i = 0; i < n; i++) {
        snprintf(s->devices[i].name, SIM_NAME_LEN, "%s", specs[i].name);
        snprintf(s->devices[i].uuid, SIM_UUID_LEN, "%s", specs[i].uuid);
        s->devices[i].total_bytes = specs[i].total_bytes;
        s->devices[i].engine.run = -1;
        s->devices[i].engine.last = -1;
    }
    __atomic_store_n(&s->magic, SIM_MAGIC, __ATOMIC_RELEASE);
}

static int any_live_locked(void)
{
    for (int i = 0; i < SIM_MAX_PROCS; i++) {
        if (g_state->procs[i].in_use && sim_slot_alive_locked(i, NULL))
            return 1;
    }
    return 0;
}

int sim_attach(void)
{
    pthread_mutex_lock(&g_attach);
    if (g_state) {
        pthread_mutex_unlock(&g_attach);
        return 0;
    }
    const char *path = getenv("SIMGPU_STATE");
    const char *env_spec = getenv("SIMGPU_DEVICES");
    const char *spec_text = (env_spec && *env_spec) ? env_spec : SIM_DEFAULT_DEVICES;
    struct sim_device_spec specs[SIM_MAX_DEVICES];
    char err[256];
    int n = sim_parse_devices(spec_text, specs, SIM_MAX_DEVICES, err, sizeof(err));
    if (n < 0) {
        fprintf(stderr, "simgpu: SIMGPU_DEVICES: %s\n", err);
        pthread_mutex_unlock(&g_attach);
        return -1;
    }
    struct engine_env engine;
    read_engine_env(&engine);
    if (!path || !*path)
        path = SIM_DEFAULT_STATE;
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
    if (fd < 0) {
        fprintf(stderr, "simgpu: SIMGPU_STATE: cannot open %s: %s\n", path, strerror(errno));
        pthread_mutex_unlock(&g_attach);
        return -1;
    }
    (void)fchmod(fd, 0666); /* containers with other uids share it; ignore if not ours */
    g_fd = fd;
    g_self_pid = recorded_pid();
    /* The descriptor is never closed: closing any descriptor of the file
     * would drop this process's POSIX liveness lock. */
    sim_lock();
    struct stat st;
    if (fstat(fd, &st) != 0 || (st.st_size < (off_t)sizeof(struct sim_state) &&
                                ftruncate(fd, (off_t)sizeof(struct sim_state)) != 0)) {
        fprintf(stderr, "simgpu: SIMGPU_STATE: cannot size %s: %s\n", path, strerror(errno));
        sim_unlock();
        pthread_mutex_unlock(&g_attach);
        return -1;
    }
    void *map = mmap(NULL, sizeof(struct sim_state), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (map == MAP_FAILED) {
        fprintf(stderr, "simgpu: SIMGPU_STATE: cannot map %s: %s\n", path, strerror(errno));
        sim_unlock();
        pthread_mutex_unlock(&g_attach);
        return -1;
    }
    g_state = map;
    if (g_state->magic != SIM_MAGIC || g_state->layout_version != SIM_LAYOUT_VERSION) {
        build_state(g_state, specs, n, spec_text, &engine);
    } else {
        /* Settings given explicitly that differ from the state's: rebuild it
         * when no process uses it, else keep it and say so. */
        const char *ctx_env = getenv("SIMGPU_CONTEXT_MEM");
        int devices_differ = env_spec && *env_spec && strcmp(g_state->devices_spec, env_spec) != 0;
        int ctx_differs = ctx_env && *ctx_env &&
                          sim_env_u64("SIMGPU_CONTEXT_MEM", g_state->context_mem) != g_state->context_mem;
        int differs = devices_differ || ctx_differs || engine_differs(g_state, &engine);
        if (differs && !any_live_locked())
            build_state(g_state, specs, n, spec_text, &engine);
        else if (differs)
            fprintf(stderr,
                    "simgpu: %s is in use with SIMGPU_DEVICES='%s' SIMGPU_CONTEXT_MEM=%llu "
                    "SIMGPU_SCHED=%s SIMGPU_TIMESLICE_US=%llu SIMGPU_CTX_SWITCH_US=%llu; "
                    "keeping them until its processes exit\n",
                    path, g_state->devices_spec, (unsigned long long)g_state->context_mem,
                    g_state->sched == SIM_SCHED_FIFO ? "fifo" : "timeslice",
                    (unsigned long long)(g_state->timeslice_ns / 1000),
                    (unsigned long long)(g_state->switch_ns / 1000));
    }
    sim_unlock();
    pthread_mutex_unlock(&g_attach);
    return 0;
}

int sim_visible_devices(const char *list, const int *base, int nbase, int *map, int max)
{
    int count = 0;
    if (!list) {
        for (int i = 0; i < nbase && i < max; i++)
            map[count++] = base[i];
        return count;
    }
    const char *p = list;
    while (*p && count < max) {
        char item[SIM_UUID_LEN];
        size_t len = strcspn(p, ",");
        if (copy_field(item, sizeof(item), p, len) != 0)
            break;
        int found = -1;
        char *endp;
        long idx = strtol(item, &endp, 10);
        if (*endp == '\0') {
            found = (idx >= 0 && idx < nbase) ? base[idx] : -1;
        } else {
            for (int i = 0; i < nbase; i++) {
                const char *u = g_state->devices[base[i]].uuid;
                if (strncmp(u, item, strlen(item)) == 0 ||
                    (strncmp(u, "GPU-", 4) == 0 && strncmp(u + 4, item, strlen(item)) == 0)) {
                    found = base[i];
                    break;
                }
            }
        }
        for (int j = 0; j < count; j++)
            if (map[j] == found)
                found = -1;
        if (found < 0)
            break;
        map[count++] = found;
        p += len;
        if (*p == ',')
            p++;
    }
    return count;
}

int sim_process_devices(int *map, int max)
{
    int all[SIM_MAX_DEVICES];
    int n = (int)g_state->device_count;
    for (int i = 0; i < n; i++)
        all[i] = i;
    return sim_visible_devices(getenv("SIMGPU_VISIBLE_DEVICES"), all, n, map, max);
}

void sim_forget_self(void)
{
    g_self_slot = -1;
    g_self_generation = 0;
    g_self_pid = recorded_pid();
}

struct sim_state *sim_state(void)
{
    return g_state;
}
