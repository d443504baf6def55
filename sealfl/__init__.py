"""sealfl: encrypted federated fine-tuning shipped as attested, signed edge releases.

Packages by who runs the code: :mod:`sealfl.clients` (partners), :mod:`sealfl.server`
(the aggregator), :mod:`sealfl.platform` (the coordinator and the CLI),
:mod:`sealfl.enclave` (the trusted side: devices, the release enclave, the key broker),
:mod:`sealfl.attestation` (pure trust decisions), :mod:`sealfl.he` (homomorphic
encryption) and :mod:`sealfl.common`.
"""

from sealfl import _moved

#: The package version (the same as pyproject.toml's ``[project] version``: tests/test_version.py).
__version__ = "0.1.0"

_moved.install()  # the old import paths of sealfl 0.1, for one release
