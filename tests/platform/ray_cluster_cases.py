"""Campaigns on a real two-node Ray cluster with token authentication (issue 22, item 1).

The cluster is Ray's own multi-node harness (``ray.cluster_utils.Cluster``: two raylets,
one GCS, all on 127.0.0.1), attached with ``ray_address`` exactly as ``--ray-address`` does.

Run by tests/platform/test_ray_cluster.py in a fresh Python process: Ray keeps the first
authentication mode and token a process uses, so an earlier test's token-less local Ray in
the same pytest process would make this cluster unreachable.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from sealfl.clients.heart.data import HOSPITALS
from sealfl.he.framed import PACKED
from sealfl.platform.campaign import CampaignSpec, run_campaign
from sealfl.platform.consortium import create_consortium
from sealfl.platform.simulate import actor_options, probe_auth, ray_environment
from tests.support.raycluster import token_cluster

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    with token_cluster(nodes=2, cpus_per_node=2) as c:
        yield c


@pytest.fixture(scope="module")
def consortium_codec(tmp_path_factory):
    from sealfl.platform.release import provision_release_enclave

    cons, codec = create_consortium(tmp_path_factory.mktemp("consortium") / "c", "heart", list(HOSPITALS))
    provision_release_enclave(cons, codec.secret_context_bytes())  # its key holder opens the final models below
    return cons, codec


@pytest.fixture(scope="module")
def consortium(consortium_codec):
    return consortium_codec[0]


def _fabricated_campaign(cons, codec, camp) -> None:
    """A finished one-round campaign as the aggregator leaves it (tests/support/releases.py),
    its model trained here on the pooled rows: the release tests need its checkpoint, not a
    Flower run."""
    from sealfl.clients.heart.data import load_partitions
    from sealfl.clients.heart.stats import local_sums
    from sealfl.clients.heart.task import HeartTask, TrainConfig
    from sealfl.he.decrypted import update_share
    from sealfl.he.framed import WIDE
    from sealfl.server.bookkeeping import CampaignDir
    from tests.support.releases import commit_round

    parts = load_partitions()
    x, y = np.concatenate([p.x_train for p in parts]), np.concatenate([p.y_train for p in parts])
    task = HeartTask()
    params, _ = task.train(task.init_params(), x, y, x.mean(0), x.std(0), TrainConfig(local_epochs=10), 0)
    total = int(sum(p.n_train for p in parts))
    commit_round(camp, 1, codec.encrypt(update_share(params, total, total, codec.WEIGHTING)), float(total),
                 codec.encrypt(sum(local_sums(p.x_train) for p in parts), WIDE), list(HOSPITALS))
    CampaignDir(camp, 1).set_status(status="finished", round=1, stats_declared_n=total)


def _model(cons, camp) -> np.ndarray:
    """The final model, opened as the release does: the release enclave's key holder
    decrypts the checkpoint's aggregate (the ciphertexts themselves are freshly random)."""
    from sealfl.clients.plugins import get_task
    from sealfl.enclave.release.enclave import ReleaseEnclave
    from sealfl.enclave.release.keyholder import KeyHolder
    from sealfl.platform.campaign_outcome import finished_checkpoint
    from sealfl.platform.release import enclave_dir, open_final_model

    keys = KeyHolder(ReleaseEnclave.open(enclave_dir(cons)), cons.he_params, bytes.fromhex(cons.context_id))
    params, mean, std = open_final_model(keys, finished_checkpoint(camp), get_task(cons.task), camp)
    return np.concatenate([np.asarray(params, np.float64).ravel(), np.asarray(mean).ravel(), np.asarray(std).ravel()])


def _alive_nodes() -> int:
    import ray

    return sum(1 for n in ray.nodes() if n["Alive"])


