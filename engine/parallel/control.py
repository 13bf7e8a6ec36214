"""The control plane inside an instance: typed keys, frozen messages, one codec, one store client.

The ranks of an instance meet in a TCPStore that rank 0 hosts (`engine.parallel.launcher`), and
instances that pair up (KV transfer pairs, expert attachments) meet in a store one of them hosts. Every
value put there is a frozen dataclass ("message") under a `Key` that names its family and its type; the
codec writes it as JSON in an envelope `{"v": VERSION, "type": class name, "body": fields}` and reads it
back by the key's declared type, so a reader gets the type it asked for or a `ControlError` naming the
key and what was there. Nothing is pickled: a store is a TCP port, and what crosses it is data.

Functions that a rank runs (what a follower rank does, the hooks it adds) cross as a `Call`: the
function's module and name (inside this project's packages only) and keyword arguments, which are
decoded by the function's own annotations.

`Store` wraps one connection to a store (a connection runs one operation at a time: a thread that
blocks on it, e.g. forming a group, takes a connection of its own via `Store.connect`).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import importlib
import json
import threading
import time
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Generic, Iterator, TypeVar

import torch.distributed as dist

from engine.parallel.groups import hosted_store, stateless_group

VERSION = 1  # of the envelope and every message; a reader refuses another
PACKAGES = ("engine", "kvtransfer", "prefill_svc", "decode_svc", "expert_svc")  # where a Call may point
DEFAULT_TIMEOUT = datetime.timedelta(seconds=60)

M = TypeVar("M")


class ControlError(RuntimeError):
    """A control message that cannot be read as its key's type: the message names the key and why."""


# ---- the codec: frozen dataclasses <-> JSON, guided by type annotations


def to_data(value: Any) -> Any:
    """A message (or any value inside one) as JSON-ready data."""
    kind = type(value)
    if kind in _PLAIN or value is None:
        return value
    if kind is Call:
        return {"function": value.function, "kwargs": {k: to_data(v) for k, v in value.kwargs.items()}}
    if dataclasses.is_dataclass(value):
        return {name: to_data(getattr(value, name)) for name in _field_names(kind)}
    if kind in (tuple, list):
        return [v if type(v) in _PLAIN else to_data(v) for v in value]
    if kind is dict:
        return {str(k): to_data(v) for k, v in value.items()}
    raise TypeError(f"{kind.__name__} cannot be a control message field (only dataclasses, tuples, dicts, "
                    f"str, int, float, bool, None)")


_PLAIN = frozenset((bool, int, float, str))


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def from_data(data: Any, kind: Any) -> Any:
    """`data` (from `to_data`) as a value of the annotated type `kind`."""
    return _decoder(kind)(data)


@functools.cache
def _decoder(kind: Any) -> Callable[[Any], Any]:
    """A function from data to `kind`, built once per type."""
    if kind is Any or kind is object:
        return lambda data: data
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:  # `X | None`
            decode_inner = _decoder(inner[0])
        elif all(a in _PLAIN for a in inner):  # `str | int | bool`
            decode_inner = functools.partial(_checked, kind=tuple(inner))
        else:
            raise TypeError(f"{kind}: a union of several dataclasses or containers cannot be decoded")
        return lambda data: None if data is None else decode_inner(data)
    if kind is Call:
        return lambda data: Call(data["function"], data["kwargs"])  # kwargs are decoded when it is resolved
    if dataclasses.is_dataclass(kind):
        hints = typing.get_type_hints(kind)
        fields = tuple((f.name, _decoder(hints[f.name])) for f in dataclasses.fields(kind))
        return lambda data: kind(**{name: decode_field(data[name]) for name, decode_field in fields})
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        if args[0] in (int, str):  # block tables, addresses: checked in one pass
            return lambda data: _checked_items(tuple(data), args[0])
        decode_item = _decoder(args[0])
        return lambda data: tuple(map(decode_item, data))
    if origin is tuple:
        decoders = tuple(map(_decoder, args))
        return lambda data: tuple(d(v) for d, v in zip(decoders, data, strict=True))
    if origin is dict:
        decode_value = _decoder(args[1])
        return lambda data: {k: decode_value(v) for k, v in data.items()}
    if kind is float:
        return lambda data: float(_checked(data, (int, float)))
    return lambda data: _checked(data, kind)


