/*
 * flight.c: bound the work a process has queued on each stream.
 *
 * The gate acts when a kernel is launched, but a driver accepts about a
 * thousand launches per stream before the caller blocks, so without a bound
 * a process could keep the GPU busy for seconds after its gate closed. Here,
 * per (context, stream), every K-th successful launch records a marker (a
 * pooled CU_EVENT_DISABLE_TIMING event) behind it, and when M markers are
 * outstanding the launching thread first waits for the oldest with
 * cuEventSynchronize (as the context's own synchronizations wait). So at most
 * (M+1)*K - 1 launches of a stream are queued between calls: with the bound
 * N, K = ceil(N/4) and M = ceil(N/K) - 1, which is N - 1 for N = 16 (K = 4,
 * M = 3). A graph launch counts as one launch. The wait counts as `pending`
 * in the process slot, like a wait at the gate, so the daemon sees the
 * container active.
 *
 * N is gpu.max_inflight (or $CGPU_MAX_INFLIGHT), lowered for long kernels:
 * what counts for the scheduler is how long queued work keeps the GPU after
 * a gate closes, so N is also held to FLIGHT_DRAIN_NS of queued work (at
 * least 2 launches). The time per launch is measured on the stream itself:
 * when a wait for marker j blocked and so did the wait for marker j-1, the
 * launches between them ran in the time between the two completions (that
 * includes other processes' kernels run in between, so a process sharing a
 * busy GPU keeps less queued, and the GPU's total queue stays about
 * FLIGHT_DRAIN_NS however many processes share it).
 *
 * Streams: the legacy default stream (NULL, CU_STREAM_LEGACY) per context,
 * the per-thread default stream (the _ptsz entry points with NULL, or
 * CU_STREAM_PER_THREAD) per context and thread, and created streams. Events
 * are created and recorded in the context current at the launch (a launch
 * only succeeds on a stream of that context). Launches into a stream that is
 * being captured queue nothing and get no marker; the markers are recorded
 * and waited for in relaxed capture mode where the driver has it, so a
 * capture elsewhere is not disturbed. A failed record or wait only drops the
 * marker, never fails the launch.
 *
 * Per stream is not enough (64 streams of 20 ms kernels, 2 launches each,
 * queue 2.5 s), so the process's queue on each GPU, all streams together,
 * is held to a budget of GPU time too, the region's gpu.queue_ns (see
 * struct queue and hold_to_budget below): when a marker is recorded and the
 * launches behind the outstanding markers, times the measured time per
 * launch, are over it, the launching thread waits for the process's oldest
 * markers, on whichever stream.
 *
 * The fast path (no marker due): one driver call (cuCtxGetCurrent), a
 * thread-local cache probe, one atomic add and a compare. Entries live in a
 * fixed table; a destroyed stream's entry keeps its context's events for the
 * next stream of that context, a destroyed context's entries forget theirs.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "flight.h"

#define FLIGHT_ENTRIES 512
#define FLIGHT_SLOTS 4 /* events per entry: M <= FLIGHT_SLOTS - 1 outstanding */
#define CACHE_WAYS 8
#define STREAM_RETIRED UINTPTR_MAX /* the entry's stream was destroyed */
#define ENV_UNREAD (-2)
#define ENV_UNSET (-1)
#define FLIGHT_DRAIN_NS 4000000ull /* queued work per stream, at most about (4 ms) */
#define FLIGHT_MIN_BOUND 2u
#define FLIGHT_PROBE_LAUNCHES 64u /* at the bound's minimum while the time is unknown */
#define FLIGHT_UNMEASURED_QUEUE 1u /* launches a process keeps queued until its time is known */
#define FLIGHT_UNBOUNDED_RECHECK 64u /* launches between reads of an unbounded bound */
/* Not CU_EVENT_BLOCKING_SYNC: on an H200 such a marker every 4 launches cost
 * 1 % of the throughput of 50 us kernels (an interrupt per marker, and a
 * wake-up that lets the queue run dry), a plain one 0.1 %. Waiting for a
 * plain event follows the context's scheduling flags, as the program's own
 * synchronizations do (spin, yield, or block with
 * cudaDeviceScheduleBlockingSync). */
