/*
 * watch.c: the watcher thread, which answers the daemon's closes.
 *
 * When the daemon ends a container's slice on a GPU it closes that gate,
 * bumps gpu.close_seq and then control.wake, and wakes the futex on the
 * latter. Every process that has launched on that GPU runs this thread: it
 * waits until the work the process queued before the close has finished
 * (cgpu_flight_drain), writes when into its slot (drained_ns) with the
 * sequence number it answers (drained_seq), and rings the GPU's doorbell.
 * The daemon grants the next container once every watching process of this
 * one has answered, and charges this one up to the last answer: the GPU
 * time of a slice is measured by the data plane's own markers.
 *
 * A process that has never launched on a GPU has nothing queued there and
 * is not waited for (gpu.watching stays 0).
 *
 * The slice's end: while the gate is open the daemon may name when the slice
 * ends (gpu.close_at_ns, written when another container waits). Launches
 * stop at that time by themselves (cgpu_past_close), and this thread wakes
 * then, drains, and answers the close the daemon will make (close_seq + 1)
 * with a ring: the daemon wakes once for the whole switch, on that ring,
 * and not also at the slice's end. The slot says the process does this
 * (gpu.closes_itself); the daemon closes the gates of those that do not.
 *
 * The idle watch: while the daemon asks (gpu.idle_grace_ns, set while the
 * gate is open and another container waits), this thread also tells it when
 * the process goes idle, so that the daemon need not look: once the process
 * has launched nothing for the grace, it waits for what it queued to finish
 * (cgpu_flight_drain), and when nothing was launched meanwhile it writes the
 * later of the two into its slot (idle_ns) at once, and rings once the grace
 * has passed since. The daemon takes the GPU from an idle holder only a
 * grace after that time, but a step before it (another container waking
 * into the GPU, where unused time stays idle) reads the report and charges
 * the holder only up to it: the GPU was idle from then. Its next launch
 * clears idle_ns and wakes this thread (cgpu_idle_launch), so it watches
 * again. A process that waits at its gate (pending) is not idle.
 */
#define _GNU_SOURCE
#include <linux/futex.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "cgpu.h"
#include "flight.h"

uint32_t cgpu_watching[CGPU_MAX_GPUS];

static pthread_once_t watch_once = PTHREAD_ONCE_INIT;
static int watcher_running; /* its slots may say closes_itself */

#define WATCH_MAX_SLEEP_NS 1000000000ull /* look again at least every second */

/* When this process last launched on each GPU, while the idle watch is asked for. */
static uint64_t last_launch_ns[CGPU_MAX_GPUS];

void cgpu_idle_launch(struct cgpu_proc *s, int g)
{
    __atomic_store_n(&last_launch_ns[g], cgpu_now_ns(), __ATOMIC_RELAXED);
    /* The launch's count is stored before this load, and the watcher's idle_ns
     * before its load of the count: one of the two sees the other. */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (__atomic_load_n(&s->gpu[g].idle_ns, __ATOMIC_RELAXED) != 0) {
        __atomic_store_n(&s->gpu[g].idle_ns, 0, __ATOMIC_RELEASE);
        /* the watcher sleeps on control.wake: a wake needs no write access */
        syscall(SYS_futex, &cgpu_region_ptr->wake, FUTEX_WAKE, INT32_MAX, NULL, NULL, 0);
    }
}

/* The idle watch of GPU g: report the process idle if it is; the time until it
 * should look again (UINT64_MAX: not before it is woken). `quiet_since` is
 * when its queued work was first found finished with no launch after it (0:
 * not yet), for the count of launches in `quiet_launches`; `idle_rung`, that
 * the report in idle_ns has been rung for. */
static uint64_t quiet_since[CGPU_MAX_GPUS];
static uint64_t quiet_launches[CGPU_MAX_GPUS];
static int idle_rung[CGPU_MAX_GPUS];

