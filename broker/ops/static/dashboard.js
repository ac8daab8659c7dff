// The broker's live dashboard: polls /api/nodes, /api/deployments, /api/migrations and
// /api/prewarm every second and redraws (the offload panel comes from each deployment's
// `offload` reports). Plain DOM, no libraries (the broker host may have no Internet). Data is
// only ever set as text (textContent, attributes), never parsed as HTML.
"use strict";

const POLL_MS = 1000;
const MAX_MIGRATIONS = 20;
const SVG_NS = "http://www.w3.org/2000/svg";
const GPU_W = 112;
const GPU_H = 54;

const openTopologies = new Set(); // node ids whose topology text the operator opened
let lastUpdated = null;

function h(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  setAttrs(node, attrs);
  node.append(...children.filter((c) => c !== null && c !== undefined));
  return node;
}

function s(tag, attrs = {}, ...children) {
  const node = document.createElementNS(SVG_NS, tag);
  setAttrs(node, attrs);
  node.append(...children);
  return node;
}

function setAttrs(node, attrs) {
  for (const [key, value] of Object.entries(attrs)) {
    if (value !== null && value !== undefined) node.setAttribute(key, String(value));
  }
}

function cssToken(text) {
  return String(text).toLowerCase().replace(/[^a-z0-9_-]/g, "-");
}

function badge(state) {
  return h("span", { class: `badge state-${cssToken(state)}` }, String(state));
}

function truncate(text, max) {
  return text.length > max ? `${text.slice(0, max - 1)}\u2026` : text;
}

function countBy(items, key) {
  const counts = new Map();
  for (const item of items) counts.set(item[key], (counts.get(item[key]) || 0) + 1);
  return [...counts].map(([k, n]) => `${n} ${k}`).join(", ");
}

function age(seconds) {
  if (seconds === null || seconds === undefined) return "never";
  if (seconds < 60) return `${seconds.toFixed(1)} s ago`;
  if (seconds < 3600) return `${Math.floor(seconds / 60)} min ago`;
  return `${(seconds / 3600).toFixed(1)} h ago`;
}

function ms(value) {
  if (value === null || value === undefined) return "not reported";
  return value < 1000 ? `${value.toFixed(1)} ms` : `${(value / 1000).toFixed(2)} s`;
}

// ---- nodes and their GPU topology ----

function gpuPositions(count) {
  if (count === 1) return { radius: 0, points: [[0, 0]] };
  // On a circle, no link runs along another one. GPU0 is at the top left (a flat pair on top
  // for an even count), the others follow clockwise.
  const radius = Math.max(110, (GPU_W + 24) / (2 * Math.sin(Math.PI / count)));
  const start = -Math.PI / 2 - Math.PI / count;
  const points = [];
  for (let i = 0; i < count; i++) {
    const angle = start + (2 * Math.PI * i) / count;
    points.push([radius * Math.cos(angle), radius * Math.sin(angle)]);
  }
  return { radius, points };
}

function linkClass(kind) {
  const nv = /^NV(\d+)$/.exec(kind);
  if (nv) return { cls: "link-nv", width: 2 + Math.min(Number(nv[1]), 18) / 3 };
  if (kind === "PIX") return { cls: "link-pix", width: 2 };
  if (kind === "PXB") return { cls: "link-pxb", width: 2 };
  if (kind === "PHB" || kind === "NODE") return { cls: "link-phb", width: 1.5 };
  if (kind === "SYS") return { cls: "link-sys", width: 1.5 };
  return { cls: "link-other", width: 1 };
}

