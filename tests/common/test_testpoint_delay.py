"""SEALFL_PAUSE_FOR turns a test pause point into a delay: every arrival waits, then goes on."""

import json
import threading

import pytest

from sealfl.common import testpoints as tp


def test_a_delay_pause_returns_for_every_arrival_and_publishes_the_event(tmp_path, monkeypatch):
    monkeypatch.setenv(tp.ENV_STAGE, "train@2")
    monkeypatch.setenv(tp.ENV_DIR, str(tmp_path))
    monkeypatch.setenv(tp.ENV_FOR, "0.05")
    assert tp.check_environment() == ("train", 2)
    tp.testpoint("train", 1)  # another round: not even an event
    assert not (tmp_path / "train.reached").exists()
    done = []
    threads = [threading.Thread(target=lambda: (tp.testpoint("train", 2), done.append(1))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert done == [1, 1]  # both arrivals waited and went on (without the delay they would block forever)
    assert json.loads((tmp_path / "train.reached").read_text())["round"] == 2


@pytest.mark.parametrize("bad", ["0", "-1", "soon", "1e9"])
def test_a_delay_that_is_not_seconds_is_refused(tmp_path, monkeypatch, bad):
    monkeypatch.setenv(tp.ENV_STAGE, "train")
    monkeypatch.setenv(tp.ENV_DIR, str(tmp_path))
    monkeypatch.setenv(tp.ENV_FOR, bad)
    with pytest.raises(tp.TestpointError, match=tp.ENV_FOR):
        tp.check_environment()
