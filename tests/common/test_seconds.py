"""is_seconds: the one check for durations (sandbox timeouts, reply timeouts, pull intervals)."""

import numpy as np
import pytest

from sealfl.common.seconds import MAX_SECONDS, is_seconds


@pytest.mark.parametrize("t", [1, 0.5, 1e6, np.int64(3), np.float32(0.25), np.float64(2.0)])
def test_numbers_of_seconds_are_accepted(t):
    assert is_seconds(t)


@pytest.mark.parametrize("t", [0, 0.0, -1, 1e6 + 1, float("nan"), float("inf"), -float("inf"), True, False,
                               "5", None, [1], 10**400, complex(1, 0)])
def test_kind_anything_else_is_refused(t):
    assert not is_seconds(t)


def test_zero_only_when_asked_and_the_cap_is_a_parameter():
    assert is_seconds(0, zero_ok=True) and is_seconds(0.0, zero_ok=True) and not is_seconds(-0.1, zero_ok=True)
    assert not is_seconds(10, hi=5) and is_seconds(5, hi=5)
    assert MAX_SECONDS == 1e6  # ~11.6 days: the sandbox's and the campaign's documented cap
