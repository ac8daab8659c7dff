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
