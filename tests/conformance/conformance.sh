#!/bin/sh
# Conformance suite for the cgpu_km control tree (docs/design.md).
#
# Written for busybox sh using only sh, echo, cat, ls and test, so that the
# same script checks the FUSE tree on a host and /proc/cgpu_km inside the
# kernel-module VM.  It expects a freshly started tree (initial values) with
# at least one GPU, and leaves it as it found it.
#
#   CGPU_KM_ROOT=/proc/cgpu_km sh conformance.sh
#
# Prints one line per failure and ends with "conformance: N passed, N failed";
# exits non-zero when anything failed.

R=${CGPU_KM_ROOT:?set CGPU_KM_ROOT to the tree root}
passed=0
failed=0
NL='
'

pass() { passed=$((passed + 1)); }
fail() { failed=$((failed + 1)); echo "FAIL: $*"; }

# check_read PATH EXPECTED: the node reads EXPECTED followed by one newline.
check_read() {
	got=$(cat "$R/$1" 2>&1; echo x)
	if [ "$got" = "$2${NL}x" ]; then pass; else fail "read $1: want '$2', got '${got%x}'"; fi
}

# check_write PATH DATA: writing DATA (as echo -n writes it) succeeds.
check_write() {
	if out=$( (echo -n "$2" > "$R/$1") 2>&1 ); then pass; else fail "write '$2' to $1: $out"; fi
}

# check_error ERRTEXT PATH DATA: writing DATA fails with the strerror ERRTEXT.
check_error() {
	if out=$( (echo -n "$3" > "$R/$2") 2>&1 ); then
		fail "write '$3' to $2 succeeded, want $1"
	else
		case "$out" in
		*"$1"*) pass ;;
		*) fail "write '$3' to $2: want $1, got: $out" ;;
		esac
	fi
}

# check_rejected PATH DATA ERRTEXT: the write fails and the value is unchanged.
check_rejected() {
	before=$(cat "$R/$1")
	check_error "$3" "$1" "$2"
	check_read "$1" "$before"
}

# check_mode PATH MODESTRING: what ls -l shows as the file's type and mode.
check_mode() {
	# shellcheck disable=SC2046
	set -- "$1" "$2" $(ls -ld "$R/$1")
	if [ "$3" = "$2" ]; then pass; else fail "mode of $1: want $2, got $3"; fi
}

check_exists() { if test -e "$R/$1"; then pass; else fail "$1 should exist"; fi; }
check_absent() { if test -e "$R/$1"; then fail "$1 should not exist"; else pass; fi; }

ctl() { check_write inst_ctl "$1"; }

EINVAL="Invalid argument"
EPERM="Operation not permitted"
EACCES="Permission denied"
ENOSPC="No space left on device"
EBUSY="busy"
ENODEV="No such device"
EEXIST="File exists"
ENOENT="No such file or directory"

gpus=0
while test -d "$R/$gpus"; do gpus=$((gpus + 1)); done
if [ "$gpus" -lt 1 ]; then fail "no GPU directory under $R"; fi
last=$((gpus - 1))

# --- root nodes -----------------------------------------------------------
version=$(cat "$R/version")
case "$version" in
[0-9]*.[0-9]*.[0-9]*) pass ;;
*) fail "version is not X.Y.Z: $version" ;;
esac
check_mode version -r--r--r--
check_mode default_memsize -rw-r--r--
check_mode inst_ctl -rw-------
check_mode upgrade -rw-r--r--
check_read default_memsize 0
check_read upgrade 0
check_rejected version "9.9.9" "$EPERM"
case "$(cat "$R/inst_ctl")" in
usage:*) pass ;;
*) fail "inst_ctl should read a usage line" ;;
esac

check_rejected upgrade 2 "$EINVAL"
check_write upgrade 1
check_read upgrade 1
check_write upgrade "0$NL"
check_read upgrade 0

for bad in " " "abc" "-1" "+1" "1x" "0x10" "1 2" "18446744073709551616"; do
	check_rejected default_memsize "$bad" "$EINVAL"
done
check_write default_memsize "  1048576 $NL"
check_read default_memsize 1048576
check_write default_memsize 18446744073709551615
check_read default_memsize 18446744073709551615
check_write default_memsize 0

