#!/bin/sh
# The causal-LM partners' text: the Python documentation's reStructuredText sources, as
# Debian packages them (python3-doc -> python3.X-doc, /usr/share/doc/python3.X/html/_sources).
# Licence: PSF License Agreement (documentation), Zero-Clause BSD for its code examples.
# Elsewhere: install the Python documentation sources and set SEALFL_CORPUS_DIR.
set -e
if ls -d /usr/share/doc/python3*/html/_sources/tutorial >/dev/null 2>&1; then
    exit 0
fi
sh "$(dirname "$0")/apt-install.sh" install-corpus python3-doc
ls -d /usr/share/doc/python3*/html/_sources/tutorial >/dev/null
