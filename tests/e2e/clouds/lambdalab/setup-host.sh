#!/usr/bin/env bash
# Host packages the Lambda lab needs (root, Debian/Ubuntu): OpenSSH's sshd and rsync (SkyPilot
# shells out to both, on both ends), sudo (SkyPilot's setup needs passwordless sudo on a node),
# tini (PID 1 of a node). Installed only when missing; the host's sshd is never started.
# postgresql: the server tests (tests/orchestrator/server) run initdb/pg_ctl (needed on PATH; Debian puts them in /usr/lib/postgresql/*/bin).
# chromium, chromium-driver: the dashboard's browser tests (tests/e2e/test_dashboard_browser.py, selenium).
set -euo pipefail
missing=()
for b in /usr/sbin/sshd:openssh-server /usr/bin/rsync:rsync /usr/bin/sudo:sudo /usr/bin/tini:tini /usr/bin/ssh:openssh-client \
         /usr/bin/chromium:chromium /usr/bin/chromedriver:chromium-driver; do
  [ -x "${b%%:*}" ] || missing+=("${b##*:}")
done
command -v initdb >/dev/null || compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null || missing+=(postgresql)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ]; then
  echo "lambda lab: needs root to install ${missing[*]} (or install them yourself)" >&2; exit 3
fi
if ! command -v apt-get >/dev/null; then
  echo "lambda lab: no apt-get here; install ${missing[*]} yourself" >&2; exit 3
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -q >/dev/null
# policy-rc.d keeps the package's service scripts from starting a host sshd
printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d.dtlab && chmod +x /usr/sbin/policy-rc.d.dtlab
[ -e /usr/sbin/policy-rc.d ] || { cp /usr/sbin/policy-rc.d.dtlab /usr/sbin/policy-rc.d; trap 'rm -f /usr/sbin/policy-rc.d' EXIT; }
rm -f /usr/sbin/policy-rc.d.dtlab
apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