# --- GPU nodes --------------------------------------------------------------
g=0
while [ "$g" -lt "$gpus" ]; do
	check_mode "$g" dr-xr-xr-x
	check_mode "$g/policy" -rw-r--r--
	check_mode "$g/max_inst" -rw-r--r--
	check_mode "$g/prio_ratio" -rw-r--r--
	check_mode "$g/free_weight" -r--r--r--
	check_mode "$g/major" -r--r--r--
	check_read "$g/policy" 1
	check_read "$g/max_inst" 16
	check_read "$g/prio_ratio" 80
	check_read "$g/free_weight" 16
	case "$(cat "$R/$g/major")" in
	"" | *[!0-9]*) fail "$g/major is not a number" ;;
	*) pass ;;
	esac
	g=$((g + 1))
done

for v in 0 1 2 3 4 5; do
	check_write 0/policy "$v$NL"
	check_read 0/policy "$v"
done
check_write 0/policy " 	3 $NL"
check_read 0/policy 3
for bad in 6 -1 " " x 3.0 "3 4" 99999999999999999999999; do
	check_rejected 0/policy "$bad" "$EINVAL"
done
check_write 0/policy 1
for bad in 0 26; do check_rejected 0/max_inst "$bad" "$EINVAL"; done
check_write 0/max_inst 25
check_read 0/free_weight 25
check_write 0/max_inst 1
check_read 0/free_weight 1
check_write 0/max_inst 16
for bad in 19 100; do check_rejected 0/prio_ratio "$bad" "$EINVAL"; done
check_write 0/prio_ratio 20
check_write 0/prio_ratio 99
check_write 0/prio_ratio 80
check_rejected 0/free_weight 3 "$EPERM"
check_rejected 0/major 3 "$EPERM"
check_read "$last/policy" 1

# --- creating containers ------------------------------------------------------
ctl "add 0 ctr-a memsize=1073741824 weight=4 highprio=1 util_limit=50"
check_exists 0/ctr-a
for n in id memsize meminfo weight highprio util_limit; do check_exists "0/ctr-a/$n"; done
check_mode 0/ctr-a dr-xr-xr-x
check_mode 0/ctr-a/id -r--r--r--
check_mode 0/ctr-a/memsize -rw-r--r--
check_mode 0/ctr-a/meminfo -r--r--r--
check_mode 0/ctr-a/weight -rw-r--r--
check_mode 0/ctr-a/highprio -rw-r--r--
check_mode 0/ctr-a/util_limit -rw-r--r--
check_read 0/ctr-a/memsize 1073741824
check_read 0/ctr-a/weight 4
check_read 0/ctr-a/highprio 1
check_read 0/ctr-a/util_limit 50
check_read 0/ctr-a/meminfo "Free: 1073741824"
check_read 0/free_weight 12
id_a=$(cat "$R/0/ctr-a/id")
case "$id_a" in
"" | *[!0-9]*) fail "id is not a number: $id_a" ;;
*) pass ;;
esac

# The legacy 13-byte form, with and without the newline.  (An empty write
# cannot be made from sh: `echo -n "" > f` issues no write at all.)
ctl "0abcdef012345"
check_exists 0/abcdef012345
check_read 0/abcdef012345/weight 1
check_read 0/abcdef012345/memsize 0
check_read 0/abcdef012345/highprio 0
check_read 0/abcdef012345/util_limit 0
if [ "$gpus" -ge 2 ]; then
	ctl "${last}legacy000001$NL"
	check_exists "$last/legacy000001"
	ctl "del $last legacy000001"
	check_absent "$last/legacy000001"
fi
id_b=$(cat "$R/0/abcdef012345/id")
if [ "$id_b" != "$id_a" ]; then pass; else fail "instance ids are not unique: $id_a"; fi

# default_memsize applies to containers created without a memsize.
check_write default_memsize 4096
ctl "add 0 ctr-d"
check_read 0/ctr-d/memsize 4096
check_write default_memsize 0
ctl "del 0 ctr-d"
check_absent 0/ctr-d

