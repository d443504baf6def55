#!/bin/sh
# Debian's faketime: the TUF project's conformance suite (tests/enclave/device/test_tuf_conformance.py
# runs it against `sealfl device tuf-client`) starts the client under faketime to test expiry.
# Idempotent; quiet when installed.
set -e
command -v faketime >/dev/null 2>&1 && exit 0
sh "$(dirname "$0")/apt-install.sh" install-faketime faketime
command -v faketime >/dev/null
