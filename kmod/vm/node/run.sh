#!/bin/sh
# The whole-node VM test: Debian's kernel under qemu (TCG) with the host's
# root shared read-only over virtio-9p, a tmpfs overlay on top (init), and
# the host's systemd as PID 1, booted into cgpu-node-test.target. There
# checks.py installs the project with `cgpu-node install` and drives the
# node through /proc/cgpu_km, simgpu as its GPU.
# Usage: run.sh KERNEL_VERSION MODULE.ko   (make -C kmod node-test)
# Env: NODE_VM_TIMEOUT (seconds, default 480), NODE_VM_SMP (default 2),
#      NODE_VM_MEM (MiB, default 2048), NODE_VM_LOG (console log, default
#      kmod/build/node/console.log), NODE_VM_UNTIL (a phase of checks.py: run
#      the phases up to it only, e.g. shares).
# On the host it writes only under kmod/build/node/ (the share is read-only;
# the guest writes to its tmpfs). Fails when a check fails, when no result
# line arrives in time, and on BUG:/WARNING:/Oops in the kernel's console.
set -eu
kver=$1
ko=$2
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../../.." && pwd)
build="$repo/kmod/build/node"
log=${NODE_VM_LOG:-$build/console.log}
timeout_s=${NODE_VM_TIMEOUT:-480}
python="$repo/.venv/bin/python"
kernel=/boot/vmlinuz-$kver
# Loaded by the initramfs in this order (dependencies first).
BOOT_MODULES="virtio_ring virtio virtio_pci_modern_dev virtio_pci_legacy_dev virtio_pci \
9pnet 9pnet_virtio netfs fscache 9p overlay"
# Services of the host that a bare GPU node does not need (masked in the guest).
MASKED="docker.service docker.socket containerd.service podman.service podman.socket \
podman-restart.service podman-auto-update.service podman-auto-update.timer \
postgresql.service prometheus.service apparmor.service e2scrub_reap.service \
systemd-timesyncd.service systemd-pstore.service apt-daily.timer apt-daily-upgrade.timer \
dpkg-db-backup.timer e2scrub_all.timer fstrim.timer man-db.timer \
getty@tty1.service serial-getty@ttyS0.service getty.target \
systemd-hwdb-update.service ldconfig.service systemd-journal-catalog-update.service \
systemd-update-done.service systemd-random-seed.service systemd-binfmt.service \
proc-sys-fs-binfmt_misc.automount systemd-firstboot.service systemd-machine-id-commit.service \
systemd-repart.service"

status=0
fail() { echo "node-vm: $*" >&2; exit 1; }

check_tools() {
	# The guest runs the host's programs: systemd, runc, nsenter, python3 among them.
	for tool in qemu-system-x86_64 busybox cpio gzip depmod modinfo runc nsenter python3 \
		systemctl journalctl; do
		command -v "$tool" >/dev/null || fail "$tool is missing (make setup installs it)"
	done
	[ -x /lib/systemd/systemd ] || fail "/lib/systemd/systemd is missing (apt-get install systemd)"
	[ -r "$kernel" ] || fail "cannot read $kernel"
	[ -r "$ko" ] || fail "no module at $ko"
	for built in .venv/bin/cgpu-node libcgpu/libcgpu.so simgpu/libnvidia-ml.so.1 \
		simgpu/sharework simgpu/cuworkload; do
		[ -e "$repo/$built" ] || fail "$built is missing (run make setup)"
	done
}

# The module where modprobe finds it: depmod over the kernel's modules and ours,
# in a copy of /lib/modules/V (the kernel's own folder linked, not copied).
stage_modules() {
	mods="$build/modroot/lib/modules/$kver"
	rm -rf "$build/modroot"
	mkdir -p "$mods/extra"
	ln -s "/lib/modules/$kver/kernel" "$mods/kernel"
	for f in modules.order modules.builtin modules.builtin.modinfo; do
		cp "/lib/modules/$kver/$f" "$mods/"
	done
	cp "$ko" "$mods/extra/cgpu_km.ko"
	depmod -b "$build/modroot" "$kver" || fail "depmod"
	grep -q '^extra/cgpu_km.ko:' "$mods/modules.dep" || fail "depmod did not list cgpu_km"
}