def _checked(value: Any, kind: type | tuple[type, ...]) -> Any:
    if not isinstance(value, kind):
        raise TypeError(f"expected {getattr(kind, '__name__', kind)}, got {value!r}")
    return value


def _checked_items(values: tuple, kind: type) -> tuple:
    if not all(isinstance(v, kind) for v in values):
        raise TypeError(f"expected {kind.__name__} items, got {values!r}")
    return values


def encode(message: Any) -> bytes:
    if not dataclasses.is_dataclass(message):
        raise TypeError(f"a control message is a dataclass, got {type(message).__name__}")
    return json.dumps({"v": VERSION, "type": type(message).__name__, "body": to_data(message)},
                      separators=(",", ":")).encode()


def decode(payload: bytes, kind: type[M], where: str = "message") -> M:
    """The message of type `kind` in `payload`; `ControlError` naming `where` if it is not one."""
    try:
        envelope = json.loads(payload)
        if envelope.get("v") != VERSION or envelope.get("type") != kind.__name__:
            raise TypeError(f"expected {kind.__name__} v{VERSION}, got {envelope.get('type')} v{envelope.get('v')}")
        return from_data(envelope["body"], kind)
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise ControlError(f"{where}: not a {kind.__name__} message: {e}") from None


# ---- functions that cross to another process


@dataclass(frozen=True, slots=True)
class Call:
    """A function of this project's packages and its keyword arguments, as data. `resolve()` imports it and
    decodes the arguments by its annotations: a partial ready for the positional arguments its caller adds."""

    function: str  # "package.module:name"
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, function: Callable, **kwargs: Any) -> "Call":
        call = cls(f"{function.__module__}:{function.__qualname__}", kwargs)
        call._target()  # fails here, in the caller, for a function another process could not find
        return call

    def resolve(self) -> Callable:
        target = self._target()
        hints = typing.get_type_hints(target)
        try:
            kwargs = {k: from_data(to_data(v), hints.get(k, Any)) for k, v in self.kwargs.items()}
        except (TypeError, KeyError, ValueError) as e:
            raise ControlError(f"arguments of {self.function}: {e}") from None
        return functools.partial(target, **kwargs)

    def _target(self) -> Callable:
        module, _, name = self.function.partition(":")
        if module.split(".")[0] not in PACKAGES or not name or "<" in name:
            raise ControlError(f"a Call names a module-level function of {', '.join(PACKAGES)}, got {self.function!r}")
        target = importlib.import_module(module)
        for part in name.split("."):
            target = getattr(target, part)
        return target


# ---- keys


@dataclass(frozen=True, slots=True)
class Key(Generic[M]):
    name: str
    message: type[M]


@dataclass(frozen=True, slots=True)
class Family(Generic[M]):
    """Keys `name/part/...` that all hold one message type."""

    name: str
    message: type[M]

    def key(self, *parts: object) -> Key[M]:
        return Key("/".join([self.name, *map(str, parts)]), self.message)


# ---- messages of the engine's ranks


@dataclass(frozen=True, slots=True)
class Ready:
    """A follower rank has loaded what it needs and is about to form the instance's groups."""

    rank: int


@dataclass(frozen=True, slots=True)
class RankError:
    """Why a rank failed: its traceback."""

    rank: int
    traceback: str


@dataclass(frozen=True, slots=True)
class Claim:
    """An instance asks the host of a store to form group `<family>-<k>` with its `ranks` ranks first."""

    ranks: int


