"""Startup kits (issue 19, item 2): every kit opened, each holds only what its party needs.

Oracles independent of the code under test: ``openssl verify`` / ``openssl x509`` for the
certificates, ``ssh-keygen -l`` for the SuperNode keys, ``cryptography``'s loaders for
"is this a private key".
"""

from __future__ import annotations

import json
import subprocess

import pytest
from cryptography.hazmat.primitives import serialization

from sealfl.clients.kit import HE_SECRET_FILE, HE_SECRET_LABEL, kit_dir
from sealfl.he import codecs
from sealfl.he.kit_wrap import unwrap
from sealfl.platform.consortium import PUBLIC_CONTEXT_FILE, create_consortium
from sealfl.platform.errors import ConsortiumError

PARTNERS = ["Cleveland", "Hungary", "Switzerland", "VA Long Beach"]


@pytest.fixture(scope="module")
def cons(tmp_path_factory):
    c, _ = create_consortium(tmp_path_factory.mktemp("kits") / "c", "t", PARTNERS)
    return c


def _files(d):
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _private_key_in(data: bytes) -> bool:
    """Does ``data`` hold a private key in any form a loader accepts (PEM/PKCS8/OpenSSH/DER)?"""
    loaders = (lambda b: serialization.load_pem_private_key(b, None), lambda b: serialization.load_ssh_private_key(b, None),
               lambda b: serialization.load_der_private_key(b, None))
    for load in loaders:
        try:
            load(data)
            return True
        except Exception:  # noqa: BLE001 - any refusal means "not this form"
            pass
    return b"PRIVATE KEY" in data


def test_partner_kits_hold_only_their_own_keys(cons):
    kits = {p: _files(kit_dir(cons.dir, p)) for p in PARTNERS}
    secrets = {p: (kits[p]["partner_key.pem"], kits[p]["supernode_auth_key"]) for p in PARTNERS}
    others = [_files(cons.dir / "superlink"), _files(cons.dir / "authority")]
    tls_key, ca_key = others[0]["superlink.key"], others[1]["ca.key"]
    for p, files in kits.items():
        assert set(files) == {"kit.json", "partner_key.pem", "partner_key.pub.pem", HE_SECRET_FILE, "ca.crt",
                              "supernode_auth_key", "supernode_auth_key.pub", "README.md"}, p
        private = [name for name, data in files.items() if _private_key_in(data)]
        assert sorted(private) == ["partner_key.pem", "supernode_auth_key"], p
        blob = b"".join(files.values())
        for q in PARTNERS:
            if q != p:
                assert not any(s in blob for s in secrets[q]), f"{p}'s kit holds a key of {q}"
        assert tls_key not in blob and ca_key not in blob
        # the HE secret in the kit opens with this partner's own key and no one else's
        from Crypto.PublicKey import ECC

        own = ECC.import_key(files["partner_key.pem"])
        assert unwrap(files[HE_SECRET_FILE], own, HE_SECRET_LABEL)
        for q in PARTNERS:
            if q != p:
                with pytest.raises(Exception):
                    unwrap(files[HE_SECRET_FILE], ECC.import_key(secrets[q][0]), HE_SECRET_LABEL)
        # the SuperNode key is the ECDSA P-384 OpenSSH form Flower reads (ssh-keygen agrees)
        out = subprocess.run(["ssh-keygen", "-l", "-f", str(kit_dir(cons.dir, p) / "supernode_auth_key.pub")],
                             capture_output=True, text=True, check=True).stdout
        assert out.startswith("384 ") and "(ECDSA)" in out
        assert (kit_dir(cons.dir, p) / "supernode_auth_key").stat().st_mode & 0o077 == 0
        assert "sealfl partner start" in files["README.md"].decode() and p in files["README.md"].decode()


def test_aggregator_kit_holds_no_secret_key(cons):
    files = _files(cons.dir / "aggregator")
    assert set(files) == {"public.he", "ca.crt", "README.md"}
    assert [n for n, data in files.items() if _private_key_in(data)] == []
    pub = codecs.from_bytes((cons.dir / PUBLIC_CONTEXT_FILE).read_bytes(), cons.he_params, bytes.fromhex(cons.context_id))
    assert not pub.has_secret_key
    assert "sealfl campaign run" in files["README.md"].decode()


def test_superlink_kit_registers_every_partner_and_its_cert_chains_to_the_ca(cons):
    sl = cons.dir / "superlink"
    files = _files(sl)
    assert set(files) == {"ca.crt", "superlink.crt", "superlink.key", "supernodes.json", "README.md"}
    assert [n for n, data in files.items() if _private_key_in(data)] == ["superlink.key"]
    reg = json.loads(files["supernodes.json"])["partners"]
    assert [r["name"] for r in reg] == PARTNERS
    for r in reg:
        assert r["public_key"] == (kit_dir(cons.dir, r["name"]) / "supernode_auth_key.pub").read_text().strip()
    ok = subprocess.run(["openssl", "verify", "-CAfile", str(sl / "ca.crt"), "-purpose", "sslserver",
                         str(sl / "superlink.crt")], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    text = subprocess.run(["openssl", "x509", "-in", str(sl / "superlink.crt"), "-noout", "-ext", "subjectAltName"],
                          capture_output=True, text=True, check=True).stdout
    assert "IP Address:127.0.0.1" in text and "DNS:localhost" in text
    for p in PARTNERS:  # one CA for everybody
        assert (kit_dir(cons.dir, p) / "ca.crt").read_bytes() == files["ca.crt"]


def test_superlink_host_sets_the_san_and_a_bad_one_is_refused_before_writing(tmp_path):
    c, _ = create_consortium(tmp_path / "a", "t", PARTNERS[:2], superlink_hosts=["fl.example.org", "10.0.0.7"])
    text = subprocess.run(["openssl", "x509", "-in", str(c.dir / "superlink" / "superlink.crt"), "-noout", "-ext",
                           "subjectAltName"], capture_output=True, text=True, check=True).stdout
    assert "DNS:fl.example.org" in text and "IP Address:10.0.0.7" in text and "127.0.0.1" not in text
    with pytest.raises(ConsortiumError, match="'bad host!'"):
        create_consortium(tmp_path / "b", "t", PARTNERS[:2], superlink_hosts=["bad host!"])
    assert not (tmp_path / "b").exists()
