"""Signing one TUF metadata document and checking it against its delegator before anything
is written: a threshold that is not met fails at the repository, not on the devices.

Pure over python-tuf ``Metadata`` and securesystemslib ``Signer`` objects (no files): the
:class:`~sealfl.platform.repo.repository.Repository` writes what these return. Source: TUF
specification 1.0, section 5.3 (a new root must verify with the old root's threshold and
its own) and python-tuf's ``Root.verify_delegate``.
"""

from __future__ import annotations

from securesystemslib.signer import Signer
from tuf.api.metadata import Metadata

from sealfl.platform.repo.keys import ROOT_THRESHOLD, RepoError

__all__ = ["sign_root", "sign_delegated"]


def sign_root(root_md: Metadata, signers: dict[str, Signer], previous: Metadata | None) -> None:
    """Replace ``root_md``'s signatures with those of every key in ``signers`` (keyid ->
    signer) that the new root or ``previous`` lists, then check both roots' thresholds.

    Raises:
        RepoError: the signatures do not meet the new root's threshold, or ``previous``'s
            (the message says how many usable root keys were found).
    """
    root_md.signatures.clear()
    wanted = set(root_md.signed.roles["root"].keyids)
    if previous is not None:
        wanted |= set(previous.signed.roles["root"].keyids)
    for keyid in sorted(wanted & set(signers)):
        root_md.sign(signers[keyid], append=True)
    try:
        if previous is not None:
            previous.signed.verify_delegate("root", root_md.signed_bytes, root_md.signatures)
        root_md.signed.verify_delegate("root", root_md.signed_bytes, root_md.signatures)
    except Exception as exc:  # python-tuf's UnsignedMetadataError and friends
        have = len(wanted & set(signers))
        raise RepoError(f"the new root is not signed by the root threshold ({ROOT_THRESHOLD} of the old and of the "
                        f"new keys; {have} usable root keys found): {exc}") from None


def sign_delegated(md: Metadata, signer: Signer, root_md: Metadata, key_file: str) -> None:
    """Replace ``md``'s signatures (targets, snapshot or timestamp) with ``signer``'s and
    check them against ``root_md``'s keys and threshold for that role.

    Raises:
        RepoError: the signature does not verify: ``key_file`` (named in the message) is
            not the key the root lists for the role.
    """
    md.signatures.clear()
    md.sign(signer, append=True)
    try:
        root_md.signed.verify_delegate(md.signed.type, md.signed_bytes, md.signatures)
    except Exception as exc:  # python-tuf's UnsignedMetadataError and friends
        raise RepoError(f"{md.signed.type} signed with {key_file} does not verify against root "
                        f"v{root_md.signed.version}: {exc}; the key file is not the one the root lists") from None