#define FLIGHT_EVENT_FLAGS CU_EVENT_DISABLE_TIMING

struct cgpu_flight_driver cgpu_flight_cu;

struct flight {
    /* The key: written under table_lock and the entry's lock, read without
     * either by the fast path (a stale read only costs a slow lookup). */
    uintptr_t ctx; /* 0 = free entry */
    uintptr_t stream;
    uintptr_t owner;  /* per-thread default stream: the thread's token, else 0 */
    int g;            /* container GPU of its context */
    uint64_t total;   /* launches counted on this entry */
    uint64_t next_mark; /* `total` at which the next marker is due (0: the first launch) */
    pthread_mutex_t lock; /* the rest */
    uint64_t marked;  /* `total` behind the last marker */
    unsigned head, count;
    int broken; /* recording failed: this stream goes unbounded */
    uint64_t per_launch_ns; /* measured time per launch, 0 = not yet known */
    uint32_t probed;        /* launches marked while per_launch_ns was unknown */
    uint64_t last_done_ns;  /* when a blocking wait saw the previous marker complete, or 0 */
    uint32_t done_since;    /* launches of markers found complete since last_done_ns */
    uint64_t done_epoch;    /* the gate's changes at last_done_ns: a time spanning a
                             * close is not this stream's, so it is no sample */
    uint64_t drained_launches; /* `total` when the last drain marker was recorded */
    CUevent drain_ev;          /* a blocking-sync marker for drains (watch.c) */
    CUevent ev[FLIGHT_SLOTS];
    uint32_t launches[FLIGHT_SLOTS]; /* launches behind each outstanding marker */
    uint64_t pos[FLIGHT_SLOTS];      /* the process's launches marked on GPU g through it */
};

/* The process's queue on one container GPU, all its streams together: what
 * the GPU-time budget is held to. Written by whoever records or retires a
 * marker, with relaxed atomics (a race only blurs an estimate). */
struct queue {
    uint64_t launches;      /* behind outstanding markers */
    uint64_t marked;        /* launches behind every marker so far: a marker's `pos` */
    uint64_t per_launch_ns; /* GPU time per launch, measured; 0 = not yet */
    uint64_t last_done_ns;  /* the last wait that blocked saw its marker complete then */
    uint64_t last_done_pos; /* that marker's pos */
    uint32_t emptied;       /* no marker was outstanding at some time since then */
};

static struct flight table[FLIGHT_ENTRIES] = {
    [0 ... FLIGHT_ENTRIES - 1] = {.lock = PTHREAD_MUTEX_INITIALIZER},
};
static unsigned table_used; /* entries [0, table_used) have been claimed at some time */
static pthread_mutex_t table_lock = PTHREAD_MUTEX_INITIALIZER;
static int env_bound = ENV_UNREAD;
static struct queue queues[CGPU_MAX_GPUS];

static __thread struct flight *cache[CACHE_WAYS] CGPU_FAST_TLS;
static __thread char thread_token CGPU_FAST_TLS; /* its address names the thread */

static int read_env_bound(void)
{
    const char *text = getenv("CGPU_MAX_INFLIGHT");
    int bound = ENV_UNSET;
    if (text != NULL && text[0] != '\0') {
        char *end;
        unsigned long v = strtoul(text, &end, 10);
        if (*end != '\0' || text[0] == '-' || v > (1ul << 30))
            cgpu_log("CGPU_MAX_INFLIGHT=%s is not a number of launches; the region's bound "
                     "applies", text);
        else
            bound = (int)v;
    }
    __atomic_store_n(&env_bound, bound, __ATOMIC_RELAXED);
    return bound;
}

static inline uint32_t bound_of(const struct cgpu_control *r, int g)
{
    int e = __atomic_load_n(&env_bound, __ATOMIC_RELAXED);
    if (cgpu_unlikely(e == ENV_UNREAD))
        e = read_env_bound();
    return e >= 0 ? (uint32_t)e : __atomic_load_n(&r->gpu[g].max_inflight, __ATOMIC_RELAXED);
}

