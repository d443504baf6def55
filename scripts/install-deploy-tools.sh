#!/bin/sh
# The tools tests/deploy checks deploy/ with: systemd-analyze (Debian's systemd). The schema
# checkers (check-jsonschema, kubernetes-validate) come from PyPI with the dev extra.
set -e
if command -v systemd-analyze >/dev/null 2>&1; then exit 0; fi
if [ "$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi
$SUDO apt-get install -y --no-install-recommends systemd >/dev/null
