"""The LLM child's thread policy: the cores really free, split over the slots, overridable;
and the thread count does not change what the model computes."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from sealfl.enclave.sandbox import threads
from sealfl.enclave.sandbox.decode import KVDecoder
from tests.support.llm_tiny import HEAD_DIM, TEXTS, encode, tiny_release_files


@pytest.mark.parametrize("usable, busy, slots, want", [
    (2, 0.1, 1, 2),   # a quiet 2-core box: both cores
    (2, 1.0, 1, 1),   # one core taken by other work
    (2, 2.0, 1, 1),   # both busy: one thread (never 0)
    (8, 0.4, 2, 4),   # split over the slots
    (8, 5.0, 2, 1),   # 3 cores free for 2 slots
    (4, 0.0, 8, 1),   # more slots than cores
    (2, None, 1, 2),  # no /proc/stat: cores / slots
])
def test_kind_threads_are_the_free_cores_split_over_the_slots(monkeypatch, usable, busy, slots, want):
    monkeypatch.delenv(threads.THREADS_ENV, raising=False)
    monkeypatch.setattr(threads, "busy_cpus", lambda *a, **k: busy)
    assert threads.choose_threads(slots, usable=usable) == want


def test_kind_an_explicit_count_or_the_environment_overrides_the_policy(monkeypatch):
    monkeypatch.setenv(threads.THREADS_ENV, "3")
    assert threads.choose_threads(1, usable=2, busy=2.0) == 3
    assert threads.choose_threads(1, 5, usable=2, busy=2.0) == 5
    monkeypatch.setenv(threads.THREADS_ENV, "zero")  # not a positive integer: ignored
    assert threads.choose_threads(1, usable=2, busy=2.0) == 1


def test_kind_usable_cpus_honours_a_cgroup_quota(tmp_path):
    f = tmp_path / "cpu.max"
    n = len(threads._affinity())
    f.write_text("150000 100000\n")
    assert threads.usable_cpus(str(f)) == min(n, 2)
    f.write_text("max 100000\n")
    assert threads.usable_cpus(str(f)) == n
    assert threads.usable_cpus(str(tmp_path / "absent")) == n


def test_kind_busy_cpus_reads_per_cpu_counters(tmp_path):
    b = threads.busy_cpus(0.05)
    assert b is None or 0.0 <= b <= len(threads._affinity()) + 1e-9
    assert threads.busy_cpus(0.0, str(tmp_path / "absent")) is None


def test_kind_thread_count_does_not_change_the_logits():
    """The INT4 release graph of the tests' tiny model, 1 and 2 threads: every step's
    logits bit for bit (onnxruntime splits rows and columns over threads, never a sum)."""
    payload, metadata = tiny_release_files()
    model = payload[metadata["variants"]["int4"]["file"]]
    rows = []
    for n in (1, 2):
        o = ort.SessionOptions()
        o.intra_op_num_threads = n
        o.add_session_config_entry("session.intra_op.allow_spinning", "0")
        dec = KVDecoder(ort.InferenceSession(model, o, providers=["CPUExecutionProvider"]), max_context=128,
                        head_dim=HEAD_DIM)
        ids = encode(" ".join(TEXTS))[:40]
        out = [dec.feed(ids, last_only=True)[-1]]
        for _ in range(16):
            out.append(dec.feed([int(np.argmax(out[-1]))], last_only=True)[-1])
        rows.append(np.stack(out))
    assert np.array_equal(rows[0], rows[1])