function topologySvg(node) {
  const gpus = node.gpus;
  const { radius, points } = gpuPositions(gpus.length);
  const width = 2 * radius + GPU_W + 16;
  const height = 2 * radius + GPU_H + 16;
  const center = new Map();
  gpus.forEach((gpu, i) => center.set(gpu.index, [points[i][0] + width / 2, points[i][1] + height / 2]));

  const svg = s("svg", {
    class: "topology",
    viewBox: `0 0 ${width} ${height}`,
    width,
    height,
    role: "img",
    "aria-label": `GPU topology of ${node.node_id}`,
  });
  for (const link of node.links) {
    const a = center.get(link.a);
    const b = center.get(link.b);
    if (!a || !b) continue; // a link to a GPU the node did not list: nothing to draw it to
    const style = linkClass(link.kind);
    svg.append(
      s(
        "line",
        {
          class: `link ${style.cls}`,
          "data-kind": link.kind,
          x1: a[0], y1: a[1], x2: b[0], y2: b[1],
          "stroke-width": style.width,
        },
        s("title", {}, `GPU${link.a} \u2013 GPU${link.b}: ${link.kind}`),
      ),
    );
  }
  for (const gpu of gpus) {
    const [cx, cy] = center.get(gpu.index);
    const x = cx - GPU_W / 2;
    const y = cy - GPU_H / 2;
    const holders = gpu.holders.length ? gpu.holders.join(", ") : "free";
    const memory = `${(gpu.memory_total_mib / 1024).toFixed(0)} GiB`;
    const name = gpu.name.replace(/^NVIDIA /, "");
    svg.append(
      s(
        "g",
        {
          class: `gpu ${gpu.free ? "gpu-free" : "gpu-used"}`,
          "data-gpu-index": gpu.index,
          "data-state": gpu.free ? "free" : "used",
          "data-holders": gpu.holders.join(" "),
        },
        s("title", {}, `GPU${gpu.index} ${gpu.name} (${gpu.uuid}), ${memory}: ${holders}`),
        s("rect", { x, y, width: GPU_W, height: GPU_H, rx: 6 }),
        s("text", { x: cx, y: y + 15, class: "gpu-title" }, `GPU${gpu.index} \u00b7 ${memory}`),
        s("text", { x: cx, y: y + 31 }, truncate(name, 18)),
        s("text", { x: cx, y: y + 47, class: "gpu-holder" }, truncate(holders, 18)),
      ),
    );
  }
  return svg;
}

function nodeCard(node) {
  const free = node.gpus.filter((g) => g.free).length;
  const linkKinds = countBy(node.links, "kind");
  const details = h(
    "details",
    { class: "topology-text" },
    h("summary", {}, "nvidia-smi topo -m"),
    h("pre", {}, node.topology_text || "(no topology reported)"),
  );
  details.open = openTopologies.has(node.node_id);
  details.addEventListener("toggle", () => {
    if (details.open) openTopologies.add(node.node_id);
    else openTopologies.delete(node.node_id);
  });
  return h(
    "article",
    { class: `node state-${cssToken(node.state)}`, "data-node-id": node.node_id },
    h("header", {}, h("h3", {}, node.node_id), badge(node.state)),
    h(
      "dl",
      { class: "facts" },
      h("dt", {}, "site"), h("dd", {}, node.site),
      h("dt", {}, "address"), h("dd", {}, node.address),
      h("dt", {}, "runtime"), h("dd", {}, node.runtime),
      h("dt", {}, "heartbeat"), h("dd", {}, age(node.last_heartbeat_age_s)),
      h("dt", {}, "GPUs"), h("dd", {}, `${free} free of ${node.gpus.length}`),
    ),
    node.gpus.length
      ? topologySvg(node)
      : h("p", { class: "empty" }, "no GPUs: CPU replicas only"),
    node.links.length ? h("p", { class: "links-summary" }, `links: ${linkKinds}`) : null,
    details,
  );
}

function renderNodes(nodes) {
  const box = document.getElementById("nodes");
  const gpus = nodes.flatMap((n) => n.gpus);
  const used = gpus.filter((g) => !g.free).length;
  document.getElementById("nodes-summary").textContent = nodes.length
    ? `${nodes.length} (${countBy(nodes, "state")}) \u00b7 ${gpus.length} GPUs, ${used} used`
    : "";
  box.replaceChildren(
    ...(nodes.length
      ? nodes.map(nodeCard)
      : [h("p", { class: "empty" }, "no nodes registered yet")]),
  );
}

// ---- deployments ----

const DEPLOYMENT_COLUMNS = [
  ["deployment", (d) => h("code", {}, d.deployment_id)],
  ["client", (d) => d.client_id],
  ["model", (d) => d.model_name],
  ["state", (d) => badge(d.state)],
  ["node", (d) => d.node_id ?? "\u2014"],
  ["GPUs", (d) => (d.gpus.length ? d.gpus.join(", ") : "\u2014")],
  ["endpoint", (d) => (d.endpoint ? h("code", {}, d.endpoint) : "\u2014")],
  ["epoch", (d) => String(d.epoch)],
  ["priority", (d) => d.priority],
  ["client site", (d) => d.site],
  ["reason / placement", (d) => [d.reason, d.explanation].filter(Boolean).join(" \u2014 ") || "\u2014"],
];

