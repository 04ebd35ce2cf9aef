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
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>
#include <string.h>

#include "cgpu.h"
#include "flight.h"

uint32_t cgpu_watching[CGPU_MAX_GPUS];

static pthread_once_t watch_once = PTHREAD_ONCE_INIT;

#define WATCH_MAX_SLEEP_NS 1000000000ull /* look again at least every second */

static void answer(int g, uint64_t seq)
{
    uint64_t done = cgpu_flight_drain(g);
    struct cgpu_proc *me = cgpu_slot();
    if (me == NULL)
        return;
    __atomic_store_n(&me->gpu[g].drained_ns, done, __ATOMIC_RELAXED);
    __atomic_store_n(&me->gpu[g].drained_seq, seq, __ATOMIC_RELEASE);
    cgpu_ring(g);
}

static void *watcher_main(void *arg)
{
    const struct cgpu_control *r = arg;
    uint64_t answered[CGPU_MAX_GPUS] = {0};
    for (;;) {
        uint32_t wake = __atomic_load_n(&r->wake, __ATOMIC_ACQUIRE);
        for (uint32_t g = 0; g < r->ngpus && g < CGPU_MAX_GPUS; g++) {
            if (!__atomic_load_n(&cgpu_watching[g], __ATOMIC_ACQUIRE))
                continue;
            uint64_t seq = __atomic_load_n(&r->gpu[g].close_seq, __ATOMIC_ACQUIRE);
            if (seq != answered[g]) {
                answer((int)g, seq);
                answered[g] = seq;
            }
        }
        cgpu_futex_wait(&r->wake, wake, WATCH_MAX_SLEEP_NS);
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
    if (rc != 0)
        cgpu_log("cannot start the watcher thread (%s): the daemon will wait out each drain",
                 strerror(rc));
    else
        pthread_setname_np(thread, "cgpu-watch");
}

void cgpu_watch(int g)
{
    struct cgpu_proc *me = cgpu_slot();
    if (me != NULL)
        __atomic_store_n(&me->gpu[g].watching, 1, __ATOMIC_SEQ_CST);
    __atomic_store_n(&cgpu_watching[g], 1, __ATOMIC_SEQ_CST);
    pthread_once(&watch_once, start_watcher);
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
    watch_once = (pthread_once_t)PTHREAD_ONCE_INIT;
}