def test_attaching_to_a_loopback_cluster_keeps_the_driver_on_loopback():
    # without RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 the driver rewrites 127.0.0.1 to the
    # outward address and never reaches a cluster bound to loopback (seen here: it hung)
    base = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1", "RAY_AUTH_TOKEN": "t", "RAY_AUTH_MODE": "token", "X": "y"}
    for addr in ("127.0.0.1:6379", "localhost:6379", "ray://127.0.0.5:10001", "[::1]:6379"):
        env = ray_environment({"mode": "attach", "address": addr}, base)
        assert env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0" and env["RAY_AUTH_TOKEN"] == "t", addr
    for addr in ("10.0.0.7:6379", "head.example:6379", "ray://192.0.2.2:10001"):
        env = ray_environment({"mode": "attach", "address": addr}, base)
        assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in env and env["RAY_AUTH_MODE"] == "token", addr
    assert base["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "1"  # the caller's dict is not changed
    opts = actor_options(0.5)
    assert opts["num_cpus"] == 0.5 and opts["max_restarts"] > 0 and opts["max_task_retries"] == -1


def test_two_node_campaign_trains_the_one_node_model(cluster, consortium, tmp_path):
    import ray

    ray.init(address=cluster.address, log_to_driver=False)
    try:
        assert _alive_nodes() == 2 and len({n["NodeID"] for n in ray.nodes()}) == 2
    finally:
        ray.shutdown()
    two = run_campaign(CampaignSpec(str(consortium.dir), str(tmp_path / "two"), rounds=2,
                                    ray_address=cluster.address))
    one = run_campaign(CampaignSpec(str(consortium.dir), str(tmp_path / "one"), rounds=2))  # embedded, 1 node
    assert two.status["status"] == one.status["status"] == "finished"
    assert two.ray["mode"] == "attach" and two.ray["auth"] == "token" and two.ray["gcs_address"] == cluster.address
    assert one.ray["mode"] == "embedded"
    assert all(r["accepted"] == sorted(HOSPITALS) for r in two.rounds)
    a, b = _model(consortium, tmp_path / "two"), _model(consortium, tmp_path / "one")
    assert a.size > 0 and a.tobytes() == b.tobytes()  # BFV sums are exact: the same bits on 1 and 2 nodes
    assert [r["pooled_test_accuracy"] for r in two.rounds] == [r["pooled_test_accuracy"] for r in one.rounds]


def test_a_driver_without_the_token_is_refused(cluster, tmp_path):
    code = f"import ray; ray.init(address={cluster.address!r}); print('CONNECTED')"
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    base["HOME"] = str(tmp_path)  # no ~/.ray/auth_token to fall back on
    cases = {"no auth mode": base, "wrong token": {**base, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64},
             "mode, no token": {**base, "RAY_AUTH_MODE": "token"},
             "right token": dict(os.environ)}
    procs = {name: subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True) for name, env in cases.items()}
    out = {name: (p.communicate(timeout=120), p.returncode) for name, p in procs.items()}
    for name in ("no auth mode", "wrong token", "mode, no token"):
        (stdout, stderr), rc = out[name]
        assert rc != 0 and "CONNECTED" not in stdout, name
        assert "token" in stderr.lower(), (name, stderr[-800:])
    (stdout, _), rc = out["right token"]
    assert rc == 0 and "CONNECTED" in stdout
    # and the GCS itself refuses an unauthenticated call (what sealfl records for an attach)
    assert probe_auth(cluster.address) == "token"
    assert probe_auth(cluster.address, token=os.environ["RAY_AUTH_TOKEN"]) == "none"


@pytest.mark.parametrize("scheme", ["bfv", "ckks"])
def test_sharded_sum_on_two_nodes_is_the_running_sum(cluster, scheme):
    """The aggregator's sum as Ray tasks on both nodes: the same bytes as the in-process
    running sum, and a partner whose last chunk is bad counts in no range."""
    import ray

    from sealfl.he.bfv import BFVCodec
    from sealfl.he.ckks import CKKSCodec
    from sealfl.he.decrypted import update_share
    from sealfl.server.aggregate import RunningSum
    from sealfl.server.sharded import sharded_sum

    cls = {"bfv": BFVCodec, "ckks": CKKSCodec}[scheme]
    secret = cls.generate()
    public = cls.from_bytes(secret.public_context_bytes(), secret.params, secret.context_id)
    length, ns = 6 * public.params.values_per_chunk(PACKED) - 7, [3, 5, 2]
    w = np.random.default_rng(11).normal(0, 0.5, (3, length))
    frames = {f"p{i}": secret.encrypt(update_share(w[i], ns[i], sum(ns), secret.WEIGHTING)) for i in range(3)}
    split = {p: public.split(f, length)[1] for p, f in frames.items()}

    def running(names):
        rs = RunningSum(public, length)
        for p in names:
            rs.add(public.load_chunks(split[p], length))
        return rs.frame()

    ray.init(address=cluster.address, log_to_driver=False)
    try:
        got, accepted, refused = sharded_sum(public, split, length, 3)
        assert got == running(list(frames)) and accepted == list(frames) and refused == {}
        split["p2"] = split["p2"][:-1] + [bytes(len(split["p2"][-1]))]
        got, accepted, refused = sharded_sum(public, split, length, 3)
        assert accepted == ["p0", "p1"] and list(refused) == ["p2"] and got == running(["p0", "p1"])
    finally:
        ray.shutdown()