function renderDeployments(deployments) {
  const box = document.getElementById("deployments");
  document.getElementById("deployments-summary").textContent = deployments.length
    ? `${deployments.length} (${countBy(deployments, "state")})`
    : "";
  if (!deployments.length) {
    box.replaceChildren(h("p", { class: "empty" }, "no deployments yet"));
    return;
  }
  const head = h("tr", {}, ...DEPLOYMENT_COLUMNS.map(([title]) => h("th", { scope: "col" }, title)));
  const rows = deployments.map((d) =>
    h(
      "tr",
      { "data-deployment-id": d.deployment_id, class: `state-${cssToken(d.state)}` },
      ...DEPLOYMENT_COLUMNS.map(([, cell]) => h("td", {}, cell(d))),
    ),
  );
  box.replaceChildren(
    h("table", { class: "deployments" }, h("thead", {}, head), h("tbody", {}, ...rows)),
  );
}

// ---- adaptive offload: where each device's requests ran, and why ----

function shareBar(share) {
  if (share === null || share === undefined) return h("span", { class: "empty" }, "no requests");
  const remote = Math.round(share * 100);
  const fill = h("span", { class: "share-remote" });
  fill.style.width = `${remote}%`; // CSSOM: the page's CSP allows no style attributes
  return h(
    "span",
    { class: "share", title: `${remote}% remote, ${100 - remote}% local` },
    h("span", { class: "share-bar", "aria-hidden": "true" }, fill),
    ` ${remote}% remote`,
  );
}

function reasons(session) {
  const byTarget = new Map();
  for (const d of session.decisions) {
    if (!byTarget.has(d.target)) byTarget.set(d.target, []);
    byTarget.get(d.target).push(`${d.reason} ${d.requests}`);
  }
  return [...byTarget].map(([target, parts]) => `${target}: ${parts.join(", ")}`).join(" \u00b7 ") || "\u2014";
}

const OFFLOAD_COLUMNS = [
  ["deployment", (d) => h("code", {}, d.deployment_id)],
  ["client", (d) => d.client_id],
  ["session", (d, o) => h("code", {}, o.session)],
  ["policy", (d, o) => o.policy],
  ["local model", (d, o) => o.local_model || "\u2014"],
  ["share", (d, o) => shareBar(o.remote_share)],
  ["remote / local", (d, o) => `${o.remote_requests} / ${o.local_requests}`],
  ["by reason", (d, o) => reasons(o)],
  ["fallbacks", (d, o) => String(o.fallbacks)],
  ["estimate remote", (d, o) => (o.remote_estimate_ms === null ? "\u2014" : ms(o.remote_estimate_ms))],
  ["estimate local", (d, o) => (o.local_estimate_ms === null ? "\u2014" : ms(o.local_estimate_ms))],
  ["replica", (d, o) => badge(o.remote_reachable ? "reachable" : "unreachable")],
  ["reported", (d, o) => age(o.reported_age_s)],
];

function renderOffload(deployments) {
  const box = document.getElementById("offload");
  const rows = deployments.flatMap((d) => (d.offload || []).map((o, i) => [d, o, i]));
  const devices = deployments.filter((d) => (d.offload || []).length).length;
  document.getElementById("offload-summary").textContent = devices
    ? `${devices} deployment(s) with a device model`
    : "";
  if (!rows.length) {
    box.replaceChildren(h("p", { class: "empty" }, "no offload reports yet"));
    return;
  }
  const head = h("tr", {}, ...OFFLOAD_COLUMNS.map(([title]) => h("th", { scope: "col" }, title)));
  const body = rows.map(([d, o, i]) =>
    h(
      "tr",
      {
        "data-offload-deployment": d.deployment_id,
        "data-offload-session": o.session,
        class: i ? "offload-older" : null, // an earlier start of the client
      },
      ...OFFLOAD_COLUMNS.map(([, cell]) => h("td", {}, cell(d, o))),
    ),
  );
  box.replaceChildren(
    h("table", { class: "deployments offload" }, h("thead", {}, head), h("tbody", {}, ...body)),
  );
}

// ---- predictive pre-warm: standby replicas at the sites clients are predicted to reach ----

function percent(probability) {
  // null for a standby a previous broker left: no prediction behind it.
  return probability === null || probability === undefined
    ? "\u2014"
    : `${Math.round(probability * 100)}%`;
}

