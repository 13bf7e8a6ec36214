"""The failures a caller can act on, as types. Plain Python: no torch, no grpc.

The engine, kvtransfer and the services raise these; each edge maps them once,
by type, never by the words of a message: gRPC status codes in `mesh.errors`,
HTTP statuses in the router's HTTP front. Every message names what was wrong
and the limit or the value expected; `param` names the request field at fault,
when one is (the OpenAI error body carries it).

    ServingError
    ├── RequestError        the request itself is invalid (a field, a token id, its length)
    ├── Overloaded          no room for it now (the router sheds it; try later)
    │   └── KVCacheFull     no room in this instance's KV cache for it now
    ├── NoReservation       it names a KV reservation this instance does not hold
    ├── UnknownModel        it names a model this mesh does not serve
    ├── Unsupported         this instance cannot do what it asks (another model, a transport it lacks)
    ├── Cancelled           it was cancelled while it ran
    ├── DeadlineExceeded    it ran out of time
    ├── Unauthenticated     it lacks valid credentials
    └── Unavailable         this instance cannot serve it now; another instance may
        ├── Draining        the instance is draining or stopped and takes no new work
        └── PeerFailed      a rank, an expert instance or another peer the work needs failed
"""

from __future__ import annotations


class ServingError(Exception):
    """A failure the caller can act on; subclasses say which."""

    def __init__(self, message: str = "", *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param  # the request field at fault, if one is


class RequestError(ServingError, ValueError):
    """A request the engine refuses; the message names the field and the limit."""


class Overloaded(ServingError):
    """There is no room for the request now: every instance that could serve it is full or busy."""


class KVCacheFull(Overloaded):
    """The KV cache has no room for the request now."""


class NoReservation(ServingError, LookupError):
    """The request names a KV reservation this instance does not hold (never made, expired or ended)."""


class UnknownModel(ServingError, LookupError):
    """The request names a model this mesh does not serve."""


class Unsupported(ServingError):
    """The request asks for something this instance cannot do (another model, a transport it lacks)."""


class Cancelled(ServingError):
    """The request was cancelled while it ran."""


class DeadlineExceeded(ServingError):
    """The work did not finish (or make progress) within its time."""


class Unauthenticated(ServingError):
    """The request lacks valid credentials."""


class Unavailable(ServingError):
    """This instance cannot serve the request now; another instance may."""


class Draining(Unavailable):
    """The instance is draining or has stopped: it finishes what it holds and takes nothing new."""


class PeerFailed(Unavailable):
    """A rank of the instance, an expert instance or another peer the work needs failed."""
