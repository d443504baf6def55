"""Global scaling from encrypted per-partner sums equals pooled statistics; kits unwrap
only with their own key."""

import numpy as np
import pytest

from sealfl.clients.errors import KitError
from sealfl.clients.heart.data import load_partitions
from sealfl.clients.heart.stats import local_sums, mean_std
from sealfl.clients.kit import cached_kit, kit_dir, load_kit
from sealfl.he import codecs
from sealfl.he.framed import WIDE
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
    assert cons.he_params.to_dict()["scheme"] == he.upper()
    kit = load_kit(str(kit_dir(cons.dir, "Cleveland")))
    assert kit.codec.has_secret_key and kit.partner == "Cleveland" and type(kit.codec) is type(codec)
    blob = codec.encrypt(np.array([1.5, -2.0]))
    # BFV decrypts exactly (values on its 2^-23 grid); CKKS within its noise
    np.testing.assert_allclose(kit.codec.decrypt(blob), [1.5, -2.0], rtol=0, atol=0 if he == "bfv" else 1e-6)
    # swap B's wrapped secret into A's kit: A's key cannot unwrap it
    a, b = kit_dir(cons.dir, "Cleveland"), kit_dir(cons.dir, "Hungary")
    (a / "he_secret.wrapped").write_bytes((b / "he_secret.wrapped").read_bytes())
    with pytest.raises(KitError, match="unwrap"):
        load_kit(str(a) + "/")  # a new cache key
    assert (a / "partner_key.pem").stat().st_mode & 0o077 == 0
    with pytest.raises(ConsortiumError):
        create_consortium(tmp_path / "c", "t", ["Cleveland", "Hungary"])
    with pytest.raises(ConsortiumError, match="unknown task"):
        create_consortium(tmp_path / "d", "t", ["A", "B"], task="other")


@pytest.mark.parametrize("he", sorted(codecs.HE_SCHEMES))
def test_cached_kits_are_per_kit_bytes_and_share_only_the_parsed_context(tmp_path, he):
    """The ClientApp's per-process kit cache (:func:`cached_kit`): the same kit bytes give the
    same kit; another partner's kit is its own entry (name, signing key, codec object) over
    the one parsed HE context they all wrap; changed files are noticed at once; a kit that
    fails to load fails every time (nothing of it is kept)."""
    cons, codec = create_consortium(tmp_path / "c", "t", ["Cleveland", "Hungary"], params=codecs.params_for(he))
    a, b = kit_dir(cons.dir, "Cleveland"), kit_dir(cons.dir, "Hungary")
    ka, kb = cached_kit(str(a)), cached_kit(str(b))
    assert cached_kit(str(a)) is ka and cached_kit(str(b)) is kb
    assert (ka.partner, kb.partner) == ("Cleveland", "Hungary") and ka.signing_key != kb.signing_key
    assert ka.codec is not kb.codec and ka.codec._ctx is kb.codec._ctx  # one parse of the shared secret
    blob = codec.encrypt(np.array([1.5, -2.0]))
    for k in (ka, kb):
        np.testing.assert_allclose(k.codec.decrypt(blob), [1.5, -2.0], rtol=0, atol=0 if he == "bfv" else 1e-6)
    fresh = load_kit(str(a))
    assert (fresh.partner, fresh.index, fresh.signing_key, fresh.codec.context_id) == \
        (ka.partner, ka.index, ka.signing_key, ka.codec.context_id)
    # B's key given for A's kit: a different key file is a different entry, and it does not unwrap
    with pytest.raises(KitError, match="unwrap"):
        cached_kit(str(a), str(b / "partner_key.pem"))
    # a re-issued kit.json (another index) is read again, not served from the cache
    meta = (a / "kit.json").read_text()
    (a / "kit.json").write_text(meta.replace('"index": 0', '"index": 7'))
    assert cached_kit(str(a)).index == 7 and cached_kit(str(a)) is not ka
    (a / "kit.json").write_text(meta)
    assert cached_kit(str(a)) is ka
    # mixed-up files: refused on every call, even though A's kit loaded before
    good = (a / "he_secret.wrapped").read_bytes()
    (a / "he_secret.wrapped").write_bytes((b / "he_secret.wrapped").read_bytes())
    for _ in range(2):
        with pytest.raises(KitError, match="unwrap"):
            cached_kit(str(a))
    (a / "he_secret.wrapped").write_bytes(good)
    assert cached_kit(str(a)) is ka


def test_consortium_refuses_colliding_or_unknown_partners(tmp_path):
    with pytest.raises(ConsortiumError, match="distinct directory names"):
        create_consortium(tmp_path / "a", "t", ["Foo Bar", "foo-bar"], task="other")
    with pytest.raises(ConsortiumError, match="FLamby hospitals"):
        create_consortium(tmp_path / "b", "t", ["Cleveland", "Bob"])
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "notes.txt").write_text("x")
    with pytest.raises(ConsortiumError, match="not an empty directory"):
        create_consortium(tmp_path / "c", "t", ["Cleveland", "Hungary"])