const STANDBY_COLUMNS = [
  ["deployment", (sb) => h("code", {}, sb.deployment_id)],
  ["node", (sb) => sb.node_id],
  ["GPUs", (sb) => (sb.gpus.length ? sb.gpus.join(", ") : "\u2014")],
  ["predicted site", (sb) => sb.site],
  ["probability", (sb) => percent(sb.probability)],
  ["state", (sb) => badge(sb.state)],
  ["reserved", (sb) => age(sb.age_s)],
];

function renderPrewarm(prewarm) {
  const box = document.getElementById("prewarm");
  const standbys = prewarm.standbys;
  // Budget 0: pre-warm is off, though standbys being stopped may still be listed.
  document.getElementById("prewarm-summary").textContent = prewarm.budget
    ? `${standbys.length} of ${prewarm.budget} standbys`
    : `off${standbys.length ? ` (${standbys.length} still held)` : ""}`;
  if (!standbys.length) {
    box.replaceChildren(
      h(
        "p",
        { class: "empty" },
        prewarm.budget ? "no standbys held" : "pre-warm is off (--prewarm-budget 0)",
      ),
    );
    return;
  }
  const head = h("tr", {}, ...STANDBY_COLUMNS.map(([title]) => h("th", { scope: "col" }, title)));
  const rows = standbys.map((sb) =>
    h(
      "tr",
      {
        "data-standby-deployment": sb.deployment_id,
        "data-standby-replica": sb.replica_id,
        class: `state-${cssToken(sb.state)}`,
      },
      ...STANDBY_COLUMNS.map(([, cell]) => h("td", {}, cell(sb))),
    ),
  );
  box.replaceChildren(
    h("table", { class: "deployments standbys" }, h("thead", {}, head), h("tbody", {}, ...rows)),
  );
}

// ---- migrations ----

function timelineSvg(migration) {
  const width = 1300;
  const events = migration.timeline;
  const t0 = events[0].at;
  const spanMs = Math.max((events[events.length - 1].at - t0) * 1000, 1);
  const x = (atMs) => 10 + ((width - 20) * Math.min(atMs, spanMs)) / spanMs;
  const hasDowntime = migration.downtime_ms !== null && migration.downtime_ms !== undefined;
  const hasSpan = migration.span_gap_ms !== null && migration.span_gap_ms !== undefined;
  const height = hasDowntime ? (hasSpan ? 128 : 100) : 72;
  const svg = s("svg", {
    class: "timeline",
    viewBox: `0 0 ${width} ${height}`,
    role: "img",
    "aria-label": `timeline of ${migration.migration_id}`,
  });
  svg.append(s("rect", { class: "timeline-bar", x: 10, y: 38, width: width - 20, height: 10 }));
  // Labels go above or below the bar, each where it fits beside the ones before it: events
  // a few ms apart (a pre-warmed move's start) would otherwise print over each other.
  const rowY = [30, 66];
  const rowFree = [10, 10];
  events.forEach((event, i) => {
    const offset = (event.at - t0) * 1000;
    const ex = x(offset);
    const label = `${event.event} +${ms(offset)}`;
    const labelWidth = label.length * 7.5;
    const wanted = i === 0 ? ex : i === events.length - 1 ? ex - labelWidth : ex - labelWidth / 2;
    let left = Math.max(10, Math.min(wanted, width - 10 - labelWidth));
    const fits = [0, 1].filter((row) => rowFree[row] <= left);
    const row = fits.length ? fits[0] : rowFree[0] <= rowFree[1] ? 0 : 1;
    left = Math.max(left, rowFree[row]);
    rowFree[row] = left + labelWidth + 8;
    const at = new Date(event.at * 1000).toLocaleTimeString();
    svg.append(
      s(
        "g",
        { class: "timeline-event", "data-event": event.event },
        s("title", {}, `${event.event} at ${at} (+${ms(offset)})`),
        s("line", { x1: ex, y1: 34, x2: ex, y2: 52 }),
        s("text", { x: left, y: rowY[row], "text-anchor": "start" }, label),
      ),
    );
  });
  if (hasDowntime) {
    // Only the gap's length is recorded, not where it fell: drawn from the left, same scale.
    const barWidth = Math.max(x(migration.downtime_ms) - 10, 2);
    svg.append(
      s(
        "rect",
        { class: "downtime-bar", x: 10, y: 74, width: barWidth, height: 8 },
        s("title", {}, `longest gap the client observed: ${ms(migration.downtime_ms)}`),
      ),
      s(
        "text",
        { x: 10, y: 96, class: "downtime-label" },
        `client-observed downtime ${ms(migration.downtime_ms)} (same time scale)`,
      ),
    );
  }
  if (hasDowntime && hasSpan) {
    // The worst gap over the whole migration (the target's start included), same scale.
    const spanWidth = Math.max(x(migration.span_gap_ms) - 10, 2);
    svg.append(
      s(
        "rect",
        { class: "downtime-bar span-gap-bar", x: 10, y: 102, width: spanWidth, height: 8 },
        s("title", {}, `longest gap over the whole migration: ${ms(migration.span_gap_ms)}`),
      ),
      s(
        "text",
        { x: 10, y: 124, class: "downtime-label" },
        `worst gap over the whole migration ${ms(migration.span_gap_ms)} (decision to old ` +
          "replica stopped)",
      ),
    );
  }
  return svg;
}