# inst_ctl errors: each changes nothing.
check_error "$EEXIST" inst_ctl "add 0 ctr-a"
check_error "$EEXIST" inst_ctl "0abcdef012345"
check_read 0/ctr-a/memsize 1073741824
check_error "$ENODEV" inst_ctl "add $gpus ctr-x"
check_error "$ENODEV" inst_ctl "add 99 ctr-x"
check_error "$ENODEV" inst_ctl "meminfo 99 ctr-a"
check_error "$ENODEV" inst_ctl "del 99 ctr-a"
check_absent "0/ctr-x"
for bad in " " "add" "add 0" "add x ctr-x" "add 0 ctr/x" "add 0 ctr-x memsize=0" \
	"add 0 ctr-x memsize=-5" "add 0 ctr-x weight=1 weight=2" "add 0 ctr-x foo=1" \
	"add 0 ctr-x highprio=2" "add 0 ctr-x util_limit=96" "add 0 ctr-x weight=17" \
	"add 0 ctr-x memsize" "add 0 policy" "add 0 .." "frob 0 ctr-x" "0abc" \
	"0abcdef0123456" "del" "del 0 ctr-x extra" "meminfo 0" "meminfo 0 ctr-a 12" \
	"meminfo 0 ctr-a 0=5" "meminfo 0 ctr-a x=5" "meminfo 0 ctr-a 5=5 5=6" \
	"add 0 aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"; do
	check_error "$EINVAL" inst_ctl "$bad"
done
check_absent "0/ctr-x"
# Words are separated by the contract's six whitespace bytes, and by nothing else:
# not by the ASCII separators 0x1c..0x1f (which Python's str.split() takes).
for sep in "$NL" "$(echo -ne '\011')" "$(echo -ne '\013')" "$(echo -ne '\014')" \
	"$(echo -ne '\015')"; do
	ctl "add${sep}0 ctr-w${sep}weight=0"
	check_read 0/ctr-w/weight 0
	ctl "del${sep}ctr-w"
done
for code in '\034' '\035' '\036' '\037'; do
	sep=$(echo -ne "$code")
	check_error "$EINVAL" inst_ctl "add${sep}0 ctr-x"
	check_error "$EINVAL" inst_ctl "add 0${sep}ctr-x"
	check_error "$EINVAL" inst_ctl "-ctr-x${sep}"
done
check_absent "0/ctr-x"
check_absent "0/ctr-w"
check_read 0/free_weight 11
check_error "$ENOENT" inst_ctl "del 0 ctr-x"
check_error "$ENOENT" inst_ctl "del ctr-x"
check_error "$ENOENT" inst_ctl "-ctr-x"
check_error "$ENOENT" inst_ctl "meminfo 0 ctr-x 1=1"

# --- container nodes ------------------------------------------------------------
check_rejected 0/ctr-a/id 7 "$EPERM"
check_rejected 0/ctr-a/meminfo 7 "$EPERM"
check_rejected 0/ctr-a/memsize 0 "$EINVAL"
check_rejected 0/ctr-a/memsize -1 "$EINVAL"
check_write 0/ctr-a/memsize 2147483648
check_read 0/ctr-a/memsize 2147483648
check_rejected 0/ctr-a/highprio 2 "$EINVAL"
check_write 0/ctr-a/highprio 0
check_read 0/ctr-a/highprio 0
check_rejected 0/ctr-a/util_limit 96 "$EINVAL"
check_write 0/ctr-a/util_limit 95
check_write 0/ctr-a/util_limit 0
check_read 0/ctr-a/util_limit 0

# Weights: 4 + 1 used of 16.
check_rejected 0/ctr-a/weight 17 "$EINVAL"
check_rejected 0/ctr-a/weight 16 "$ENOSPC"
check_write 0/ctr-a/weight 15
check_read 0/free_weight 0
ctl "add 0 ctr-z weight=3"
check_read 0/ctr-z/weight 0
check_read 0/free_weight 0
ctl "del 0 ctr-z"
check_write 0/ctr-a/weight 0
check_read 0/free_weight 15
check_write 0/ctr-a/weight 4
check_read 0/free_weight 11

# max_inst cannot drop below the containers or the weights in use.
check_rejected 0/max_inst 4 "$EBUSY"
check_write 0/max_inst 5
check_read 0/free_weight 0
check_write 0/ctr-a/weight 1
ctl "add 0 c3"
ctl "add 0 c4"
check_rejected 0/max_inst 3 "$EBUSY"
ctl "add 0 c5"
check_error "$ENOSPC" inst_ctl "add 0 c6"
check_error "$ENOSPC" inst_ctl "0legacy000007"
check_absent 0/c6
check_absent 0/legacy000007
ctl "del 0 c3"
ctl "del c4"
ctl "-c5"
check_write 0/max_inst 16
check_write 0/ctr-a/weight 4

