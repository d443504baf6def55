#!/bin/sh
# The device TPM 2.0 path: swtpm (a software TPM the tests start on loopback), swtpm-tools
# (swtpm_setup) and tpm2-tools (the CLI the `tpm` backend drives; see sealfl/enclave/tee/tpm.py
# for why the CLI and not tpm2-pytss). Idempotent; quiet when everything is installed.
set -e
if command -v swtpm >/dev/null 2>&1 && command -v swtpm_setup >/dev/null 2>&1 \
   && command -v tpm2_quote >/dev/null 2>&1; then
    exit 0
fi
sh "$(dirname "$0")/apt-install.sh" install-tpm swtpm swtpm-tools tpm2-tools
command -v swtpm >/dev/null && command -v tpm2_quote >/dev/null
