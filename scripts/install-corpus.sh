#!/bin/sh
# The causal-LM partners' text: the Python documentation's reStructuredText sources, as
# Debian packages them (python3-doc -> python3.X-doc, /usr/share/doc/python3.X/html/_sources).
# Licence: PSF License Agreement (documentation), Zero-Clause BSD for its code examples.
set -e
if ls -d /usr/share/doc/python3*/html/_sources/tutorial >/dev/null 2>&1; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-corpus: no apt-get; install the Python documentation sources and set SEALFL_CORPUS_DIR" >&2
    exit 1
fi
SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo"
$SUDO apt-get install -y -q python3-doc >/dev/null 2>&1 || { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q python3-doc >/dev/null; }
ls -d /usr/share/doc/python3*/html/_sources/tutorial >/dev/null