function migrationCard(migration) {
  const outcome = migration.outcome ?? "under way";
  const events = migration.timeline;
  const started = events.length ? new Date(events[0].at * 1000).toLocaleTimeString() : "\u2014";
  const failed = migration.failed_requests ?? "not reported";
  return h(
    "article",
    {
      class: migration.prewarmed ? "migration prewarmed" : "migration",
      "data-migration-id": migration.migration_id,
      "data-prewarmed": migration.prewarmed ? "true" : null,
    },
    h(
      "header",
      {},
      h("code", {}, migration.migration_id),
      " ",
      badge(outcome),
      migration.prewarmed
        ? h(
            "span",
            { class: "badge prewarmed-badge", title: "switched to a pre-warmed standby" },
            "pre-warmed",
          )
        : null,
      h(
        "span",
        { class: "migration-facts" },
        ` deployment ${migration.deployment_id} \u00b7 ${migration.trigger} \u00b7 ` +
          `${migration.source ?? "?"} \u2192 ${migration.target ?? "?"} \u00b7 ` +
          `${migration.strategy} \u00b7 started ${started} \u00b7 ` +
          `downtime ${ms(migration.downtime_ms)} \u00b7 ` +
          `worst gap over the migration ${ms(migration.span_gap_ms)} \u00b7 ` +
          `failed requests ${failed}`,
      ),
    ),
    events.length ? timelineSvg(migration) : h("p", { class: "empty" }, "no events recorded yet"),
  );
}

function renderMigrations(migrations) {
  const box = document.getElementById("migrations");
  const shown = migrations.slice(0, MAX_MIGRATIONS);
  document.getElementById("migrations-summary").textContent = migrations.length
    ? `${migrations.length}` +
      (migrations.length > shown.length ? `, newest ${shown.length} shown` : "")
    : "";
  box.replaceChildren(
    ...(shown.length
      ? shown.map(migrationCard)
      : [h("p", { class: "empty" }, "no migrations yet")]),
  );
}

// ---- polling ----

async function fetchJson(path) {
  // The session cookie of /login goes along (same origin); without it, log in again.
  const response = await fetch(path, { cache: "no-store", credentials: "same-origin" });
  if (response.status === 401) {
    window.location.assign("/login");
  }
  if (!response.ok) {
    let message = `HTTP ${response.status}`;
    try {
      message = (await response.json()).error || message;
    } catch {
      // not JSON: keep the status
    }
    throw new Error(`${path}: ${message}`);
  }
  return response.json();
}

function setStatus(ok, text) {
  const status = document.getElementById("status");
  status.className = ok ? "status status-ok" : "status status-error";
  status.textContent = text;
}

async function refresh() {
  try {
    const [nodes, deployments, migrations, prewarm] = await Promise.all([
      fetchJson("/api/nodes"),
      fetchJson("/api/deployments"),
      fetchJson("/api/migrations"),
      fetchJson("/api/prewarm"),
    ]);
    renderNodes(nodes);
    renderDeployments(deployments);
    renderOffload(deployments);
    renderPrewarm(prewarm);
    renderMigrations(migrations);
    lastUpdated = new Date();
    setStatus(true, `last updated ${lastUpdated.toLocaleTimeString()}`);
  } catch (err) {
    const stale = lastUpdated ? `; showing data from ${lastUpdated.toLocaleTimeString()}` : "";
    setStatus(false, `update failed: ${err.message}${stale}`);
  } finally {
    setTimeout(refresh, POLL_MS);
  }
}

refresh();
