#!/bin/sh
# promtool, Prometheus's linter of the metrics text format and naming rules, for the tests of
# `sealfl device serve`'s /metrics. Only the one binary is taken from Debian's `prometheus`
# package (19 MB download, promtool 48 MB): `apt-get download` + `dpkg-deb`, not
# `apt-get install` -- that would pull 12 JavaScript packages, create a system user and
# install the Prometheus server itself. Usage: install-promtool.sh DEST_DIR (e.g. .venv/bin).
set -e
DEST="${1:?usage: install-promtool.sh DEST_DIR}"
if [ -x "$DEST/promtool" ]; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1 || ! command -v dpkg-deb >/dev/null 2>&1; then
    echo "install-promtool: no apt-get/dpkg-deb; put Prometheus's promtool into $DEST" >&2
    exit 1
fi
mkdir -p "$DEST"
DEST="$(cd "$DEST" && pwd)"   # absolute: the work below happens in a temporary directory
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
cd "$TMP"
apt-get download -q prometheus >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get download -q prometheus >/dev/null; }
dpkg-deb --fsys-tarfile prometheus_*.deb | tar -xO ./usr/bin/promtool > promtool
chmod 0755 promtool
./promtool --version >/dev/null 2>&1
mv promtool "$DEST/promtool"
