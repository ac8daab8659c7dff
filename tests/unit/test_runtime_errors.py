"""What error messages may carry: short quotes of values, and text fit for a caller."""

from __future__ import annotations

from runtime.errors import client_text, quote


def test_quote_keeps_short_values_whole_and_cuts_long_ones() -> None:
    assert quote("dep-1") == "'dep-1'"
    assert quote("a\x1b[31mb") == "'a\\x1b[31mb'"
    assert quote("x" * 7_000_000) == f"{'x' * 40!r}… (7000000 characters)"


def test_client_text_drops_escape_codes_paths_and_class_names() -> None:
    tail = (
        "\x1b[1;31m2026-11-23 ERROR runtime.server: ModelLoadError: cannot load "
        "/home/node/state/models/ab12 as an ONNX model\x1b[m\nexit code 1"
    )
    assert client_text(tail) == (
        "2026-11-23 ERROR runtime.server: cannot load <path> as an ONNX model\nexit code 1"
    )
    assert client_text("y" * 5000) == "y" * 2000 + "… (3000 more characters)"


def test_client_text_drops_tracebacks_and_bare_exception_words() -> None:
    # What a replica's log tail held once when grpc's poller outlived the event loop.
    tail = (
        "ERROR runtime.server: cannot load <path> as an ONNX model\n"
        "ERROR asyncio: Exception in callback None()\n"
        "handle: <Handle cancelled>\n"
        "Traceback (most recent call last):\n"
        '  File "/usr/lib/python3.11/asyncio/events.py", line 80, in _run\n'
        "    self._context.run(self._callback, *self._args)\n"
        "OSError: [Errno 9] Bad file descriptor"
    )
    assert client_text(tail) == (
        "ERROR runtime.server: cannot load <path> as an ONNX model\n"
        "ERROR asyncio: in callback None()\n"
        "handle: <Handle cancelled>\n"
        "[Errno 9] Bad file descriptor"
    )


def test_client_text_drops_where_a_host_listens() -> None:
    # A replica's log tail on a failed start: its ports are the node's business.
    tail = (
        "INFO runtime.server: metrics served at http://127.0.0.1:45123/metrics\n"
        "INFO runtime.server: runtime listening on 10.0.3.7:39021 (TLS)\n"
        "not ready at [::1]:8001 nor node-a.example:7001, nor ipv4:127.0.0.1:5000\n"
        "bind failed: port 45123 in use; --metrics-port=9100; listening on :9100"
    )
    assert client_text(tail) == tail  # a caller's own addresses stay, unless asked
    assert client_text(tail, hide_addresses=True) == (
        "INFO runtime.server: metrics served at http://<address>/metrics\n"
        "INFO runtime.server: runtime listening on <address> (TLS)\n"
        "not ready at <address> nor <address>, nor ipv4:<address>\n"
        "bind failed: port <port> in use; --metrics-port=<port>; listening on <address>"
    )
    # Times and version numbers are no addresses.
    text = "2026-11-23 12:30:45,123 took 0:00:01, opset 1.2:3"
    assert client_text(text, hide_addresses=True) == text
