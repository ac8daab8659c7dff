"""Real headless Chromium for page tests: Debian's `chromium`, flags for a closed network,
and a parsed DOM dump. Without Chromium a test skips, or fails under CI=true (where .ci/run
installs it)."""

from __future__ import annotations

import asyncio
import os
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_TIMEOUT_S = 120.0
WINDOW = (1400, 1000)

# Flags for this closed network: without the background-networking ones Chromium keeps trying
# Google's hosts. --no-sandbox because CI runs as root.
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    f"--window-size={WINDOW[0]},{WINDOW[1]}",
    # Virtual time: the page loads, fetches and renders (it polls every second) before the
    # dump or screenshot, without a wall-clock sleep.
    "--virtual-time-budget=5000",
]


def require_chromium() -> str:
    """The Chromium binary; skips the test without one, or fails it under CI=true."""
    if os.access(CHROMIUM, os.X_OK):
        return CHROMIUM
    reason = f"{CHROMIUM} not found: install Debian's chromium (apt-get install chromium)"
    if os.environ.get("CI") == "true":
        pytest.fail(reason)
    pytest.skip(reason)


async def run_chromium(binary: str, profile: Path, *args: str) -> str:
    """Run Chromium with a fresh profile and `args`; returns its stdout. Fails on an error exit."""
    proc = await asyncio.create_subprocess_exec(
        binary,
        *CHROMIUM_FLAGS,
        f"--user-data-dir={profile}",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        stdout, stderr = await asyncio.wait_for(proc.communicate(), CHROMIUM_TIMEOUT_S)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        pytest.fail(f"chromium did not finish within {CHROMIUM_TIMEOUT_S} s")
    if proc.returncode != 0:
        pytest.fail(
            f"chromium exited {proc.returncode}: {stderr.decode(errors='replace')[-3000:]}"
        )
    return stdout.decode()


class Element:
    def __init__(self, tag: str, attrs: dict[str, str]) -> None:
        self.tag = tag
        self.attrs = attrs


class DomDump(HTMLParser):
    """Every element of a dumped DOM with its attributes, and the page's text."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.elements: list[Element] = []
        self.text: list[str] = []
        self.feed(html)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.elements.append(Element(tag, {k: v or "" for k, v in attrs}))

    def handle_data(self, data: str) -> None:
        self.text.append(data)

    def having(self, attr: str) -> list[Element]:
        return [e for e in self.elements if attr in e.attrs]


def element_text(html: str, element_id: str) -> str:
    """The text inside the element with this id (no nested element of the same tag)."""
    match = re.search(rf'<(\w+)[^>]*\bid="{element_id}"[^>]*>(.*?)</\1>', html, re.S)
    assert match, f"no element with id {element_id}"
    return re.sub(r"<[^>]+>", "", match.group(2))
