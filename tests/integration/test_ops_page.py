"""The dashboard page in real headless Chromium, served by the real ops app on loopback.

Chromium (Debian's `chromium`, at /usr/bin/chromium) opens `/` as a user does: the page sends
it to the login form, the test types the ops token and submits, and the dashboard's
JavaScript fetches `/api/...` with the session cookie the login gave. The test then reads the
DOM (and checks what it says) or takes a screenshot (decodes the PNG and checks that the GPUs
were drawn, free and used). Chromium is driven over its DevTools pipe, so the token is typed,
never put in a command line or a URL. Without Chromium the tests skip, and fail under
CI=true, where .ci/run installs it.
"""

from __future__ import annotations

import collections
import re
import struct
import zlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from broker.ops import BrokerMetrics, OpsAuth, create_ops_app, start_ops_server
from tests.chromium_support import (
    WINDOW,
    DomDump,
    element_text,
    log_in,
    open_page,
    require_chromium,
)
from tests.ops_support import DEPLOYMENT_ID, OPS_TOKEN, StaticOpsView

DASHBOARD_CSS = Path(__file__).parents[2] / "broker" / "ops" / "static" / "dashboard.css"


async def serve(view: StaticOpsView) -> AsyncIterator[str]:
    app = create_ops_app(view, BrokerMetrics(), OpsAuth(OPS_TOKEN))
    runner, port = await start_ops_server(app, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        await runner.cleanup()


@pytest.fixture
async def page_url() -> AsyncIterator[str]:
    """The dashboard over two nodes (8 NVLink GPUs, 4 PCIe GPUs), a deployment, two migrations
    (the newer one pre-warmed) and two standbys of a pre-warm budget of 4."""
    async for url in serve(StaticOpsView()):
        yield url


@pytest.fixture
async def empty_page_url() -> AsyncIterator[str]:
    """The dashboard of a broker that knows nothing yet, pre-warm off."""
    view = StaticOpsView(
        node_list=[],
        deployment_list=[],
        migration_list=[],
        prewarm_info={"budget": 0, "standbys": []},
    )
    async for url in serve(view):
        yield url


def decode_png(data: bytes) -> tuple[int, int, list[bytes]]:
    """Width, height and the RGB rows of an 8-bit, non-interlaced RGB or RGBA PNG."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat = 8, []
    width = height = channels = 0
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            width, height, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and color in (2, 6) and interlace == 0, (depth, color, interlace)
            channels = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat.append(body)
    raw = zlib.decompress(b"".join(idat))
    stride = width * channels
    previous = bytearray(stride)
    rows = []
    for y in range(height):
        start = y * (stride + 1)
        line = bytearray(raw[start + 1 : start + 1 + stride])
        unfilter(raw[start], line, previous, channels)
        rows.append(bytes(line) if channels == 3 else bytes(_drop_alpha(line)))
        previous = line
    return width, height, rows


def unfilter(kind: int, line: bytearray, previous: bytearray, bpp: int) -> None:
    """Undo PNG filter `kind` on `line` in place (PNG spec, section 9)."""
    if kind == 1:
        for i in range(bpp, len(line)):
            line[i] = (line[i] + line[i - bpp]) & 0xFF
    elif kind == 2:
        line[:] = bytes((a + b) & 0xFF for a, b in zip(line, previous, strict=True))
    elif kind == 3:
        for i in range(len(line)):
            left = line[i - bpp] if i >= bpp else 0
            line[i] = (line[i] + ((left + previous[i]) >> 1)) & 0xFF
    elif kind == 4:
        for i in range(len(line)):
            a, c = (line[i - bpp], previous[i - bpp]) if i >= bpp else (0, 0)
            b = previous[i]
            p = a + b - c
            pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
            predictor = a if pa <= pb and pa <= pc else b if pb <= pc else c
            line[i] = (line[i] + predictor) & 0xFF
    else:
        assert kind == 0, f"unknown PNG filter {kind}"


def _drop_alpha(line: bytearray) -> bytearray:
    return bytearray(b for i, b in enumerate(line) if i % 4 != 3)


def css_color(variable: str) -> bytes:
    """The RGB bytes of a `--variable: #rrggbb` in the dashboard's stylesheet."""
    match = re.search(rf"--{variable}:\s*#([0-9a-fA-F]{{6}});", DASHBOARD_CSS.read_text())
    assert match, f"--{variable} not in {DASHBOARD_CSS}"
    return bytes.fromhex(match.group(1))


async def test_page_renders_nodes_topology_and_deployment(page_url: str, tmp_path: Path) -> None:
    chromium = require_chromium()
    async with open_page(chromium, tmp_path / "profile") as page:
        await log_in(page, page_url, OPS_TOKEN)
        html = await page.dom()
    dom = DomDump(html)

    assert element_text(html, "status").startswith("last updated"), element_text(html, "status")
    nodes = [e.attrs["data-node-id"] for e in dom.having("data-node-id")]
    assert nodes == ["node-dgx-a", "node-ws-b"]

    gpus = [e for e in dom.having("data-gpu-index") if e.tag == "g"]
    assert len(gpus) == 12
    used = [e for e in gpus if e.attrs["data-state"] == "used"]
    assert len(used) == 4
    assert {e.attrs["data-holders"] for e in used} == {DEPLOYMENT_ID}
    kinds = collections.Counter(e.attrs["data-kind"] for e in dom.having("data-kind"))
    assert kinds == {"NV12": 28, "PIX": 2, "SYS": 4}

    rows = [e.attrs["data-deployment-id"] for e in dom.having("data-deployment-id")]
    assert rows == [DEPLOYMENT_ID]
    migrations = [e.attrs["data-migration-id"] for e in dom.having("data-migration-id")]
    assert migrations == ["mig-0002", "mig-0001"]
    events = [e.attrs["data-event"] for e in dom.having("data-event")]
    assert events == ["triggered", "target_ready", "switched", "drained"] * 2
    text = " ".join(dom.text)
    for expected in ["node-dgx-a", DEPLOYMENT_ID, "resnet50", "127.0.0.1:9001", "42.5 ms"]:
        assert expected in text


async def test_page_renders_the_offload_panel(page_url: str, tmp_path: Path) -> None:
    chromium = require_chromium()
    async with open_page(chromium, tmp_path / "profile") as page:
        await log_in(page, page_url, OPS_TOKEN)
        html = await page.dom()
        share = await page.evaluate(
            "getComputedStyle(document.querySelector("
            "'[data-offload-session=\"5e55a0c0ffee0001\"] .share-remote')).width"
        )
    dom = DomDump(html)
    rows = dom.having("data-offload-session")
    assert [
        (e.attrs["data-offload-deployment"], e.attrs["data-offload-session"]) for e in rows
    ] == [
        (DEPLOYMENT_ID, "5e55a0c0ffee0001"),
        (DEPLOYMENT_ID, "5e55a0c0ffee0000"),
    ]
    panel = element_text(html, "offload")
    for expected in [
        "fastest", "resnet50-int8.onnx", "20% remote", "40 / 160", "18.3 ms", "6.5 ms",
        "unreachable", "local: fallback 3, faster 150, remote-down 7", "remote: measuring 2",
        "4.0 s ago", "100% remote", "reachable",
    ]:  # fmt: skip
        assert expected in panel, (expected, panel)
    assert element_text(html, "offload-summary") == "1 deployment(s) with a device model"
    # 20% of the 5rem bar: the width is set through the CSSOM, which the page's CSP allows.
    assert share.endswith("px") and 14 <= float(share[:-2]) <= 18, share


async def test_page_renders_the_prewarm_panel(page_url: str, tmp_path: Path) -> None:
    chromium = require_chromium()
    async with open_page(chromium, tmp_path / "profile") as page:
        await log_in(page, page_url, OPS_TOKEN)
        html = await page.dom()
        standbys = await page.evaluate(
            "[...document.querySelectorAll('[data-standby-replica]')].map((row) =>"
            " [row.dataset.standbyReplica, ...[...row.cells].map((c) => c.textContent)])"
        )
        # Each migration's header, and the size of its pre-warmed marker (0 x 0: not shown).
        headers = await page.evaluate(
            "[...document.querySelectorAll('[data-migration-id]')].map((m) => {"
            " const marker = m.querySelector('.prewarmed-badge')?.getBoundingClientRect();"
            " return [m.dataset.migrationId, m.querySelector('header').textContent,"
            " marker ? marker.width * marker.height : 0]; })"
        )
        # The boxes of the pre-warmed move's timeline labels: its first events are ms apart.
        boxes = await page.evaluate(
            '[...document.querySelectorAll(\'[data-migration-id="mig-0002"] .timeline-event'
            " text')].map((t) => { const b = t.getBoundingClientRect();"
            " return [b.left, b.top, b.right, b.bottom]; })"
        )
    assert element_text(html, "prewarm-summary") == "2 of 4 standbys"
    assert len(boxes) == 4
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            overlap = a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]
            assert not overlap, (a, b)
    # The oldest first: one a previous broker left (no prediction), one ready.
    assert standbys == [
        ["rep-sb-0001", DEPLOYMENT_ID, "node-dgx-a", "4", "metro-east", "\u2014", "retiring",
         "1 min ago"],
        ["rep-sb-0002", DEPLOYMENT_ID, "node-ws-b", "0, 1", "campus-west", "62%", "ready",
         "12.5 s ago"],
    ]  # fmt: skip
    (prewarmed_id, prewarmed, marker), (cold_id, cold, no_marker) = headers
    assert (prewarmed_id, cold_id) == ("mig-0002", "mig-0001")
    assert "pre-warmed" in prewarmed and marker > 0
    assert "pre-warmed" not in cold and no_marker == 0
    # The pre-warmed move's downtime and timeline are shown as any other's.
    assert "downtime 3.5 ms" in prewarmed
    assert 'aria-label="timeline of mig-0002"' in html


