/*
 * track.c: size and GPU of every live allocation, keyed by device pointer,
 * allocation handle, array or context. Open addressing with linear probing
 * and backward-shift deletion (no tombstones); one process-local mutex per
 * kind, which is fine: these maps are never shared between processes.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "cgpu.h"

struct entry {
    uint64_t key; /* 0 = empty */
    uint64_t size;
    int32_t gpu;
};

struct table {
    pthread_mutex_t lock;
    struct entry *slots;
    size_t cap; /* power of two */
    size_t used;
};

static struct table tables[CGPU_TRACK_KINDS] = {
    [0 ... CGPU_TRACK_KINDS - 1] = {PTHREAD_MUTEX_INITIALIZER, NULL, 0, 0},
};

static size_t hash(uint64_t key)
{
    key ^= key >> 33;
    key *= 0xff51afd7ed558ccdULL;
    key ^= key >> 33;
    return (size_t)key;
}

static void insert_raw(struct entry *slots, size_t cap, const struct entry *e)
{
    size_t i = hash(e->key) & (cap - 1);
    while (slots[i].key != 0 && slots[i].key != e->key)
        i = (i + 1) & (cap - 1);
    slots[i] = *e;
}

static int grow(struct table *t)
{
    size_t cap = t->cap ? t->cap * 2 : 1024;
    struct entry *slots = calloc(cap, sizeof *slots);
    if (slots == NULL)
        return -1;
    for (size_t i = 0; i < t->cap; i++)
        if (t->slots[i].key != 0)
            insert_raw(slots, cap, &t->slots[i]);
    free(t->slots);
    t->slots = slots;
    t->cap = cap;
    return 0;
}

static long find(const struct table *t, uint64_t key)
{
    if (t->cap == 0)
        return -1;
    size_t i = hash(key) & (t->cap - 1);
    while (t->slots[i].key != 0) {
        if (t->slots[i].key == key)
            return (long)i;
        i = (i + 1) & (t->cap - 1);
    }
    return -1;
}

/* Key 0 is the empty marker; a real pointer or handle is never 0, so map it to 1<<63. */
static uint64_t norm(uint64_t key)
{
    return key ? key : 1ull << 63;
}

void cgpu_track_put(enum cgpu_track_kind kind, uint64_t key, uint64_t size, int g)
{
    struct table *t = &tables[kind];
    struct entry e = {norm(key), size, g};
    pthread_mutex_lock(&t->lock);
    if ((t->used + 1) * 10 >= t->cap * 7 && grow(t) != 0) {
        pthread_mutex_unlock(&t->lock);
        return;
    }
    if (find(t, e.key) < 0)
        t->used++;
    insert_raw(t->slots, t->cap, &e);
    pthread_mutex_unlock(&t->lock);
}

int cgpu_track_get(enum cgpu_track_kind kind, uint64_t key, uint64_t *size, int *g)
{
    struct table *t = &tables[kind];
    pthread_mutex_lock(&t->lock);
    long i = find(t, norm(key));
    if (i >= 0) {
        *size = t->slots[i].size;
        *g = t->slots[i].gpu;
    }
    pthread_mutex_unlock(&t->lock);
    return i >= 0;
}

int cgpu_track_take(enum cgpu_track_kind kind, uint64_t key, uint64_t *size, int *g)
{
    struct table *t = &tables[kind];
    pthread_mutex_lock(&t->lock);
    long found = find(t, norm(key));
    if (found >= 0) {
        size_t i = (size_t)found, mask = t->cap - 1;
        *size = t->slots[i].size;
        *g = t->slots[i].gpu;
        /* backward-shift deletion keeps every probe chain unbroken */
        size_t j = i;
        for (;;) {
            j = (j + 1) & mask;
            if (t->slots[j].key == 0)
                break;
            size_t home = hash(t->slots[j].key) & mask;
            /* move j into the hole at i unless its home lies cyclically in (i, j] */
            int in_range = (i <= j) ? (home > i && home <= j) : (home > i || home <= j);
            if (!in_range) {
                t->slots[i] = t->slots[j];
                i = j;
            }
        }
        t->slots[i].key = 0;
        t->used--;
    }
    pthread_mutex_unlock(&t->lock);
    return found >= 0;
}

/* A forked child inherits no usable CUDA state: start with empty maps and
 * fresh locks (another thread may have held one at the fork). */
void cgpu_track_after_fork(void)
{
    for (int k = 0; k < CGPU_TRACK_KINDS; k++) {
        pthread_mutex_init(&tables[k].lock, NULL);
        if (tables[k].cap)
            memset(tables[k].slots, 0, tables[k].cap * sizeof *tables[k].slots);
        tables[k].used = 0;
    }
}
