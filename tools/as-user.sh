#!/bin/sh
# Run a command as an unprivileged user: `make check` runs the unit tier so.
#   tools/as-user.sh COMMAND [ARG...]
# As root it drops to $CGPU_TEST_USER (default nobody) with no supplementary
# groups, HOME and TMPDIR in a fresh scratch folder that user owns (pytest's
# temporary folders, its cache and hypothesis' database go there), and removes
# the folder afterwards. As any other user it runs the command as it is.
set -eu
[ "$(id -u)" = 0 ] || exec "$@"
user=${CGPU_TEST_USER:-nobody}
group=$(id -gn "$user")
scratch=$(mktemp -d /tmp/cgpu-as-user.XXXXXX)
trap 'rm -rf "$scratch"' EXIT
chown "$user:$group" "$scratch"
export HOME="$scratch" TMPDIR="$scratch" HYPOTHESIS_STORAGE_DIRECTORY="$scratch/hypothesis"
status=0
setpriv --reuid="$user" --regid="$group" --clear-groups --inh-caps=-all "$@" || status=$?
exit "$status"
