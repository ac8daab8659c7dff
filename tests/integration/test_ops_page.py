"""The dashboard page in real headless Chromium, served by the real ops app on loopback.

Chromium (Debian's `chromium`, at /usr/bin/chromium) opens `/` as a user does: the page sends
it to the login form, the test types the ops token and submits, and the dashboard's
JavaScript fetches `/api/...` with the session cookie the login gave. The test then reads the
DOM (and checks what it says), reads the load charts' canvases (uPlot draws them) or takes a
screenshot (decodes the PNG and checks that the GPUs and the load lines were drawn; the load
screenshots are kept in `ARTIFACTS_DIR`). Chromium is driven over its DevTools pipe, so the
token is typed, never put in a command line or a URL. Without Chromium the tests skip, and
fail under CI=true, where .ci/run installs it.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import copy
import json
import re
import struct
import time
import zlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

import modelzoo
from broker.ops import (
    BrokerMetrics,
    LoadInfo,
    MigrationInfo,
    OpsAuth,
    create_ops_app,
    start_ops_server,
)
from edge_client.client import OffloadClient
from edge_client.ops_commands import _status
from tests.chromium_support import (
    WINDOW,
    DomDump,
    element_text,
    log_in,
    open_page,
    require_chromium,
)
from tests.cluster_support import THREE_NODES, Cluster, infer_once
from tests.ops_support import (
    BATCH_DEPLOYMENT_ID,
    DEPLOYMENT_ID,
    OPS_TOKEN,
    StaticOpsView,
    live_load,
    ops_headers,
    save_artifact,
)

DASHBOARD_CSS = Path(__file__).parents[2] / "broker" / "ops" / "static" / "dashboard.css"
EMPTY_LOAD: LoadInfo = {"window_s": 300.0, "nodes": [], "deployments": [], "resizes": []}


async def serve(view: StaticOpsView, *middlewares: Middleware) -> AsyncIterator[str]:
    app = create_ops_app(view, BrokerMetrics(), OpsAuth(OPS_TOKEN))
    app.middlewares.extend(middlewares)
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
        load_info=EMPTY_LOAD,
    )
    async for url in serve(view):
        yield url


@pytest.fixture
def load_view() -> StaticOpsView:
    """The sample nodes and deployment with a minute of load history (`live_load`): a burst
    on node-dgx-a, two resizes, a second deployment on node-ws-b."""
    return StaticOpsView(load_info=live_load(time.time()))


@pytest.fixture
async def load_page_url(load_view: StaticOpsView) -> AsyncIterator[str]:
    async for url in serve(load_view):
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


async def test_page_renders_the_services_panel(page_url: str, tmp_path: Path) -> None:
    chromium = require_chromium()
    async with open_page(chromium, tmp_path / "profile") as page:
        await log_in(page, page_url, OPS_TOKEN)
        await page.evaluate("document.querySelector('[data-service] details').open = true")
        html = await page.dom()
        replicas = await page.evaluate(
            "[...document.querySelectorAll('[data-service-replica]')].map((row) =>"
            " [...row.cells].map((c) => c.textContent))"
        )
        clients = await page.evaluate(
            "[...document.querySelectorAll('[data-service-client]')].map((row) =>"
            " [...row.cells].map((c) => c.textContent))"
        )
        figures = await page.evaluate(
            "document.querySelector('[data-service=\"detector\"] .service-figures').textContent"
        )
        decisions = await page.evaluate(
            "[...document.querySelectorAll('[data-scale-decision]')].map((li) =>"
            " [...li.childNodes].slice(1).map((n) => n.textContent).join('').trim())"
        )
    assert element_text(html, "services-summary") == "1 service(s), 3 client(s)"
    # Each scale decision with its reason (after its time, in the browser's locale).
    assert decisions == [
        "start dep-svc-01 at metro-east: a client at metro-east needs a replica: none runs yet",
        "start dep-svc-02 at campus-west: a client at campus-west needs a replica: none within "
        "10 ms",
    ]
    assert figures == (
        "model yolo-n, owner fleet-ops \u00b7 3 client(s) on 2 replica(s) \u00b7 "
        "requests 24.0/s \u00b7 p99 18.0 ms \u00b7 batches of 3.2 rows \u00b7 "
        "compute best-effort 40%, critical 60%"
    )
    assert replicas == [
        ["dep-svc-01", "metro-east", "node-dgx-a", "running", "3", "24.0/s", "18.0 ms", "2",
         "3.2 rows", "best-effort 40%, critical 60%"],
        ["dep-svc-02", "campus-west", "\u2014", "pending", "0", "\u2014", "\u2014", "\u2014",
         "\u2014", "\u2014"],
    ]  # fmt: skip
    assert clients == [
        ["cam-1", "dep-svc-01", "12.0/s", "0.0/s", "10.0 ms"],
        ["cam-2", "dep-svc-01", "8.0/s", "1.5/s", "18.0 ms"],
        ["cam-3", "dep-svc-01", "4.0/s", "0.0/s", "\u2014"],
    ]


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
    assert element_text(html, "load-nodes") == "no load samples yet"
    assert element_text(html, "load-deployments") == "no deployment has reported load yet"
    assert element_text(html, "resizes") == "no resizes yet"


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


# ---- load over time: uPlot charts ----

CHARTS = """[...document.querySelectorAll('#load [data-chart]')].map((box) => [
  box.dataset.chart,
  box.closest('[data-load-deployment]')?.dataset.loadDeployment ?? null,
  box.querySelectorAll('canvas').length,
  [...box.querySelectorAll('.u-legend .u-series .u-label')].map((label) => label.textContent),
])"""
"""Each load chart: [kind, its deployment (null: the nodes'), canvases, its legend's labels]."""

_STROKE = """(box, label) => {
  const row = [...box.querySelectorAll('.u-legend .u-series')]
    .find((r) => r.querySelector('.u-label')?.textContent === label);
  const [r, g, b] = getComputedStyle(row.querySelector('.u-marker')).borderTopColor
    .match(/\\d+/g).map(Number);
  const canvas = box.querySelector('canvas');
  const { width, height } = canvas;
  const data = canvas.getContext('2d').getImageData(0, 0, width, height).data;
  let total = 0;
  let widest = 0;
  for (let y = 0; y < height; y++) {
    let inRow = 0;
    for (let i = 4 * y * width; i < 4 * (y + 1) * width; i += 4) {
      const near = Math.abs(data[i] - r) + Math.abs(data[i + 1] - g) + Math.abs(data[i + 2] - b);
      if (data[i + 3] > 200 && near < 30) inRow++;
    }
    total += inRow;
    widest = Math.max(widest, inRow);
  }
  return [total, widest, width];
}"""


def stroke_pixels(selector: str, label: str) -> str:
    """A JavaScript expression: [the pixels of the chart at `selector` drawn in the colour of
    its series `label` (its legend marker's), the most of them in one pixel row, the canvas
    width]. uPlot draws on a canvas: this is how a test sees a line."""
    return f"({_STROKE})(document.querySelector({json.dumps(selector)}), {json.dumps(label)})"


def deployment_chart(deployment_id: str, kind: str) -> str:
    return f'[data-load-deployment="{deployment_id}"] [data-chart="{kind}"]'


async def test_page_charts_load_over_time(page_url: str, tmp_path: Path) -> None:
    chromium = require_chromium()
    async with open_page(chromium, tmp_path / "profile") as page:
        await log_in(page, page_url, OPS_TOKEN)
        charts = await page.wait_for(
            f"document.querySelectorAll('#load canvas').length === 3 && {CHARTS}"
        )
        lines = {
            node: await page.evaluate(stroke_pixels("#load-nodes", node))
            for node in ("node-dgx-a", "node-ws-b")
        }
        slo = await page.evaluate(
            stroke_pixels(deployment_chart(DEPLOYMENT_ID, "requests"), "p99 SLO")
        )
        facts = await page.evaluate(
            f"document.querySelector('[data-load-deployment=\"{DEPLOYMENT_ID}\"] .load-facts')"
            ".textContent"
        )
        batching = await page.evaluate(
            f"document.querySelector('[data-load-deployment=\"{DEPLOYMENT_ID}\"] .batch-facts')"
            ".textContent"
        )
        resizes = await page.evaluate(
            "[...document.querySelectorAll('[data-resize-id]')].map((row) =>"
            " [row.dataset.resizeId, ...[...row.cells].map((c) => c.textContent)])"
        )
        html = await page.dom()
    assert charts == [
        ["nodes", None, 1, ["Time", "node-dgx-a", "node-ws-b"]],
        ["requests", DEPLOYMENT_ID, 1,
         ["Time", "requests/s", "failed/s", "p50 ms", "p99 ms", "p99 SLO"]],
        ["cpu", DEPLOYMENT_ID, 1, ["Time", "CPU used", "CPU limit"]],
    ]  # fmt: skip
    for node, (drawn, _, _) in lines.items():
        assert drawn > 300, (node, drawn)
    # The SLO is a horizontal line (dashed): one pixel row holds a good part of the width.
    drawn, widest, width = slo
    assert widest > 0.4 * width, slo
    assert facts.strip() == (
        "on node-dgx-a \u00b7 priority critical \u00b7 SLO p99 \u2264 50.0 ms \u00b7 now 42.5 "
        "req/s, p99 30.0 ms, CPU 0.90 of 1.25 cores"
    )
    assert batching == (
        "batches of 3.5 rows, queue delay p99 2.5 ms \u00b7 compute critical 80%, best-effort 20%"
    )
    ((resize_id, _, *cells),) = resizes  # the time is the browser's local time
    assert [resize_id, *cells] == [
        "r-0001", DEPLOYMENT_ID, "node-dgx-a", "0.50 \u2192 1.25", "usage",
        "throttled 62% of the last 1.0 s at 0.50 cores; critical",
    ]  # fmt: skip
    assert element_text(html, "load-summary") == (
        "last 300 s \u00b7 2 node(s), 1 deployment(s), 1 resize(s)"
    )


async def test_load_charts_take_new_data_in_place(
    load_view: StaticOpsView, load_page_url: str, tmp_path: Path
) -> None:
    chromium = require_chromium()
    node_value = (
        "[...document.querySelectorAll('#load-nodes .u-series')].find((row) =>"
        " row.querySelector('.u-label').textContent === 'node-dgx-a')"
        ".querySelector('.u-value').textContent"
    )
    async with open_page(chromium, tmp_path / "profile") as page:
        await log_in(page, load_page_url, OPS_TOKEN)
        await page.wait_for("document.querySelectorAll('#load canvas').length === 5")
        await page.evaluate(
            "document.querySelectorAll('#load canvas').forEach((c, i) => {"
            " c.dataset.mark = String(i); })"
        )
        # A heartbeat more: the legend shows the new latest load, on the same canvases.
        points = load_view.load_info["nodes"][0]["points"]
        points.append([points[-1][0] + 1, 0.77, 12.3, 16.0, 2100])
        await page.wait_for(f"{node_value} === '0.77'")
        # The batch deployment is gone: its card and its charts go, the others stay.
        assert load_view.load_info["deployments"][1]["deployment_id"] == BATCH_DEPLOYMENT_ID
        del load_view.load_info["deployments"][1]
        cards = await page.wait_for(
            "document.querySelectorAll('[data-load-deployment]').length === 1"
            " && [...document.querySelectorAll('[data-load-deployment]')]"
            ".map((card) => card.dataset.loadDeployment)"
        )
        marks = await page.evaluate(
            "[...document.querySelectorAll('#load canvas')].map((c) => c.dataset.mark ?? null)"
        )
    assert cards == [DEPLOYMENT_ID]
    assert marks == ["0", "1", "2"]


async def test_screenshot_shows_load_over_time(load_page_url: str, tmp_path: Path) -> None:
    chromium = require_chromium()
    async with open_page(chromium, tmp_path / "profile") as page:
        await log_in(page, load_page_url, OPS_TOKEN)
        await page.wait_for("document.querySelectorAll('#load canvas').length === 5")
        node_colors = await page.evaluate(
            "[...document.querySelectorAll('#load-nodes .u-series')].slice(1).map((row) =>"
            " [row.querySelector('.u-label').textContent, getComputedStyle("
            "row.querySelector('.u-marker')).borderTopColor.match(/\\d+/g).map(Number)])"
        )
        resizes = await page.evaluate(
            "[...document.querySelectorAll('[data-resize-id]')].map((r) => r.dataset.resizeId)"
        )
        await page.evaluate("document.getElementById('load-title').scrollIntoView()")
        png = await page.screenshot()
    path = save_artifact("ops-page-load.png", png)
    assert resizes == ["r-0002", "r-0001"]  # the newest first
    _, _, rows = decode_png(png)
    pixels = collections.Counter(row[x : x + 3] for row in rows for x in range(0, len(row), 3))
    assert [node for node, _ in node_colors] == ["node-dgx-a", "node-ws-b"]
    for node, rgb in node_colors:  # a minute of each node's load, as a line
        assert pixels[bytes(rgb)] > 300, (node, rgb, path)
    assert pixels[css_color("bad")] > 300, path  # the critical deployment's SLO line
    assert pixels[css_color("free-edge")] > 300, path  # CPU used


MARKUP = '<img src=x onerror="window.pwned = true">'


@pytest.fixture
async def markup_page_url() -> AsyncIterator[str]:
    """Reasons, and a node id, that are HTML: a resize's, a rebalance's."""
    load = StaticOpsView().load_info
    load["resizes"][0]["reason"] = MARKUP
    load["nodes"][1]["node_id"] = MARKUP
    rebalance = StaticOpsView().migration_list[0]
    rebalance["migration_id"] = "mig-0003"
    rebalance["trigger"] = "rebalance"
    rebalance["reason"] = f"node-dgx-a hot (load 0.95 for 30 s); {MARKUP}"
    async for url in serve(StaticOpsView(migration_list=[rebalance], load_info=load)):
        yield url


async def test_reasons_are_shown_as_text(markup_page_url: str, tmp_path: Path) -> None:
    chromium = require_chromium()
    async with open_page(chromium, tmp_path / "profile") as page:
        await log_in(page, markup_page_url, OPS_TOKEN)
        await page.wait_for("document.querySelectorAll('#load canvas').length === 3")
        shown = await page.evaluate(
            "[document.querySelector('[data-resize-id] td:last-child').textContent,"
            " document.querySelector('[data-migration-id] .migration-reason').textContent,"
            " document.querySelector('[data-migration-id] header').textContent,"
            " [...document.querySelectorAll('#load-nodes .u-label')].map((l) => l.textContent),"
            " document.querySelectorAll('img').length, window.pwned ?? null]"
        )
    resize_reason, migration_reason, header, legend, images, pwned = shown
    assert resize_reason == MARKUP
    assert migration_reason == f"reason: node-dgx-a hot (load 0.95 for 30 s); {MARKUP}"
    assert " \u00b7 rebalance \u00b7 " in header
    assert legend == ["Time", "node-dgx-a", MARKUP]
    assert (images, pwned) == (0, None)


@web.middleware
async def _no_load_api(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.path == "/api/load":
        raise web.HTTPNotFound()  # as any path this broker does not know
    return await handler(request)


@pytest.fixture
async def old_broker_url() -> AsyncIterator[str]:
    """A broker older than the load history: /api/load is a 404, the rest as usual."""
    async for url in serve(StaticOpsView(), _no_load_api):
        yield url


class _FailingLoadView(StaticOpsView):
    async def load(self) -> LoadInfo:
        raise RuntimeError("history unavailable")


@pytest.fixture
async def failing_load_url() -> AsyncIterator[str]:
    async for url in serve(_FailingLoadView()):
        yield url


async def test_a_broker_without_the_load_api_shows_the_rest(
    old_broker_url: str, tmp_path: Path
) -> None:
    chromium = require_chromium()
    async with open_page(chromium, tmp_path / "profile") as page:
        await log_in(page, old_broker_url, OPS_TOKEN)
        html = await page.dom()
        hidden = await page.evaluate(
            "[document.getElementById('load-missing').hidden,"
            " document.getElementById('load-panels').hidden,"
            " document.querySelectorAll('#load canvas').length]"
        )
    dom = DomDump(html)
    assert element_text(html, "status").startswith("last updated")
    assert [e.attrs["data-node-id"] for e in dom.having("data-node-id")] == [
        "node-dgx-a",
        "node-ws-b",
    ]
    assert [e.attrs["data-migration-id"] for e in dom.having("data-migration-id")] == [
        "mig-0002",
        "mig-0001",
    ]
    assert hidden == [False, True, 0]
    assert element_text(html, "load-missing") == (
        "this broker serves no load history (/api/load): it predates the load charts"
    )
    assert element_text(html, "load-summary") == ""


async def test_a_failing_load_view_shows_the_rest(failing_load_url: str, tmp_path: Path) -> None:
    chromium = require_chromium()
    async with open_page(chromium, tmp_path / "profile") as page:
        await log_in(page, failing_load_url, OPS_TOKEN)
        html = await page.dom()
    assert element_text(html, "status").startswith("last updated")
    assert [e.attrs["data-deployment-id"] for e in DomDump(html).having("data-deployment-id")] == [
        DEPLOYMENT_ID
    ]
    assert element_text(html, "load-summary") == (
        "update failed: /api/load: load: RuntimeError: history unavailable"
    )


# ---- the dashboard of a real cluster under inference ----


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    cluster = Cluster(tmp_path)
    try:
        await cluster.start_broker()
        # A sample with every heartbeat: an idle node's otherwise goes every 10 s (its
        # --sample-interval), and the chart below wants a few seconds of them.
        await asyncio.gather(
            *(
                cluster.start_node(plan, "process", "--sample-interval", "0.2")
                for plan in THREE_NODES[:2]
            )
        )
        yield cluster
    finally:
        await cluster.stop()


async def _api_load(cluster: Cluster) -> Any:
    headers = ops_headers(cluster.root / "broker-state" / "ops-token")
    async with (
        aiohttp.ClientSession(headers=headers) as http,
        http.get(f"http://127.0.0.1:{cluster.ops_port}/api/load") as response,
    ):
        assert response.status == 200, await response.text()
        return await response.json()


async def test_dashboard_charts_a_live_clusters_load(cluster: Cluster, tmp_path: Path) -> None:
    chromium = require_chromium()
    nodes = [plan.node_id for plan in THREE_NODES[:2]]
    async with cluster.edge("alice") as alice:
        sha = (await alice.upload(modelzoo.model_path("mlp"))).sha256
        deployment = await alice.deploy(model_sha256=sha, model_name="mlp", gpus=1, site="site-a")
    stop = asyncio.Event()

    async def infer() -> None:  # a closed loop on the replica, while the page is looked at
        while not stop.is_set():
            await infer_once(deployment)

    inference = asyncio.create_task(infer(), name="inference")
    try:
        # Three seconds of heartbeats (0.2 s apart) of every node, the requests in them.
        deadline = time.monotonic() + 60
        while True:
            load = await _api_load(cluster)
            heartbeats = {n["node_id"]: len(n["points"]) for n in load["nodes"]}
            served = [
                p[1]
                for d in load["deployments"]
                if d["deployment_id"] == deployment.deployment_id
                for p in d["points"]
            ]
            if all(heartbeats.get(n, 0) >= 15 for n in nodes) and any(served):
                break
            assert time.monotonic() < deadline, (heartbeats, served)
            await asyncio.sleep(0.2)
        token = (cluster.root / "broker-state" / "ops-token").read_text().strip()
        async with open_page(chromium, tmp_path / "profile") as page:
            await log_in(page, f"http://127.0.0.1:{cluster.ops_port}/", token)
            charts = await page.wait_for(
                f"document.querySelectorAll('#load canvas').length === 3 && {CHARTS}"
            )
            lines = [await page.evaluate(stroke_pixels("#load-nodes", node)) for node in nodes]
            html = await page.dom()
            await page.evaluate("document.getElementById('load-title').scrollIntoView()")
            save_artifact("ops-page-load-live.png", await page.screenshot())
    finally:
        stop.set()
        await inference
    assert [chart[:3] for chart in charts] == [
        ["nodes", None, 1],
        ["requests", deployment.deployment_id, 1],
        ["cpu", deployment.deployment_id, 1],
    ]
    assert charts[0][3] == ["Time", *nodes]
    for node, (drawn, _, _) in zip(nodes, lines, strict=True):
        assert drawn > 100, (node, drawn)
    # These nodes run the static policy (the default), which never resizes: the list says so.
    # A real resize needs CPU limits a node can change (Docker, or a writable cgroup) and a
    # burst; bench.resize makes them, and the resize list is checked on `live_load` above.
    assert load["resizes"] == []
    assert element_text(html, "resizes") == "no resizes yet"


async def test_a_one_time_link_logs_in_and_leaves_the_address_bar(
    page_url: str, tmp_path: Path
) -> None:
    chromium = require_chromium()
    headers = {"Authorization": f"Bearer {OPS_TOKEN}"}
    async with (
        aiohttp.ClientSession(headers=headers) as http,
        http.post(f"{page_url}api/login-link") as response,
    ):
        link = page_url.rstrip("/") + (await response.json())["path"]
    async with open_page(chromium, tmp_path / "profile") as page:
        await page.navigate(link)
        await page.wait_for(
            "(document.getElementById('status')?.textContent ?? '').startsWith('last updated')"
        )
        assert await page.evaluate("location.href") == page_url
        assert await page.evaluate("document.cookie") == ""  # HttpOnly, as after a login
    async with open_page(chromium, tmp_path / "profile2") as page:  # the link is used up
        await page.navigate(link)
        error = await page.wait_for(
            "document.getElementById('login-error')?.hidden === false"
            " && document.getElementById('login-error').textContent"
        )
        assert "code=" not in await page.evaluate("location.href")
        assert await page.evaluate("fetch('/api/nodes').then((r) => r.status)") == 401
    assert "used already or has expired" in error


def crowded_migration() -> MigrationInfo:
    """A make-before-break move whose last four steps fall in its last 3 %: their labels
    cannot all sit where their events are."""
    start = time.time() - 60
    steps = [
        ("decided", 0.0),
        ("target_started", 0.002),
        ("target_ready", 1.2),
        ("switched", 1.45),
        ("client_acknowledged", 1.455),
        ("old_stopped", 1.49),
        ("completed", 1.491),
    ]
    migration = copy.deepcopy(StaticOpsView().migration_list[1])
    migration["migration_id"] = "mig-crowded"
    migration["timeline"] = [{"event": e, "at": start + s} for e, s in steps]
    return migration


@pytest.mark.parametrize("window_width", [WINDOW[0], 700])
async def test_timeline_labels_stay_inside_their_card(tmp_path: Path, window_width: int) -> None:
    chromium = require_chromium()
    view = StaticOpsView(migration_list=[crowded_migration(), *StaticOpsView().migration_list])
    async for url in serve(view):
        async with open_page(chromium, tmp_path / "profile") as page:
            await page.call(
                "Emulation.setDeviceMetricsOverride",
                width=window_width,
                height=WINDOW[1],
                deviceScaleFactor=1,
                mobile=False,
            )
            await log_in(page, url, OPS_TOKEN)
            cards = await page.evaluate(
                "[...document.querySelectorAll('[data-migration-id]')].map((card) => {"
                " const c = card.getBoundingClientRect();"
                " return [card.dataset.migrationId, [c.left, c.right],"
                " [...card.querySelectorAll('.timeline-event text')].map((t) => {"
                " const b = t.getBoundingClientRect();"
                " return [t.textContent, b.left, b.top, b.right, b.bottom]; })]; })"
            )
    assert [card[0] for card in cards] == ["mig-crowded", "mig-0002", "mig-0001"]
    for card_id, (card_left, card_right), labels in cards:
        assert labels, card_id
        for text, left, _, right, _ in labels:
            assert card_left <= left and right <= card_right, (card_id, text, left, right)
        for i, a in enumerate(labels):
            for b in labels[i + 1 :]:
                overlap = a[1] < b[3] and b[1] < a[3] and a[2] < b[4] and b[2] < a[4]
                assert not overlap, (card_id, a, b)


async def _api(cluster: Cluster, path: str) -> Any:
    headers = ops_headers(cluster.root / "broker-state" / "ops-token")
    async with (
        aiohttp.ClientSession(headers=headers) as http,
        http.get(f"http://127.0.0.1:{cluster.ops_port}{path}") as response,
    ):
        assert response.status == 200, await response.text()
        return await (response.json() if path.startswith("/api/") else response.text())


async def test_dashboard_metrics_and_status_show_a_live_services_replica_and_clients(
    cluster: Cluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    chromium = require_chromium()
    model = modelzoo.model_path("mlp")
    inputs = modelzoo.sample_inputs(model)
    keys = cluster.api_keys
    async with (
        OffloadClient(cluster.broker_address, keys["alice"]) as alice,
        OffloadClient(cluster.broker_address, keys["bob"]) as bob,
    ):
        sha = await alice.upload_model(model)
        await alice.create_service("detector", sha, "mlp", gpus=1, clients=["bob"])
        mine = await alice.use_service("detector", site="site-a")
        theirs = await bob.use_service("detector", site="site-a")
        assert mine.deployment_id == theirs.deployment_id  # one replica for both
        replica = mine.deployment_id
        # Until the replica's per-client figures of both reached the broker.
        deadline = time.monotonic() + 60
        while True:
            for client in (alice, bob, bob):
                await client.infer(inputs)
            (service,) = await _api(cluster, "/api/services")
            busiest = {c["client_id"]: c for c in service["busiest_clients"]}
            if {"alice", "bob"} <= busiest.keys() and all(
                c["request_rate"] > 0 for c in busiest.values()
            ):
                break
            assert time.monotonic() < deadline, service
            await asyncio.sleep(0.1)
        metrics = await _api(cluster, "/metrics")
        token = (cluster.root / "broker-state" / "ops-token").read_text().strip()
        async with open_page(chromium, tmp_path / "profile") as page:
            await log_in(page, f"http://127.0.0.1:{cluster.ops_port}/", token)
            row = await page.wait_for(
                f"document.querySelector('[data-service-replica=\"{replica}\"]') && "
                f"[...document.querySelector('[data-service-replica=\"{replica}\"]').cells]"
                ".map((c) => c.textContent)"
            )
            decision = await page.evaluate(
                f"document.querySelector('[data-scale-decision=\"{replica}\"]').textContent"
            )
            html = await page.dom()
            await page.evaluate("document.getElementById('services-title').scrollIntoView()")
            save_artifact("ops-page-services-live.png", await page.screenshot())
        args = argparse.Namespace(
            ops=f"http://127.0.0.1:{cluster.ops_port}",
            ops_token_file=str(cluster.root / "broker-state" / "ops-token"),
            json=False,
        )
        assert await _status(args) == 0
        status = capsys.readouterr().out
        secrets = (mine.token, theirs.token, keys["alice"], keys["bob"])
    assert (service["name"], service["owner"], service["clients"]) == ("detector", "alice", 2)
    (shown,) = service["replicas"]
    assert (shown["deployment_id"], shown["node_id"], shown["clients"]) == (replica, "node-a", 2)
    assert shown["request_rate"] is not None and shown["request_rate"] > 0
    # The panel: the replica at site-a on node-a, running, with its two clients.
    assert row[:5] == [replica, "site-a", "node-a", "running", "2"]
    # ... and why it started: alice's attach found none running.
    assert decision.endswith(
        f"start {replica} at site-a: a client at site-a needs a replica: none runs yet"
    ), decision
    (started,) = service["scale_decisions"]
    assert (started["action"], started["deployment_id"]) == ("start", replica)
    assert element_text(html, "services-summary") == "1 service(s), 2 client(s)"
    # /metrics: the service's figures and each client's calls, measured at the replica.
    for line in (
        'offload_service_replicas{service="detector",site="site-a"} 1.0',
        'offload_service_clients{service="detector"} 2.0',
        'offload_service_request_rate{service="detector"}',
        'offload_service_client_request_rate{client="alice",service="detector"}',
        'offload_service_client_request_rate{client="bob",service="detector"}',
        'offload_service_client_refused_rate{client="bob",service="detector"} 0.0',
    ):
        assert line in metrics, line
    # offload status: the service and its replica's line.
    assert "services     1\n" in status
    assert "detector (model mlp, owner alice): 2 client(s), 1 replica(s);" in status
    assert re.search(rf"^\s+{replica}\s+site-a\s+node-a\s+running\s+2\s", status, re.M), status
    # No client's token (nor its API key) anywhere an operator reads.
    for secret in secrets:
        assert secret not in html and secret not in metrics and secret not in status
