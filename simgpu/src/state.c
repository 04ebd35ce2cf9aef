/*
 * state.c: the shared device model (see state.h for the locking scheme).
 */
#define _GNU_SOURCE
#include "state.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define SIM_MAGIC 0x53494d4750553031ULL /* "SIMGPU01" */
#define SIM_LAYOUT_VERSION 1U
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

void sim_reap_locked(void)
{
    for (int i = 0; i < SIM_MAX_PROCS; i++) {
        struct sim_proc *p = &g_state->procs[i];
        if (p->in_use && !sim_slot_alive_locked(i, NULL)) {
            uint64_t gen = p->generation;
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

uint64_t sim_enqueue_locked(int dev, int slot, uint64_t dur_ns, uint64_t not_before_ns)
{
    struct sim_device *d = &g_state->devices[dev];
    uint64_t start = sim_now_ns();
    if (d->busy_until_ns > start)
        start = d->busy_until_ns;
    if (not_before_ns > start)
        start = not_before_ns;
    uint64_t end = start + dur_ns;
    d->busy_until_ns = end;
    d->busy_total_ns += dur_ns;
    g_state->procs[slot].busy_ns[dev] += dur_ns;
    if (dur_ns == 0)
        return end;
    if (d->log_count > 0) {
        struct sim_interval *last = &d->log[(d->log_count - 1) % SIM_LOG_LEN];
        if (last->slot == slot && last->pid == g_state->procs[slot].pid && last->end_ns == start) {
            last->end_ns = end;
            return end;
        }
    }
    struct sim_interval *iv = &d->log[d->log_count % SIM_LOG_LEN];
    iv->start_ns = start;
    iv->end_ns = end;
    iv->slot = slot;
    iv->pid = g_state->procs[slot].pid;
    d->log_count++;
    return end;
}

uint64_t sim_busy_in_locked(int dev, int slot, int32_t pid, uint64_t from_ns, uint64_t to_ns)
{
    const struct sim_device *d = &g_state->devices[dev];
    uint64_t n = d->log_count < SIM_LOG_LEN ? d->log_count : SIM_LOG_LEN;
    uint64_t busy = 0;
    /* Intervals are appended in FIFO order, so their ends never decrease. */
    for (uint64_t k = 0; k < n; k++) {
        const struct sim_interval *iv = &d->log[(d->log_count - 1 - k) % SIM_LOG_LEN];
        if (iv->end_ns <= from_ns)
            break;
        if (slot >= 0 && (iv->slot != slot || iv->pid != pid))
            continue;
        uint64_t a = iv->start_ns > from_ns ? iv->start_ns : from_ns;
        uint64_t b = iv->end_ns < to_ns ? iv->end_ns : to_ns;
        if (b > a)
            busy += b - a;
    }
    return busy;
}

/* ---------- attach ---------- */

static void build_state(struct sim_state *s, const struct sim_device_spec *specs, int n,
                        const char *spec_text)
{
    memset(s, 0, sizeof(*s));
    s->layout_version = SIM_LAYOUT_VERSION;
    s->device_count = (uint32_t)n;
    s->context_mem = sim_env_u64("SIMGPU_CONTEXT_MEM", SIM_DEFAULT_CONTEXT_MEM);
    snprintf(s->devices_spec, sizeof(s->devices_spec), "%s", spec_text);
    for (int i = 0; i < n; i++) {
        snprintf(s->devices[i].name, SIM_NAME_LEN, "%s", specs[i].name);
        snprintf(s->devices[i].uuid, SIM_UUID_LEN, "%s", specs[i].uuid);
        s->devices[i].total_bytes = specs[i].total_bytes;
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
        build_state(g_state, specs, n, spec_text);
    } else {
        /* Settings given explicitly that differ from the state's: rebuild it
         * when no process uses it, else keep it and say so. */
        const char *ctx_env = getenv("SIMGPU_CONTEXT_MEM");
        int devices_differ = env_spec && *env_spec && strcmp(g_state->devices_spec, env_spec) != 0;
        int ctx_differs = ctx_env && *ctx_env &&
                          sim_env_u64("SIMGPU_CONTEXT_MEM", g_state->context_mem) != g_state->context_mem;
        if ((devices_differ || ctx_differs) && !any_live_locked())
            build_state(g_state, specs, n, spec_text);
        else if (devices_differ || ctx_differs)
            fprintf(stderr,
                    "simgpu: %s is in use with SIMGPU_DEVICES='%s' SIMGPU_CONTEXT_MEM=%llu; "
                    "keeping them until its processes exit\n",
                    path, g_state->devices_spec, (unsigned long long)g_state->context_mem);
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
