"""Run `python -m runtime.server` as a real subprocess for tests, and read its log."""

from __future__ import annotations

import contextlib
import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

LISTENING = re.compile(r"runtime listening on [\d.]+:(\d+)")


@dataclass
class RuntimeProcess:
    process: subprocess.Popen[str]
    port: int
    log: list[str] = field(default_factory=list)

    def wait_for_log(self, pattern: str, timeout_s: float = 60.0) -> re.Match[str]:
        """The first log line matching `pattern`, waiting for it up to `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        regex = re.compile(pattern)
        while time.monotonic() < deadline:
            for line in list(self.log):
                if match := regex.search(line):
                    return match
            if self.process.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.02)
        raise AssertionError(f"no log line matches {pattern!r}; log:\n" + "".join(self.log))

    _reader: threading.Thread = field(default=None, repr=False)  # type: ignore[assignment]


@contextlib.contextmanager
def runtime_process(
    model: Path, token_file: Path, *extra: str, name: str = "model"
) -> Iterator[RuntimeProcess]:
    """Start the runtime on a free loopback port; kill it on exit if it is still running."""
    command = [
        sys.executable, "-m", "runtime.server", "--model", str(model), "--name", name,
        "--host", "127.0.0.1", "--port", "0", "--token-file", str(token_file), *extra,
    ]  # fmt: skip
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    log: list[str] = []
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            log.append(line)
            lines.put(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 60
        port = None
        while port is None and time.monotonic() < deadline:
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                if process.poll() is not None:
                    break
                continue
            if match := LISTENING.search(line):
                port = int(match.group(1))
        if port is None:
            process.kill()
            reader.join(5)
            raise AssertionError("runtime did not start listening; log:\n" + "".join(log))
        running = RuntimeProcess(process, port, log)
        running._reader = reader
        yield running
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(10)
        reader.join(5)
        if process.stderr is not None:
            process.stderr.close()
