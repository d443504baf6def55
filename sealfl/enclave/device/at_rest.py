"""Boot of a release encrypted at rest: the key comes only from a key broker to this
device's attested state (:mod:`sealfl.kbs`).

A release declares, in its signed metadata::

    "at_rest": {"alg": "AES-256-GCM", "files": ["model.int8.onnx.enc", ...]}

The listed payload files hold :mod:`sealfl.attestation.encrypted_files` ciphertext; the signed manifest covers
those ciphertext bytes, so the release is verified before any key exists on the device.
After verification and measurement (PCR 23 holds the release root), :func:`open_payload`
asks ``key_source(tee, state_root) -> (release root hex, 32-byte key)`` -- normally
:func:`sealfl.enclave.device.kbs_client.broker_key_source` -- checks the key is for this release, decrypts
the files (the key stays in memory only), and checks every decrypted ``*.onnx``,
``*.onnx.enc`` and ``model_file`` is a self-contained ONNX model (:func:`sealfl.attestation.onnx_check.check_self_contained`),
as verification does for plain ``.onnx`` files.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from sealfl.attestation.errors import AttestationError
from sealfl.attestation.onnx_check import check_self_contained
from sealfl.attestation.verify import VerifiedRelease
from sealfl.common.errors import SealflError
from sealfl.common.fields import Fields
from sealfl.enclave.errors import BootError
from sealfl.enclave.tee.interface import TEE

__all__ = ["KeySource", "open_payload"]

KeySource = Callable[[TEE, Path], tuple[str, bytes]]


def open_payload(release: VerifiedRelease, tee: TEE, state_root: Path, key_source: KeySource | None) -> dict:
    """The release payload with its at-rest files decrypted (the payload itself if none);
    files the boot streamed without keeping them (``release.streamed``) stay out of it.

    Raises:
        BootError: reason ``"key"``: malformed ``at_rest`` metadata, no key source, the broker
            refused or gave a key for another release, or a file does not decrypt / is not a
            self-contained ONNX model.
    """
    spec = release.metadata.get("at_rest")
    if spec is None:
        return release.payload
    fields = Fields("metadata.at_rest", lambda m: BootError(m, reason="key"))
    fields.object(spec, "")
    fields.only(spec, ("alg", "files"))
    fields.get(spec, "alg", "choice", choices=("AES-256-GCM",))
    files = fields.get(spec, "files", "array", nonempty=True, max_len=64)
    for i, name in enumerate(files):
        if not isinstance(name, str) or (name not in release.payload and name not in release.streamed):
            raise fields.fail(fields.join("files", i), "does not name a payload file of the release")
    if key_source is None:
        raise BootError(f"release {release.name} v{release.version} is encrypted at rest; boot it with a key "
                        "broker (sealfl device boot --key-broker URL)", reason="key")
    from sealfl.attestation import encrypted_files as atrest

    try:
        root, key = key_source(tee, state_root)
    except SealflError as exc:
        raise BootError(f"no key for release {release.name} v{release.version}: {exc}", reason="key") from exc
    if root != release.root_digest:
        raise BootError(f"the key broker released a key for root {root[:16]}…, not this release "
                        f"({release.root_digest[:16]}…)", reason="key")
    out = dict(release.payload)
    try:
        for name in files:
            if name in release.streamed:  # verified, not kept: this boot does not load it
                continue
            out[name] = atrest.decrypt(key, name, release.payload[name])
            if name.lower().endswith((".onnx", ".onnx.enc")) or name == release.metadata.get("model_file"):
                check_self_contained(out[name], name)
    except (SealflError, AttestationError) as exc:
        raise BootError(f"release {release.name} v{release.version}: {exc}", reason="key") from exc
    return out
