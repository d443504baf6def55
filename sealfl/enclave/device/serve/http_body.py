"""Reading a request body with a size cap, for both HTTP APIs of ``device serve``."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["read_body"]


async def read_body(request, cap: int, too_large: Callable[[str], Exception]) -> bytes:
    """The body of ``request`` (a Starlette request), refused as soon as it is longer than
    ``cap`` bytes -- by its declared ``Content-Length`` before anything is read, else while
    streaming -- by raising ``too_large(message)``."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > cap):
        raise too_large(f"the request body is {declared[:20]} bytes; at most {cap} are accepted")
    parts, got = [], 0
    async for chunk in request.stream():
        got += len(chunk)
        if got > cap:
            raise too_large(f"the request body is larger than {cap} bytes; at most {cap} are accepted")
        parts.append(chunk)
    return b"".join(parts)
