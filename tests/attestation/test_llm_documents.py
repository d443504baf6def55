"""Signed LLM documents a device reads: the canary and generation_config.json. Every field
with every wrong JSON type is refused with the package's own error (never a raw
TypeError/KeyError), and the canary decision refuses answers that do not agree."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sealfl.attestation.errors import CanaryError
from sealfl.attestation.llm_canary import LLM_CANARY_SCHEMA, check_llm_canary, parse_llm_canary
from sealfl.enclave.device.llm_boot import parse_generation_config
from sealfl.enclave.errors import BootError


def _canary():
    return {"schema": LLM_CANARY_SCHEMA, "sequences": [[1, 5, 7, 9], [2, 3]], "prefill": [2, 1],
            "expected_top1": [[5, 7, 9, 4], [3, 8]], "expected_max_logit": [[1.0, 2.0, 3.0, 4.0], [0.5, 0.25]],
            "vocab": 10, "min_agreement": 0.75, "max_mean_abs_diff": 1.0, "reference": "test"}


def _gen():
    return {"bos_token_id": 1, "eos_token_ids": [2], "pad_token_id": 2, "head_dim": 64, "max_context": 2048,
            "special_tokens": {"bos_token": "<s>"}}


WRONG = st.one_of(st.none(), st.booleans(), st.text(max_size=5), st.floats(allow_nan=True),
                  st.integers(min_value=-10**12, max_value=10**12), st.lists(st.integers(), max_size=3),
                  st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))


@settings(max_examples=200, deadline=None)
@given(key=st.sampled_from(sorted(_canary())), value=WRONG)
def test_kind_every_canary_field_with_a_wrong_value_is_refused(key, value):
    doc = _canary()
    num = isinstance(value, (int, float)) and not isinstance(value, bool)
    still_valid = {"reference": isinstance(value, str) and bool(value),
                   "min_agreement": num and 0 < value <= 1,
                   "max_mean_abs_diff": num and 0 < value <= 1000,
                   "vocab": isinstance(value, int) and not isinstance(value, bool) and 10 <= value <= 10**7}
    if doc[key] == value or still_valid.get(key, False):
        return  # not a wrong value
    doc[key] = value
    with pytest.raises(CanaryError):
        parse_llm_canary(doc)


@settings(max_examples=200, deadline=None)
@given(key=st.sampled_from(sorted(_gen())), value=WRONG)
def test_kind_every_generation_config_field_with_a_wrong_value_is_refused(key, value):
    doc = _gen()
    ok = {"bos_token_id": lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 10**7,
          "pad_token_id": lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 10**7,
          "head_dim": lambda v: isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 4096,
          "max_context": lambda v: isinstance(v, int) and not isinstance(v, bool) and 16 <= v <= 131072,
          "eos_token_ids": lambda v: isinstance(v, list) and 1 <= len(v) <= 16 and all(
              isinstance(e, int) and not isinstance(e, bool) and 0 <= e <= 10**7 for e in v),
          "special_tokens": lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in v.values())}[key]
    if ok(value):
        return
    doc[key] = value
    with pytest.raises(BootError) as err:
        parse_generation_config(json.dumps(doc).encode())
    assert err.value.reason == "model" and (key in str(err.value) or "not valid JSON" in str(err.value))


@pytest.mark.parametrize("data", [b"", b"[1]", b'{"bos_token_id": 1,', b'{"a": 1, "a": 2}', b"\xff\xfe"])
def test_kind_generation_config_that_is_not_a_json_object_is_refused(data):
    with pytest.raises(BootError):
        parse_generation_config(data)


def test_kind_canary_decision_counts_agreement_and_logit_distance():
    c = parse_llm_canary(_canary())

    def answers(top1_shift=0, logit_shift=0.0):
        out = []
        for t, m in zip(c.expected_top1, c.expected_max_logit):
            ids = np.array([[(x + top1_shift) % c.vocab] for x in t])
            out.append((ids, np.array([[v + logit_shift] for v in m])))
        return out

    assert check_llm_canary(c, answers())["agreement"] == 1.0
    assert check_llm_canary(c, answers(logit_shift=0.9))["mean_abs_diff"] == pytest.approx(0.9)
    with pytest.raises(CanaryError, match="agree"):
        check_llm_canary(c, answers(top1_shift=1))
    with pytest.raises(CanaryError, match="differ"):
        check_llm_canary(c, answers(logit_shift=1.5))
    bad = answers()
    bad[0] = (bad[0][0], np.full_like(bad[0][1], np.nan))
    with pytest.raises(CanaryError, match="finite"):
        check_llm_canary(c, bad)
    with pytest.raises(CanaryError, match="shape"):
        check_llm_canary(c, [(np.zeros((2, 1)), np.zeros((2, 1)))] * 2)