def test_the_llm_release_variants_build_at_once_on_two_nodes_with_the_same_bytes(cluster):
    """The release pipeline's quantisation as Ray tasks: INT4 and INT8 are built on the
    two nodes at once, byte for byte what the in-process build gives -- the release files
    (and so its root digest) do not depend on the cluster."""
    import hashlib

    import onnx
    import ray

    from sealfl.platform.llm.build import VARIANTS, quantize_variants
    from sealfl.platform.llm.quantize import quantize_llm
    from tests.support.llm_tiny import tiny_fp32_onnx

    proto = onnx.load_from_string(tiny_fp32_onnx())
    adapted = ("q_proj", "v_proj", "qkv_proj")
    local, where = quantize_variants(proto, adapted)  # Ray not connected here: in-process
    assert where == {v: "local" for v in VARIANTS}
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        remote, nodes = quantize_variants(proto, adapted)
    finally:
        ray.shutdown()
    assert set(nodes.values()) == alive and len(alive) == 2  # one variant per node, at once
    for v in VARIANTS:
        direct = quantize_llm(proto, v, eight_bit=adapted)
        assert hashlib.sha256(remote[v]).digest() == hashlib.sha256(local[v]).digest() == hashlib.sha256(direct).digest()


def _release_files(d) -> dict:
    """A release directory's files with what randomised signatures change blanked: the
    release key and the sim TEE's attestation key sign with randomised ECDSA (FIPS 186-3, a
    fresh nonce per signature), so the signature values differ between two builds, and so
    do ``model.sig``'s digests of the files that hold them (and its subject, a digest over
    all). Everything else is kept, DSSE payloads decoded."""
    import base64
    from pathlib import Path

    signed = {"manifest.dsse.json", "attestation.json", "provenance.dsse.json"}

    def blank(v):
        if isinstance(v, dict):
            return {k: "<sig>" if k in ("sig", "signature") else blank(x) for k, x in v.items()}
        return [blank(x) for x in v] if isinstance(v, list) else v

    out = {}
    for f in sorted(Path(d).iterdir()):
        data = f.read_bytes()
        if f.name == "model.sig":
            doc = json.loads(data)
            statement = json.loads(base64.b64decode(doc["dsseEnvelope"]["payload"]))
            for r in statement["predicate"]["resources"]:
                if r["name"] in signed:
                    r["digest"] = "<digest of a file holding a signature>"
            for sub in statement["subject"]:
                sub["digest"] = "<digest over those>"
            doc["dsseEnvelope"]["payload"] = statement
            out[f.name] = blank(doc)
        elif f.name in signed:
            doc = json.loads(data)
            if "payload" in doc:
                doc["payload"] = json.loads(base64.b64decode(doc["payload"]))
            out[f.name] = blank(doc)
        else:
            out[f.name] = data
    return out


def _client_actors() -> dict:
    """Flower's ClientApp actors this cluster has run: actor id -> node id (dead ones too)."""
    from ray._private import state

    return {a["ActorID"]: a["Address"]["NodeID"] for a in state.actors().values()
            if a["ActorClassName"] == "ClientAppActor"}


