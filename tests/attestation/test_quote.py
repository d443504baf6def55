"""Quotes: PCR arithmetic (TPM 2.0 Part 1 §17, §18.5) and pure verification."""

from __future__ import annotations

import base64
import hashlib

import pytest

from sealfl.attestation import keys
from sealfl.attestation.errors import PolicyError, QuoteError
from sealfl.attestation.quote import (
    make_quote,
    pcr_after,
    pcr_digest,
    qualifying_data,
    quote_message,
    verify_quote,
)


def _sha(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


D1, D2 = _sha(b"first measurement"), _sha(b"second measurement")


def test_pcr_after_matches_hand_computation():
    zero = b"\x00" * 32
    expected = _sha(_sha(zero + D1) + D2)
    assert pcr_after([D1, D2]) == expected.hex()
    assert pcr_after([D1.hex(), D2.hex()]) == expected.hex()
    assert pcr_after([]) == zero.hex()
    with pytest.raises(QuoteError):
        pcr_after([b"short"])


def test_pcr_digest_is_sha256_over_ascending_indices():
    v16, v23 = _sha(b"a"), _sha(b"b")
    assert pcr_digest({23: v23, 16: v16}) == hashlib.sha256(v16 + v23).hexdigest()


def _quote(ak, purpose="challenge", data=b"n" * 32, pcrs=None):
    pcrs = pcrs or {16: bytes.fromhex(pcr_after([D1]))}
    return make_quote("sim", pcrs, purpose, data, lambda m: keys.sign(ak, m))


def test_kind_qualifying_data_is_sha256_of_label_nul_data():
    # independent oracle: hashlib over the documented byte layout label || 0x00 || data
    data = bytes(range(32))
    assert qualifying_data("release", data) == _sha(b"sealfl.release-attestation/v1\x00" + data)
    assert qualifying_data("challenge", data) == _sha(b"sealfl.challenge/v1\x00" + data)
    ak = keys.generate_key()
    quote = _quote(ak, "challenge", data)
    assert quote["nonce"] == _sha(b"sealfl.challenge/v1\x00" + data).hex() and quote["purpose"] == "challenge"
    for purpose, bad in (("nope", data), ("release", b""), ("release", b"x" * 65), ("release", "not bytes")):
        with pytest.raises(QuoteError):
            qualifying_data(purpose, bad)


def test_good_quote_verifies_and_signature_covers_canonical_json():
    ak = keys.generate_key()
    quote = _quote(ak)
    verify_quote(quote, ak.public_key(), "challenge", b"n" * 32, {16: pcr_after([D1])}, allowed_backends={"sim"})
    assert keys.verify(ak.public_key(), quote_message(quote), base64.b64decode(quote["signature"]))
    assert quote["pcr_bank"] == "sha256"


def test_kind_challenge_quote_never_verifies_as_release_attestation():
    ak = keys.generate_key()
    root_digest = _sha(b"a release's root digest")
    challenge = _quote(ak, "challenge", root_digest)  # a verifier chose the root digest as its nonce
    with pytest.raises(QuoteError, match="purpose"):
        verify_quote(challenge, ak.public_key(), "release", root_digest, {16: pcr_after([D1])})
    relabelled = dict(challenge, purpose="release")  # flipping the signed field breaks the signature
    with pytest.raises(QuoteError, match="signature"):
        verify_quote(relabelled, ak.public_key(), "release", root_digest, {16: pcr_after([D1])})
    # and the other way round: a release attestation is no answer to a challenge
    release = _quote(ak, "release", root_digest)
    with pytest.raises(QuoteError, match="purpose"):
        verify_quote(release, ak.public_key(), "challenge", root_digest, {16: pcr_after([D1])})
    # even with the purpose field aside, the qualifying data differs (label inside the hash)
    assert challenge["nonce"] != release["nonce"]


def test_wrong_nonce_refused():
    ak = keys.generate_key()
    with pytest.raises(QuoteError, match="nonce"):
        verify_quote(_quote(ak), ak.public_key(), "challenge", b"m" * 32, {16: pcr_after([D1])})


def test_signature_by_another_ak_refused():
    ak, rogue = keys.generate_key(), keys.generate_key()
    with pytest.raises(QuoteError, match="signature"):
        verify_quote(_quote(rogue), ak.public_key(), "challenge", b"n" * 32, {16: pcr_after([D1])})


def test_edited_quote_fields_refused():
    ak = keys.generate_key()
    quote = _quote(ak)
    quote["pcrs"]["16"] = pcr_after([D2])  # claim another measurement without re-signing
    with pytest.raises(QuoteError, match="signature"):
        verify_quote(quote, ak.public_key(), "challenge", b"n" * 32, {16: pcr_after([D2])})


def test_policy_mismatches():
    ak = keys.generate_key()
    quote = _quote(ak)
    with pytest.raises(PolicyError, match="PCR 16"):
        verify_quote(quote, ak.public_key(), "challenge", b"n" * 32, {16: pcr_after([D2])})
    with pytest.raises(PolicyError, match="PCR 23"):
        verify_quote(quote, ak.public_key(), "challenge", b"n" * 32, {23: pcr_after([D1])})
    with pytest.raises(PolicyError, match="backend"):
        verify_quote(quote, ak.public_key(), "challenge", b"n" * 32, {16: pcr_after([D1])},
                     allowed_backends={"tpm"})


def test_signed_but_inconsistent_pcr_digest_refused():
    ak = keys.generate_key()
    quote = _quote(ak)
    quote["pcr_digest"] = "00" * 32
    quote["signature"] = base64.b64encode(keys.sign(ak, quote_message(quote))).decode()
    with pytest.raises(QuoteError, match="pcr_digest"):
        verify_quote(quote, ak.public_key(), "challenge", b"n" * 32, {16: pcr_after([D1])})


def _variants_of(text: str) -> list[str]:
    """Other texts a lenient decoder would map to the same bytes as ``text``."""
    out = [text[:4] + "!!" + text[4:], text[:4] + "\n" + text[4:], " " + text,
           text.rstrip("=") if text.endswith("=") else text + "=="]
    if "+" in text or "/" in text:
        out.append(text.replace("+", "-").replace("/", "_"))
    assert text not in out
    return out


def _nonzero_pad_bits(text: str) -> list[str]:
    """``text`` with its last data character moved to the next alphabet letter, which sets a
    pad bit (RFC 4648 §3.5) -- only where padding exists (otherwise there are no pad bits)."""
    if not text.endswith("="):
        return []
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    data = text.rstrip("=")
    return [data[:-1] + alphabet[alphabet.index(data[-1]) + 1] + text[len(data):]]


def test_kind_quote_signature_base64_is_strict():
    ak = keys.generate_key()
    quote = _quote(ak)
    for sig in _variants_of(quote["signature"]) + _nonzero_pad_bits(quote["signature"]):
        with pytest.raises(QuoteError, match="Base64"):
            verify_quote(dict(quote, signature=sig), ak.public_key(), "challenge", b"n" * 32, {16: pcr_after([D1])})


def test_kind_a_quote_signature_rewritten_to_high_s_is_refused():
    from Crypto.Util.asn1 import DerSequence

    ak = keys.generate_key()
    quote = _quote(ak)
    seq = DerSequence().decode(base64.b64decode(quote["signature"]))
    n = int("FFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551", 16)  # SEC 2 §2.4.2
    flipped = DerSequence([int(seq[0]), n - int(seq[1])]).encode()
    with pytest.raises(QuoteError, match="high S"):
        verify_quote(dict(quote, signature=base64.b64encode(flipped).decode()), ak.public_key(), "challenge",
                     b"n" * 32, {})
