"""Booting one variant of a causal-LM release holds that variant only (issue 24, item 2):
the other variants are verified as they stream past, never kept by the device process, and
still recorded, byte for byte, in the device's slot."""

from __future__ import annotations

import pytest

from sealfl.enclave.device import boot as boot_module
from sealfl.enclave.device.boot import boot, boot_last_good, read_device_state
from sealfl.enclave.device.llm_boot import llm_files_to_keep
from sealfl.enclave.device.slots import slot_path
from sealfl.enclave.errors import BootError
from tests.support.llm_tiny import write_tiny_release


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-llm")
    _, payload, metadata = write_tiny_release(root)
    return root, payload, metadata


def test_llm_files_to_keep_drops_only_the_other_variants():
    md = {"runtime": "onnx-causal-lm/v1", "default_variant": "int4",
          "variants": {"int4": {"file": "a.onnx"}, "int8": {"file": "b.onnx"}}}
    names = ["a.onnx", "b.onnx", "tokenizer.json", "x.bin"]
    assert llm_files_to_keep(md, names) == {"a.onnx", "tokenizer.json", "x.bin"}
    assert llm_files_to_keep(md, names, "int8") == {"b.onnx", "tokenizer.json", "x.bin"}
    assert llm_files_to_keep(md, names, "int2") is None  # llm_spec refuses it, with its reason
    assert llm_files_to_keep({**md, "runtime": "onnx/v1"}, names) is None  # not a causal LM: keep all
    assert llm_files_to_keep({**md, "variants": "x"}, names) is None


@pytest.mark.parametrize("variant", [None, "int8"])
def test_boot_holds_the_chosen_variant_only_and_records_every_file(tiny, tmp_path, variant):
    root, payload, metadata = tiny
    chosen = metadata["variants"][variant or metadata["default_variant"]]["file"]
    other = next(v["file"] for v in metadata["variants"].values() if v["file"] != chosen)
    with boot(root / "trust", root / "release", tmp_path / "dev", backend="sim", variant=variant) as dev:
        assert dev.model_file == chosen
        assert chosen in dev.release.payload and other not in dev.release.payload
        assert set(dev.release.streamed) == {other}
        assert dev.generate([1, 5, 7], None).completion_tokens >= 1
    state = read_device_state(tmp_path / "dev")
    slot = slot_path(tmp_path / "dev", state.last_good.slot)
    assert {p.name for p in slot.iterdir()} >= set(payload)
    for name, data in payload.items():
        assert (slot / name).read_bytes() == data
    # the slot verifies on its own (the streamed file was hashed again as it was copied)
    with boot_last_good(root / "trust", tmp_path / "dev", backend="sim", variant=variant) as dev:
        assert dev.release.version == 1


def test_a_variant_changed_after_verification_is_not_recorded(tiny, tmp_path, monkeypatch):
    """The streamed file is copied from the release directory into the slot; if it changed
    since it was verified the copy's hash differs and the boot is refused as a verification
    failure, state.json untouched."""
    root, payload, metadata = tiny
    rel = tmp_path / "release"
    rel.mkdir()
    for f in (root / "release").iterdir():
        (rel / f.name).write_bytes(f.read_bytes())
    other = metadata["variants"]["int8"]["file"]
    real = boot_module.boot_llm

    def tamper_then_boot(*a, **kw):
        data = bytearray((rel / other).read_bytes())
        data[-1] ^= 1
        (rel / other).write_bytes(bytes(data))
        return real(*a, **kw)

    monkeypatch.setattr(boot_module, "boot_llm", tamper_then_boot)
    with pytest.raises(BootError) as info:
        boot(root / "trust", rel, tmp_path / "dev", backend="sim")
    assert (info.value.reason, info.value.file, info.value.check) == ("verification", other, "hash")
    assert read_device_state(tmp_path / "dev").last_good is None
