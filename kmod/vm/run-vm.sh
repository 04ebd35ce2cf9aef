#!/bin/sh
# Boot a kernel in qemu (TCG; no KVM needed) with a busybox initramfs that
# holds cgpu_km.ko, the conformance suite (tests/conformance/) and this
# folder's init and checks.sh; read the serial console and decide.
# Usage: run-vm.sh KERNEL_VERSION MODULE.ko
# Env: VM_TIMEOUT (seconds, default 300), VM_SMP (vCPUs, default 2),
#      PYTHON (runs tests/kmod/difftest.py, default python3),
#      VM_LOG (console log, default kmod/build/vm-console.log).
# Fails when the VM reports a failure, when no result line arrives in time,
# and on BUG:/WARNING:/Oops/general protection in the kernel log.  The kernel
# runs with slub_debug (red zones, poisoning, call sites), so a corrupted or
# leaked slab object shows as well.
set -eu
kver=$1
ko=$2
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
timeout_s=${VM_TIMEOUT:-300}
python=${PYTHON:-python3}
build="$repo/kmod/build"
log=${VM_LOG:-$build/vm-console.log}
kernel=/boot/vmlinuz-$kver

for tool in qemu-system-x86_64 busybox cpio gzip; do
	command -v "$tool" >/dev/null || { echo "run-vm: $tool is missing" >&2; exit 1; }
done
[ -r "$kernel" ] || { echo "run-vm: cannot read $kernel" >&2; exit 1; }
[ -r "$ko" ] || { echo "run-vm: no module at $ko" >&2; exit 1; }
# busybox-static's binary (the initramfs has no libc).
busybox=/bin/busybox
[ -x "$busybox" ] || busybox=$(command -v busybox)

mkdir -p "$build"
stage=$(mktemp -d "$build/initramfs.XXXXXX")
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/bin" "$stage/conformance"
cp "$busybox" "$stage/bin/busybox"
cp "$here/init" "$stage/init"
cp "$here/checks.sh" "$stage/checks.sh"
cp "$ko" "$stage/cgpu_km.ko"
if [ -d "$repo/tests/conformance" ]; then
	cp -R "$repo/tests/conformance/." "$stage/conformance/"
fi
difftest="$repo/tests/kmod/difftest.py"
expected="$build/difftest-expected.txt"
"$python" "$difftest" script >"$stage/difftest.sh"
"$python" "$difftest" params >"$stage/difftest.params"
"$python" "$difftest" expected >"$expected"
chmod 755 "$stage" "$stage/init"
initrd="$build/initramfs.cpio.gz"
(cd "$stage" && find . | cpio -o -H newc --quiet | gzip -1) >"$initrd"

echo "run-vm: booting $kernel (TCG, ${VM_SMP:-2} vCPUs, limit ${timeout_s}s), console in $log"
start=$(date +%s)
status=0
timeout --kill-after=10 "$timeout_s" qemu-system-x86_64 -accel tcg -smp "${VM_SMP:-2}" -m 512 \
	-nographic -no-reboot -kernel "$kernel" -initrd "$initrd" \
	-append "console=ttyS0 panic=-1 quiet slub_debug=FZPU" </dev/null >"$log" 2>&1 || status=$?
wall=$(($(date +%s) - start))

# The test's own lines, for the reader of the make output.
grep -E '^(CGPU-VM|ok |not ok |#|FAIL|conformance)' "$log" | tr -d '\r' || true
problems=""
# "BUG kmalloc-64 (Tainted: ...): Redzone overwritten" is slub_debug's report.
kernel_problems='BUG:|BUG [a-z0-9_-]+ \(|WARNING:|Oops|general protection'
if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
	problems="$problems; no result within ${timeout_s}s"
fi
grep -q '^CGPU-VM-RESULT: PASS' "$log" || problems="$problems; no PASS result line"
if grep -qE "$kernel_problems" "$log"; then
	problems="$problems; kernel log reports a problem"
	grep -nE -B2 -A20 "$kernel_problems" "$log" | head -80 >&2
fi
"$python" "$difftest" compare "$expected" "$log" || problems="$problems; differential test"
echo "run-vm: VM wall time ${wall}s"
if [ -n "$problems" ]; then
	echo "run-vm: FAIL${problems} (console log: $log)" >&2
	tail -n 40 "$log" >&2
	exit 1
fi
echo "run-vm: PASS"
