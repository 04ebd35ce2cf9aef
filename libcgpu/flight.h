/*
 * flight.h: the in-flight bound of libcgpu (flight.c), seen from hooks.c.
 *
 * The gate holds launches, but work a process queued before the gate closed
 * still runs. flight.c keeps that queue short: per stream, a completion
 * marker (an event) every K launches, and a wait for the oldest marker when
 * more than M are outstanding, so at most about K*M launches per stream are
 * queued (the region's gpu.max_inflight, or $CGPU_MAX_INFLIGHT).
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
    CUresult (*exchange_capture_mode)(CUstreamCaptureMode *mode); /* optional */
};
extern struct cgpu_flight_driver cgpu_flight_cu CGPU_HIDDEN;

/* After a successful launch on `stream` of container GPU g (`ptsz`: the
 * per-thread default stream variant, where NULL means that stream). May
 * wait for earlier launches of the stream to finish. */
void cgpu_flight_launched(struct cgpu_region *r, int g, CUstream stream, int ptsz) CGPU_HIDDEN;
/* A context was destroyed: its markers and events are gone. */
void cgpu_flight_forget_ctx(CUcontext ctx) CGPU_HIDDEN;
/* A stream was destroyed: its entry (and events) may serve another stream. */
void cgpu_flight_forget_stream(CUstream stream) CGPU_HIDDEN;
/* In a forked child: no CUDA state survives. */
void cgpu_flight_after_fork(void) CGPU_HIDDEN;

#endif /* CGPU_FLIGHT_H */
