#!/bin/sh
# The kernel module's own checks, run inside the test VM after the
# conformance suite (which covers the contract itself): module parameters,
# the character device's major, non-root access, open files of removed
# nodes, concurrent writers on the same nodes, unload with containers
# present and a fresh reload.  Prints TAP-like lines; exits 1 on a failure.
# Needs: the module loaded or not, $KO the module file, busybox.
R=/proc/cgpu_km
KO=${KO:-/cgpu_km.ko}
ROUNDS=${ROUNDS:-150}
failures=0

ok() { echo "ok - $*"; }
not_ok() { echo "not ok - $*"; failures=$((failures + 1)); }
# check DESCRIPTION COMMAND...: the command's status decides.
check() {
	desc=$1
	shift
	if "$@"; then ok "$desc"; else not_ok "$desc"; fi
}
# same DESCRIPTION WANT GOT
same() {
	if [ "$2" = "$3" ]; then ok "$1"; else not_ok "$1: want '$2', got '$3'"; fi
}
ctl() { printf '%s\n' "$*" >$R/inst_ctl; }
# The containers of GPU $1: its directories.
containers() { for d in $R/$1/*/; do [ -d "$d" ] && basename "$d"; done; }
sum_weights() {
	s=0
	for c in $(containers "$1"); do s=$((s + $(cat $R/$1/$c/weight))); done
	echo $s
}
unload() { rmmod cgpu_km; }
# Runs a shell command line as uid 1000 (busybox su; init made the user).
as_user() { su -s /bin/sh cgpu-user -c "$1"; }

# -- unload whatever the suite left, then parameters -------------------------
echo "# unload after the conformance suite, containers: $(containers 0 | wc -l)"
check "rmmod after the suite" unload
check "/proc/cgpu_km is gone after rmmod" test ! -e $R

check "insmod with gpus=3 policy=4 max_inst=8 prio_ratio=50 gpu_mem=1000,2000" \
	insmod "$KO" gpus=3 policy=4 max_inst=8 prio_ratio=50 gpu_mem=1000,2000
check "gpus=3 gives GPU directories 0..2" test -d $R/2 -a ! -e $R/3
same "policy parameter" 4 "$(cat $R/2/policy)"
same "max_inst parameter" 8 "$(cat $R/1/max_inst)"
same "prio_ratio parameter" 50 "$(cat $R/0/prio_ratio)"
same "free_weight follows max_inst" 8 "$(cat $R/0/free_weight)"
same "sysfs shows the parameters in force" "3 4 8 50" \
	"$(cd /sys/module/cgpu_km/parameters && echo $(cat gpus policy max_inst prio_ratio))"
major=$(cat $R/0/major)
same "major is the registered character device" "$major cgpu_km" \
	"$(grep ' cgpu_km$' /proc/devices)"
same "every GPU reports the same major" "$major" "$(cat $R/2/major)"
check "major is not 0" test "$major" -gt 0
ctl add 1 whole
ctl meminfo 1 whole 7=300 9=200
same "meminfo Free of a whole-device container comes from gpu_mem" \
	"$(printf 'Free: 1500\nPID: 7 Mem: 300\nPID: 9 Mem: 200')" "$(cat $R/1/whole/meminfo)"
ctl add 2 nomem
same "meminfo Free is 0 without gpu_mem for that GPU" "Free: 0" "$(cat $R/2/nomem/meminfo)"
check "rmmod" unload
check "the character device is released" sh -c '! grep -q " cgpu_km$" /proc/devices'

for bad in gpus=0 gpus=17 policy=6 policy=-2 max_inst=0 max_inst=26 prio_ratio=19 prio_ratio=100; do
	check "insmod refuses $bad" sh -c "! insmod $KO $bad 2>/dev/null && test ! -e $R"
done

# -- non-root users ------------------------------------------------------------
insmod "$KO" gpus=2
same "sysfs shows the table's initial values by default" "1 16 80" \
	"$(cd /sys/module/cgpu_km/parameters && echo $(cat policy max_inst prio_ratio))"
same "uid 1000 writing policy gets EACCES" "Permission denied" \
	"$(as_user "printf '2\n' > $R/0/policy" 2>&1 | sed 's/.*: //')"
same "uid 1000 writing inst_ctl gets EACCES" "Permission denied" \
	"$(as_user "printf 'add 0 user\n' > $R/inst_ctl" 2>&1 | sed 's/.*: //')"
same "uid 1000 reading inst_ctl gets EACCES" "Permission denied" \
	"$(as_user "cat $R/inst_ctl" 2>&1 | sed 's/.*: //')"
same "uid 1000 runs as uid 1000" 1000 "$(as_user "id -u")"
same "uid 1000 can read policy" 1 "$(as_user "cat $R/0/policy")"
check "uid 1000 changed nothing" test "$(cat $R/0/policy)" = 1 -a ! -e $R/0/user

# -- files held open across removal --------------------------------------------
ctl add 0 held
exec 3<$R/0/held/weight 4>$R/0/held/memsize
ctl del 0 held
# procfs answers EIO for an entry removed while open (the FUSE tree: ENOENT).
same "reading a removed container's open node fails (EIO)" "Input/output error" \
	"$(cat <&3 2>&1 | sed 's/.*: //')"
same "writing a removed container's open node fails (EIO)" "Input/output error" \
	"$( (echo 5 >&4) 2>&1 | sed 's/.*: //')"
exec 3<&- 4>&-
ctl add 0 held
same "a re-created container is fresh" 0 "$(cat $R/0/held/memsize)"
ctl del held

# -- concurrent writers on the same nodes --------------------------------------
for i in 1 2 3 4 5 6; do ctl add 0 p$i weight=2; done
for i in 1 2 3; do ctl add 1 q$i; done
weights() {
	n=0
	while [ $n -lt $ROUNDS ]; do
		echo $((RANDOM % 6)) >$R/0/p$((RANDOM % 6 + 1))/weight
		echo $((RANDOM % 4)) >$R/1/q$((RANDOM % 3 + 1))/weight
		# containers that churn creates and deletes meanwhile
		echo $((RANDOM % 3)) >$R/$((RANDOM % 2))/t$((RANDOM % 4))/weight
		n=$((n + 1))
	done 2>/dev/null
}
knobs() {
	n=0
	while [ $n -lt $ROUNDS ]; do
		echo $((RANDOM % 6)) >$R/$((RANDOM % 2))/policy
		echo $((6 + RANDOM % 20)) >$R/$((RANDOM % 2))/max_inst
		echo $((20 + RANDOM % 80)) >$R/0/prio_ratio
		n=$((n + 1))
	done 2>/dev/null
}
churn() {
	n=0
	while [ $n -lt $ROUNDS ]; do
		t=t$((RANDOM % 4))
		case $((RANDOM % 5)) in
		0) ctl add 0 $t weight=$((RANDOM % 3)) ;;
		1) ctl add 1 $t memsize=4096 ;;
		2) ctl del 0 $t ;;
		3) ctl -$t ;;
		4) ctl meminfo $((RANDOM % 2)) $t $((RANDOM + 1))=$RANDOM ;;
		esac
		ctl meminfo 0 p$((RANDOM % 6 + 1)) 1=$RANDOM 2=$RANDOM
		n=$((n + 1))
	done 2>/dev/null
}
readers() {
	n=0
	while [ $n -lt $ROUNDS ]; do
		fw=$(cat $R/0/free_weight)
		[ "$fw" -le 25 ] || echo "# bad free_weight $fw"
		cat $R/0/*/meminfo $R/1/*/weight >/dev/null
		ls $R/0 $R/1 >/dev/null
		n=$((n + 1))
	done 2>/dev/null
}
echo "# concurrent writers: 2x weights, 2x knobs, 2x churn, 1x readers, $ROUNDS rounds each"
bad_reads=/tmp/bad-reads
weights & weights & knobs & knobs & churn & churn & readers >$bad_reads &
wait
same "readers never saw free_weight out of range" "" "$(cat $bad_reads)"
for g in 0 1; do
	mi=$(cat $R/$g/max_inst)
	sum=$(sum_weights $g)
	count=$(containers $g | wc -l)
	same "GPU $g: free_weight == max_inst - sum(weights) after the writers" \
		$((mi - sum)) "$(cat $R/$g/free_weight)"
	check "GPU $g: sum(weights) $sum <= max_inst $mi" test "$sum" -le "$mi"
	check "GPU $g: containers $count <= max_inst $mi" test "$count" -le "$mi"
	same "GPU $g: no directory listed twice" "" "$(ls $R/$g | sort | uniq -d)"
done
same "GPU 0 kept p1..p6" "p1 p2 p3 p4 p5 p6" "$(containers 0 | grep '^p' | tr '\n' ' ' | sed 's/ $//')"
same "GPU 1 kept q1..q3" "q1 q2 q3" "$(containers 1 | grep '^q' | tr '\n' ' ' | sed 's/ $//')"
same "instance ids of distinct containers are unique" "" \
	"$(for c in $(containers 0 | grep '^p') $(containers 1 | grep '^q'); do
		cat $R/*/$c/id | head -n1; done | sort | uniq -d)"
