#!/usr/bin/env bash
# Real-GPU validation of cgpu_km: the cGPU documents' experiment, in one run.
#
#   tests/gpu/validate.sh              on a host with an NVIDIA GPU, PyTorch and torchvision
#   tests/gpu/validate.sh --simulate   the same steps on simgpu with a synthetic workload
#
# It builds libcgpu, makes the Python side importable without a registry
# (wheels and fuse.py from .whl/, libfuse from .deb/ when missing), serves the
# control tree (the module's /proc/cgpu_km if loaded, else cgpu-fuse, else the
# mount-free cgpu_km.tree.plain), starts cgpu-daemon, and runs four sections
# (tests/gpu/harness.py): 1. memory, 2. compute (weights 1:2 under policies
# 2, 1, 5), 3. overhead, 4. latency (make bench's latency rows, sharework's
# timed kernels: no scheduler against policies 1, 2, 4), 5. detector (the
# daemon's compute check stopped nothing so far, and stops a process that
# launches past libcgpu's gate: tests/attacks/rawlaunch.c). Before them,
# tests/gpu/procaddr_probe.c checks that cuGetProcAddress, dlsym and dlvsym
# answer each name libcgpu wraps with its wrapper on this driver. About 8
# minutes on a GPU. It prints tables and one PASS/FAIL line per check;
# with $OUT set it saves validate.txt, tables.md, checks.txt, procaddr.txt
# (the probe's answers) and validate-logs.tar.gz there. Exit status: 0 when
# every section measured (whatever the figures), 1 when a section could not
# run, 2 on a broken setup.
#
# Environment knobs: CGPU_VALIDATE_TREE=auto|proc|fuse|plain (auto),
# CGPU_VALIDATE_BUDGET (seconds for the whole run: 540, simulated 240),
# CGPU_VALIDATE_PYTHON (the interpreter with torch: python3),
# CGPU_VALIDATE_LIBCGPU_CHECK=1 (first run tests/gpu/libcgpu_torch.py --no-bench),
# VALIDATE_BACKEND=torch|driver (driver: synthetic kernels, for rehearsing without torch),
# VALIDATE_WINDOW, VALIDATE_WARMUP, VALIDATE_BATCHES, VALIDATE_POLICIES,
# VALIDATE_OVERHEAD_BATCH, VALIDATE_MEM_LIMIT, VALIDATE_CTX_BYTES,
# VALIDATE_LATENCY_SECONDS, VALIDATE_LATENCY_ROWS (harness.py).
set -u -o pipefail

SIMULATE=0
for arg in "$@"; do
    case "$arg" in
        --simulate) SIMULATE=1 ;;
        -h|--help) sed -n '2,32p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "validate.sh: unknown argument $arg (try --help)" >&2; exit 2 ;;
    esac
done

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$REPO" || exit 2

# --- outer: keep a transcript (in $OUT as it is written), save the rest at the end ---
if [ -z "${CGPU_VALIDATE_WORK:-}" ]; then
    export CGPU_VALIDATE_WORK
    CGPU_VALIDATE_WORK=$(mktemp -d "${TMPDIR:-/tmp}/cgpu-validate.XXXXXX") || exit 2
    transcript=$CGPU_VALIDATE_WORK/validate.txt
    if [ -n "${OUT:-}" ]; then
        mkdir -p "$OUT" && transcript=$OUT/validate.txt
    fi
    bash "${BASH_SOURCE[0]}" "$@" 2>&1 | tee "$transcript"
    rc=${PIPESTATUS[0]}
    if [ -n "${OUT:-}" ]; then
        saved=validate.txt
        for f in tables.md checks.txt procaddr.txt; do
            [ -f "$CGPU_VALIDATE_WORK/$f" ] && cp "$CGPU_VALIDATE_WORK/$f" "$OUT/$f" && saved="$saved, $f"
        done
        tar -czf "$OUT/validate-logs.tar.gz" -C "$CGPU_VALIDATE_WORK" \
            --exclude=site --exclude=simgpu-state --exclude=regions --exclude=tree --exclude=procaddr_probe . 2>/dev/null
        echo "saved $saved, validate-logs.tar.gz in $OUT"
    fi
    exit "$rc"
fi

