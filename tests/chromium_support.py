"""Real headless Chromium for page tests: Debian's `chromium`, flags for a closed network,
a parsed DOM dump, and a page driven as a user would (`open_page`, `log_in`). Without Chromium
a test skips, or fails under CI=true (where .ci/run installs it)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import re
import time
from collections.abc import AsyncIterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

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


class BrowserPage:
    """One Chromium tab, driven over the DevTools protocol on a pipe (`--remote-debugging-pipe`:
    no port, so nothing else on the machine can reach it, and what the test types, a token
    say, never appears in a command line). Calls run one at a time."""

    def __init__(self, commands: int, replies: asyncio.StreamReader) -> None:
        self._commands = commands
        self._replies = replies
        self._next_id = 0
        self._session = ""

    async def call(self, method: str, *, browser: bool = False, **params: Any) -> Any:
        """Send a DevTools command to the tab (or, with `browser`, to the browser) and return
        its result; AssertionError with the protocol's error."""
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if not browser:
            message["sessionId"] = self._session
        os.write(self._commands, json.dumps(message).encode() + b"\0")
        while True:
            raw = await asyncio.wait_for(self._replies.readuntil(b"\0"), CHROMIUM_TIMEOUT_S)
            reply = json.loads(raw[:-1])
            if reply.get("id") == self._next_id:  # anything else is an event: not needed
                if "error" in reply:
                    raise AssertionError(f"{method}: {reply['error']}")
                return reply["result"]

    async def attach(self) -> None:
        target = await self.call("Target.createTarget", browser=True, url="about:blank")
        attached = await self.call(
            "Target.attachToTarget", browser=True, targetId=target["targetId"], flatten=True
        )
        self._session = attached["sessionId"]
        await self.call(
            "Emulation.setDeviceMetricsOverride",
            width=WINDOW[0],
            height=WINDOW[1],
            deviceScaleFactor=1,
            mobile=False,
        )

    async def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (a promise is awaited)."""
        result = await self.call(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            raise AssertionError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout_s: float = 30.0) -> Any:
        """Poll a JavaScript expression until it is truthy; its value. Fails after
        `timeout_s`, saying what the page shows."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(AssertionError):  # a navigation replaced the page
                if value := await self.evaluate(expression):
                    return value
            await asyncio.sleep(0.05)
        body = await self.evaluate("document.body ? document.body.innerText : ''")
        pytest.fail(f"{expression} still false after {timeout_s} s; the page says: {body!r}")

    async def navigate(self, url: str) -> None:
        await self.call("Page.navigate", url=url)

    async def type_text(self, text: str) -> None:
        """Type into the focused element, as a user (or a password manager) would."""
        await self.call("Input.insertText", text=text)

    async def dom(self) -> str:
        return str(await self.evaluate("document.documentElement.outerHTML"))

    async def screenshot(self) -> bytes:
        """A PNG of the window (`WINDOW`)."""
        shot = await self.call("Page.captureScreenshot", format="png")
        return base64.b64decode(shot["data"])


@contextlib.asynccontextmanager
async def open_page(binary: str, profile: Path) -> AsyncIterator[BrowserPage]:
    """A tab of a fresh Chromium with its own profile; the browser is closed on exit."""
    to_browser, commands = os.pipe()
    replies_fd, from_browser = os.pipe()
    flags = [f for f in CHROMIUM_FLAGS if not f.startswith("--virtual-time-budget")]
    proc = await asyncio.create_subprocess_exec(
        # The DevTools pipe is fds 3 (commands in) and 4 (replies out) of the browser; bash,
        # as dash refuses to redirect fds above 9.
        "/bin/bash", "-c", f'exec "$@" 3<&{to_browser} 4>&{from_browser}', "bash",
        binary, *flags, f"--user-data-dir={profile}", "--remote-debugging-pipe",
        pass_fds=(to_browser, from_browser), stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    os.close(to_browser)
    os.close(from_browser)
    loop = asyncio.get_running_loop()
    replies = asyncio.StreamReader(limit=256 * 1024 * 1024)  # screenshots, DOM dumps
    transport, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(replies), os.fdopen(replies_fd, "rb", 0)
    )
    page = BrowserPage(commands, replies)
    try:
        await page.attach()
        yield page
    finally:
        with contextlib.suppress(
            AssertionError, TimeoutError, OSError, asyncio.IncompleteReadError
        ):
            await page.call("Browser.close", browser=True)
        try:
            await asyncio.wait_for(proc.wait(), 30)
        except TimeoutError:
            proc.kill()
            await proc.wait()
        transport.close()
        os.close(commands)


async def log_in(page: BrowserPage, url: str, token: str) -> None:
    """Open the dashboard at `url` as a user does: it sends the browser to its login form, the
    user types the ops token and submits; returns once the dashboard has drawn its data."""
    await page.navigate(url)
    await page.wait_for("document.getElementById('login') !== null")
    await page.evaluate("document.getElementById('token').focus()")
    await page.type_text(token)
    await page.evaluate("document.getElementById('login').requestSubmit()")
    await page.wait_for(
        "(document.getElementById('status')?.textContent ?? '').startsWith('last updated')"
    )


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
