# The compiled recognisers' signatures (lchat/proxy/_oneread_c.pyx), for mypy.
from typing import Any

from lchat.proxy.oneread import WholeRequest as _WholeRequest

API: int
WholeRequest: Any

def configure(
    whole_request: Any,
    request_names: tuple[bytes, ...],
    response_names: tuple[bytes, ...],
    prefixes: tuple[bytes, ...],
) -> None: ...
def request(
    data: bytes, max_bytes: int, max_headers: int, previous: _WholeRequest | None = None
) -> _WholeRequest | None: ...
def response(data: bytes) -> tuple[int, int, bytes] | None: ...