async def test_without_the_token_the_page_shows_no_data(page_url: str, tmp_path: Path) -> None:
    chromium = require_chromium()
    async with open_page(chromium, tmp_path / "profile") as page:
        await page.navigate(page_url)
        await page.wait_for("document.getElementById('login') !== null")
        assert await page.evaluate("fetch('/api/nodes').then((r) => r.status)") == 401
        await page.evaluate("document.getElementById('token').focus()")
        await page.type_text("not-the-token")
        await page.evaluate("document.getElementById('login').requestSubmit()")
        error = await page.wait_for(
            "document.getElementById('login-error')?.hidden === false"
            " && document.getElementById('login-error').textContent"
        )
        html = await page.dom()
        assert await page.evaluate("fetch('/api/deployments').then((r) => r.status)") == 401
    assert error == "wrong token: try again"
    assert DomDump(html).having("data-node-id") == []
    assert DEPLOYMENT_ID not in html and "node-dgx-a" not in html


async def test_the_session_is_a_cookie_scripts_cannot_read(page_url: str, tmp_path: Path) -> None:
    chromium = require_chromium()
    async with open_page(chromium, tmp_path / "profile") as page:
        await log_in(page, page_url, OPS_TOKEN)
        assert await page.evaluate("location.href") == page_url
        assert await page.evaluate("document.cookie") == ""  # HttpOnly
        assert OPS_TOKEN not in await page.evaluate("JSON.stringify(sessionStorage)")
        assert await page.evaluate("fetch('/api/nodes').then((r) => r.status)") == 200
        await page.evaluate("document.querySelector('form.logout').requestSubmit()")
        await page.wait_for("document.getElementById('login') !== null")
        assert await page.evaluate("fetch('/api/nodes').then((r) => r.status)") == 401