/* Launches between two markers of f with the bound n: a quarter of it, or
 * half while none of its waits has blocked (the GPU keeps up with the stream,
 * and a marker is only a cost); either way at most n - 1 are queued. */
static inline uint32_t launches_per_marker(const struct flight *f, uint32_t n)
{
    uint32_t parts = f->per_launch_ns != 0 ? FLIGHT_SLOTS : 2;
    return (n + parts - 1) / parts;
}

static inline int key_is(const struct flight *f, uintptr_t ctx, uintptr_t s, uintptr_t owner)
{
    return __atomic_load_n(&f->ctx, __ATOMIC_RELAXED) == ctx &&
           __atomic_load_n(&f->stream, __ATOMIC_RELAXED) == s &&
           __atomic_load_n(&f->owner, __ATOMIC_RELAXED) == owner;
}

/* Markers of f (held) that leave the queue unwaited: their entry is retaken. */
static void forget_markers(struct flight *f)
{
    if (f->g < 0 || f->g >= CGPU_MAX_GPUS)
        return;
    for (unsigned i = 0; i < f->count; i++)
        __atomic_fetch_sub(&queues[f->g].launches, f->launches[(f->head + i) % FLIGHT_SLOTS],
                           __ATOMIC_RELAXED);
}

/* Caller holds table_lock and f->lock. */
static void set_key(struct flight *f, uintptr_t ctx, uintptr_t s, uintptr_t owner, int g)
{
    forget_markers(f);
    f->g = g;
    __atomic_store_n(&f->ctx, ctx, __ATOMIC_RELAXED);
    __atomic_store_n(&f->stream, s, __ATOMIC_RELAXED);
    __atomic_store_n(&f->owner, owner, __ATOMIC_RELAXED);
    __atomic_store_n(&f->total, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&f->next_mark, 0, __ATOMIC_RELAXED);
    f->marked = 0;
    f->head = f->count = 0;
    f->broken = 0;
    f->per_launch_ns = f->last_done_ns = f->done_epoch = 0;
    f->probed = f->done_since = 0;
    f->drained_launches = 0;
}

/* The entry of a key, claimed if new: a retired entry of the same context
 * first (its events are that context's), then a free one. NULL when full. */
static __attribute__((noinline, cold)) struct flight *find_or_claim(uintptr_t ctx, uintptr_t s,
                                                                    uintptr_t owner, int g)
{
    static int said_full;
    struct flight *hit = NULL, *retired = NULL, *free_entry = NULL;
    pthread_mutex_lock(&table_lock);
    for (unsigned i = 0; i < table_used && hit == NULL; i++) {
        struct flight *f = &table[i];
        if (key_is(f, ctx, s, owner))
            hit = f;
        else if (retired == NULL && f->ctx == ctx && f->stream == STREAM_RETIRED)
            retired = f;
        else if (free_entry == NULL && f->ctx == 0)
            free_entry = f;
    }
    if (hit == NULL) {
        hit = retired != NULL ? retired : free_entry;
        if (hit == NULL && table_used < FLIGHT_ENTRIES)
            hit = &table[table_used++];
        if (hit != NULL) {
            pthread_mutex_lock(&hit->lock);
            if (hit != retired) {
                memset(hit->ev, 0, sizeof hit->ev);
                hit->drain_ev = NULL;
            }
            set_key(hit, ctx, s, owner, g);
            pthread_mutex_unlock(&hit->lock);
        } else if (!__atomic_exchange_n(&said_full, 1, __ATOMIC_RELAXED)) {
            cgpu_log("more than %d streams in use: launches on the others are not bounded",
                     FLIGHT_ENTRIES);
        }
    }
    pthread_mutex_unlock(&table_lock);
    return hit;
}

static inline struct flight *lookup(uintptr_t ctx, uintptr_t s, uintptr_t owner, int g)
{
    unsigned way = (unsigned)((ctx >> 4) ^ (s >> 4) ^ s ^ (owner >> 4)) % CACHE_WAYS;
    struct flight *f = cache[way];
    if (cgpu_likely(f != NULL && key_is(f, ctx, s, owner)))
        return f;
    f = find_or_claim(ctx, s, owner, g);
    cache[way] = f;
    return f;
}

