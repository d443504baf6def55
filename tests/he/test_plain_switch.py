"""The plaintext baseline of make bench (sealfl.he.plain) is unreachable from a
normal campaign: every process must opt in, and the release enclave never loads it."""

from __future__ import annotations

import numpy as np
import pytest

from sealfl.he import codecs, plain
from sealfl.he.errors import CiphertextError
from sealfl.platform.consortium import Consortium, create_consortium
from sealfl.platform.errors import ConsortiumError


def test_kind_plaintext_needs_the_opt_in_in_every_process(monkeypatch, tmp_path):
    monkeypatch.setenv(plain.ENV, plain.ENV_VALUE)
    cons, codec = create_consortium(tmp_path / "c", "bench", ["Cleveland", "Hungary"], params=plain.PlainParams())
    assert cons.he_params.to_dict()["scheme"] == "PLAINTEXT-BENCHMARK-ONLY"
    blob = codec.encrypt(np.array([0.5, -100.0]))
    np.testing.assert_array_equal(codec.decrypt(blob, 2), [0.5, -100.0])  # no clipping, no grid
    for value in (None, "", "yes", "1"):  # another process, or a careless setting
        if value is None:
            monkeypatch.delenv(plain.ENV)
        else:
            monkeypatch.setenv(plain.ENV, value)
        with pytest.raises(ConsortiumError, match="benchmarks only"):
            Consortium.load(cons.dir)
        with pytest.raises(CiphertextError, match="benchmarks only"):
            codecs.params_from_dict(plain.PlainParams().to_dict())
        with pytest.raises(CiphertextError, match="benchmarks only"):
            plain.PlainCodec.generate()
    from sealfl.clients.errors import KitError
    from sealfl.clients.kit import kit_dir, load_kit

    with pytest.raises(KitError, match="benchmarks only"):
        load_kit(str(kit_dir(cons.dir, "Hungary")))


def test_kind_release_enclave_never_loads_a_plaintext_context(monkeypatch, tmp_path):
    from sealfl.he.bfv import BFVCodec

    monkeypatch.setenv(plain.ENV, plain.ENV_VALUE)
    with pytest.raises(CiphertextError):
        BFVCodec.from_bytes(plain.PlainCodec.generate().secret_context_bytes(), plain.PlainParams(), b"\0" * 32)
