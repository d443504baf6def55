"""Size caps of release verification, in one place (like python-tuf's ``UpdaterConfig``)."""

from __future__ import annotations

from dataclasses import dataclass

from sealfl.attestation.errors import AttestationError

__all__ = ["VerifyConfig", "DEFAULT_CONFIG", "DEFAULT_MAX_FILE_BYTES"]

#: Default cap on one payload file's signed size (2 GiB, protobuf's limit for an ONNX file).
DEFAULT_MAX_FILE_BYTES = 2 * 1024**3


@dataclass(frozen=True)
class VerifyConfig:
    """Caps applied while reading and verifying a release directory (all in bytes or counts).

    The three signed documents are read first, each under its own cap; payload files are
    then read no further than their *signed* size + 1 byte, and a signed size above
    ``max_file_bytes`` is refused before anything of the payload is read.

    Attributes:
        max_envelope_bytes: cap on ``manifest.dsse.json`` (default 4 MiB; a statement lists
            every file, ~150 bytes each, Base64 adds a third).
        max_manifest_bytes: cap on ``manifest.json`` (default 4 MiB).
        max_attestation_bytes: cap on ``attestation.json`` (default 64 KiB; a quote is ~1 KiB).
        max_signature_bytes: cap on ``model.sig`` (default 4 MiB; it lists every file too).
        max_provenance_bytes: cap on ``provenance.dsse.json`` (default 16 MiB: up to 100,000
            rounds of ~120 bytes each, Base64 adds a third).
        max_file_bytes: cap on one payload file's signed size (default 2 GiB).
        max_entries: cap on the number of entries of a release directory (default 4096).

    Raises:
        AttestationError: (on construction) a cap that is not a positive integer.
    """

    max_envelope_bytes: int = 4 * 1024**2
    max_manifest_bytes: int = 4 * 1024**2
    max_attestation_bytes: int = 64 * 1024
    max_signature_bytes: int = 4 * 1024**2
    max_provenance_bytes: int = 16 * 1024**2
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
    max_entries: int = 4096

    def __post_init__(self) -> None:
        for name in ("max_envelope_bytes", "max_manifest_bytes", "max_attestation_bytes", "max_signature_bytes",
                     "max_provenance_bytes", "max_file_bytes",
                     "max_entries"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise AttestationError(f"VerifyConfig.{name} must be a positive integer, got {value!r}")

    def document_cap(self, name: str) -> int:
        """Cap in bytes for the signed document ``name`` (``manifest.dsse.json``,
        ``manifest.json``, ``attestation.json`` or ``model.sig``); ``max_file_bytes`` for any other name."""
        return {"manifest.dsse.json": self.max_envelope_bytes, "manifest.json": self.max_manifest_bytes,
                "attestation.json": self.max_attestation_bytes, "model.sig": self.max_signature_bytes,
                "provenance.dsse.json": self.max_provenance_bytes}.get(name, self.max_file_bytes)


DEFAULT_CONFIG = VerifyConfig()
