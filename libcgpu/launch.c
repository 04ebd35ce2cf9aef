/*
 * launch.c: which threads are between a gate and the driver.
 *
 * A drain (flight.c) must not record its markers while a launch that passed
 * the gate before the close has yet to reach the driver. Each launching
 * thread says so in a word of its own, with a plain store: no locked add on
 * a word every thread shares. For the drain to see that store, or the
 * launch to see the closed gate, the two sides need a full barrier between
 * their store and their load (cgpu_launch_enter). The drain's side takes it
 * for both, with membarrier(), which puts one in every running thread of
 * the process; where the kernel refuses it (a seccomp profile, an old
 * kernel) each launch fences instead. Threads past CGPU_LAUNCHERS share
 * cgpu_launching, an atomic count.
 */
#define _GNU_SOURCE
#include <linux/membarrier.h>
#include <pthread.h>
#include <sched.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "cgpu.h"

struct cgpu_launcher cgpu_launchers[CGPU_LAUNCHERS];
struct cgpu_launcher cgpu_launcher_shared;
__thread struct cgpu_launcher *cgpu_launcher_self CGPU_FAST_TLS;
uint32_t cgpu_launching[CGPU_MAX_GPUS];
int cgpu_launch_fence = 1;

static unsigned launchers_used; /* cgpu_launchers[0, launchers_used) have been taken */
static pthread_once_t key_once = PTHREAD_ONCE_INIT;
static pthread_key_t exit_key;

/* At its thread's end (a later destructor may still launch: the shared count). */
static void launcher_release(void *arg)
{
    struct cgpu_launcher *me = arg;
    cgpu_launcher_self = &cgpu_launcher_shared;
    __atomic_store_n(&me->gpu, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&me->taken, 0, __ATOMIC_RELEASE);
}

static void make_key(void)
{
    if (pthread_key_create(&exit_key, launcher_release) != 0)
        exit_key = (pthread_key_t)-1;
}

struct cgpu_launcher *cgpu_launcher_claim(void)
{
    struct cgpu_launcher *me = &cgpu_launcher_shared;
    pthread_once(&key_once, make_key);
    /* without the key a word could not be given back when its thread ends */
    for (unsigned i = 0; i < CGPU_LAUNCHERS && exit_key != (pthread_key_t)-1; i++) {
        uint32_t free_word = 0;
        if (__atomic_compare_exchange_n(&cgpu_launchers[i].taken, &free_word, 1, 0,
                                        __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) {
            me = &cgpu_launchers[i];
            unsigned used = __atomic_load_n(&launchers_used, __ATOMIC_RELAXED);
            while (used <= i && !__atomic_compare_exchange_n(&launchers_used, &used, i + 1, 1,
                                                             __ATOMIC_SEQ_CST, __ATOMIC_RELAXED))
                ;
            if (pthread_setspecific(exit_key, me) != 0) {
                launcher_release(me);
                me = &cgpu_launcher_shared;
            }
            break;
        }
    }
    cgpu_launcher_self = me;
    return me;
}

void cgpu_launch_barrier_register(void)
{
    long ok = syscall(SYS_membarrier, MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED, 0, 0);
    __atomic_store_n(&cgpu_launch_fence, ok != 0, __ATOMIC_SEQ_CST);
}

void cgpu_launches_settle(int g)
{
    if (__atomic_load_n(&cgpu_launch_fence, __ATOMIC_SEQ_CST)) {
        __atomic_thread_fence(__ATOMIC_SEQ_CST); /* every launch fences too */
    } else if (syscall(SYS_membarrier, MEMBARRIER_CMD_PRIVATE_EXPEDITED, 0, 0) != 0) {
        /* not once registered; were it refused, launches fence from now on */
        cgpu_log("membarrier failed after its registration: launches fence from now on");
        __atomic_store_n(&cgpu_launch_fence, 1, __ATOMIC_SEQ_CST);
    }
    unsigned used = __atomic_load_n(&launchers_used, __ATOMIC_SEQ_CST);
    for (unsigned i = 0; i < used; i++)
        while (__atomic_load_n(&cgpu_launchers[i].gpu, __ATOMIC_ACQUIRE) == (uint32_t)g + 1)
            sched_yield();
    while (__atomic_load_n(&cgpu_launching[g], __ATOMIC_SEQ_CST) != 0)
        sched_yield();
}

/* In a forked child only the forking thread runs: the other words are free,
 * and the barrier is registered again with the child's watcher. */
void cgpu_launch_after_fork(void)
{
    for (unsigned i = 0; i < CGPU_LAUNCHERS; i++) {
        if (&cgpu_launchers[i] == cgpu_launcher_self)
            continue;
        cgpu_launchers[i].gpu = 0;
        cgpu_launchers[i].taken = 0;
    }
    memset(cgpu_launching, 0, sizeof cgpu_launching);
    cgpu_launch_fence = 1;
}