static uint64_t watch_idle(const struct cgpu_control *r, int g)
{
    struct cgpu_proc *me = cgpu_slot();
    uint64_t grace = __atomic_load_n(&r->gpu[g].idle_grace_ns, __ATOMIC_ACQUIRE);
    if (me == NULL)
        return UINT64_MAX;
    if (grace == 0 || __atomic_load_n(&r->gpu[g].gate, __ATOMIC_ACQUIRE) != CGPU_GATE_OPEN) {
        /* nobody asks: no report stands (the next ask starts afresh) */
        if (__atomic_load_n(&me->gpu[g].idle_ns, __ATOMIC_RELAXED) != 0)
            __atomic_store_n(&me->gpu[g].idle_ns, 0, __ATOMIC_RELEASE);
        quiet_since[g] = 0;
        return UINT64_MAX;
    }
    uint64_t said = __atomic_load_n(&me->gpu[g].idle_ns, __ATOMIC_ACQUIRE);
    if (said != 0) {
        /* its next launch clears it and wakes this thread */
        if (idle_rung[g])
            return UINT64_MAX;
        uint64_t now = cgpu_now_ns();
        if (now < said + grace)
            return said + grace - now;
        idle_rung[g] = 1;
        cgpu_ring(g);
        return UINT64_MAX;
    }
    if (__atomic_load_n(&me->gpu[g].pending, __ATOMIC_ACQUIRE) != 0)
        return grace;
    uint64_t launches = __atomic_load_n(&me->gpu[g].launches, __ATOMIC_ACQUIRE);
    uint64_t last = __atomic_load_n(&last_launch_ns[g], __ATOMIC_RELAXED);
    uint64_t now = cgpu_now_ns();
    if (launches != quiet_launches[g]) {
        quiet_launches[g] = launches;
        quiet_since[g] = 0;
    }
    if (now < last + grace)
        return last + grace - now;
    if (quiet_since[g] == 0) {
        /* launched nothing for the grace: when does what it queued finish? */
        uint64_t done = cgpu_flight_drain(g);
        if (__atomic_load_n(&me->gpu[g].launches, __ATOMIC_ACQUIRE) != launches)
            return 0; /* busy again: look again at once */
        quiet_since[g] = done > last ? done : last;
    }
    uint64_t since = quiet_since[g];
    idle_rung[g] = 0;
    __atomic_store_n(&me->gpu[g].idle_ns, since, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&me->gpu[g].launches, __ATOMIC_SEQ_CST) != launches) {
        /* a launch that may not have seen idle_ns: take it back, unless it did */
        __atomic_compare_exchange_n(&me->gpu[g].idle_ns, &since, 0, 0, __ATOMIC_SEQ_CST,
                                    __ATOMIC_RELAXED);
        return 0;
    }
    return 0; /* rung once the grace has passed since */
}

static void answer(int g, uint64_t seq)
{
    uint64_t done = cgpu_flight_drain(g);
    struct cgpu_proc *me = cgpu_slot();
    if (me == NULL)
        return;
    __atomic_store_n(&me->gpu[g].drained_ns, done, __ATOMIC_RELAXED);
    /* before the ring, and after any wait that then need not ring (region.c) */
    __atomic_store_n(&me->gpu[g].drained_seq, seq, __ATOMIC_SEQ_CST);
    cgpu_ring(g);
}

/* The slice's end the daemon named (gpu.close_at_ns): once it has come, with
 * the gate still open, this process has stopped launching (cgpu_past_close),
 * so its drain is the one the daemon's close would ask for, answered ahead
 * (close_seq + 1). `*answered` is the last close answered; the time until
 * the slice's end (UINT64_MAX: none, or answered). */
static uint64_t close_itself(const struct cgpu_control *r, int g, uint64_t *answered)
{
    /* The count of closes on both sides of the gate's load: the gate was open
     * while close_seq was `seq`, so the next close is seq + 1. The end after
     * the gate: the daemon writes it before it opens the gate, so this is the
     * grant's, not the last one's. */
    uint64_t seq = __atomic_load_n(&r->gpu[g].close_seq, __ATOMIC_SEQ_CST);
    uint32_t gate = __atomic_load_n(&r->gpu[g].gate, __ATOMIC_SEQ_CST);
    uint64_t at = __atomic_load_n(&r->gpu[g].close_at_ns, __ATOMIC_SEQ_CST);
    if (gate != CGPU_GATE_OPEN || at == 0 || *answered == seq + 1 ||
        __atomic_load_n(&r->gpu[g].close_seq, __ATOMIC_SEQ_CST) != seq)
        return UINT64_MAX;
    uint64_t now = cgpu_now_ns();
    if (now < at)
        return at - now;
    answer(g, seq + 1);
    *answered = seq + 1;
    return UINT64_MAX;
}

