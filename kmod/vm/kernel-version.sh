#!/bin/sh
# Print the newest installed kernel version V that has both /boot/vmlinuz-V
# (to boot in the VM) and /lib/modules/V/build (to build the module).
set -eu
for v in $(ls /lib/modules 2>/dev/null | sort -V -r); do
	if [ -r "/boot/vmlinuz-$v" ] && [ -d "/lib/modules/$v/build" ]; then
		echo "$v"
		exit 0
	fi
done
echo "kernel-version: no kernel with both /boot/vmlinuz-V and /lib/modules/V/build" >&2
exit 1