# What the guest takes from the build folder: cgpu_km's wheel for
# `cgpu-node install --wheel` (building it under TCG takes half a minute) and
# the runc container's root (busybox, cuworkload and the libraries they link).
prepare_payload() {
	rm -rf "$build/wheel" "$build/wheel-build" "$build/rootfs"
	"$python" - "$build" <<-'PY' || fail "cannot build the wheel and the container's root"
		import shutil, sys
		from pathlib import Path
		from cgpu_km.demo.image import build_rootfs
		from cgpu_km.node.prefix import build_wheel, checkout
		build = Path(sys.argv[1])
		wheel = build_wheel(checkout(), build / "wheel-build")
		(build / "wheel").mkdir()
		shutil.move(wheel, build / "wheel" / wheel.name)
		shutil.rmtree(build / "wheel-build")
		build_rootfs(build / "rootfs")
	PY
}

# busybox, the modules that mount the share and the overlay, and init.
pack_initramfs() {
	stage="$build/initramfs"
	rm -rf "$stage"
	mkdir -p "$stage/bin" "$stage/modules"
	busybox=/bin/busybox
	[ -x "$busybox" ] || busybox=$(command -v busybox)
	cp "$busybox" "$stage/bin/busybox"
	cp "$here/init" "$stage/init"
	for m in $BOOT_MODULES; do
		path=$(modinfo -k "$kver" -F filename "$m") || fail "no module $m in $kver"
		cp "$path" "$stage/modules/$m.ko"
	done
	echo "$BOOT_MODULES" >"$stage/modules/order"
	(cd "$stage" && find . | cpio -o -H newc --quiet | gzip -1) >"$build/initramfs.cpio.gz"
	rm -rf "$stage"
}

# systemd boots into cgpu-node-test.target (the basic system and the checks);
# status messages only for failures.
cmdline() {
	printf '%s' "console=ttyS0 panic=-1 quiet cgpu.repo=$repo systemd.unit=cgpu-node-test.target"
	printf '%s' " systemd.show_status=error systemd.firstboot=0"
	[ -z "${NODE_VM_UNTIL:-}" ] || printf ' cgpu.until=%s' "$NODE_VM_UNTIL"
	for unit in $MASKED; do printf ' systemd.mask=%s' "$unit"; done
}

boot() {
	rm -f "$log"
	echo "node-vm: booting $kernel (TCG, ${NODE_VM_SMP:-2} vCPUs, limit ${timeout_s}s), console in $log"
	timeout --kill-after=10 "$timeout_s" qemu-system-x86_64 -accel tcg -smp "${NODE_VM_SMP:-2}" \
		-m "${NODE_VM_MEM:-2048}" -nographic -no-reboot -kernel "$kernel" \
		-initrd "$build/initramfs.cpio.gz" -append "$(cmdline)" \
		-fsdev local,id=hostroot,path=/,security_model=none,readonly=on,multidevs=remap \
		-device virtio-9p-pci,fsdev=hostroot,mount_tag=hostroot \
		</dev/null >"$log" 2>&1 || status=$?
}

# The checks' lines, then the verdict: every check passed, a result line came in
# time, and the kernel reported nothing (the checks look at dmesg too).
verdict() {
	tr -d '\r' <"$log" | grep -aE '^(CGPU-NODE|PASS|FAIL|#)' || true
	echo "node-vm: VM wall time ${wall}s"
	problems=""
	if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
		problems="$problems; no result within ${timeout_s}s"
	fi
	grep -aq '^CGPU-NODE-RESULT: PASS' "$log" || problems="$problems; no PASS result line"
	if grep -aqE '^\[ *[0-9.]+\] .*(BUG:|WARNING:|Oops|general protection|Kernel panic)' "$log"
	then
		problems="$problems; the kernel log reports a problem"
	fi
	if [ -n "$problems" ]; then
		tail -n 40 "$log" >&2
		fail "FAIL${problems} (console log: $log)"
	fi
	echo "node-vm: PASS"
}

check_tools
mkdir -p "$build"
stage_modules
prepare_payload
pack_initramfs
start=$(date +%s)
boot
wall=$(($(date +%s) - start))
verdict