# --- inner -------------------------------------------------------------------
WORK=$CGPU_VALIDATE_WORK
mkdir -p "$WORK/logs"
: > "$WORK/pids"
T0=$(date +%s)
if [ "$SIMULATE" = 1 ]; then BUDGET=${CGPU_VALIDATE_BUDGET:-240}; else BUDGET=${CGPU_VALIDATE_BUDGET:-540}; fi

log() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*"; }
broken() { log "BROKEN: $*"; exit 2; }
left() { echo $((BUDGET - ($(date +%s) - T0))); }
is_mounted() { grep -qs " $1 " /proc/mounts; }

TREE_PID=""
DAEMON_PID=""
SUPERVISOR_PID=""
FUSE_ROOT=""
cleanup() {
    local pid
    while read -r pid; do
        [ -n "$pid" ] && kill -TERM -- "-$pid" 2>/dev/null
    done < "$WORK/pids"
    touch "$WORK/stop-daemon"
    [ -n "$SUPERVISOR_PID" ] && kill -TERM "$SUPERVISOR_PID" 2>/dev/null
    DAEMON_PID=$(cat "$WORK/daemon.pid" 2>/dev/null)
    [ -n "$DAEMON_PID" ] && kill -TERM "$DAEMON_PID" 2>/dev/null
    sleep 0.5
    while read -r pid; do
        [ -n "$pid" ] && kill -KILL -- "-$pid" 2>/dev/null
    done < "$WORK/pids"
    if [ -n "$DAEMON_PID" ]; then
        timeout 10 tail --pid="$DAEMON_PID" -f /dev/null 2>/dev/null || kill -KILL "$DAEMON_PID" 2>/dev/null
    fi
    if [ -n "$FUSE_ROOT" ] && is_mounted "$FUSE_ROOT"; then
        fusermount -u "$FUSE_ROOT" 2>/dev/null || fusermount -u -z "$FUSE_ROOT" 2>/dev/null || umount -l "$FUSE_ROOT" 2>/dev/null
    fi
    if [ -n "$TREE_PID" ]; then
        kill -TERM "$TREE_PID" 2>/dev/null
        timeout 10 tail --pid="$TREE_PID" -f /dev/null 2>/dev/null || kill -KILL "$TREE_PID" 2>/dev/null
    fi
    rm -rf "$WORK/regions" "$WORK/site" "$WORK/simgpu-state"
}
trap cleanup EXIT
trap 'log "interrupted"; exit 2' INT TERM

if [ "$SIMULATE" = 1 ]; then MODE=sim; else MODE=real; fi
if [ "$MODE" = real ]; then BACKEND=${VALIDATE_BACKEND:-torch}; else BACKEND=${VALIDATE_BACKEND:-driver}; fi
log "cgpu_km real-GPU validation, mode $MODE, backend $BACKEND, repo $REPO, work $WORK, budget ${BUDGET}s"
for tool in timeout tail mktemp tar; do
    command -v "$tool" >/dev/null || broken "$tool not found"
done

# --- simulated GPU -------------------------------------------------------------------
if [ "$MODE" = sim ]; then
    export CGPU_SIMULATE=1 CGPU_SIMGPU_DIR="$REPO/simgpu" SIMGPU_STATE="$WORK/simgpu-state"
    export SIMGPU_DEVICES="${SIMGPU_DEVICES:-NVIDIA H200:143771MiB:GPU-a1b2c3d4-0000-4000-8000-00000000c0de}"
    export LD_LIBRARY_PATH="$REPO/simgpu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export VALIDATE_WINDOW=${VALIDATE_WINDOW:-2} VALIDATE_WARMUP=${VALIDATE_WARMUP:-1}
    # two of make bench's latency rows (make bench has them all, on simgpu)
    export VALIDATE_LATENCY_SECONDS=${VALIDATE_LATENCY_SECONDS:-1.5}
    export VALIDATE_LATENCY_ROWS=${VALIDATE_LATENCY_ROWS-one busy,single 50 ms kernels}
else
    unset CGPU_SIMULATE
    export VALIDATE_WINDOW=${VALIDATE_WINDOW:-8} VALIDATE_WARMUP=${VALIDATE_WARMUP:-2}
fi
export VALIDATE_MODE=$MODE VALIDATE_BACKEND=$BACKEND VALIDATE_WORK=$WORK

