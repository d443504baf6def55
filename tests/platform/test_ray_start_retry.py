"""Ray's fixed 30 s raylet registration deadline (ray/_private/node.py) is missed on a busy
host; the embedded Ray is started again, the failed attempt's processes killed by pid."""

import os

import pytest

from sealfl.platform.errors import SimulationError
from sealfl.platform.simulate import init_local_ray, is_ray_start_timeout

# the exact text Ray 2.55 raises (ray/_private/node.py, Node.__init__)
RAY_TEXT = ("The current node timed out during startup. This could happen because some of the raylet "
            "failed to startup or the GCS has become overloaded.")


class FakeRun:
    """A run whose members grow by two pids at every init attempt."""

    def __init__(self, failures: int, error: Exception | None = None):
        self.failures, self.error = failures, error
        self.pids = [os.getpid()]
        self.calls = self.shutdowns = 0
        self.killed: list[list[int]] = []

    def init(self):
        self.calls += 1
        self.pids += [10_000 + 2 * self.calls, 10_001 + 2 * self.calls]
        if self.calls <= self.failures:
            raise self.error or Exception(RAY_TEXT)

    def shutdown(self):
        self.shutdowns += 1

    def go(self):
        init_local_ray(self.init, self.shutdown, members=lambda: list(self.pids), kill=self.killed.append)


def test_a_missed_start_up_deadline_is_retried_and_the_failed_attempts_processes_are_killed():
    run = FakeRun(failures=2)
    run.go()
    assert run.calls == 3 and run.shutdowns == 2
    assert run.killed == [[10_002, 10_003], [10_004, 10_005]]  # only what each failed attempt started


def test_a_host_too_busy_three_times_is_a_clear_error():
    run = FakeRun(failures=5)
    with pytest.raises(SimulationError, match="did not register within its fixed 30 s in 3 attempts"):
        run.go()
    assert run.calls == 3 and len(run.killed) == 3


@pytest.mark.parametrize("error", [ValueError(RAY_TEXT), Exception("address already in use"),
                                   RuntimeError("token mismatch")])
def test_other_start_up_errors_are_not_retried(error):
    run = FakeRun(failures=1, error=error)
    with pytest.raises(type(error)):
        run.go()
    assert run.calls == 1 and run.killed == []


def test_only_rays_own_timeout_text_counts():
    assert is_ray_start_timeout(Exception(RAY_TEXT))
    assert not is_ray_start_timeout(Exception("The current node failed"))
    assert not is_ray_start_timeout(TimeoutError(RAY_TEXT))


def test_the_installed_ray_still_raises_the_text_we_retry_on():
    import inspect

    import ray._private.node as node

    src = inspect.getsource(node)
    assert "raylet_start_wait_time_s = 30" in src and RAY_TEXT.split(". ")[0] in src