static int capturing(uintptr_t s)
{
    CUstreamCaptureStatus status;
    if (cgpu_flight_cu.stream_is_capturing == NULL)
        return 0;
    /* an error (the legacy stream while another is captured) counts as capturing */
    return cgpu_flight_cu.stream_is_capturing((CUstream)s, &status) != CUDA_SUCCESS ||
           status != CU_STREAM_CAPTURE_STATUS_NONE;
}

/* The bound of f (held) now: `bound`, or less for long kernels. A new stream
 * starts at the minimum, so long kernels never pile up before they are
 * measured; one whose waits never block (the GPU keeps up) gets `bound`
 * after FLIGHT_PROBE_LAUNCHES launches, since a marker per launch costs. */
static uint32_t effective_bound(const struct flight *f, uint32_t bound)
{
    if (f->per_launch_ns == 0)
        return f->probed < FLIGHT_PROBE_LAUNCHES && bound > FLIGHT_MIN_BOUND ? FLIGHT_MIN_BOUND
                                                                           : bound;
    uint64_t n = FLIGHT_DRAIN_NS / f->per_launch_ns;
    if (n < FLIGHT_MIN_BOUND)
        n = FLIGHT_MIN_BOUND;
    return n < bound ? (uint32_t)n : bound;
}

/* The oldest marker of f (held) completed (`blocked`: a wait saw it complete
 * at `now`, having started at `from`; else a query found it complete): the
 * process's queue on GPU g loses its launches, and a wait that blocked
 * measures the GPU time per launch, over all the process's streams. If the
 * queue never ran empty since the last wait that blocked, the launches
 * marked after that wait's marker up to this one ran in the time between the
 * two, as a GPU runs one process's work in the order it was queued (where
 * streams overtake each other the figure is rougher; a close of the gate meanwhile does not matter, queued work runs on;
 * an emptied queue is only seen when its markers are retired, so idle time
 * may count, and work of others run in between counts too: both make the
 * figure larger and the queue shorter). A marker waited for right after it
 * was recorded, with nothing else outstanding, ran in the time of the wait
 * (the sample that follows a kernel that got shorter). */
static void queue_done(const struct flight *f, unsigned slot, int blocked, uint64_t from,
                       uint64_t now)
{
    struct queue *q = &queues[f->g];
    uint32_t launches = f->launches[slot];
    uint64_t queued = __atomic_fetch_sub(&q->launches, launches, __ATOMIC_RELAXED);
    int emptied = __atomic_exchange_n(&q->emptied, queued == launches, __ATOMIC_RELAXED);
    if (!blocked) {
        if (emptied)
            __atomic_store_n(&q->emptied, 1, __ATOMIC_RELAXED);
        return;
    }
    uint64_t last = __atomic_load_n(&q->last_done_ns, __ATOMIC_RELAXED);
    uint64_t last_pos = __atomic_load_n(&q->last_done_pos, __ATOMIC_RELAXED);
    uint64_t pos = f->pos[slot], sample = 0;
    if (last != 0 && now > last && !emptied && pos > last_pos)
        sample = (now - last) / (pos - last_pos);
    else if (from != 0 && now > from && queued == launches && launches > 0)
        sample = (now - from) / launches;
    if (sample != 0) {
        uint64_t per = __atomic_load_n(&q->per_launch_ns, __ATOMIC_RELAXED);
        __atomic_store_n(&q->per_launch_ns, per ? (per + sample) / 2 : sample,
                         __ATOMIC_RELAXED);
    }
    __atomic_store_n(&q->last_done_ns, now, __ATOMIC_RELAXED);
    if (pos > last_pos)
        __atomic_store_n(&q->last_done_pos, pos, __ATOMIC_RELAXED);
}

/* Take the oldest marker of f (held) off its ring; its slot. */
static unsigned pop_oldest(struct flight *f)
{
    unsigned slot = f->head;
    f->head = (slot + 1) % FLIGHT_SLOTS;
    f->count--;
    return slot;
}