static void *watcher_main(void *arg)
{
    const struct cgpu_control *r = arg;
    uint64_t answered[CGPU_MAX_GPUS] = {0};
    for (;;) {
        uint32_t wake = __atomic_load_n(&r->wake, __ATOMIC_ACQUIRE);
        uint64_t sleep_ns = WATCH_MAX_SLEEP_NS;
        for (uint32_t g = 0; g < r->ngpus && g < CGPU_MAX_GPUS; g++) {
            if (!__atomic_load_n(&cgpu_watching[g], __ATOMIC_ACQUIRE))
                continue;
            uint64_t seq = __atomic_load_n(&r->gpu[g].close_seq, __ATOMIC_ACQUIRE);
            if (seq != answered[g] && seq + 1 != answered[g]) { /* not answered ahead */
                answer((int)g, seq);
                answered[g] = seq;
            }
            uint64_t end = close_itself(r, (int)g, &answered[g]);
            if (end < sleep_ns)
                sleep_ns = end;
            uint64_t look = watch_idle(r, (int)g);
            if (look < sleep_ns)
                sleep_ns = look;
        }
        if (sleep_ns > 0)
            cgpu_futex_wait(&r->wake, wake, sleep_ns);
    }
    return NULL;
}

static void start_watcher(void)
{
    const struct cgpu_control *r = cgpu_region_ptr;
    sigset_t all, old;
    sigfillset(&all);
    /* signals meant for the program never land on this thread */
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, 256 << 10);
    pthread_t thread;
    cgpu_launch_barrier_register(); /* before the first drain */
    int rc = pthread_create(&thread, &attr, watcher_main, (void *)r);
    pthread_attr_destroy(&attr);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc != 0) {
        cgpu_log("cannot start the watcher thread (%s): the daemon will wait out each drain",
                 strerror(rc));
    } else {
        pthread_setname_np(thread, "cgpu-watch");
        __atomic_store_n(&watcher_running, 1, __ATOMIC_RELEASE);
    }
}

void cgpu_watch(int g)
{
    struct cgpu_proc *me = cgpu_slot();
    if (me != NULL)
        __atomic_store_n(&me->gpu[g].watching, 1, __ATOMIC_SEQ_CST);
    __atomic_store_n(&cgpu_watching[g], 1, __ATOMIC_SEQ_CST);
    pthread_once(&watch_once, start_watcher);
    if (me != NULL && __atomic_load_n(&watcher_running, __ATOMIC_ACQUIRE))
        __atomic_store_n(&me->gpu[g].closes_itself, 1, __ATOMIC_SEQ_CST);
}

/* At exit the process's work goes with it: nothing more to answer for (a
 * process that is killed is found gone by the daemon instead). */
__attribute__((destructor)) static void watch_exit(void)
{
    struct cgpu_proc *me = cgpu_slot_ptr;
    if (me == NULL)
        return;
    for (int g = 0; g < CGPU_MAX_GPUS; g++) {
        if (__atomic_exchange_n(&me->gpu[g].watching, 0, __ATOMIC_SEQ_CST))
            cgpu_ring(g);
    }
}

/* In a forked child: no thread survives, and nothing is queued yet. */
void cgpu_watch_after_fork(void)
{
    memset(cgpu_watching, 0, sizeof cgpu_watching);
    memset(last_launch_ns, 0, sizeof last_launch_ns);
    memset(quiet_since, 0, sizeof quiet_since);
    memset(quiet_launches, 0, sizeof quiet_launches);
    memset(idle_rung, 0, sizeof idle_rung);
    watcher_running = 0;
    watch_once = (pthread_once_t)PTHREAD_ONCE_INIT;
}
