"""Release pipeline -> `sealfl verify` (the real CLI, in a subprocess) -> device boot.

The campaign is replaced by a checkpoint encrypted under the consortium's HE context
(no Ray needed): the release enclave must decrypt it to the same parameters.
"""

import base64
import hashlib
import json
import shutil
import subprocess
import sys

import numpy as np
import onnxruntime as ort
import pytest

from sealfl.attestation.bundle import build_attestation
from sealfl.attestation.dsse import sign_envelope
from sealfl.attestation.keys import generate_key
from sealfl.clients.heart.data import HOSPITALS, load_partitions
from sealfl.clients.heart.stats import local_sums
from sealfl.clients.heart.task import HeartTask, TrainConfig
from sealfl.enclave.device.boot import boot
from sealfl.enclave.release.enclave import ReleaseEnclave
from sealfl.he.decrypted import update_share
from sealfl.he.framed import WIDE
from sealfl.platform import release as release_mod
from sealfl.platform.consortium import create_consortium
from sealfl.platform.errors import ReleaseError
from sealfl.platform.release import MODEL_FILE, check_gate, enclave_dir, provision_release_enclave, release, trust_dir
from sealfl.server.bookkeeping import CampaignDir
from tests.support.releases import commit_round


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("rel")
    cons, codec = create_consortium(root / "c", "heart", list(HOSPITALS))
    provision_release_enclave(cons, codec.secret_context_bytes())
    parts = load_partitions()
    x = np.concatenate([p.x_train for p in parts])
    y = np.concatenate([p.y_train for p in parts])
    task = HeartTask()
    params, _ = task.train(task.init_params(), x, y, x.mean(0), x.std(0), TrainConfig(local_epochs=10), 0)
    weights = np.array([p.n_train for p in parts], dtype=np.float64)
    # as the aggregator would hold it when every partner trained to the same w: E(Σ n_i w) under
    # CKKS ("count" weighting), E(Σ (n_i / N) w) under BFV ("share"): what update_share of all rows gives
    total = int(weights.sum())
    model_ct = codec.encrypt(update_share(params, total, total, codec.WEIGHTING))
    stats_ct = codec.encrypt(sum(local_sums(p.x_train) for p in parts), WIDE)
    for r in (1, 2):  # earlier rounds' aggregates (other ciphertexts), as the round log holds them
        commit_round(root / "camp", r, codec.encrypt(update_share(0 * params, total, total, codec.WEIGHTING)),
                     float(weights.sum()), stats_ct, list(HOSPITALS))
    commit_round(root / "camp", 3, model_ct, float(weights.sum()), stats_ct, list(HOSPITALS))
    # as the aggregator leaves it (with the total of rows the partners declared in the statistics round)
    CampaignDir(root / "camp", 3).set_status(status="finished", round=3, stats_declared_n=int(weights.sum()))
    res = release(cons.dir, root / "camp", root / "release", version=2)
    return {"root": root, "cons": cons, "params": params, "res": res, "x": x}


def _verify(trust, rel):
    return subprocess.run([sys.executable, "-m", "sealfl.platform.cli", "verify", "--trust", str(trust), str(rel)],
                          capture_output=True, text=True, timeout=120)


def test_release_decrypts_to_the_trained_model(built):
    np.testing.assert_allclose(built["res"].params, built["params"], atol=1e-6)
    acc = built["res"].accuracy
    assert acc["int8"]["pooled"] >= acc["fp32"]["pooled"] - 0.01
    assert acc["fp32"]["n"] == sum(len(p.y_test) for p in load_partitions())


def test_verify_accepts_the_untouched_release(built):
    r = _verify(trust_dir(built["cons"]), built["root"] / "release")
    assert r.returncode == 0, r.stderr
    assert built["res"].summary["root_digest"] in r.stdout


def _copy(built, tmp_path):
    d = tmp_path / "release"
    shutil.copytree(built["root"] / "release", d)
    return d