/* Whether the oldest marker of f (held) is complete; if so it is retired. */
static int oldest_done(struct flight *f)
{
    unsigned slot = f->head;
    if (f->ev[slot] == NULL || cgpu_flight_cu.event_query == NULL ||
        cgpu_flight_cu.event_query(f->ev[slot]) != CUDA_SUCCESS)
        return 0;
    pop_oldest(f);
    f->done_since += f->launches[slot]; /* counted in the next blocking wait */
    queue_done(f, slot, 0, 0, 0);
    return 1;
}

/* Wait for the oldest marker of f (held), counted as pending on GPU g. A
 * wait that blocks measures the time per launch since the last one that
 * blocked: the launches of the markers in between were queued before it
 * ended (markers are recorded before older ones are waited for), so the
 * stream was busy with them all along. `fresh`: it was recorded just now
 * (the budget's wait; its start is timed). */
static void wait_oldest(struct flight *f, const struct cgpu_control *r, int g, int fresh)
{
    unsigned slot = f->head;
    CUevent ev = f->ev[slot];
    uint32_t launches = f->launches[slot];
    if (ev == NULL || cgpu_flight_cu.event_synchronize == NULL) {
        pop_oldest(f);
        queue_done(f, slot, 0, 0, 0);
        f->last_done_ns = 0;
        return;
    }
    if (oldest_done(f))
        return;
    pop_oldest(f);
    struct cgpu_proc *me = cgpu_slot();
    if (me != NULL)
        __atomic_fetch_add(&me->gpu[g].pending, 1, __ATOMIC_RELAXED);
    uint64_t from = fresh ? cgpu_now_ns() : 0;
    CUresult rc = cgpu_flight_cu.event_synchronize(ev); /* an error drops the marker */
    if (me != NULL)
        __atomic_fetch_sub(&me->gpu[g].pending, 1, __ATOMIC_RELAXED);
    uint64_t now = cgpu_now_ns();
    uint64_t epoch = __atomic_load_n(&r->gpu[g].gate_changes, __ATOMIC_ACQUIRE);
    queue_done(f, slot, rc == CUDA_SUCCESS, from, now);
    launches += f->done_since;
    if (rc == CUDA_SUCCESS && f->last_done_ns != 0 && launches > 0 && now > f->last_done_ns &&
        epoch == f->done_epoch) {
        uint64_t sample = (now - f->last_done_ns) / launches;
        f->per_launch_ns = f->per_launch_ns ? (f->per_launch_ns + sample) / 2 : sample;
    }
    f->last_done_ns = rc == CUDA_SUCCESS ? now : 0;
    f->done_epoch = epoch;
    f->done_since = 0;
}

/* Record a marker behind the last launch of f (held) on stream s. */
static void record(struct flight *f, uintptr_t s, uint32_t launches)
{
    unsigned slot = (f->head + f->count) % FLIGHT_SLOTS;
    if (f->ev[slot] == NULL) {
        CUevent ev;
        if (cgpu_flight_cu.event_create == NULL ||
            cgpu_flight_cu.event_create(&ev, FLIGHT_EVENT_FLAGS) != CUDA_SUCCESS)
            return;
        f->ev[slot] = ev;
    }
    if (cgpu_flight_cu.event_record == NULL ||
        cgpu_flight_cu.event_record(f->ev[slot], (CUstream)s) != CUDA_SUCCESS) {
        f->broken = 1; /* not this stream's context, or the driver refuses: no bound */
        return;
    }
    struct queue *q = &queues[f->g];
    f->launches[slot] = launches;
    f->pos[slot] = __atomic_add_fetch(&q->marked, launches, __ATOMIC_RELAXED);
    __atomic_fetch_add(&q->launches, launches, __ATOMIC_RELAXED);
    f->count++;
}

/* The GPU time a process may keep queued on GPU g now. */
static uint64_t budget_of(const struct cgpu_control *r, int g)
{
    uint64_t budget = __atomic_load_n(&r->gpu[g].queue_ns, __ATOMIC_RELAXED);
    return budget != 0 ? budget : CGPU_DEFAULT_QUEUE_NS;
}

