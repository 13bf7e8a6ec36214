"""TLS on every gRPC hop, from files the environment names: one identity per process.

    INFERMESH_TLS_CA           the mesh's CA certificate (PEM): peers' certificates must be signed by it
    INFERMESH_TLS_CERT, _KEY   this process's certificate (signed by the CA) and its private key
    INFERMESH_TLS_SERVER_NAME  optional: the name peers' certificates carry, when they are dialled by
                               address (pods by IP); unset, a certificate must name the host it is reached at

All three files set: every server speaks TLS (the router's HTTP front HTTPS, with the same certificate) and,
but for the router's public ports, takes only clients that present a certificate from the CA (mutual TLS): a
process without one cannot register, reserve KV, push KV or drain an instance. Every client checks the
server's certificate and presents its own. The CA alone: a client (the CLI, a user's program) that checks the
router's certificate and presents none. Probes that speak no TLS (the kubelet's) dial a service's
`--health-port`, plaintext and health alone (`rpc.start_health_server`).
Nothing set: plaintext. Anything else is an error naming what is missing.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Mapping

import grpc

CA, CERT, KEY, SERVER_NAME = (f"INFERMESH_TLS_{name}" for name in ("CA", "CERT", "KEY", "SERVER_NAME"))


@dataclass(frozen=True, slots=True)
class Identity:
    ca: bytes
    cert: bytes | None  # None: a client that presents no certificate
    key: bytes | None
    server_name: str = ""


def identity(environ: Mapping[str, str] = os.environ) -> Identity | None:
    """This process's identity from the environment; None when TLS is off."""
    ca, cert, key = (environ.get(name, "") for name in (CA, CERT, KEY))
    if not (ca or cert or key):
        return None
    if not ca or bool(cert) != bool(key):
        missing = [name for name, value in ((CA, ca), (CERT, cert), (KEY, key)) if not value]
        raise ValueError(f"TLS needs {CA} (and for a certificate both {CERT} and {KEY}); "
                         f"{', '.join(missing)} not set")
    return _load(ca, cert, key, environ.get(SERVER_NAME, ""))


@functools.lru_cache(maxsize=4)
def _load(ca: str, cert: str, key: str, server_name: str) -> Identity:
    def read(path: str, name: str) -> bytes:
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as e:
            raise ValueError(f"{name}={path}: {e.strerror}") from None

    return Identity(read(ca, CA), read(cert, CERT) if cert else None, read(key, KEY) if key else None, server_name)


def server_credentials(me: Identity, client_certs: bool) -> grpc.ServerCredentials:
    """`client_certs`: take only clients whose certificate the CA signed (mutual TLS)."""
    if me.cert is None:
        raise ValueError(f"a server needs {CERT} and {KEY}")
    return grpc.ssl_server_credentials([(me.key, me.cert)], root_certificates=me.ca,
                                       require_client_auth=client_certs)


def server_files(environ: Mapping[str, str] = os.environ) -> tuple[str, str] | None:
    """(certificate path, key path) for a server that takes files (the HTTP front); None when TLS is off."""
    me = identity(environ)
    if me is None:
        return None
    if me.cert is None:
        raise ValueError(f"a server needs {CERT} and {KEY}")
    return environ[CERT], environ[KEY]


def channel_credentials(me: Identity, options: list[tuple[str, object]]
                        ) -> tuple[grpc.ChannelCredentials, list[tuple[str, object]]]:
    """The credentials and options of a channel to a peer of the mesh (sync or grpc.aio alike)."""
    credentials = grpc.ssl_channel_credentials(root_certificates=me.ca, private_key=me.key,
                                               certificate_chain=me.cert)
    if me.server_name:
        options = [*options, ("grpc.ssl_target_name_override", me.server_name)]
    return credentials, options