async def test_empty_broker_page_says_so(empty_page_url: str, tmp_path: Path) -> None:
    chromium = require_chromium()
    async with open_page(chromium, tmp_path / "profile") as page:
        await log_in(page, empty_page_url, OPS_TOKEN)
        html = await page.dom()
    assert element_text(html, "status").startswith("last updated")
    assert element_text(html, "nodes") == "no nodes registered yet"
    assert element_text(html, "deployments") == "no deployments yet"
    assert element_text(html, "offload") == "no offload reports yet"
    assert element_text(html, "prewarm-summary") == "off"
    assert element_text(html, "prewarm") == "pre-warm is off (--prewarm-budget 0)"
    assert element_text(html, "migrations") == "no migrations yet"


async def test_screenshot_shows_free_and_used_gpus(page_url: str, tmp_path: Path) -> None:
    chromium = require_chromium()
    async with open_page(chromium, tmp_path / "profile") as page:
        await log_in(page, page_url, OPS_TOKEN)
        png = await page.screenshot()

    width, height, rows = decode_png(png)
    assert (width, height) == WINDOW
    pixels = collections.Counter(row[x : x + 3] for row in rows for x in range(0, len(row), 3))
    background, most = pixels.most_common(1)[0]
    assert background == css_color("bg")
    # Not blank: a good part of the window is something other than the page background.
    assert sum(pixels.values()) - most > 0.2 * width * height
    # The GPU boxes are drawn: fills of free and of used (held by the deployment) GPUs.
    # Each box is about 110 x 52 px; four used and eight free GPUs are on the first screen.
    box = 100 * 40
    assert pixels[css_color("used")] > 3 * box
    assert pixels[css_color("free")] > 6 * box
