"""Global scaling from encrypted per-partner sums equals pooled statistics; kits unwrap
only with their own key."""

import numpy as np
import pytest

from sealfl.clients.data import load_partitions
from sealfl.clients.errors import KitError
from sealfl.clients.kit import kit_dir, load_kit
from sealfl.clients.stats import local_sums, mean_std
from sealfl.common import codecs
from sealfl.common.framed import WIDE
from sealfl.platform.consortium import create_consortium
from sealfl.platform.errors import ConsortiumError
from sealfl.server.aggregate import sum_chunks, validate_frames


@pytest.mark.parametrize("he", sorted(codecs.HE_SCHEMES))
def test_encrypted_scaling_equals_pooled_numpy(he):
    parts = load_partitions()
    secret = codecs.generate(codecs.params_for(he))
    public = codecs.from_bytes(secret.public_context_bytes(), secret.params, secret.context_id)
    frames = {p.name: secret.encrypt(local_sums(p.x_train), WIDE) for p in parts}
    agg = sum_chunks(public, validate_frames(public, frames, 27, WIDE), 27, layout=WIDE)
    mean, std = mean_std(secret.decrypt(agg, 27, WIDE))
    pooled = np.concatenate([p.x_train for p in parts]).astype(np.float64)
    # BFV: each partner's sums are rounded to 2^-12 (the wide layout): |error of a sum| <= 4 * 2^-13;
    # CKKS: the decryption noise of 4 sums, ~1e-8, is below that
    n = len(pooled)
    np.testing.assert_allclose(mean, pooled.mean(axis=0), rtol=0, atol=4 * 2.0**-13 / n)
    np.testing.assert_allclose(std, pooled.std(axis=0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("he", sorted(codecs.HE_SCHEMES))
def test_kits_unwrap_with_own_key_only(tmp_path, he):
    cons, codec = create_consortium(tmp_path / "c", "t", ["Cleveland", "Hungary"], params=codecs.params_for(he))
    assert cons.ckks.to_dict()["scheme"] == he.upper()
    kit = load_kit(str(kit_dir(cons.dir, "Cleveland")))
    assert kit.codec.has_secret_key and kit.partner == "Cleveland" and type(kit.codec) is type(codec)
    blob = codec.encrypt(np.array([1.5, -2.0]))
    # BFV decrypts exactly (values on its 2^-23 grid); CKKS within its noise
    np.testing.assert_allclose(kit.codec.decrypt(blob), [1.5, -2.0], rtol=0, atol=0 if he == "bfv" else 1e-6)
    # swap B's wrapped secret into A's kit: A's key cannot unwrap it
    a, b = kit_dir(cons.dir, "Cleveland"), kit_dir(cons.dir, "Hungary")
    (a / "ckks_secret.wrapped").write_bytes((b / "ckks_secret.wrapped").read_bytes())
    with pytest.raises(KitError, match="unwrap"):
        load_kit(str(a) + "/")  # a new cache key
    assert (a / "partner_key.pem").stat().st_mode & 0o077 == 0
    with pytest.raises(ConsortiumError):
        create_consortium(tmp_path / "c", "t", ["Cleveland", "Hungary"])
    with pytest.raises(ConsortiumError, match="unknown task"):
        create_consortium(tmp_path / "d", "t", ["A", "B"], task="other")


def test_consortium_refuses_colliding_or_unknown_partners(tmp_path):
    with pytest.raises(ConsortiumError, match="distinct directory names"):
        create_consortium(tmp_path / "a", "t", ["Foo Bar", "foo-bar"], task="other")
    with pytest.raises(ConsortiumError, match="FLamby hospitals"):
        create_consortium(tmp_path / "b", "t", ["Cleveland", "Bob"])
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "notes.txt").write_text("x")
    with pytest.raises(ConsortiumError, match="not an empty directory"):
        create_consortium(tmp_path / "c", "t", ["Cleveland", "Hungary"])


def test_kit_files_mixed_between_partners_are_refused(tmp_path):
    cons, _ = create_consortium(tmp_path / "c", "t", ["Cleveland", "Hungary"])
    a, b = kit_dir(cons.dir, "Cleveland"), kit_dir(cons.dir, "Hungary")
    (a / "kit.json").write_text((b / "kit.json").read_text())
    with pytest.raises(KitError, match="mixed up"):
        load_kit(str(a))