/* Whether the process's queue on GPU g is over its budget: what is queued
 * ahead of the newest launch, the outstanding launches but one times their
 * measured GPU time (a few launches while unmeasured). The newest is never
 * counted: it keeps the GPU busy while the host wakes to launch the next,
 * and costs a waking neighbour one kernel. */
static int over_budget(const struct cgpu_control *r, int g)
{
    uint64_t queued = __atomic_load_n(&queues[g].launches, __ATOMIC_RELAXED);
    uint64_t per = __atomic_load_n(&queues[g].per_launch_ns, __ATOMIC_RELAXED);
    if (per == 0)
        return queued > FLIGHT_UNMEASURED_QUEUE;
    return queued > 1 && (queued - 1) * per > budget_of(r, g);
}

/* Of the process's other entries on GPU g, retire the markers found complete
 * and return the one whose oldest marker is older than f's (held) oldest,
 * locked; NULL when f's is the oldest. Entries another thread holds are
 * passed over (it is in a marker's wait itself). */
static struct flight *reap_others(struct flight *f, int g)
{
    struct flight *oldest = NULL;
    uint64_t pos = f->count > 0 ? f->pos[f->head] : UINT64_MAX;
    unsigned used = __atomic_load_n(&table_used, __ATOMIC_ACQUIRE);
    for (unsigned i = 0; i < used; i++) {
        struct flight *e = &table[i];
        if (e == f || e->g != g || __atomic_load_n(&e->ctx, __ATOMIC_RELAXED) == 0 ||
            pthread_mutex_trylock(&e->lock) != 0)
            continue;
        while (e->count > 0 && oldest_done(e))
            ;
        if (e->count > 0 && e->g == g && e->pos[e->head] < pos) {
            if (oldest != NULL)
                pthread_mutex_unlock(&oldest->lock);
            oldest = e;
            pos = e->pos[e->head];
        } else {
            pthread_mutex_unlock(&e->lock);
        }
    }
    return oldest;
}

/* Hold the launching thread while the process's queue on GPU g is over its
 * budget, waiting for its oldest markers (f is held, its newest just
 * recorded). Markers of other streams are waited for from here too: what
 * counts is the time all the process's queued work keeps the GPU. */
static void hold_to_budget(struct flight *f, const struct cgpu_control *r, int g)
{
    while (over_budget(r, g)) {
        struct flight *e = reap_others(f, g);
        if (!over_budget(r, g)) {
            if (e != NULL)
                pthread_mutex_unlock(&e->lock);
            break;
        }
        if (e != NULL) {
            wait_oldest(e, r, g, 0);
            pthread_mutex_unlock(&e->lock);
        } else if (f->count > 0) {
            wait_oldest(f, r, g, f->count == 1);
        } else {
            break; /* what is left is held by other threads, waiting already */
        }
    }
}

static void mark(struct flight *f, uint32_t bound, const struct cgpu_control *r, int g,
                 uintptr_t ctx, uintptr_t s, uintptr_t owner)
{
    pthread_mutex_lock(&f->lock);
    uint64_t total = __atomic_load_n(&f->total, __ATOMIC_ACQUIRE);
    if (!key_is(f, ctx, s, owner) || f->broken ||
        total < __atomic_load_n(&f->next_mark, __ATOMIC_RELAXED)) {
        pthread_mutex_unlock(&f->lock);
        return;
    }
    uint32_t since = (uint32_t)(total - f->marked);
    f->marked = total;
    if (f->per_launch_ns == 0 && f->probed < FLIGHT_PROBE_LAUNCHES)
        f->probed += since;
    uint32_t n = effective_bound(f, bound), every = launches_per_marker(f, n);
    uint32_t markers = (n + every - 1) / every - 1;
    if (markers < 1)
        markers = 1;
    if (since > 0 && !capturing(s)) {
        CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_RELAXED;
        int exchanged = cgpu_flight_cu.exchange_capture_mode != NULL &&
                        cgpu_flight_cu.exchange_capture_mode(&mode) == CUDA_SUCCESS;
        while (f->count >= markers)
            wait_oldest(f, r, g, 0);
        record(f, s, since);
        hold_to_budget(f, r, g);
        if (exchanged)
            cgpu_flight_cu.exchange_capture_mode(&mode);
    }
    /* launches until the next marker, from what the waits measured */
    __atomic_store_n(&f->next_mark, total + launches_per_marker(f, effective_bound(f, bound)),
                     __ATOMIC_RELAXED);
    pthread_mutex_unlock(&f->lock);
}

