"""The repository's signing checks, directly on python-tuf metadata (no files)."""

from __future__ import annotations

import copy
from datetime import datetime, timedelta, timezone

import pytest
from tuf.api.metadata import Metadata, Root, Targets

from sealfl.platform.repo.keys import RepoError, new_signer
from sealfl.platform.repo.signing import sign_delegated, sign_root


def _expires():
    return datetime.now(timezone.utc).replace(microsecond=0) + timedelta(days=1)


def _root(root_signers, targets_signer, threshold=2):
    md = Metadata(Root(expires=_expires()))
    for s in root_signers:
        md.signed.add_key(s.public_key, "root")
    md.signed.roles["root"].threshold = threshold
    md.signed.add_key(targets_signer.public_key, "targets")
    return md


def test_sign_root_needs_the_threshold_of_the_new_and_of_the_previous_root():
    old, tgt = [new_signer() for _ in range(3)], new_signer()
    v1 = _root(old, tgt)
    sign_root(v1, {s.public_key.keyid: s for s in old[:2]}, previous=None)  # 2 of 3: enough
    assert len(v1.signatures) == 2
    with pytest.raises(RepoError, match="1 usable root keys"):
        sign_root(copy.deepcopy(v1), {old[0].public_key.keyid: old[0]}, previous=None)
    # a rotation to new keys signed by the new keys only: the old root's threshold is not met
    new = [new_signer() for _ in range(3)]
    v2 = _root(new, tgt)
    v2.signed.version = 2
    with pytest.raises(RepoError, match="not signed by the root threshold"):
        sign_root(v2, {s.public_key.keyid: s for s in new}, previous=v1)
    sign_root(v2, {s.public_key.keyid: s for s in [*old[:2], *new[:2]]}, previous=v1)
    v1.signed.verify_delegate("root", v2.signed_bytes, v2.signatures)
    v2.signed.verify_delegate("root", v2.signed_bytes, v2.signatures)
    # a key neither root lists signs nothing
    stranger = new_signer()
    sign_root(v2, {s.public_key.keyid: s for s in [*old[:2], *new[:2], stranger]}, previous=v1)
    assert stranger.public_key.keyid not in v2.signatures


def test_sign_delegated_refuses_a_key_the_root_does_not_list_and_names_the_key_file():
    roots, tgt = [new_signer() for _ in range(3)], new_signer()
    root = _root(roots, tgt)
    md = Metadata(Targets(expires=_expires()))
    sign_delegated(md, tgt, root, "keys/targets.pem")
    assert list(md.signatures) == [tgt.public_key.keyid]
    with pytest.raises(RepoError, match="keys/targets.pem does not verify against root v1"):
        sign_delegated(md, new_signer(), root, "keys/targets.pem")
    assert len(md.signatures) == 1 and tgt.public_key.keyid not in md.signatures  # the old signature is gone too
