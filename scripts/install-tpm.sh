#!/bin/sh
# The device TPM 2.0 path: swtpm (a software TPM the tests start on loopback), swtpm-tools
# (swtpm_setup) and tpm2-tools (the CLI the `tpm` backend drives; see sealfl/enclave/tpm.py
# for why the CLI and not tpm2-pytss). Idempotent; quiet when everything is installed.
set -e
if command -v swtpm >/dev/null 2>&1 && command -v swtpm_setup >/dev/null 2>&1 \
   && command -v tpm2_quote >/dev/null 2>&1; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-tpm: no apt-get; install swtpm, swtpm-tools and tpm2-tools with your package manager" >&2
    exit 1
fi
SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo"
PKGS="swtpm swtpm-tools tpm2-tools"
$SUDO apt-get install -y -q --no-install-recommends $PKGS >/dev/null 2>&1 || { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q --no-install-recommends $PKGS >/dev/null; }
command -v swtpm >/dev/null && command -v tpm2_quote >/dev/null
