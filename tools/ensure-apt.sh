#!/bin/sh
# Install the Debian packages named as arguments that are not installed yet.
# Runs apt-get update at most once, and only when something is missing.
set -eu
missing=""
for pkg in "$@"; do
	if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'ok installed'; then
		missing="$missing $pkg"
	fi
done
[ -z "$missing" ] && exit 0
if [ "$(id -u)" != 0 ]; then
	echo "ensure-apt: missing packages:$missing (run as root to install them)" >&2
	exit 1
fi
echo "ensure-apt: installing$missing"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# shellcheck disable=SC2086
apt-get install -y -qq --no-install-recommends $missing >/dev/null