# --- build ---------------------------------------------------------------------------
build() {  # build DIR [TARGET]: make, then again without -Werror (a newer compiler's new warnings)
    local dir=$1 target=${2:-}
    if timeout 300 make -C "$dir" $target >"$WORK/logs/build-$dir.log" 2>&1; then return 0; fi
    log "make -C $dir $target failed; retrying with WERROR=0 (see logs/build-$dir.log)"
    timeout 300 make -C "$dir" WERROR=0 $target >>"$WORK/logs/build-$dir.log" 2>&1
}
if command -v make >/dev/null && { command -v gcc || command -v cc; } >/dev/null; then
    dirs="libcgpu"
    [ "$MODE" = sim ] && dirs="simgpu libcgpu"
    for dir in $dirs; do
        build "$dir" || { tail -20 "$WORK/logs/build-$dir.log"; broken "cannot build $dir"; }
    done
    # the latency section's workload, linked for this host's libcuda.so.1
    [ "$MODE" = real ] && { build simgpu sharework-host || log "cannot build simgpu/sharework-host: the latency section will not run"; }
    log "built: $dirs"
elif [ -f libcgpu/libcgpu.so ]; then
    log "gcc or make missing: using the libcgpu/libcgpu.so that is already here"
else
    broken "make and a C compiler (gcc or cc) are needed to build libcgpu (or carry a built libcgpu/libcgpu.so)"
fi
[ -f libcgpu/libcgpu.so ] || broken "libcgpu/libcgpu.so was not built"

# --- Python: the venv when there is one (simulated), else python3 + wheels from .whl/ ---------
PY=""
if [ "$MODE" = sim ] && [ -x "$REPO/.venv/bin/python" ]; then
    PY="$REPO/.venv/bin/python"
    export PYTHONPATH="$REPO"