/* The stream key of a launch: the legacy default stream is 0, the
 * per-thread default stream is keyed by its thread too. */
static void stream_key(CUstream stream, int ptsz, uintptr_t *s, uintptr_t *owner)
{
    *s = (uintptr_t)stream;
    *owner = 0;
    if (*s == (uintptr_t)CU_STREAM_LEGACY)
        *s = 0;
    else if (*s == 0 && ptsz)
        *s = (uintptr_t)CU_STREAM_PER_THREAD;
    if (*s == (uintptr_t)CU_STREAM_PER_THREAD)
        *owner = (uintptr_t)&thread_token;
}

struct flight *cgpu_flight_count(int g, CUstream stream, int ptsz)
{
    CUcontext ctx;
    if (cgpu_unlikely(cgpu_flight_cu.ctx_get_current == NULL) ||
        cgpu_flight_cu.ctx_get_current(&ctx) != CUDA_SUCCESS || ctx == NULL)
        return NULL;
    uintptr_t s, owner;
    stream_key(stream, ptsz, &s, &owner);
    struct flight *f = lookup((uintptr_t)ctx, s, owner, g);
    if (cgpu_unlikely(f == NULL))
        return NULL;
    /* one atomic add, and a compare: is a marker due? */
    uint64_t total = __atomic_add_fetch(&f->total, 1, __ATOMIC_RELEASE);
    return cgpu_unlikely(total >= __atomic_load_n(&f->next_mark, __ATOMIC_RELAXED)) ? f : NULL;
}

void cgpu_flight_bound(struct flight *f, const struct cgpu_control *r, int g)
{
    uintptr_t ctx = __atomic_load_n(&f->ctx, __ATOMIC_RELAXED);
    uintptr_t s = __atomic_load_n(&f->stream, __ATOMIC_RELAXED);
    uintptr_t owner = __atomic_load_n(&f->owner, __ATOMIC_RELAXED);
    if (owner != 0 && owner != (uintptr_t)&thread_token)
        return; /* the entry was retaken meanwhile */
    uint32_t bound = bound_of(r, g);
    if (bound == 0) { /* unbounded: no markers; the bound is read again later */
        pthread_mutex_lock(&f->lock);
        if (key_is(f, ctx, s, owner)) {
            f->marked = __atomic_load_n(&f->total, __ATOMIC_ACQUIRE);
            __atomic_store_n(&f->next_mark, f->marked + FLIGHT_UNBOUNDED_RECHECK,
                             __ATOMIC_RELAXED);
        }
        pthread_mutex_unlock(&f->lock);
        return;
    }
    mark(f, bound, r, g, ctx, s, owner);
}

/* Record f's drain marker on `on` (held: table_lock and f->lock): a
 * blocking-sync event, so that the watcher sleeps until it completes. */
static CUevent record_drain(struct flight *f, uintptr_t on)
{
    if (f->drain_ev == NULL) {
        CUevent ev;
        if (cgpu_flight_cu.event_create == NULL ||
            cgpu_flight_cu.event_create(&ev, CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING) !=
                CUDA_SUCCESS)
            return NULL;
        f->drain_ev = ev;
    }
    if (cgpu_flight_cu.event_record(f->drain_ev, (CUstream)on) != CUDA_SUCCESS)
        return NULL;
    return f->drain_ev;
}

/* Launches of f not yet behind a drain marker, or not known complete. */
static int has_work(const struct flight *f)
{
    return __atomic_load_n(&f->total, __ATOMIC_ACQUIRE) != f->drained_launches || f->count > 0;
}