def test_kind_a_kit_copied_under_any_directory_name_opens_as_its_partner(tmp_path):
    import shutil

    cons, _ = create_consortium(tmp_path / "c", "t", ["Cleveland", "Hungary"])
    site = tmp_path / "site" / "kit"  # as the README's partner quickstart copies it
    shutil.copytree(kit_dir(cons.dir, "Cleveland"), site)
    assert load_kit(str(site)).partner == "Cleveland"
    b = kit_dir(cons.dir, "Hungary")
    (site / "he_secret.wrapped").write_bytes((b / "he_secret.wrapped").read_bytes())  # mixed-up files
    with pytest.raises(KitError):
        load_kit(str(site))


def test_a_sealfl_0_1_consortium_is_read_with_its_old_names(tmp_path):
    """0.1 wrote "ckks" for the HE parameters, aggregator/public.ckks and ckks_secret.wrapped
    (wrapped under the label b"ckks-secret-context"): read for one release."""
    import json

    from sealfl.clients.kit import HE_SECRET_FILE
    from sealfl.he.kit_wrap import unwrap, wrap
    from sealfl.platform.consortium import Consortium

    cons, codec = create_consortium(tmp_path / "c", "t", ["Cleveland", "Hungary"], params=codecs.params_for("bfv"))
    d = cons.dir
    (d / "aggregator" / "public.he").rename(d / "aggregator" / "public.ckks")
    meta = json.loads((d / "consortium.json").read_text())
    meta["ckks"] = meta.pop("he")
    (d / "consortium.json").write_text(json.dumps(meta))
    kd = kit_dir(d, "Hungary")
    from Crypto.PublicKey import ECC

    key = ECC.import_key((kd / "partner_key.pem").read_bytes())
    secret = unwrap((kd / HE_SECRET_FILE).read_bytes(), key, b"he-secret-context")
    (kd / HE_SECRET_FILE).unlink()
    (kd / "ckks_secret.wrapped").write_bytes(wrap(secret, key.public_key(), b"ckks-secret-context"))
    kit_meta = json.loads((kd / "kit.json").read_text())
    kit_meta["ckks"] = kit_meta.pop("he")
    (kd / "kit.json").write_text(json.dumps(kit_meta))

    old = Consortium.load(d)
    assert old.he_params == cons.he_params and old.public_context.name == "public.ckks"
    kit = load_kit(str(kd))
    np.testing.assert_array_equal(kit.codec.decrypt(codec.encrypt(np.array([0.5, -1.0]))), [0.5, -1.0])


@pytest.mark.parametrize("content, words", [
    (b"", "not strict JSON"),
    (b"[]", "must be an object"),
    (b'{"name": "t"}', "'partners' is missing"),
    (b'{"name": "t", "partners": ["A", 3], "he": {}, "context_id": "00", "task": "heart"}', r"'partners\[1\]' must be a string, got integer 3"),
    (b'{"name": "t", "partners": ["A"], "he": [], "context_id": "00", "task": "heart"}', "'he' must be an object"),
    (b'{"name": 1e999}', "'name' must be a string, got number inf"),
])
def test_a_damaged_consortium_file_is_refused_by_field(tmp_path, content, words):
    from sealfl.platform.consortium import Consortium

    (tmp_path / "consortium.json").write_bytes(content)
    with pytest.raises(ConsortiumError, match=words):
        Consortium.load(tmp_path)


@pytest.mark.parametrize("edit, words", [
    (lambda m: m.pop("partner"), "field 'partner' is missing"),
    (lambda m: m.update(index="x"), "field 'index' must be an integer, got string 'x'"),
    (lambda m: m.update(partner=None), "field 'partner' must be a string, got null"),
    (lambda m: m.update(context_id="zz"), "field 'context_id' must be hex digits"),
    (lambda m: m.clear() or m.update(x=[1]), "field 'partner' is missing"),
])
def test_a_damaged_kit_file_is_refused_by_field(tmp_path, edit, words):
    import json

    cons, _ = create_consortium(tmp_path / "c", "t", ["Cleveland", "Hungary"])
    kd = kit_dir(cons.dir, "Cleveland")
    meta = json.loads((kd / "kit.json").read_text())
    edit(meta)
    (kd / "kit.json").write_text(json.dumps(meta))
    with pytest.raises(KitError, match=f"kit.json: {words}.*re-issue the kit"):
        load_kit(str(kd))
    (kd / "kit.json").write_text("[1, 2]")
    with pytest.raises(KitError, match="kit.json: document must be an object"):
        load_kit(str(kd) + "/")


def test_a_kit_file_that_cannot_be_read_is_named(tmp_path):
    cons, _ = create_consortium(tmp_path / "c", "t", ["Cleveland", "Hungary"])
    kd = kit_dir(cons.dir, "Cleveland")
    (kd / "he_secret.wrapped").unlink()
    (kd / "he_secret.wrapped").mkdir()  # a directory where the file belongs
    with pytest.raises(KitError, match=r"cannot read .*he_secret.wrapped: Is a directory; re-issue the kit"):
        load_kit(str(kd))
