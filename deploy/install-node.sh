#!/bin/sh
# Install cgpu_km on a GPU node from the DaemonSet's init container.
#
#   install-node.sh [HOST_ROOT]      (default: /host, where the node's / is mounted)
#
# Copies the image's self-contained /opt/cgpu_km (its own Python, the venv with
# cgpu_km, libcgpu.so, the systemd units) to the node, links the programs into
# /usr/local/bin, describes the OCI hook as the CDI device aliyun.com/cgpu=shared
# in /etc/cdi/cgpu.json (the device plugin adds that device to every container
# it allocates for, so the runtime runs `cgpu-hook` for exactly those), and
# enables the tree and daemon services in the node's systemd, so that they
# survive restarts of this pod. When the installed version
# changes while the daemon runs, it asks for a hot update through the tree's
# `upgrade` node instead of restarting anything (containers keep their limits).
# Idempotent: running it again with the same version changes nothing.
#
# Environment (for tests and unusual nodes):
#   CGPU_SOURCE   what to install (default /opt/cgpu_km)
#   SYSTEMCTL     how to run the node's systemctl
#                 (default: nsenter --target 1 --mount --uts --ipc --net --pid -- systemctl)
#   TREE_ROOTS    where to look for the control tree (default: /proc/cgpu_km /run/cgpu_km)
#   CGPU_HOOK_STAGE  the OCI hook that registers containers: createRuntime (default;
#                 runc 1.0+, crun, which every CDI-capable engine runs) or prestart
#                 (deprecated by the OCI spec, for an older runtime)
set -eu

HOST_ROOT=${1:-/host}
SOURCE=${CGPU_SOURCE:-/opt/cgpu_km}
SYSTEMCTL=${SYSTEMCTL:-nsenter --target 1 --mount --uts --ipc --net --pid -- systemctl}
TREE_ROOTS=${TREE_ROOTS:-/proc/cgpu_km /run/cgpu_km}
HOOK_STAGE=${CGPU_HOOK_STAGE:-createRuntime}
PREFIX=/opt/cgpu_km            # the path as the node sees it
DEST=$HOST_ROOT$PREFIX
CDI_DIR=$HOST_ROOT/etc/cdi
UNIT_DIR=$HOST_ROOT/etc/systemd/system
BIN_DIR=$HOST_ROOT/usr/local/bin
PROGRAMS="cgpu-hook cgpu-daemon cgpu-fuse cgpu-smi"

say() { echo "install-node: $*"; }
fail() { echo "install-node: error: $*" >&2; exit 1; }

[ -d "$HOST_ROOT" ] || fail "host root $HOST_ROOT is not a directory (mount the node's / there)"
[ -f "$SOURCE/VERSION" ] || fail "$SOURCE/VERSION missing: not a cgpu_km image"
case $HOOK_STAGE in
    createRuntime|prestart) ;;
    *) fail "CGPU_HOOK_STAGE=$HOOK_STAGE: expected createRuntime or prestart" ;;
esac
new_version=$(cat "$SOURCE/VERSION")
old_version=$(cat "$DEST/VERSION" 2>/dev/null || echo none)

# 1. The files: copy beside, then swap, so a node never sees half a tree.
if [ "$new_version" = "$old_version" ]; then
    say "version $new_version already installed in $PREFIX"
else
    say "installing version $new_version (was $old_version) in $PREFIX"
    mkdir -p "$(dirname "$DEST")"
    rm -rf "$DEST.new" "$DEST.old"
    cp -a "$SOURCE" "$DEST.new"
    if [ -e "$DEST" ]; then mv "$DEST" "$DEST.old"; fi
    mv "$DEST.new" "$DEST"
    rm -rf "$DEST.old"
fi

# 2. The programs on the node's PATH.
mkdir -p "$BIN_DIR"
for program in $PROGRAMS; do
    [ -x "$DEST/venv/bin/$program" ] || fail "$PREFIX/venv/bin/$program missing in the image"
    ln -sfn "$PREFIX/venv/bin/$program" "$BIN_DIR/$program"
done

# 3. The OCI hook as a CDI device (CDI 0.6.0; containerd 1.7+ with enable_cdi,
#    CRI-O, docker 25+). runc and crun run createRuntime and prestart at the
#    same point; the hook's argument names its stage.
mkdir -p "$CDI_DIR"
hook=/usr/local/bin/cgpu-hook
cat > "$CDI_DIR/cgpu.json.tmp" <<SPEC
{"cdiVersion": "0.6.0", "kind": "aliyun.com/cgpu",
 "devices": [{"name": "shared", "containerEdits": {"env": ["CGPU_HOOKED=1"]}}],
 "containerEdits": {"hooks": [
   {"hookName": "$HOOK_STAGE", "path": "$hook",
    "args": ["cgpu-hook", "$HOOK_STAGE"], "env": ["PATH=/usr/bin:/bin"], "timeout": 30},
   {"hookName": "poststop", "path": "$hook",
    "args": ["cgpu-hook", "poststop"], "env": ["PATH=/usr/bin:/bin"], "timeout": 30}]}}
SPEC
mv "$CDI_DIR/cgpu.json.tmp" "$CDI_DIR/cgpu.json"
say "OCI hook (at $HOOK_STAGE, poststop) as CDI device aliyun.com/cgpu=shared in /etc/cdi/cgpu.json"

# 4. The tree and the daemon as services of the node.
units=""
for unit in "$DEST"/systemd/*.service; do
    [ -f "$unit" ] || continue
    name=$(basename "$unit")
    mkdir -p "$UNIT_DIR"
    cp "$unit" "$UNIT_DIR/$name.tmp"
    mv "$UNIT_DIR/$name.tmp" "$UNIT_DIR/$name"
    units="$units $name"
done
if [ -z "$units" ]; then
    say "warning: the image has no systemd units; start the tree and the daemon by hand"
else
    $SYSTEMCTL daemon-reload
    # shellcheck disable=SC2086 # a list of unit names
    $SYSTEMCTL enable --now $units
    say "enabled and started:$units"
fi

# 5. A new version of a running daemon: hot update, no restart.
if [ "$old_version" != none ] && [ "$new_version" != "$old_version" ]; then
    for root in $TREE_ROOTS; do
        if [ -w "$HOST_ROOT$root/upgrade" ]; then
            echo 1 > "$HOST_ROOT$root/upgrade"
            say "asked the daemon for a hot update through $root/upgrade"
            break
        fi
    done
fi
say "done"