# meminfo: the daemon's feed replaces the per-process usage.
# check_fed FEED WANT: writing FEED to inst_ctl makes 0/ctr-a/meminfo read WANT.
# A daemon serving this tree feeds each container once as it first sees it (no
# processes: "Free: <memsize>" alone); if that lands between our write and the
# read, the read shows exactly that, and the write is made once more.
check_fed() {
	ctl "$1"
	got=$(cat "$R/0/ctr-a/meminfo" 2>&1; echo x)
	if [ "$got" = "Free: 2147483648${NL}x" ]; then echo -n "$1" > "$R/inst_ctl"; fi
	check_read 0/ctr-a/meminfo "$2"
}
check_fed "meminfo 0 ctr-a 200=1000 100=2000" \
	"Free: 2147480648${NL}PID: 100 Mem: 2000${NL}PID: 200 Mem: 1000"
check_fed "meminfo 0 ctr-a 300=5$NL" "Free: 2147483643${NL}PID: 300 Mem: 5"
check_fed "meminfo 0 ctr-a 300=4294967296" "Free: 0${NL}PID: 300 Mem: 4294967296"
ctl "meminfo 0 ctr-a"
check_read 0/ctr-a/meminfo "Free: 2147483648"

# The same container on two GPUs shares its instance id; -<id> removes both.
if [ "$gpus" -ge 2 ]; then
	ctl "add 1 ctr-a memsize=1"
	check_read 1/ctr-a/id "$id_a"
	check_read 1/ctr-a/weight 1
	check_read 1/free_weight 15
	ctl "del 1 ctr-a"
	check_absent 1/ctr-a
	check_exists 0/ctr-a
	ctl "add 1 ctr-a"
	ctl "-ctr-a"
	check_absent 0/ctr-a
	check_absent 1/ctr-a
else
	ctl "-ctr-a"
	check_absent 0/ctr-a
fi
ctl "del abcdef012345"
check_absent 0/abcdef012345
check_read 0/free_weight 16

# --- the tree's shape changes only through inst_ctl ---------------------------
# Creating a file is EPERM; procfs fails the lookup of a missing name before
# any create could be refused, so /proc/cgpu_km answers ENOENT (which busybox
# sh reports as "nonexistent directory" for a redirection).
create_error=$EPERM
case "$R" in /proc/*) create_error="nonexistent directory" ;; esac
check_error "$create_error" newfile 1
check_absent newfile
check_error "$create_error" 0/newfile 1
if command -v mkdir >/dev/null 2>&1; then
	if mkdir "$R/0/newdir" 2>/dev/null; then fail "mkdir succeeded"; else pass; fi
	if rm -f "$R/version" 2>/dev/null; then fail "unlink succeeded"; else pass; fi
	if rmdir "$R/0" 2>/dev/null; then fail "rmdir succeeded"; else pass; fi
	if mv "$R/upgrade" "$R/upgrade2" 2>/dev/null; then fail "rename succeeded"; else pass; fi
	check_exists version
	check_exists 0
	check_exists upgrade
fi

# --- non-root users read but cannot write -----------------------------------------
if [ -n "${CGPU_KM_AS_USER:-}" ] || su -s /bin/sh nobody -c true 2>/dev/null; then
	as_user=${CGPU_KM_AS_USER:-su -s /bin/sh nobody -c}
	got=$($as_user "cat $R/0/policy" 2>&1)
	if [ "$got" = 1 ]; then pass; else fail "non-root read of 0/policy: $got"; fi
	for target in 0/policy default_memsize inst_ctl; do
		got=$($as_user "echo 2 > $R/$target" 2>&1)
		case "$got" in
		*"$EACCES"*) pass ;;
		*) fail "non-root write to $target: want $EACCES, got: $got" ;;
		esac
	done
	check_read 0/policy 1
else
	echo "note: no way to switch to a non-root user; non-root checks not run"
fi

echo "conformance: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
