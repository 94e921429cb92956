#!/usr/bin/env bash
# apt-get install PACKAGE... (as root) leaving the machine's services as they were: no daemon a
# package brings is started, nor left enabled.
# - start: a policy-rc.d that refuses every start (invoke-rc.d and deb-systemd-invoke ask it) is in
#   place for the install, then the machine's own policy-rc.d, if it had one, is put back;
# - enable: a package's postinst enables its units whatever policy-rc.d says, so every unit enabled
#   by this install is disabled again (units enabled before it stay enabled).
# Packages already installed are left alone; with none missing, apt is not run at all.
set -euo pipefail
missing=()
for package in "$@"; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q " installed$" || missing+=("$package")
done
[ ${#missing[@]} -gt 0 ] || exit 0
if [ "$(id -u)" != 0 ]; then
    echo "apt_install.sh: installing ${missing[*]} needs root; run as root or install them yourself" >&2
    exit 1
fi

enabled_units() {  # works without a running systemd (--root reads the unit files)
    if command -v systemctl >/dev/null; then
        systemctl --root=/ list-unit-files --state=enabled --no-legend 2>/dev/null | awk '{print $1}' | sort
    fi
}

POLICY=/usr/sbin/policy-rc.d
saved=$(mktemp -d)
[ -e $POLICY ] && cp -p $POLICY "$saved/policy-rc.d"
restore_policy() {
    if [ -e "$saved/policy-rc.d" ]; then cp -p "$saved/policy-rc.d" $POLICY; else rm -f $POLICY; fi
    rm -rf "$saved"
}
trap restore_policy EXIT
printf '#!/bin/sh\n# ops/apt_install.sh: no service starts during this install\nexit 101\n' > $POLICY
chmod 755 $POLICY

before=$(enabled_units)
apt-get update -q
DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
for unit in $(comm -13 <(printf '%s\n' "$before") <(enabled_units)); do
    echo "apt_install.sh: disabling $unit (enabled by installing ${missing[*]})" >&2
    deb-systemd-helper disable "$unit" 2>/dev/null || systemctl --root=/ disable "$unit"
done
