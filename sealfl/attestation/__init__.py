"""sealfl.attestation -- manifests, DSSE/in-toto signing, quotes and release verification.

Pure verification functions over bytes and parsed data (:mod:`.verify`, :mod:`.device_state`,
:mod:`.onnx_check`, every document parser); I/O lives in thin wrappers
(:func:`~sealfl.attestation.reader.load_release`,
:func:`~sealfl.attestation.trust.load_trust_anchors`). :mod:`.release` gathers the public
entry points. Imports only the standard library, numpy, pycryptodome and (lazily, to parse
ONNX models) onnx. Import submodules directly, e.g.
``from sealfl.attestation.release import load_release, verify_release``.
"""