for t in t0 t1 t2 t3; do
	if [ -d $R/0/$t ] && [ -d $R/1/$t ]; then
		same "$t on both GPUs shares its id" "$(cat $R/0/$t/id)" "$(cat $R/1/$t/id)"
	fi
done

# -- unload with containers present, then a fresh load -------------------------
exec 5<$R/version 6>$R/inst_ctl
count=$(($(containers 0 | wc -l) + $(containers 1 | wc -l)))
check "unload with $count containers present (and files open)" unload
check "/proc/cgpu_km is gone" test ! -e $R
same "reading a node open across unload fails" "" "$(cat <&5 2>/dev/null)"
check "writing inst_ctl open across unload fails" sh -c '! { echo "add 0 late" >&6; } 2>/dev/null'
exec 5<&- 6>&-
check "load again" insmod "$KO" gpus=2

# -- unload while writers and readers are busy ----------------------------------
for i in 1 2 3; do ctl add 0 p$i; ctl add 1 q$i; done
weights & churn & readers >/dev/null &
usleep 300000
check "unload while writers run" unload
wait
check "/proc/cgpu_km is gone after the busy unload" test ! -e $R
check "load again after the busy unload" insmod "$KO" gpus=2
same "the reloaded tree has no containers" "" "$(containers 0; containers 1)"
same "the reloaded tree has initial values" "1 16 80 16 0 0" \
	"$(cat $R/0/policy $R/1/max_inst $R/0/prio_ratio $R/0/free_weight $R/default_memsize $R/upgrade | tr '\n' ' ' | sed 's/ $//')"
ctl add 0 first
same "instance ids start again at 1" 1 "$(cat $R/0/first/id)"

echo "# $failures module checks failed"
[ "$failures" -eq 0 ]
