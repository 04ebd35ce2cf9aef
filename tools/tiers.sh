#!/bin/sh
# Run test tiers one after another, each as its own make target (test-TIER),
# whatever the earlier ones gave, and print one result line per tier.
#   tools/tiers.sh TIER...
# The last line is "N passed, N failed", counted in tiers; the exit status is
# non-zero when a tier failed. Each tier's whole output is in build/tiers/TIER.log.
set -u
logs=build/tiers
mkdir -p "$logs"
summary=""
passed=0
failed=0
for tier in "$@"; do
	echo "=== tier $tier: make test-$tier"
	start=$(date +%s)
	# The tier's status, through the pipe to tee.
	status=$( { { ${MAKE:-make} --no-print-directory "test-$tier" 2>&1; echo $? >&3; } \
		| tee "$logs/$tier.log" >&2; } 3>&1 )
	wall=$(( $(date +%s) - start ))
	# pytest's summary ("12 passed, 1 skipped in 3.4s"), else the tier's last line.
	result=$(grep -E '^=+ .*(passed|failed|error|skipped|deselected).* in [0-9.]+s' \
		"$logs/$tier.log" | tail -n 1 | sed 's/^=* //; s/ =*$//')
	[ -n "$result" ] || result=$(grep -v '^make' "$logs/$tier.log" | tail -n 1)
	if [ "$status" = 0 ]; then
		passed=$((passed + 1)); verdict=ok
	else
		failed=$((failed + 1)); verdict="FAILED (exit $status)"
	fi
	summary="$summary
tier $tier: $verdict, wall ${wall} s: $result"
done
echo "=== tiers$summary"
echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