@dataclass(frozen=True, slots=True)
class ExpertLoad:
    """Tokens an expert rank's experts computed: [MoE layer][local expert]."""

    tokens: tuple[tuple[int, ...], ...]


FOLLOWER = Key("follower", Call)  # what ranks 1.. run: `call(rank, store, host=...)` (engine.parallel.launcher)
READY = Family("ready", Ready)
RANK_ERROR = Family("error", RankError)
EXPERT_LOAD = Family("load", ExpertLoad)


# ---- the store client


class Store:
    """One connection to a TCPStore, in typed keys and messages. `raw` is the torch store (groups form on it)."""

    def __init__(self, raw: dist.Store, address: str) -> None:
        self.raw, self.address = raw, address

    @classmethod
    def host(cls, host: str, port: int = 0, timeout: datetime.timedelta = DEFAULT_TIMEOUT,
             world_size: int | None = None) -> "Store":
        """A store served from here on host:port (0: any free port), listening on `host` alone."""
        raw = hosted_store(host, port, timeout, world_size)
        return cls(raw, f"{host}:{raw.port}")

    @classmethod
    def connect(cls, address: str, timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> "Store":
        """A new connection to the store at host:port (waits up to `timeout` for it to be served)."""
        host, port = address.rsplit(":", 1)
        return cls(dist.TCPStore(host, int(port), is_master=False, timeout=timeout), address)

    def reconnect(self, timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> "Store":
        return Store.connect(self.address, timeout)

    def join(self, name: str, rank: int, world_size: int, **options: Any) -> dist.ProcessGroup:
        """Form group `name` (`groups.stateless_group`) over a connection of its own: forming one blocks until
        every rank has joined, and a connection runs one operation at a time."""
        return stateless_group(self.reconnect(options.get("timeout", DEFAULT_TIMEOUT)).raw, name, rank, world_size,
                               **options)

    def put(self, key: Key[M], message: M) -> None:
        if not isinstance(message, key.message):
            raise TypeError(f"{key.name} holds {key.message.__name__}, got {type(message).__name__}")
        self.raw.set(key.name, encode(message))

    def get(self, key: Key[M]) -> M:
        """The message under `key`, waiting for it as long as the store's timeout."""
        return decode(self.raw.get(key.name), key.message, key.name)

    def peek(self, key: Key[M]) -> M | None:
        """The message under `key`, or None if there is none yet."""
        return self.get(key) if self.raw.check([key.name]) else None

    def has(self, *keys: Key) -> bool:
        return self.raw.check([k.name for k in keys])

    def wait(self, keys: list[Key], timeout: datetime.timedelta) -> None:
        """Until every key is set; TimeoutError after `timeout`."""
        try:
            self.raw.wait([k.name for k in keys], timeout)
        except RuntimeError:  # torch raises DistStoreError (a RuntimeError) on timeout
            raise TimeoutError(f"{', '.join(k.name for k in keys)} not set within "
                               f"{timeout.total_seconds()} s") from None

    def delete(self, key: Key) -> None:
        self.raw.delete_key(key.name)

    def claim(self, family: str, ranks: int) -> int:
        """Ask the store's host to form group `<family>-<k>` with `ranks` ranks first; returns k (1, 2, ...)."""
        k = self.raw.add(f"{family}s", 1)
        self.put(Family(family, Claim).key(k), Claim(ranks))
        return k

    def claims(self, family: str, stop: threading.Event, poll_s: float = 0.05) -> Iterator[tuple[int, int]]:
        """(k, ranks) of every claim of `family`, in order, as each appears, until `stop` is set; how a store's
        host learns of the groups others ask it to form. Polled: a blocking wait could not be stopped. Ends
        quietly when the store goes away."""
        keys, k = Family(family, Claim), 1
        try:
            while not stop.is_set():
                if (claim := self.peek(keys.key(k))) is not None:
                    yield k, claim.ranks
                    k += 1
                else:
                    time.sleep(poll_s)
        except RuntimeError:
            return