def _flip_onnx(d, built):
    p = d / MODEL_FILE
    b = bytearray(p.read_bytes())
    b[len(b) // 2] ^= 0x01
    p.write_bytes(bytes(b))


def _edit_manifest(d, built):
    m = json.loads((d / "manifest.json").read_text())
    m["version"] = m["version"] + 1
    (d / "manifest.json").write_text(json.dumps(m))


def _other_signer(d, built):
    env = json.loads((d / "manifest.dsse.json").read_text())
    payload = base64.b64decode(env["payload"])
    (d / "manifest.dsse.json").write_text(json.dumps(sign_envelope(payload, env["payloadType"], generate_key())))


def _other_measurement(d, built):
    # the same enclave (same attestation key) after running other code: PCR 16 differs; the
    # quote is a genuine release attestation over this release's signed statement
    enclave = ReleaseEnclave.open(enclave_dir(built["cons"]))
    enclave.tee.extend(16, b"\x42" * 32)
    statement = base64.b64decode(json.loads((d / "manifest.dsse.json").read_text())["payload"])
    quote = enclave.tee.quote("release", hashlib.sha256(statement).digest(), [16])
    (d / "attestation.json").write_text(json.dumps(build_attestation(quote)))


def _missing(d, built):
    (d / MODEL_FILE).unlink()


def _extra(d, built):
    (d / "notes.txt").write_text("not in the manifest")


@pytest.mark.parametrize("tamper, file, check", [
    (_flip_onnx, MODEL_FILE, "hash"),
    (_edit_manifest, "manifest.json", "manifest"),
    (_other_signer, "manifest.dsse.json", "signature"),
    (_other_measurement, "attestation.json", "attestation"),
    (_missing, MODEL_FILE, "missing-file"),
    (_extra, "notes.txt", "extra-file"),
])
def test_verify_refuses_tampering(built, tmp_path, tamper, file, check):
    d = _copy(built, tmp_path)
    tamper(d, built)
    r = _verify(trust_dir(built["cons"]), d)
    assert r.returncode != 0
    msg = " ".join(r.stderr.split())
    assert file in msg and check in msg, msg


def test_device_outputs_equal_direct_onnxruntime(built, tmp_path):
    int8 = (built["root"] / "release" / MODEL_FILE).read_bytes()
    x = np.concatenate([p.x_test for p in load_partitions()]).astype(np.float32)
    direct = ort.InferenceSession(int8, providers=["CPUExecutionProvider"]).run(None, {"features": x})[0]
    with boot(trust_dir(built["cons"]), built["root"] / "release", tmp_path / "dev", backend="sim") as dev:
        on_device = dev.predict(x)
        assert dev.release.version == 2
    np.testing.assert_array_equal(np.asarray(on_device), direct)


@pytest.mark.parametrize("fp32, int8, allowed", [(0.80, 0.80, True), (0.80, 0.795, True), (0.80, 0.81, True),
                                                    (0.80, 0.789, False), (0.80, 0.70, False)])
def test_gate_allows_at_most_one_point(fp32, int8, allowed):
    if allowed:
        check_gate(fp32, int8, 0.01)
    else:
        with pytest.raises(ReleaseError, match="not releasing"):
            check_gate(fp32, int8, 0.01)


def test_refused_gate_writes_nothing(built, tmp_path, monkeypatch):
    def worse_int8(cons, candidates, **kw):  # stands in for the partners' federated evaluation
        return {"fp32": {"pooled": 0.80}, "int8": {"pooled": 0.70}}

    monkeypatch.setattr(release_mod, "federated_evaluate", worse_int8)
    with pytest.raises(ReleaseError, match="not releasing"):
        release(built["cons"].dir, built["root"] / "camp", tmp_path / "r2", version=3)
    assert not (tmp_path / "r2").exists()


def test_release_refuses_unfinished_or_stale_campaigns(built, tmp_path):
    camp = tmp_path / "camp"
    shutil.copytree(built["root"] / "camp", camp)
    CampaignDir(camp, 3).set_status(status="failed", round=2, error="boom")
    with pytest.raises(ReleaseError, match="not finished"):
        release(built["cons"].dir, camp, tmp_path / "r", version=3)
    import subprocess

    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid whose process has exited: the campaign's owner was killed
    CampaignDir(camp, 3).set_status(status="running", round=2, error=None, owner={"pid": gone.pid})
    with pytest.raises(ReleaseError, match=r"is 'dead', not finished.*'campaign resume' continues from it"):  # as 'campaign status' says
        release(built["cons"].dir, camp, tmp_path / "r", version=3)
    CampaignDir(camp, 5).set_status(status="finished", round=5)  # checkpoint says round 3
    with pytest.raises(ReleaseError, match="stale"):
        release(built["cons"].dir, camp, tmp_path / "r", version=3)
    with pytest.raises(ReleaseError, match="not a campaign"):
        release(built["cons"].dir, tmp_path / "nothing", tmp_path / "r", version=3)
    assert not (tmp_path / "r").exists()


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "sealfl.platform.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def test_device_boot_cli_keeps_last_good_and_exits_3(built, tmp_path):
    trust, good, state = trust_dir(built["cons"]), built["root"] / "release", tmp_path / "state"
    part = load_partitions()[0]
    rows = tmp_path / "rows.csv"
    rows.write_text("\ufeffage,sex,trestbps,chol,fbs,thalch,exang,oldpeak,cp1,cp2,cp3,r1,r2\n"  # with a BOM
                    + "\n".join(",".join(f"{v:g}" for v in r) for r in part.x_test[:5]), encoding="utf-8")
    r = _cli("device", "boot", "-t", trust, "-r", good, "-s", state, "--input", rows, "--tee", "sim")
    assert r.returncode == 0, r.stderr
    got = [float(v) for v in r.stdout.split()[-5:]]
    want = ort.InferenceSession((good / MODEL_FILE).read_bytes()).run(None, {"features": part.x_test[:5]})[0]
    np.testing.assert_allclose(got, want.reshape(-1), atol=5e-5)

    bad = _copy(built, tmp_path)
    _flip_onnx(bad, built)
    r = _cli("device", "boot", "-t", trust, "-r", bad, "-s", state)
    assert r.returncode == 3
    assert "kept the last good release v2" in " ".join(r.stderr.split())
    last_good = json.loads((state / "state.json").read_text())["last_good"]
    assert last_good["root_digest"] == built["res"].summary["root_digest"]


@pytest.mark.parametrize("content, words, code", [
    # a malformed file is refused before anything boots (1: nothing runs, nothing recorded) ...
    (",".join(["1"] * 12 + ["nan"]) + "\n", "NaN", 1),
    (",".join(f"c{i}" for i in range(13)) + "\n" + ",".join(["1"] * 13) + "\nx," + ",".join(["1"] * 12) + "\n",
     "non-numeric", 1),
    ("63,1,14S," + ",".join(["1"] * 10) + "\n" + ",".join(["1"] * 13) + "\n", "non-numeric", 1),  # typo, no header
    ("age,sex\n" + ",".join(["1"] * 13) + "\n", "header has 2 columns", 1),
    (",".join(["1"] * 12 + ["1e39"]) + "\n", "float32", 1),
    ("", "no data rows", 1),
    # ... rows that do not fit the verified release are refused after it booted (5: it runs, nothing scored)
    ("1,2,3\n", "the rows have 3 columns, release heart-risk takes 13", 5),
    # the hardening issue's example: another patient's implausible chol is refused by name
    ("63,1,145,233,1,150,0,2.3,0,0,1,0,0\n63,1,145,100000,1,150,0,2.3,0,0,1,0,0\n", "row 2, column 'chol'", 5),
])
def test_kind_bad_input_rows_are_refused_and_the_exit_code_says_what_runs(built, tmp_path, content, words, code):
    f = tmp_path / "in.csv"
    f.write_text(content)
    state = tmp_path / "s"
    r = _cli("device", "boot", "-t", trust_dir(built["cons"]), "-r", built["root"] / "release",
             "-s", state, "--input", f, "--tee", "sim")
    assert r.returncode == code, r.stderr
    assert words in " ".join(r.stderr.split()) and "Traceback" not in r.stderr
    assert (state / "state.json").exists() == (code == 5)  # exit 1: nothing was booted or recorded


def test_kind_gate_scores_candidates_the_way_the_device_runs_them(built, tmp_path):
    """A partner's score of the INT8 candidate comes from the same sandboxed runtime a
    device boots: identical outputs on the same rows, and a model that does not load is
    the sandbox's error, not the partner process's."""
    from sealfl.clients.heart.onnx_eval import evaluate_onnx, onnx_predict
    from sealfl.enclave.errors import RuntimeSandboxError

    int8 = (built["root"] / "release" / MODEL_FILE).read_bytes()
    part = load_partitions()[1]
    partner_view = onnx_predict(int8, part.x_test)
    with boot(trust_dir(built["cons"]), built["root"] / "release", tmp_path / "dev", backend="sim") as dev:
        device_view = np.asarray(dev.predict(part.x_test)).reshape(-1)
    np.testing.assert_array_equal(partner_view, device_view)
    r = evaluate_onnx(part.name, int8)
    assert r["n"] == len(part.y_test) and r["correct"] == int(np.sum((device_view >= 0.5) == (part.y_test >= 0.5)))
    with pytest.raises(RuntimeSandboxError, match="could not load the model"):
        onnx_predict(b"not an onnx model", part.x_test)


def test_release_states_its_quantisation_canary_and_input_ranges(built):
    from sealfl.clients.heart.data import FEATURE_SPEC

    meta = json.loads((built["root"] / "release" / "manifest.json").read_text())["metadata"]
    assert meta["quantization"]["name"] == "sealfl.int8-per-row/v1"
    assert meta["input"]["features"] == [dict(f) for f in FEATURE_SPEC]
    canary = meta["canary"]
    assert canary["tolerance"] == 1e-4 and len(canary["inputs"]) == len(canary["expected"]) >= 8
    # the canary's expected outputs are what onnxruntime computes on this CPU, within tolerance
    int8 = (built["root"] / "release" / MODEL_FILE).read_bytes()
    got = ort.InferenceSession(int8).run(None, {"features": np.asarray(canary["inputs"], np.float32)})[0]
    np.testing.assert_allclose(got, np.asarray(canary["expected"]), rtol=0, atol=canary["tolerance"])


def test_release_versions_must_increase(built, tmp_path):
    with pytest.raises(ReleaseError, match="use --version 3"):
        release(built["cons"].dir, built["root"] / "camp", tmp_path / "again", version=2)
    assert not (tmp_path / "again").exists()


def test_kind_a_campaign_of_another_consortium_is_named_as_such(built, tmp_path):
    other, _ = create_consortium(tmp_path / "other", "other", list(HOSPITALS))
    camp = tmp_path / "camp"
    shutil.copytree(built["root"] / "camp", camp)
    (camp / "server_config.json").write_text(json.dumps({"context_id": other.context_id, "train": {}}))
    with pytest.raises(ReleaseError) as info:
        release(built["cons"].dir, camp, tmp_path / "rel", version=7)
    msg = str(info.value)
    assert "belongs to another consortium" in msg and "'heart'" in msg and other.context_id[:16] in msg
    assert not (tmp_path / "rel").exists()  # refused before anything was decrypted or written


def test_kind_a_new_version_of_the_same_content_is_pointed_out():
    from sealfl.platform.register import same_content

    entries = [{"version": 1, "state": "issued", "root_digest": "aa"}, {"version": 2, "state": "reserved"},
               {"version": 3, "root_digest": "aa"}, {"version": 4, "state": "issued", "root_digest": "bb"}]
    assert same_content(entries, "aa", 5) == [1, 3]  # 0.1 entries without a state are issued
    assert same_content(entries, "aa", 3) == [1] and same_content(entries, "cc", 5) == []

# -- sealfl audit: the chain from the rounds to a device's quote --------------------------------

_NONCE = bytes(range(1, 17))


def _attested_device(trust, release_dir, state):
    """Boot ``release_dir`` on a sim device in ``state`` and return its public evidence."""
    from sealfl.enclave.device.evidence import attest_device, device_public_key

    boot(trust, release_dir, state, backend="sim").close()
    return attest_device(state, _NONCE), device_public_key(state)


@pytest.fixture(scope="module")
def chain(built, tmp_path_factory):
    """The public material of the real chain: trust dir, round log, release, device evidence."""
    root = tmp_path_factory.mktemp("audit")
    trust = trust_dir(built["cons"])
    evidence, ak = _attested_device(trust, built["root"] / "release", root / "device")
    (root / "evidence.json").write_text(json.dumps(evidence))
    (root / "ak.pem").write_bytes(ak)
    return {"trust": trust, "rounds": built["root"] / "camp" / "rounds.jsonl", "release": built["root"] / "release",
            "evidence": root / "evidence.json", "ak": root / "ak.pem", "root": root}


def _audit_cli(chain, *extra, **swap):
    paths = {**chain, **swap}
    return subprocess.run([sys.executable, "-m", "sealfl.platform.cli", "audit", "--trust", str(paths["trust"]),
                           "--rounds", str(paths["rounds"]), "--release", str(paths["release"]),
                           "--evidence", str(paths["evidence"]), "--device-ak", str(paths["ak"]),
                           "--nonce", _NONCE.hex(), "--allow-sim", *extra],
                          capture_output=True, text=True, timeout=120)


def _links(chain, **swap):
    """audit_chain on the chain's files with one piece swapped: {link: (ok, detail)}."""
    from sealfl.attestation.audit import DeviceEvidence, audit_chain
    from sealfl.attestation.keys import load_public_key
    from sealfl.attestation.release import load_trust_anchors, read_release_dir
    from sealfl.enclave.device.evidence import measure_config
    from sealfl.enclave.measurement import measure_device_runtime

    paths = {**chain, **swap}
    device = DeviceEvidence(json.loads(paths["evidence"].read_bytes()), load_public_key(paths["ak"].read_bytes()),
                            _NONCE, frozenset({"sim"}), frozenset({measure_device_runtime().hex()}),
                            frozenset({measure_config(paths["trust"]).hex()}))
    links = audit_chain(trust=load_trust_anchors(paths["trust"]), round_log=paths["rounds"].read_bytes(),
                        release_files=read_release_dir(paths["release"]), device=device)
    return {link.name: (link.ok, link.detail) for link in links}


def test_audit_passes_on_the_real_chain_and_prints_one_line_per_link(chain, built):
    done = _audit_cli(chain)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    assert [line.split()[:2] for line in lines] == [["PASS", n] for n in
                                                    ("rounds", "decrypted-aggregate", "provenance", "release", "device")]
    doc = json.loads(_audit_cli(chain, "--json").stdout)
    assert doc["ok"] is True and [d["link"] for d in doc["links"]][0] == "rounds"
    # what the provenance says, checked here against the campaign files with hashlib
    env = json.loads((chain["release"] / "provenance.dsse.json").read_bytes())
    pred = json.loads(base64.b64decode(env["payload"]))["predicate"]
    ckpt = CampaignDir(built["root"] / "camp").read_checkpoint()
    assert pred["decrypted_aggregate"] == {"round": 3, "sha256": hashlib.sha256(ckpt.model_ct).hexdigest()}
    assert [r["round"] for r in pred["rounds"]] == [1, 2, 3]
    assert all(r["partners"] == sorted(HOSPITALS) for r in pred["rounds"])
    public = (built["cons"].dir / "aggregator" / "public.he").read_bytes()
    assert pred["he"]["public_params_sha256"] == hashlib.sha256(public).hexdigest() and pred["he"]["codec"] == "bfv"
    assert pred["consortium"]["partners"] == list(HOSPITALS) and pred["optimizer"]["name"] == "fedavg"
    assert pred["gate"]["max_drop"] == 0.01 and pred["quantization"] and pred["version"] == 2


def _only_failing(links, *names):
    failing = sorted(n for n, (ok, _) in links.items() if not ok)
    assert failing == sorted(names), links
    return links


def test_audit_names_a_swapped_round_digest(chain, tmp_path):
    lines = chain["rounds"].read_text().splitlines()
    rec = json.loads(lines[0])
    rec["aggregate_sha256"] = hashlib.sha256(b"another aggregate").hexdigest()
    (tmp_path / "rounds.jsonl").write_text("\n".join([json.dumps(rec)] + lines[1:]) + "\n")
    links = _only_failing(_links(chain, rounds=tmp_path / "rounds.jsonl"), "rounds")
    assert "round 1: the log's aggregate" in links["rounds"][1]
    done = _audit_cli(chain, rounds=tmp_path / "rounds.jsonl")
    assert done.returncode == 1 and "FAIL  rounds" in done.stdout and "PASS  device" in done.stdout


def test_audit_names_a_swapped_final_aggregate(chain, tmp_path):
    lines = chain["rounds"].read_text().splitlines()
    last = json.loads(lines[-1])
    last["aggregate_sha256"] = hashlib.sha256(b"not what the enclave decrypted").hexdigest()
    (tmp_path / "rounds.jsonl").write_text("\n".join(lines[:-1] + [json.dumps(last)]) + "\n")
    links = _only_failing(_links(chain, rounds=tmp_path / "rounds.jsonl"), "rounds", "decrypted-aggregate")
    assert "the log's last round 3" in links["decrypted-aggregate"][1]


def _release_copy(chain, tmp_path, name="release"):
    d = tmp_path / name
    shutil.copytree(chain["release"], d)
    return d


def test_audit_names_a_provenance_that_lies_about_the_decrypted_aggregate(chain, built, tmp_path):
    from sealfl.attestation.canonical import canonical_json
    from tests.support.releases import resigned_model_sig

    enclave = ReleaseEnclave.open(enclave_dir(built["cons"]))  # even the release key cannot make the chain hold
    d = _release_copy(chain, tmp_path)
    env = json.loads((d / "provenance.dsse.json").read_bytes())
    statement = json.loads(base64.b64decode(env["payload"]))
    statement["predicate"]["decrypted_aggregate"]["sha256"] = hashlib.sha256(b"some other model").hexdigest()
    (d / "provenance.dsse.json").write_bytes(canonical_json(sign_envelope(canonical_json(statement),
                                                                           env["payloadType"], enclave._key)))
    files = {p.name: p.read_bytes() for p in d.iterdir()}
    (d / "model.sig").write_bytes(resigned_model_sig(files, enclave._key))
    links = _only_failing(_links(chain, release=d), "decrypted-aggregate")
    assert "decrypted round 3's aggregate" in links["decrypted-aggregate"][1]


def test_audit_names_a_provenance_of_another_release(chain, built, tmp_path):
    from tests.support.releases import default_payload

    enclave = ReleaseEnclave.open(enclave_dir(built["cons"]))
    env = json.loads((chain["release"] / "provenance.dsse.json").read_bytes())
    predicate = json.loads(base64.b64decode(env["payload"]))["predicate"]
    other = tmp_path / "other"
    name = json.loads((chain["release"] / "manifest.json").read_bytes())["name"]
    enclave.write_release(other, default_payload(), name, 5, {}, predicate)
    d = _release_copy(chain, tmp_path)
    shutil.copy(other / "provenance.dsse.json", d / "provenance.dsse.json")
    links = _links(chain, release=d)
    assert not links["provenance"][0] and "another release's" in links["provenance"][1]
    assert not links["release"][0] and "model.sig" in links["release"][1]  # model.sig signs the original
    assert not links["rounds"][0] and "not checked" in links["rounds"][1]


def test_audit_names_a_release_of_another_enclave(chain, tmp_path):
    from tests.support.releases import default_payload

    stranger = ReleaseEnclave.create(tmp_path / "stranger")
    env = json.loads((chain["release"] / "provenance.dsse.json").read_bytes())
    predicate = json.loads(base64.b64decode(env["payload"]))["predicate"]
    name = json.loads((chain["release"] / "manifest.json").read_bytes())["name"]
    stranger.write_release(tmp_path / "theirs", default_payload(), name, 2, {}, predicate)
    links = _links(chain, release=tmp_path / "theirs")
    assert not links["release"][0] and "'signature'" in links["release"][1]
    assert not links["provenance"][0] and not links["device"][0]  # the device booted another root digest


def test_audit_names_a_device_that_runs_another_release(chain, built, tmp_path):
    from tests.support.releases import default_payload

    enclave = ReleaseEnclave.open(enclave_dir(built["cons"]))
    enclave.write_release(tmp_path / "v9", default_payload(), "heart-mlp", 9, {"model_file": "model.int8.onnx"})
    evidence, ak = _attested_device(chain["trust"], tmp_path / "v9", tmp_path / "device")
    (tmp_path / "evidence.json").write_text(json.dumps(evidence))
    (tmp_path / "ak.pem").write_bytes(ak)
    links = _only_failing(_links(chain, evidence=tmp_path / "evidence.json", ak=tmp_path / "ak.pem"), "device")
    assert "release_root" in links["device"][1]
    done = _audit_cli(chain, evidence=tmp_path / "evidence.json", ak=tmp_path / "ak.pem")
    assert done.returncode == 1 and "FAIL  device" in done.stdout
    # the chain's own evidence held against another device's AK: refused too
    links = _only_failing(_links(chain, ak=tmp_path / "ak.pem"), "device")
    assert "does not hold" in links["device"][1]


def _audit_without_device(chain, *extra):
    return subprocess.run([sys.executable, "-m", "sealfl.platform.cli", "audit", "--trust", str(chain["trust"]),
                           "--rounds", str(chain["rounds"].parent), "--release", str(chain["release"]), *extra],
                          capture_output=True, text=True, timeout=120)


def test_audit_without_device_evidence_fails_unless_asked_to_stop_at_the_release(chain, tmp_path):
    # --rounds given the campaign directory: its rounds.jsonl is read
    done = _audit_without_device(chain)
    assert done.returncode == 1 and "FAIL  device" in done.stdout and "--no-device" in done.stdout
    done = _audit_without_device(chain, "--no-device", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    links = {d["link"]: d for d in json.loads(done.stdout)["links"]}
    assert links["device"]["skipped"] is True and links["device"]["ok"] is False
    assert all(d["ok"] for name, d in links.items() if name != "device")
    # skipping the device never hides a broken earlier link
    lines = chain["rounds"].read_text().splitlines()
    first = json.loads(lines[0])
    first["aggregate_sha256"] = "0" * 64
    (tmp_path / "rounds.jsonl").write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")
    done = subprocess.run([sys.executable, "-m", "sealfl.platform.cli", "audit", "--trust", str(chain["trust"]),
                           "--rounds", str(tmp_path), "--release", str(chain["release"]), "--no-device"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "FAIL  rounds" in done.stdout and "SKIP  device" in done.stdout
    # --no-device with evidence is a contradiction, refused
    done = _audit_cli(chain, "--no-device")
    assert done.returncode == 1 and "--no-device" in done.stderr
