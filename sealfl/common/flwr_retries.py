"""Flower's retries of message objects, shortened where sealfl runs Flower's own code.

A Flower message travels as metadata plus content objects pushed after it. Whoever pulls
the message (a SuperNode from the SuperLink, a ClientApp from its SuperNode, the ServerApp
from the SuperLink) sees it as soon as its metadata is stored and then pulls the objects;
an object not stored yet is retried after 1 s, 2 s, 4 s ... up to 10 s (flwr 1.42
``flwr/supercore/constant.py``: ``PULL_INITIAL_BACKOFF = 1``, ``PULL_BACKOFF_CAP = 10``;
``flwr/supercore/inflatable/inflatable_utils.py``: ``pull_objects``). On loopback the
objects follow within milliseconds, so a message that raced its objects waited a whole
second: most of a deployed heart round. :func:`shorten_object_retries` makes the retries of
one Flower module start at :data:`OBJECT_RETRY_S` and double up to :data:`OBJECT_RETRY_CAP_S`
(the number of tries and the total time Flower allows are unchanged).
"""

from __future__ import annotations

import functools
from types import ModuleType

__all__ = ["OBJECT_RETRY_S", "OBJECT_RETRY_CAP_S", "shorten_object_retries"]

#: seconds before the first retry of an object that is not stored yet, and the doubling cap
OBJECT_RETRY_S, OBJECT_RETRY_CAP_S = 0.005, 0.2


def shorten_object_retries(module: ModuleType) -> None:
    """Make ``module``'s calls of Flower's ``pull_objects`` (a module global there, e.g.
    ``flwr.supernode.start_client_internal``, ``flwr.superlink.grid.http_grid``) retry after
    :data:`OBJECT_RETRY_S` .. :data:`OBJECT_RETRY_CAP_S` seconds. Idempotent.

    Raises:
        AttributeError: ``module`` has no ``pull_objects`` (Flower changed).
    """
    from flwr.supercore.inflatable.inflatable_utils import pull_objects

    current = getattr(module, "pull_objects")
    if getattr(current, "func", None) is pull_objects:
        return
    if current is not pull_objects:
        raise AttributeError(f"{module.__name__}.pull_objects is not Flower's pull_objects (flwr changed)")
    module.pull_objects = functools.partial(pull_objects, initial_backoff=OBJECT_RETRY_S,
                                            backoff_cap=OBJECT_RETRY_CAP_S)
