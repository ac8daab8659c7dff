"""Errors the runtime raises, mapped to gRPC status codes in one table (`runtime.rpc.status`).

Hierarchy::

    RuntimeServerError
    ├── InvalidInput          a tensor or request field does not match the model
    ├── ModelNotFound         the request names a model or version this server does not serve
    ├── NotReady              the model is loading, warming up, or the server is draining
    ├── TooLate               the call's deadline leaves less than the model's compute time
    ├── QueueFull             the request's priority class (or its client) has as many
    │                         queued as allowed
    ├── RateLimited           the request's client is over its rate limit (--clients-file)
    ├── InferenceFailed       ONNX Runtime failed while running valid inputs
    └── ModelLoadError        the model file cannot be loaded or warmed up (start-up only)

An error's message is meant for the caller. It names the field and quotes at most a short
prefix of an offending value (`quote`); text that may carry a host's details (a log tail)
goes through `client_text` before a caller sees it (no paths, addresses or ports of the
host). The node daemon uses both helpers too: this module imports nothing, so every package
may.
"""

from __future__ import annotations

import re

QUOTE_CHARS = 40
"""The most characters of an offending value an error message quotes."""
MESSAGE_CHARS = 2000
"""The most characters of a message a caller gets (a gRPC status travels in trailing
metadata, which clients limit to 8 KiB by default)."""

# CSI sequences (colours, cursor moves) and other two-character escapes.
_ANSI = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|[@-Z\\-_])")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
# Absolute paths of two or more components: a host's files, a traceback's source files.
_PATH = re.compile(r"(?<![\w.:/])/(?:[\w.+@-]+/)+[\w.+@-]*")
# `ValueError: `, `grpc.aio.AioRpcError: `, `<class 'KeyError'>`, a bare `Exception`:
# exception class names.
_CLASS_NAME = re.compile(
    r"<class '[\w.]+'>:? ?"
    r"|\b(?:[A-Za-z_]\w*\.)*(?:[A-Z]\w*)?(?:Error|Exception|Exit|Interrupt)\b:? ?"
)
# host:port (an IPv4 address, a bracketed IPv6 one, a name with a letter), or `:port` alone:
# where a host listens. Times (12:30:45) and numbers with a decimal point are left alone.
_ADDRESS = re.compile(
    r"(?:\[[0-9A-Za-z:.%]+\]|\b\d{1,3}(?:\.\d{1,3}){3}"
    r"|\b(?=[\w-]*[A-Za-z])[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*|(?<![\w:.]))"
    r":\d{1,5}(?![\d.])"
)
# `port 45123`, `--metrics-port=9100`, `ports: 80`: a port number named as one.
_PORT = re.compile(r"\b(ports?\b[ \t]*[=:]?[ \t]*)\d{1,5}\b", re.IGNORECASE)
# A Python traceback's header and its indented frames (a log tail may hold one; its last,
# unindented line stays, without its class name).
_TRACEBACK = re.compile(
    r"^[ \t]*Traceback \(most recent call last\):\n(?:[ \t]+.*(?:\n|$))*", re.MULTILINE
)


def quote(value: str, limit: int = QUOTE_CHARS) -> str:
    """`value` quoted for an error message: its `repr` (escapes make control characters and
    odd text visible) when short, else the repr of its first `limit` characters, an ellipsis
    and its length."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}… ({len(value)} characters)"


def client_text(text: str, limit: int = MESSAGE_CHARS, hide_addresses: bool = False) -> str:
    """`text` as a caller may see it: without terminal escape codes and control characters
    (newlines stay), Python tracebacks' frames dropped, absolute paths replaced by `<path>`,
    exception class names removed, and at most `limit` characters (the rest is counted, not
    shown).

    With `hide_addresses` (text from a node, which may carry a replica's log tail), host:port
    addresses become `<address>` and port numbers `<port>`: where a node's replicas listen is
    no caller's business. Not by default: a caller's own bad address, quoted back in a
    refusal ('node:99999' is not host:port, port 1..65535), must stay readable."""
    text = _ANSI.sub("", text)
    text = _CONTROL.sub("", text)
    text = _TRACEBACK.sub("", text)
    text = _PATH.sub("<path>", text)
    if hide_addresses:
        text = _ADDRESS.sub("<address>", text)
        text = _PORT.sub(r"\1<port>", text)
    text = _CLASS_NAME.sub("", text)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text) - limit} more characters)"


class RuntimeServerError(Exception):
    """Base class of the runtime's own errors; the message is meant for the caller."""


class InvalidInput(RuntimeServerError):
    """The request does not match the model's inputs or outputs."""


class ModelNotFound(RuntimeServerError):
    """No model of that name (or version) is served here."""


class NotReady(RuntimeServerError):
    """The server cannot take this request now; retrying elsewhere or later may succeed."""


class TooLate(RuntimeServerError):
    """The call's deadline leaves less time than the model takes to compute: an answer
    would come after the caller stopped waiting, so it is not computed."""


class QueueFull(RuntimeServerError):
    """The request's priority class already has `--max-queued-per-class` requests waiting
    for a batch, or its client its share of them: the replica holds no more
    (RESOURCE_EXHAUSTED; retry with backoff)."""


class RateLimited(RuntimeServerError):
    """The calling client is over its rate limit (its line's MAX_RPS in the clients file,
    `runtime.clients`): RESOURCE_EXHAUSTED; retry later."""


class InferenceFailed(RuntimeServerError):
    """ONNX Runtime failed on inputs that passed every check."""


class ModelLoadError(RuntimeServerError):
    """The model could not be loaded, or its warm-up inference failed."""
