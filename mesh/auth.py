"""Bearer tokens: `authorization: Bearer <token>` on a gRPC call's metadata or an HTTP request's headers.

Two tokens, each off when empty: the API token (`INFERMESH_API_TOKEN`) guards the router's public API;
the admin token (`INFERMESH_ADMIN_TOKEN`) guards what changes the mesh (`Admin.Drain` on every instance,
`Supervisor.Scale`). `require` compares in constant time and never puts a token in a message or a log;
`credentials` is what a client adds to its calls.
"""

from __future__ import annotations

import hmac

from engine.errors import Unauthenticated

ADMIN_TOKEN_ENV = "INFERMESH_ADMIN_TOKEN"


def bearer(metadata) -> str | None:
    """The `authorization` value among (key, value) pairs (gRPC's invocation metadata, HTTP headers)."""
    return next((value for key, value in metadata or () if key.lower() == "authorization"), None)


def require(expected: str, authorization: str | None, what: str) -> None:
    """Raises `Unauthenticated` unless no token is set or `authorization` carries it."""
    if not expected:
        return
    given = (authorization or "").removeprefix("Bearer ").strip()
    if not hmac.compare_digest(given.encode(), expected.encode()):
        raise Unauthenticated(f"{what} needs a valid token: 'authorization: Bearer <token>'")


def credentials(token: str) -> tuple[tuple[str, str], ...]:
    """The metadata of a call that carries `token` (none when it is empty)."""
    return (("authorization", f"Bearer {token}"),) if token else ()
