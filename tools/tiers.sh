#!/bin/sh
# Run test tiers one after another, each as its own make target (test-TIER),
# whatever the earlier ones gave, and print one result line per tier.
#   tools/tiers.sh TIER...
# A tier is "ok" when it exited 0 and ran tests, "skipped" when pytest ran none
# of them (all skipped or deselected, or none collected), else "FAILED". The
# last line is "N passed, N skipped, N failed", counted in tiers; the exit
# status is non-zero when a tier failed, or was skipped on a run as root (root
# runs every tier: a skipped one is a part that was never tested). Each tier's
# whole output is in build/tiers/TIER.log.
set -u
logs=build/tiers
mkdir -p "$logs"
summary=""
passed=0
skipped=0
failed=0
counts='([0-9]+ (passed|failed|errors?|skipped|deselected|xfailed|xpassed|warnings?)|no tests ran)'
for tier in "$@"; do
	echo "=== tier $tier: make test-$tier"
	start=$(date +%s)
	# The tier's status, through the pipe to tee.
	status=$( { { ${MAKE:-make} --no-print-directory "test-$tier" 2>&1; echo $? >&3; } \
		| tee "$logs/$tier.log" >&2; } 3>&1 )
	wall=$(( $(date +%s) - start ))
	# pytest's summary ("12 passed, 1 skipped in 3.4s"; framed in "=" without -q).
	result=$(grep -E "^(=+ )?$counts.* in [0-9.]+s" "$logs/$tier.log" | tail -n 1 \
		| sed 's/^=* //; s/ =*$//')
	ran=yes
	if [ -n "$result" ]; then
		echo "$result" | grep -Eq '[0-9]+ (passed|failed|errors?|xfailed|xpassed)' || ran=no
	else
		result=$(grep -v '^make' "$logs/$tier.log" | tail -n 1)
	fi
	if [ "$ran" = no ]; then
		# pytest ran nothing (it exits 5 when it collected nothing): why, if it said
		skipped=$((skipped + 1)); verdict=skipped
		reason=$(grep -m 1 '^SKIPPED' "$logs/$tier.log" | sed 's/^SKIPPED \[[0-9]*\] //')
		[ -z "$reason" ] || result="$result; $reason"
	elif [ "$status" = 0 ]; then
		passed=$((passed + 1)); verdict=ok
	else
		failed=$((failed + 1)); verdict="FAILED (exit $status)"
	fi
	summary="$summary
tier $tier: $verdict, wall ${wall} s: $result"
done
echo "=== tiers$summary"
echo "$passed passed, $skipped skipped, $failed failed"
if [ "$skipped" != 0 ] && [ "$(id -u)" = 0 ]; then
	echo "a tier was skipped on a run as root: every tier must run" >&2
	exit 1
fi
[ "$failed" = 0 ]