uint64_t cgpu_flight_drain(int g)
{
    /* Launches that passed the gate before it closed reach the driver first. */
    cgpu_launches_settle(g);
    CUevent waits[FLIGHT_ENTRIES];
    unsigned nwaits = 0;
    CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_RELAXED;
    int exchanged = cgpu_flight_cu.exchange_capture_mode != NULL &&
                    cgpu_flight_cu.exchange_capture_mode(&mode) == CUDA_SUCCESS;
    /* table_lock is held through the waits: no entry's context is forgotten
     * (its events destroyed) under them. Launches are gated meanwhile. */
    pthread_mutex_lock(&table_lock);
    for (unsigned i = 0; i < table_used; i++) {
        struct flight *f = &table[i];
        uintptr_t ctx = __atomic_load_n(&f->ctx, __ATOMIC_RELAXED);
        if (ctx == 0 || f->g != g || f->stream == STREAM_RETIRED)
            continue;
        pthread_mutex_lock(&f->lock);
        /* Another thread's per-thread stream cannot be named from here: the
         * legacy stream of the context waits for it (both are blocking). */
        uintptr_t on = f->owner != 0 ? 0 : f->stream;
        CUevent ev = NULL;
        if (has_work(f) && cgpu_flight_cu.event_record != NULL &&
            cgpu_flight_cu.ctx_push != NULL &&
            cgpu_flight_cu.ctx_push((CUcontext)ctx) == CUDA_SUCCESS) {
            uint64_t total = __atomic_load_n(&f->total, __ATOMIC_ACQUIRE);
            if (!capturing(on)) /* a capture would take the marker into its graph */
                ev = record_drain(f, on);
            if (ev != NULL)
                f->drained_launches = total;
            CUcontext popped;
            cgpu_flight_cu.ctx_pop(&popped);
        }
        pthread_mutex_unlock(&f->lock);
        if (ev != NULL && nwaits < FLIGHT_ENTRIES)
            waits[nwaits++] = ev;
    }
    for (unsigned i = 0; i < nwaits; i++)
        cgpu_flight_cu.event_synchronize(waits[i]); /* an error drops the marker */
    uint64_t done = cgpu_now_ns();
    pthread_mutex_unlock(&table_lock);
    if (exchanged)
        cgpu_flight_cu.exchange_capture_mode(&mode);
    return done;
}

void cgpu_flight_forget_ctx(CUcontext ctx)
{
    pthread_mutex_lock(&table_lock);
    for (unsigned i = 0; i < table_used; i++) {
        struct flight *f = &table[i];
        if (f->ctx != (uintptr_t)ctx || ctx == NULL)
            continue;
        pthread_mutex_lock(&f->lock);
        set_key(f, 0, 0, 0, -1);
        memset(f->ev, 0, sizeof f->ev); /* destroyed with the context */
        f->drain_ev = NULL;
        pthread_mutex_unlock(&f->lock);
    }
    pthread_mutex_unlock(&table_lock);
}

void cgpu_flight_forget_stream(CUstream stream)
{
    uintptr_t s = (uintptr_t)stream;
    if (s == 0 || s == (uintptr_t)CU_STREAM_LEGACY || s == (uintptr_t)CU_STREAM_PER_THREAD)
        return;
    pthread_mutex_lock(&table_lock);
    for (unsigned i = 0; i < table_used; i++) {
        struct flight *f = &table[i];
        if (f->stream != s)
            continue;
        pthread_mutex_lock(&f->lock);
        set_key(f, f->ctx, STREAM_RETIRED, 0, f->g); /* the events stay, for this context */
        pthread_mutex_unlock(&f->lock);
    }
    pthread_mutex_unlock(&table_lock);
}

void cgpu_flight_after_fork(void)
{
    pthread_mutex_init(&table_lock, NULL);
    for (unsigned i = 0; i < FLIGHT_ENTRIES; i++) {
        pthread_mutex_init(&table[i].lock, NULL);
        set_key(&table[i], 0, 0, 0, -1);
        memset(table[i].ev, 0, sizeof table[i].ev);
        table[i].drain_ev = NULL;
    }
    table_used = 0;
    memset(queues, 0, sizeof queues);
}
