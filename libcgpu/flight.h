/*
 * flight.h: the in-flight bound of libcgpu (flight.c), seen from hooks.c.
 *
 * The gate holds launches, but work a process queued before the gate closed
 * still runs. flight.c keeps that queue short: per stream, a completion
 * marker (an event) every K launches, and a wait for the oldest marker when
 * more than M are outstanding, so at most about K*M launches per stream are
 * queued (the region's gpu.max_inflight, or $CGPU_MAX_INFLIGHT), and the
 * GPU time the process has queued over all its streams is held to the
 * region's gpu.queue_ns.
 */
#ifndef CGPU_FLIGHT_H
#define CGPU_FLIGHT_H

#pragma GCC visibility push(default)
#include "cuda.h"
#pragma GCC visibility pop

#include "cgpu.h"

/* The real driver's entry points flight.c calls; hooks.c fills them in when
 * it resolves the driver (NULL where the driver lacks one). */
struct cgpu_flight_driver {
    __typeof__(&cuCtxGetCurrent) ctx_get_current;
    __typeof__(&cuEventCreate) event_create;
    __typeof__(&cuEventRecord) event_record;
    __typeof__(&cuEventSynchronize) event_synchronize;
    __typeof__(&cuEventQuery) event_query;
    __typeof__(&cuStreamIsCapturing) stream_is_capturing;
    __typeof__(&cuCtxPushCurrent_v2) ctx_push;
    __typeof__(&cuCtxPopCurrent_v2) ctx_pop;
    CUresult (*exchange_capture_mode)(CUstreamCaptureMode *mode); /* optional */
};
extern struct cgpu_flight_driver cgpu_flight_cu CGPU_HIDDEN;

struct flight;

/* After a successful launch on `stream` of container GPU g (`ptsz`: the
 * per-thread default stream variant, where NULL means that stream): count
 * it on its stream's entry, which it returns when a marker is due (NULL:
 * none is, or the stream is not tracked). */
struct flight *cgpu_flight_count(int g, CUstream stream, int ptsz) CGPU_HIDDEN;
/* Then, outside the launch: hold the stream's queue to the bound; may wait
 * for earlier launches of the stream to finish. */
void cgpu_flight_bound(struct flight *f, const struct cgpu_control *r, int g) CGPU_HIDDEN;
/* Wait until everything this process queued on GPU g has finished (a
 * blocking marker behind the last launch of each stream); returns when. */
uint64_t cgpu_flight_drain(int g) CGPU_HIDDEN;
/* A context was destroyed: its markers and events are gone. */
void cgpu_flight_forget_ctx(CUcontext ctx) CGPU_HIDDEN;
/* A stream was destroyed: its entry (and events) may serve another stream. */
void cgpu_flight_forget_stream(CUstream stream) CGPU_HIDDEN;
/* In a forked child: no CUDA state survives. */
void cgpu_flight_after_fork(void) CGPU_HIDDEN;

#endif /* CGPU_FLIGHT_H */
