"""SEAL objects to and from bytes through TenSEAL's ``sealapi`` bindings.

TenSEAL 0.3.18 binds SEAL's ``save``/``load`` only with a file *path* argument
(``Ciphertext.save(str)``, ``Ciphertext.load(SEALContext, str)``, and
``Serializable<Ciphertext>.save(str)`` for a seeded symmetric ciphertext). :class:`SealIO`
gives them an anonymous in-memory file (Linux ``memfd_create(2)``, opened again through
``/proc/self/fd/N``), one per thread, so no bytes touch a file system and nothing is left
behind after a crash.

:func:`header_problem` is the pure check of SEAL's serialisation header
(``SEALHeader``, SEAL 4 ``native/src/seal/serialization.h``) that runs before SEAL
parses anything.
"""

from __future__ import annotations

import os
import struct
import threading

__all__ = ["SealIO", "header_problem", "SEAL_HEADER", "SEAL_MAGIC", "COMPR_ZSTD"]

#: magic (u16), header size (u8), version major/minor (u8, u8), compr_mode (u8), reserved (u16), size (u64)
SEAL_HEADER = struct.Struct("<HBBBBHQ")
SEAL_MAGIC = 0xA15E
#: ``compr_mode_type::zstd`` (serialization.h); TenSEAL's SEAL build compresses with zstd
COMPR_ZSTD = 2


def header_problem(raw: bytes) -> str | None:
    """Why ``raw`` is not exactly one zstd-compressed SEAL object (None if it is).

    Checks, on the bytes only: SEAL's magic, a 16-byte header, zstd compression, SEAL
    version 4, a zero reserved field, and that the header's total size equals
    ``len(raw)`` (so no byte follows the object). What is inside the compressed stream is
    SEAL's to check when it loads -- and SEAL ignores what follows the ciphertext's members
    there (zstd skippable frames, extra decompressed bytes): such bytes ride within the
    chunk size bound and die at the aggregator, whose sums SEAL serialises afresh.
    """
    if len(raw) < SEAL_HEADER.size:
        return f"{len(raw)} bytes, shorter than SEAL's header"
    magic, hsize, major, _minor, compr, reserved, size = SEAL_HEADER.unpack_from(raw)
    if magic != SEAL_MAGIC or hsize != SEAL_HEADER.size:
        return "not a SEAL object (bad magic or header size)"
    if major != 4:
        return f"SEAL serialisation version {major}, expected 4"
    if reserved:
        return "SEAL header's reserved field is not zero"
    if compr != COMPR_ZSTD:
        return f"compression mode {compr}, expected zstd ({COMPR_ZSTD})"
    if size != len(raw):
        return (f"SEAL object of {size} bytes in {len(raw)} bytes"
                + (f" ({len(raw) - size} trailing)" if size < len(raw) else " (truncated)"))
    return None


class _MemFile:
    """One anonymous memory file, closed when collected (with its thread's ``threading.local``)."""

    def __init__(self) -> None:
        self.fd = os.memfd_create("sealfl-seal", os.MFD_CLOEXEC)
        self.path = f"/proc/self/fd/{self.fd}"

    def __del__(self, _close=os.close) -> None:  # os may be gone already at interpreter exit
        try:
            _close(self.fd)
        except OSError:
            pass


class SealIO:
    """Bytes <-> SEAL objects via a per-thread anonymous memory file.

    Raises OSError if the kernel has no ``memfd_create`` (Linux < 3.17) or ``/proc`` is
    not mounted; SEAL's own exceptions (``ValueError``/``RuntimeError``) propagate from
    :meth:`load_ciphertext` for bytes SEAL refuses.
    """

    def __init__(self) -> None:
        self._local = threading.local()

    def _file(self) -> _MemFile:
        f = getattr(self._local, "file", None)
        if f is None:
            f = self._local.file = _MemFile()
        return f

    def save(self, obj) -> bytes:
        """``obj.save(path)`` (a SEAL ``Ciphertext``, ``Serializable<Ciphertext>``, ...) -> its bytes."""
        f = self._file()
        os.ftruncate(f.fd, 0)
        obj.save(f.path)
        return os.pread(f.fd, os.fstat(f.fd).st_size, 0)

    def load_ciphertext(self, seal_context, raw: bytes):
        """A ``sealapi.Ciphertext`` loaded (and validated by SEAL: metadata and every
        residue below its prime, ``Ciphertext::load`` -> ``is_valid_for``) from ``raw``
        under ``seal_context``; a seeded ciphertext is expanded."""
        import tenseal.sealapi as sealapi

        f = self._file()
        os.ftruncate(f.fd, 0)
        os.pwrite(f.fd, raw, 0)
        ct = sealapi.Ciphertext()
        ct.load(seal_context, f.path)
        return ct