else
    PY=$(command -v "${CGPU_VALIDATE_PYTHON:-python3}") || broken "${CGPU_VALIDATE_PYTHON:-python3} not found"
    SITE="$WORK/site"
    mkdir -p "$SITE"
    export PYTHONPATH="$REPO:$SITE"
    if ! timeout 60 "$PY" -c 'import trio, outcome, sniffio, sortedcontainers, attr, idna' 2>/dev/null; then
        [ -d .whl ] || broken "trio is not importable and there is no .whl/ folder of wheels"
        timeout 60 "$PY" - "$SITE" .whl/*.whl <<'EOF' || broken "cannot unpack the wheels in .whl/"
import sys, zipfile
for wheel in sys.argv[2:]:
    zipfile.ZipFile(wheel).extractall(sys.argv[1])
EOF
        log "unpacked $(ls .whl/*.whl | wc -l) wheels from .whl/ into $SITE"
    fi
    if ! timeout 60 "$PY" -c 'import fuse' 2>/dev/null && [ -f .whl/fuse.py ]; then
        cp .whl/fuse.py "$SITE/fuse.py"
    fi
fi
export PY
timeout 60 "$PY" -c 'import trio, pynvml, prometheus_client, cgpu_km.daemon.cli, cgpu_km.container.run' \
    >"$WORK/logs/imports.log" 2>&1 || { cat "$WORK/logs/imports.log"; broken "the daemon's modules do not import with $PY"; }
log "python: $PY ($("$PY" -c 'import sys; print(sys.version.split()[0])'))"

# --- the GPU ---------------------------------------------------------------------------
if [ "$MODE" = real ] && [ "$BACKEND" = torch ]; then
    command -v nvidia-smi >/dev/null || broken "nvidia-smi not found: no NVIDIA driver here?"
    timeout 60 nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv \
        || broken "nvidia-smi failed"
    timeout 180 "$PY" -c '
import torch, torchvision
assert torch.cuda.is_available(), "torch.cuda.is_available() is False"
print("torch", torch.__version__, "torchvision", torchvision.__version__, "CUDA", torch.version.cuda,
      "device", torch.cuda.get_device_name(0))' || broken "torch with CUDA is not usable"
fi
if [ "${CGPU_VALIDATE_LIBCGPU_CHECK:-0}" = 1 ] && [ "$MODE" = real ]; then
    log "libcgpu's own real-GPU check (tests/gpu/libcgpu_torch.py --no-bench)"
    timeout -k 5 180 "$PY" tests/gpu/libcgpu_torch.py --no-bench 2>&1 | tee "$WORK/logs/libcgpu_torch.log"
fi

# --- libcgpu's lookup routes: cuGetProcAddress(_v2), dlsym and dlvsym answer every wrapped
# name with libcgpu's wrapper on this driver (tests/gpu/procaddr_probe.c; issue 36) -----------
probe_lookups() {
    local probe=$WORK/procaddr_probe region=$WORK/probe-region cc rc
    cc=$(command -v gcc || command -v cc) || { log "no C compiler: the lookup probe does not run"; return 0; }
    if ! timeout 120 "$cc" -std=gnu11 -O2 -o "$probe" tests/gpu/procaddr_probe.c -ldl \
            >"$WORK/logs/build-procaddr.log" 2>&1; then
        echo "FAIL lookups: tests/gpu/procaddr_probe.c did not build (logs/build-procaddr.log)" >> "$WORK/checks.txt"
        return 0
    fi
    # the driver's own answers, without libcgpu, then libcgpu's (it swaps only with a region)
    env -u LD_PRELOAD timeout 120 "$probe" --lib libcgpu/libcgpu.so --driver \
        >"$WORK/logs/procaddr-driver.txt" 2>&1
    timeout 60 "$PY" -c 'import sys; from cgpu_km.dataplane import region as r
r.Region.create(sys.argv[1], "procaddr-probe", [r.GpuSpec(0)], gates_open=True).close()' "$region" \
        || { echo "FAIL lookups: cannot create the probe's region" >> "$WORK/checks.txt"; return 0; }
    LD_PRELOAD="$REPO/libcgpu/libcgpu.so" CGPU_REGION="$region" timeout 120 "$probe" \
        --lib libcgpu/libcgpu.so --expect "$WORK/logs/procaddr-driver.txt" >"$WORK/procaddr.txt" 2>&1
    rc=$?
    rm -rf "$region"
    grep -v '^q ' "$WORK/procaddr.txt" | tail -8
    if [ "$rc" = 0 ]; then
        echo "PASS lookups: $(tail -1 "$WORK/procaddr.txt" | sed 's/^procaddr_probe: //'): every answer is libcgpu's wrapper" >> "$WORK/checks.txt"
    else
        echo "FAIL lookups: $(grep -c '^FAIL' "$WORK/procaddr.txt") lookup(s) did not end at libcgpu's wrapper (procaddr.txt, status $rc)" >> "$WORK/checks.txt"
    fi
}
log "libcgpu's lookup routes (tests/gpu/procaddr_probe.c)"
probe_lookups
NGPUS=$(timeout 60 "$PY" -m cgpu_km.daemon --count-gpus 2>"$WORK/logs/count-gpus.log") \
    || { cat "$WORK/logs/count-gpus.log"; broken "cgpu-daemon --count-gpus failed"; }
log "GPUs: $NGPUS"

# --- the control tree: module, FUSE, or plain files ------------------------------------------
TREE_MODE=${CGPU_VALIDATE_TREE:-auto}
ROOT=""
ensure_libfuse() {  # fusermount and libfuse.so.2, from .deb/ when missing
    if command -v fusermount >/dev/null && ldconfig -p 2>/dev/null | grep -q 'libfuse\.so\.2'; then
        return 0
    fi
    ls .deb/*.deb >/dev/null 2>&1 || { log "no fusermount/libfuse.so.2 and no .deb/ folder"; return 1; }
    local deb
    for deb in .deb/*.deb; do
        if command -v dpkg-deb >/dev/null; then
            dpkg-deb -x "$deb" / || return 1
        else
            timeout 60 "$PY" - "$deb" <<'EOF' || return 1
import io, sys, tarfile
data = open(sys.argv[1], "rb").read()
assert data[:8] == b"!<arch>\n", "not a .deb"
pos = 8
while pos < len(data):
    name, size = data[pos:pos + 16].strip().decode(), int(data[pos + 48:pos + 58])
    body = data[pos + 60:pos + 60 + size]
    if name.startswith("data.tar"):
        tarfile.open(fileobj=io.BytesIO(body)).extractall("/")
    pos += 60 + size + (size & 1)
EOF
        fi
    done
    command -v ldconfig >/dev/null && ldconfig
    log "unpacked $(ls .deb/*.deb | wc -l) packages from .deb/ (fuse, libfuse2)"
    command -v fusermount >/dev/null
}
start_plain() {
    ROOT="$WORK/tree"
    "$PY" -m cgpu_km.tree.plain --root "$ROOT" --gpus "$NGPUS" >"$WORK/logs/tree.log" 2>&1 &
    TREE_PID=$!
    for _ in $(seq 100); do
        [ -p "$ROOT/inst_ctl" ] && return 0
        kill -0 "$TREE_PID" 2>/dev/null || break
        sleep 0.1
    done
    cat "$WORK/logs/tree.log"
    return 1
}
start_fuse() {
    ensure_libfuse || return 1
    [ -e /dev/fuse ] || mknod -m 666 /dev/fuse c 10 229 2>/dev/null || { log "no /dev/fuse"; return 1; }
    timeout 30 "$PY" -c 'import fuse' >"$WORK/logs/tree.log" 2>&1 || { log "fusepy does not load: $(tail -1 "$WORK/logs/tree.log")"; return 1; }
    ROOT="$WORK/tree"
    mkdir -p "$ROOT"
    "$PY" -m fuse_fs.mount --root "$ROOT" --gpus "$NGPUS" >"$WORK/logs/tree.log" 2>&1 &
    TREE_PID=$!
    FUSE_ROOT=$ROOT
    for _ in $(seq 100); do
        is_mounted "$ROOT" && [ -e "$ROOT/inst_ctl" ] && return 0
        kill -0 "$TREE_PID" 2>/dev/null || break
        sleep 0.1
    done
    log "cgpu-fuse did not mount: $(tail -2 "$WORK/logs/tree.log" | tr '\n' ' ')"
    kill -TERM "$TREE_PID" 2>/dev/null; wait "$TREE_PID" 2>/dev/null
    fusermount -u -z "$ROOT" 2>/dev/null
    TREE_PID="" FUSE_ROOT=""
    rmdir "$ROOT" 2>/dev/null
    return 1
}
case "$TREE_MODE" in
    auto|proc)
        if [ -e /proc/cgpu_km/inst_ctl ]; then
            ROOT=/proc/cgpu_km
            log "control tree: the kernel module's /proc/cgpu_km"
        elif [ "$TREE_MODE" = proc ]; then
            broken "CGPU_VALIDATE_TREE=proc but /proc/cgpu_km is not there"
        elif start_fuse; then
            log "control tree: cgpu-fuse at $ROOT"
        else
            log "FUSE is not usable here: falling back to the mount-free tree (cgpu_km.tree.plain)"
            start_plain || broken "the plain tree did not start"
            log "control tree: plain files at $ROOT"
        fi ;;
    fuse) start_fuse || broken "CGPU_VALIDATE_TREE=fuse but cgpu-fuse did not mount"
          log "control tree: cgpu-fuse at $ROOT" ;;
    plain) start_plain || broken "the plain tree did not start"
           log "control tree: plain files at $ROOT (forced)" ;;
    *) broken "CGPU_VALIDATE_TREE must be auto, proc, fuse or plain, not $TREE_MODE" ;;
esac
export CGPU_KM_ROOT=$ROOT CGPU_REGION_DIR="$WORK/regions"
mkdir -p "$CGPU_REGION_DIR"
timeout 10 cat "$ROOT/version" >/dev/null || broken "the control tree at $ROOT cannot be read"

# --- the daemon: restarted when it exits, as systemd's Restart= would; restarts are counted ---
# (harness.py voids a measuring window during which the daemon restarted)
supervise_daemon() {
    local rc
    while [ ! -f "$WORK/stop-daemon" ]; do
        "$PY" -m cgpu_km.daemon --root "$ROOT" --state-dir "$WORK/daemon" \
            --region-dir "$CGPU_REGION_DIR" --period 0.05 >>"$WORK/logs/daemon.log" 2>&1 &
        echo $! > "$WORK/daemon.pid"
        wait $!
        rc=$?
        [ -f "$WORK/stop-daemon" ] && break
        echo "$(date +%H:%M:%S) cgpu-daemon exited with status $rc; restarting" | tee -a "$WORK/daemon-restarts"
        sleep 0.2
    done
}
: > "$WORK/daemon-restarts"
export VALIDATE_DAEMON_DIR="$WORK"
supervise_daemon &
SUPERVISOR_PID=$!
for _ in $(seq 300); do
    [ -f "$WORK/daemon/snapshot.json" ] && break
    [ -s "$WORK/daemon-restarts" ] && { tail -30 "$WORK/logs/daemon.log"; broken "cgpu-daemon exited at start"; }
    sleep 0.1
done
[ -f "$WORK/daemon/snapshot.json" ] || { tail -30 "$WORK/logs/daemon.log"; broken "cgpu-daemon did not publish within 30 s"; }
log "cgpu-daemon running (pid $(cat "$WORK/daemon.pid"), period 0.05 s)"

# --- the sections --------------------------------------------------------------------------------
WINDOW=${VALIDATE_WINDOW:-10}
WARMUP=${VALIDATE_WARMUP:-3}
PHASES=$(( $(echo "${VALIDATE_BATCHES:-1,16,32,64,128}" | tr ',' '\n' | grep -c .) * $(echo "${VALIDATE_POLICIES:-2,1,5}" | tr ',' '\n' | grep -c .) ))
per_phase=$("$PY" -c 'import sys; print(int(float(sys.argv[1]) + float(sys.argv[2])) + 20)' "$WINDOW" "$WARMUP") \
    || broken "VALIDATE_WINDOW and VALIDATE_WARMUP must be numbers of seconds"
FAILED_SECTIONS=""
run_section() {  # run_section NAME TIMEOUT
    local name=$1 limit=$2 remaining rc
    remaining=$(( $(left) - 15 ))
    if [ "$remaining" -lt 30 ]; then
        log "section $name SKIPPED: the time budget is spent"
        FAILED_SECTIONS="$FAILED_SECTIONS $name"
        return
    fi
    [ "$limit" -gt "$remaining" ] && limit=$remaining
    log "section $name (at most ${limit}s)"
    timeout -k 10 "$limit" "$PY" tests/gpu/harness.py "$name"
    rc=$?
    case $rc in
        0) ;;
        124|137) log "section $name timed out after ${limit}s"; FAILED_SECTIONS="$FAILED_SECTIONS $name" ;;
        *) log "section $name could not measure (status $rc)"; FAILED_SECTIONS="$FAILED_SECTIONS $name" ;;
    esac
    kill -0 "$SUPERVISOR_PID" 2>/dev/null || broken "the daemon's supervisor is gone"
}
run_section memory 240
run_section compute $(( PHASES * per_phase + 180 ))
run_section overhead $(( 4 * per_phase + 150 ))
latency_limit=$("$PY" -c 'import sys; print(int(36 * (float(sys.argv[1]) + 5)) + 60)' "${VALIDATE_LATENCY_SECONDS:-3}") \
    || broken "VALIDATE_LATENCY_SECONDS must be a number of seconds"
run_section latency "$latency_limit"
cc=$(command -v gcc || command -v cc) \
    && timeout 120 "$cc" -std=gnu11 -O2 -shared -fPIC -Ilibcgpu/include -o "$WORK/librawlaunch.so" \
        tests/attacks/rawlaunch.c >"$WORK/logs/build-rawlaunch.log" 2>&1 \
    || log "cannot build tests/attacks/rawlaunch.c: the detector section will not run"
run_section detector 120

# --- summary ---------------------------------------------------------------------------------------
echo
restarts=$(grep -c . "$WORK/daemon-restarts")
if [ "$restarts" -gt 0 ]; then
    echo "FAIL daemon: cgpu-daemon exited and was restarted $restarts time(s) (logs/daemon.log)" >> "$WORK/checks.txt"
    grep -B2 -m3 -E '^[A-Za-z]*Error|Error:' "$WORK/logs/daemon.log" | sed 's/^/daemon log: /'
else
    echo "PASS daemon: cgpu-daemon ran the whole time without exiting" >> "$WORK/checks.txt"
fi
grep -iE 'error|warning' "$WORK/logs/daemon.log" | grep -v '^ ' | sort | uniq -c | sort -rn | head -5 | sed 's/^/daemon log: /'
log "summary ($(( $(date +%s) - T0 )) s, mode $MODE, backend $BACKEND, tree $ROOT)"
cat "$WORK/checks.txt"
log "$(grep -c '^PASS' "$WORK/checks.txt") passed, $(grep -c '^FAIL' "$WORK/checks.txt") failed"
if [ -n "$FAILED_SECTIONS" ]; then
    log "sections that did not measure:$FAILED_SECTIONS"
    exit 1
fi
exit 0
