"""gRPC over TLS from PEM bytes: listeners, channels, and the rule for plaintext listeners.

Shared by every process: the runtime (inside the image, where only grpc is there to read
PEMs with: `runtime.pem`) and the broker, node daemon and edge client (which check their PEM
files with `common.certs` first). One function builds server credentials, one channel
credentials, so every channel is set up the same way.

The rule (`check_listener`): a listener on an address other hosts can reach serves TLS, or
starts only with `--insecure`; plaintext on loopback is always allowed.
"""

from __future__ import annotations

import contextlib
import ipaddress
from collections.abc import Sequence

import grpc

from runtime.errors import quote
from runtime.pem import TlsIdentity

_HANDSHAKE_MARKERS = ("handshake", "ssl_error", "certificate_verify_failed", "tsi_")
"""Lower-case pieces of the details gRPC gives when a TLS handshake failed (no common CA,
a peer without a certificate, plaintext against TLS)."""


def server_credentials(
    tls: TlsIdentity, *, require_client_cert: bool = False
) -> grpc.ServerCredentials:
    """A listener's credentials: `tls.cert` and `tls.key`. With `require_client_cert`, a
    caller must present a certificate that chains to `tls.ca` (mutual TLS); without, none is
    asked for (gRPC Python cannot make one optional: a port is one or the other)."""
    return grpc.ssl_server_credentials(
        [(tls.key, tls.cert)],
        root_certificates=tls.ca if require_client_cert else None,
        require_client_auth=require_client_cert,
    )


RECONNECT_OPTIONS: tuple[tuple[str, object], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)
"""Every channel's reconnect backoff. gRPC's own starts at 1 s and grows by 1.6x to two
minutes: a node whose broker was down for four seconds would try again only five seconds
after it went, past the restarted broker's `--lost-after`, and be counted lost while alive.
Here a restarted peer is found again within about a second."""


def open_channel(
    target: str,
    tls: TlsIdentity | None,
    options: Sequence[tuple[str, object]] = (),
    interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
) -> grpc.aio.Channel:
    """A channel to `target`: TLS when `tls` is given (the server's certificate must chain
    to `tls.ca`; `tls.cert` and `tls.key`, when not empty, are presented for mutual TLS),
    plaintext otherwise. It reconnects as `RECONNECT_OPTIONS` says, besides `options`."""
    options = [*RECONNECT_OPTIONS, *options]
    if tls is None:
        return grpc.aio.insecure_channel(target, options=options, interceptors=list(interceptors))
    credentials = grpc.ssl_channel_credentials(
        root_certificates=tls.ca,
        private_key=tls.key or None,
        certificate_chain=tls.cert or None,
    )
    return grpc.aio.secure_channel(
        target, credentials, options=options, interceptors=list(interceptors)
    )


def listen(
    server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None
) -> int:
    """Bind `address` on `server`, over TLS when `credentials` are given; the bound port.
    OSError when it cannot be bound."""
    try:
        if credentials is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, credentials)
    except RuntimeError as err:
        raise OSError(f"cannot listen on {address}: {err}") from err


def is_loopback(address: str) -> bool:
    """Whether host:port names this host's loopback only (a wildcard host does not)."""
    host = address.rpartition(":")[0].strip("[]")
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(host).is_loopback
    return host == "localhost"


def check_listener(
    flag: str,
    address: str,
    tls: bool,
    insecure: bool,
    tls_flags: str = "--tls-cert, --tls-key and --tls-ca (`offload certs` makes them)",
) -> None:
    """ValueError, saying why, for a plaintext listener (`tls` False) that other hosts can
    reach (`address` not loopback) without `insecure`: its tokens and data would cross the
    network in the clear. `tls_flags` says what to give instead."""
    if tls or insecure or is_loopback(address):
        return
    raise ValueError(
        f"{flag} {quote(address)} is reachable from other hosts and no TLS certificate was "
        f"given: tokens and tensors would cross the network in the clear. Give {tls_flags}, "
        "or --insecure to accept that"
    )


def is_handshake_failure(details: str | None) -> bool:
    """Whether gRPC's `details` of an UNAVAILABLE call say the TLS handshake failed (wrong CA,
    a missing client certificate, TLS against plaintext): retrying will not help."""
    text = (details or "").lower()
    return any(marker in text for marker in _HANDSHAKE_MARKERS)


def peer_common_name(context: grpc.aio.ServicerContext) -> str | None:
    """The common name of the certificate the caller presented and the listener verified;
    None over plaintext or when the caller sent none."""
    names = context.auth_context().get("x509_common_name") or []
    if not names:
        return None
    name = names[0]
    return name.decode("utf-8", "replace") if isinstance(name, bytes) else str(name)
