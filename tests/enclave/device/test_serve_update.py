"""``device serve --repo URL --poll S``: a newer release published to a real repository is
verified and switched to while two streaming clients keep asking; nothing fails, each
client sees the old release and then only the new one, and /health, /metrics and
``device status`` name the new version."""

from __future__ import annotations

import threading

import httpx
import pytest

from sealfl.enclave.device.status import device_status
from sealfl.platform.repo.server import RepoServer
from tests.enclave.device.test_serve import DEADLINE_S, MESSAGES, Server, _wait
from tests.support.llm_tiny import write_tiny_release
from tests.support.tufrepo import make_repo, provision_trust, publish_verified


@pytest.mark.slow
def test_serve_switches_to_a_newer_release_while_serving_with_no_failed_request(tmp_path):
    root = tmp_path / "llm"
    enclave, payload, metadata = write_tiny_release(root)
    repo = make_repo(tmp_path)
    provision_trust(root / "trust", repo)
    publish_verified(repo, root / "trust", root / "release")
    with RepoServer(repo.www) as mirror:
        (tmp_path / "a").mkdir()
        s = Server(root, tmp_path / "a", args=("--repo", mirror.url, "--poll", "0.5", "--max-concurrent", "2"))
        try:
            assert s.wait_ready()["release"]["version"] == 1
            stop = threading.Event()
            seen: list[list[str]] = [[], []]
            errors: list[str] = []

            def client(i: int) -> None:
                while not stop.is_set():
                    try:
                        fps, text = set(), ""
                        for chunk in s.client.chat.completions.create(model="tiny-llm", messages=MESSAGES,
                                                                      max_tokens=24, seed=i, stream=True):
                            fps.add(chunk.system_fingerprint)
                            if chunk.choices and chunk.choices[0].delta.content:
                                text += chunk.choices[0].delta.content
                        assert len(fps) == 1 and text, (fps, text)  # one model per answer
                        seen[i].append(fps.pop())
                    except Exception as exc:  # noqa: BLE001 -- every failure is counted
                        errors.append(repr(exc))

            threads = [threading.Thread(target=client, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            _wait(lambda: all(seen), "answers from v1")
            enclave.write_release(root / "release-v2", payload, "tiny-llm", 2, metadata)
            publish_verified(repo, root / "trust", root / "release-v2")
            _wait(lambda: s.health().json()["release"]["version"] == 2, "the switch to v2")
            n_after = [len(x) for x in seen]
            _wait(lambda: all(len(x) > n + 1 for x, n in zip(seen, n_after)), "answers after the switch")
            stop.set()
            for t in threads:
                t.join(timeout=DEADLINE_S)
            assert errors == []
            for answers in seen:
                assert answers[0].startswith("v1-") and answers[-1].startswith("v2-"), answers
                first_v2 = next(i for i, fp in enumerate(answers) if fp.startswith("v2-"))
                assert all(fp.startswith("v1-") for fp in answers[:first_v2])
                assert all(fp.startswith("v2-") for fp in answers[first_v2:])  # never back
            assert s.metric("sealfl_llm_release_info", {"version": "2"}) == 1
            with pytest.raises(KeyError):
                s.metric("sealfl_llm_release_info", {"version": "1"})
            assert s.metric("sealfl_llm_release_switches_total") == 1
            assert s.metric("sealfl_llm_update_checks_total", {"result": "installed"}) == 1
            checks = {r: s.metric("sealfl_llm_update_checks_total", {"result": r}) for r in
                      ("installed", "current", "kept", "refused")}
            assert checks["refused"] == 0 and checks["kept"] == 0, (checks, s.log.read_text())
            assert s.metric("sealfl_llm_requests_rejected_total", {"reason": "busy"}) == 0
            st = device_status(tmp_path / "a" / "state")
            assert st["release"]["version"] == 2 and st["release"]["source"]["kind"] == "repository"
            r = httpx.get(s.url + "/v1/models", timeout=DEADLINE_S)
            assert r.status_code == 200
        finally:
            code, log, _ = s.stop()
        assert code == 143, log
        assert "switched to tiny-llm v2" in log
