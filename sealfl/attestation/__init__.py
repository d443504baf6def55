"""sealfl.attestation -- manifests, DSSE/in-toto signing, quotes and release verification.

Pure verification functions over bytes and parsed data; I/O lives in thin wrappers
(:func:`~sealfl.attestation.release.read_release_dir`,
:func:`~sealfl.attestation.trust.load_trust_anchors`). Imports only the standard library,
numpy and pycryptodome. Import submodules directly, e.g.
``from sealfl.attestation.release import verify_release``.
"""
