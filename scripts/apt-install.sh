#!/bin/sh
# Install Debian packages quietly (sudo unless root), refreshing the package lists only when
# the first attempt fails. Usage: apt-install.sh WHAT PKG... (WHAT names the caller in errors).
set -e
WHAT="$1"; shift
if ! command -v apt-get >/dev/null 2>&1; then
    echo "$WHAT: no apt-get; install $* with your package manager" >&2
    exit 1
fi
SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo"
$SUDO apt-get install -y -q --no-install-recommends "$@" >/dev/null 2>&1 || {
    $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q --no-install-recommends "$@" >/dev/null; }