def test_the_heart_release_is_the_same_built_in_process_on_one_node_and_on_two(cluster, consortium_codec, tmp_path):
    """The release pipeline as Ray tasks (issue 22, item 3): export and INT8 quantisation are
    tasks on the cluster given, the gate's evaluations run in the partners' ClientApp actors
    on it. On a 1-node and on the 2-node token cluster the release is the same -- root
    digest, model and every file, apart from the randomised ECDSA signature values -- and
    its model, canary and gate figures are those of the in-process build."""
    import shutil

    import ray

    from sealfl.clients.plugins import get_task
    from sealfl.enclave.release.enclave import ReleaseEnclave
    from sealfl.enclave.release.keyholder import KeyHolder
    from sealfl.platform.campaign_outcome import finished_checkpoint
    from sealfl.platform.release import enclave_dir, open_final_model, release
    from sealfl.platform.tabular_build import build_tabular_candidates

    consortium, codec = consortium_codec
    camp = tmp_path / "camp"
    _fabricated_campaign(consortium, codec, camp)

    def build(label, address):
        cons_dir = tmp_path / f"cons-{label}"  # its own copy: each build may issue version 1
        shutil.copytree(consortium.dir, cons_dir)
        return release(cons_dir, camp, tmp_path / f"rel-{label}", version=1, ray_address=address)

    results = {}
    with token_cluster(nodes=1, cpus_per_node=2) as one:
        results["one"] = build("one", one.address)
        ray.init(address=one.address, log_to_driver=False)
        try:
            one_node = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        finally:
            ray.shutdown()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        alive, before = {n["NodeID"] for n in ray.nodes() if n["Alive"]}, _client_actors()
    finally:
        ray.shutdown()
    results["two"] = build("two", cluster.address)
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        gate = {a: node for a, node in _client_actors().items() if a not in before}
    finally:
        ray.shutdown()

    assert set(results["one"].nodes) == {"export", "quantize"} and set(results["one"].nodes.values()) == one_node
    assert set(results["two"].nodes.values()) <= alive and len(alive) == 2
    assert gate and set(gate.values()) == alive  # the partners' gate evaluations ran on both nodes
    assert results["one"].summary["root_digest"] == results["two"].summary["root_digest"]
    files = {k: _release_files(tmp_path / f"rel-{k}") for k in results}
    assert set(files["one"]) >= {"model.int8.onnx", "manifest.json", "model.sig", "provenance.dsse.json"}
    assert files["two"].keys() == files["one"].keys()
    assert [n for n in files["two"] if files["two"][n] != files["one"][n]] == []
    sigs = {k: json.loads((tmp_path / f"rel-{k}" / "manifest.dsse.json").read_bytes())["signatures"][0]["sig"]
            for k in results}
    assert sigs["one"] != sigs["two"]  # the signatures are randomised: blanking them is what makes files equal
    assert results["one"].accuracy["int8"]["pooled"] == results["two"].accuracy["int8"]["pooled"]
    # in-process (no Ray): the same model and canary
    keys = KeyHolder(ReleaseEnclave.open(enclave_dir(consortium)), consortium.he_params,
                     bytes.fromhex(consortium.context_id))
    params, mean, std = open_final_model(keys, finished_checkpoint(camp), get_task("heart"), camp)
    local = build_tabular_candidates("heart", params, mean, std)
    assert local.nodes == {"export": "local", "quantize": "local"}
    assert local.int8 == (tmp_path / "rel-two" / "model.int8.onnx").read_bytes() and len(local.int8) > 1000
    assert local.canary == json.loads((tmp_path / "rel-one" / "manifest.json").read_bytes())["metadata"]["canary"]


def test_killing_a_worker_node_mid_campaign_loses_no_round(cluster, consortium, tmp_path):
    """After round 1 the worker node (raylet, its object store and the partner actors on it)
    is killed without warning; a replacement node joins (as an autoscaler would add one);
    Ray restarts the lost actors there and retries their calls: every round finishes with
    every partner, and the model is the one of an undisturbed campaign."""
    import ray

    worker = next(iter(cluster.worker_nodes))
    killed = []

    def on_round(rec):
        if rec["round"] == 1 and not killed:
            cluster.remove_node(worker, allow_graceful=False)
            killed.append(worker)
            cluster.add_node(num_cpus=2)

    res = run_campaign(CampaignSpec(str(consortium.dir), str(tmp_path / "camp"), rounds=3,
                                    ray_address=cluster.address), on_round=on_round)
    assert killed == [worker]
    assert "will be retried" in (tmp_path / "camp" / "worker.log").read_text()  # Ray retried the lost calls
    assert res.status["status"] == "finished"
    assert [r["round"] for r in res.rounds] == [1, 2, 3]
    assert all(r["accepted"] == sorted(HOSPITALS) and not r["rejected"] for r in res.rounds)
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        dead = [n for n in ray.nodes() if not n["Alive"]]
        assert len(dead) == 1 and _alive_nodes() == 2  # the kill was real; the replacement is up
    finally:
        ray.shutdown()
    run_campaign(CampaignSpec(str(consortium.dir), str(tmp_path / "ref"), rounds=3))  # undisturbed, 1 node
    assert _model(consortium, tmp_path / "camp").tobytes() == _model(consortium, tmp_path / "ref").tobytes()
