// The broker's live dashboard: polls /api/nodes, /api/deployments, /api/migrations,
// /api/prewarm, /api/load and /api/services every second and redraws (the offload panel comes from each
// deployment's `offload` reports). Plain DOM; the load charts are uPlot's (vendored beside this
// file: the broker host may have no Internet), updated in place. Data is only ever set as text
// (textContent, attributes), never parsed as HTML.
"use strict";

const POLL_MS = 1000;
const MAX_MIGRATIONS = 20;
const MAX_RESIZES = 10;
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

// ---- services: one model for many clients, their replicas and their busiest clients ----

function rate(value) {
  return value === null || value === undefined ? "\u2014" : `${value.toFixed(1)}/s`;
}

function orDash(value, format) {
  return value === null || value === undefined ? "\u2014" : format(value);
}

function classShares(shares) {
  const parts = Object.entries(shares)
    .sort(([a], [b]) => a.localeCompare(b))
    .map(([name, share]) => `${name} ${Math.round(share * 100)}%`);
  return parts.join(", ") || "\u2014";
}

const SERVICE_REPLICA_COLUMNS = [
  ["replica", (r) => h("code", {}, r.deployment_id)],
  ["site", (r) => r.site],
  ["node", (r) => r.node_id || "\u2014"],
  ["state", (r) => badge(r.state)],
  ["clients", (r) => String(r.clients)],
  ["requests", (r) => rate(r.request_rate)],
  ["p99", (r) => orDash(r.latency_p99_ms, ms)],
  ["queue", (r) => orDash(r.queued, String)],
  ["batch", (r) => orDash(r.batch_size_mean, (b) => `${b.toFixed(1)} rows`)],
  ["compute by class", (r) => classShares(r.class_shares)],
];

const SERVICE_CLIENT_COLUMNS = [
  ["client", (c) => c.client_id],
  ["replica", (c) => h("code", {}, c.deployment_id)],
  ["requests", (c) => rate(c.request_rate)],
  ["refused", (c) => rate(c.refused_rate)],
  ["p99", (c) => orDash(c.latency_p99_ms, ms)],
];

function table(columns, items, rowAttrs, cls) {
  const head = h("tr", {}, ...columns.map(([title]) => h("th", { scope: "col" }, title)));
  const rows = items.map((item) =>
    h("tr", rowAttrs(item), ...columns.map(([, cell]) => h("td", {}, cell(item)))),
  );
  return h("table", { class: `deployments ${cls}` }, h("thead", {}, head), h("tbody", {}, ...rows));
}

function serviceCard(svc) {
  const figures = [
    `model ${svc.model_name}, owner ${svc.owner}`,
    `${svc.clients} client(s) on ${svc.replicas.length} replica(s)`,
    `requests ${rate(svc.request_rate)}`,
    `p99 ${orDash(svc.latency_p99_ms, ms)}`,
  ];
  if (svc.batch_size_mean !== null) figures.push(`batches of ${svc.batch_size_mean.toFixed(1)} rows`);
  if (Object.keys(svc.class_shares).length) figures.push(`compute ${classShares(svc.class_shares)}`);
  return h(
    "div",
    { class: "service-card", "data-service": svc.name },
    h("h3", {}, svc.name, " ", h("span", { class: "summary service-figures" }, figures.join(" \u00b7 "))),
    svc.replicas.length
      ? table(
          SERVICE_REPLICA_COLUMNS,
          svc.replicas,
          (r) => ({ "data-service-replica": r.deployment_id, class: `state-${cssToken(r.state)}` }),
          "service-replicas",
        )
      : h("p", { class: "empty" }, "no replica yet: one starts when a client attaches"),
    svc.scale_decisions.length
      ? h(
          "ul",
          { class: "scale-decisions", "aria-label": `scale decisions of ${svc.name}` },
          ...svc.scale_decisions.map((d) =>
            h(
              "li",
              { "data-scale-decision": d.deployment_id },
              h("time", {}, new Date(d.at * 1000).toLocaleTimeString()),
              ` ${d.action} `,
              h("code", {}, d.deployment_id),
              ` at ${d.site}: ${d.reason}`,
            ),
          ),
        )
      : null,
    svc.busiest_clients.length
      ? h(
          "details",
          { class: "service-clients" },
          h("summary", {}, `busiest clients (${svc.busiest_clients.length} of ${svc.clients})`),
          table(SERVICE_CLIENT_COLUMNS, svc.busiest_clients, (c) => ({ "data-service-client": c.client_id }), "service-clients"),
        )
      : null,
  );
}

function renderServices(services) {
  const box = document.getElementById("services");
  const summary = document.getElementById("services-summary");
  summary.className = "summary";
  const clients = services.reduce((n, svc) => n + svc.clients, 0);
  summary.textContent = services.length ? `${services.length} service(s), ${clients} client(s)` : "";
  const open = new Set(
    [...box.querySelectorAll(".service-card details[open]")].map((d) => d.closest(".service-card").dataset.service),
  );
  const cards = services.map(serviceCard);
  for (const card of cards) {
    const details = card.querySelector("details");
    if (details && open.has(card.dataset.service)) details.open = true; // keep what the operator opened
  }
  box.replaceChildren(...(cards.length ? cards : [h("p", { class: "empty" }, "no services")]));
}

function servicesFailed(err) {
  const summary = document.getElementById("services-summary");
  if (err.status === 404) {
    // A broker older than services' figures: nothing to show, and nothing wrong.
    document.getElementById("services").replaceChildren(
      h("p", { class: "empty" }, "this broker serves no services (/api/services)"),
    );
    summary.className = "summary";
    summary.textContent = "";
    return;
  }
  if (err.status === undefined) console.error(err);
  summary.className = "summary status-error";
  summary.textContent = `update failed: ${err.message}`;
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

// The width of a timeline label in the SVG's own units: its font is 12px of those units
// (dashboard.css), measured in that font, so that a wide font does not run past the card.
let labelMeasure = null;
function labelWidth(label) {
  if (labelMeasure === null) {
    labelMeasure = document.createElement("canvas").getContext("2d");
    labelMeasure.font = `12px ${getComputedStyle(document.body).fontFamily}`;
  }
  // 7.5 per character: a wide sans-serif's average, where no canvas is to be had.
  return labelMeasure ? labelMeasure.measureText(label).width + 2 : label.length * 7.5;
}

function timelineSvg(migration) {
  const width = 1300;
  const events = migration.timeline;
  const t0 = events[0].at;
  const spanMs = Math.max((events[events.length - 1].at - t0) * 1000, 1);
  const x = (atMs) => 10 + ((width - 20) * Math.min(atMs, spanMs)) / spanMs;
  const hasDowntime = migration.downtime_ms !== null && migration.downtime_ms !== undefined;
  const hasSpan = migration.span_gap_ms !== null && migration.span_gap_ms !== undefined;
  // Labels go above the bar (row 0) or below it (rows 1, 2, ...), each in the first row
  // where it fits beside the ones before it, never past either edge: events a few ms apart
  // (a pre-warmed move's start, a move's last steps) would otherwise print over each other
  // or off the card. A row is added when none has room.
  const rowFree = [10, 10];
  const labels = events.map((event, i) => {
    const offset = (event.at - t0) * 1000;
    const ex = x(offset);
    const label = `${event.event} +${ms(offset)}`;
    const w = labelWidth(label);
    const wanted = i === 0 ? ex : i === events.length - 1 ? ex - w : ex - w / 2;
    const left = Math.max(10, Math.min(wanted, width - 10 - w));
    let row = rowFree.findIndex((free) => free <= left);
    if (row < 0) {
      row = rowFree.length;
      rowFree.push(10);
    }
    rowFree[row] = left + w + 8;
    return { event, offset, ex, label, left, row };
  });
  const rowY = (row) => (row === 0 ? 30 : 66 + 16 * (row - 1));
  const below = rowY(rowFree.length - 1) - 66; // what the rows past the first below add
  const height = (hasDowntime ? (hasSpan ? 128 : 100) : 72) + below;
  const svg = s("svg", {
    class: "timeline",
    viewBox: `0 0 ${width} ${height}`,
    role: "img",
    "aria-label": `timeline of ${migration.migration_id}`,
  });
  svg.append(s("rect", { class: "timeline-bar", x: 10, y: 38, width: width - 20, height: 10 }));
  labels.forEach(({ event, offset, ex, label, left, row }) => {
    const at = new Date(event.at * 1000).toLocaleTimeString();
    svg.append(
      s(
        "g",
        { class: "timeline-event", "data-event": event.event },
        s("title", {}, `${event.event} at ${at} (+${ms(offset)})`),
        s("line", { x1: ex, y1: 34, x2: ex, y2: 52 }),
        s("text", { x: left, y: rowY(row), "text-anchor": "start" }, label),
      ),
    );
  });
  if (hasDowntime) {
    // Only the gap's length is recorded, not where it fell: drawn from the left, same scale.
    const barWidth = Math.max(x(migration.downtime_ms) - 10, 2);
    svg.append(
      s(
        "rect",
        { class: "downtime-bar", x: 10, y: 74 + below, width: barWidth, height: 8 },
        s("title", {}, `longest gap the client observed: ${ms(migration.downtime_ms)}`),
      ),
      s(
        "text",
        { x: 10, y: 96 + below, class: "downtime-label" },
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
        {
          class: "downtime-bar span-gap-bar",
          x: 10,
          y: 102 + below,
          width: spanWidth,
          height: 8,
        },
        s("title", {}, `longest gap over the whole migration: ${ms(migration.span_gap_ms)}`),
      ),
      s(
        "text",
        { x: 10, y: 124 + below, class: "downtime-label" },
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
    // What started the move (a rebalance names the hot node), then a failure's reason.
    migration.reason ? h("p", { class: "migration-reason" }, `reason: ${migration.reason}`) : null,
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

// ---- load over time: uPlot charts, kept between polls and given new data in place ----

const NODE_CHART_HEIGHT = 220;
const CHART_HEIGHT = 190;
// Node lines, in the order /api/load lists the nodes (a stable order).
const NODE_COLORS = ["#1f6fb4", "#d9480f", "#2b8a3e", "#7048e8", "#c2255c", "#0c8599", "#8d6e00", "#495057"];
const FAILED_COLOR = "#c2255c";
const P50_COLOR = "#e0a458";

const charts = new Map(); // key -> { plot, signature, box, height }
const loadCards = new Map(); // deployment id -> its article
let loadSpan = [0, 1]; // the time axis every chart shares: oldest to newest point, Unix s
let loadUpdated = null;

function cssVar(name) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim();
}

function fixed(value, digits) {
  return value === null || value === undefined ? "\u2014" : value.toFixed(digits);
}

function cores(value) {
  return value ? `${value.toFixed(2)}` : "unlimited"; // 0: no CPU limit
}

function legendValue(format) {
  // Hovering: the value at that instant; otherwise the series' latest known one.
  return (u, value, seriesIdx, idx) => {
    if (idx === null || idx === undefined) {
      const ys = u.data[seriesIdx];
      let i = ys.length - 1;
      while (i >= 0 && (ys[i] === null || ys[i] === undefined)) i--;
      value = i >= 0 ? ys[i] : null;
    }
    return value === null || value === undefined ? "\u2014" : format(value);
  };
}

function timeSeries() {
  const at = (t) => (t === null || t === undefined ? "latest" : new Date(t * 1000).toLocaleTimeString());
  return { value: (u, t) => at(t) };
}

function upTo(headroom) {
  // A y range from 0 to a little above the largest value (1 when there is none yet).
  return (u, min, max) => [0, max > 0 ? max * headroom : 1];
}

function chartWidth(box) {
  const style = getComputedStyle(box);
  const padding = parseFloat(style.paddingLeft) + parseFloat(style.paddingRight);
  return Math.max(box.clientWidth - padding, 240);
}

function timeSpan(load) {
  let lo = Infinity;
  let hi = -Infinity;
  for (const item of [...load.nodes, ...load.deployments]) {
    for (const point of item.points) {
      lo = Math.min(lo, point[0]);
      hi = Math.max(hi, point[0]);
    }
  }
  if (!Number.isFinite(lo)) return [0, 1];
  return lo === hi ? [lo - 1, hi + 1] : [lo, hi];
}

// Give the chart under `key` new data, or (re)create it when what it plots changed (a node
// came or went, the SLO changed): a poll redraws the lines, not the page.
function syncChart(key, box, signature, data, height, options) {
  const chart = charts.get(key);
  if (chart && chart.signature === signature && chart.box === box && chart.plot.root.isConnected) {
    chart.plot.setData(data);
    return;
  }
  dropChart(key);
  box.replaceChildren();
  const made = options();
  const plot = new uPlot(
    {
      ...made,
      width: chartWidth(box),
      height,
      // Hovering one chart shows the same instant on all; no drag-zoom: each poll rescales.
      cursor: { sync: { key: "load" }, drag: { x: false, y: false } },
      scales: { x: { time: true, range: () => loadSpan }, ...made.scales },
    },
    data,
    box,
  );
  charts.set(key, { plot, signature, box, height });
}

function dropChart(key) {
  const chart = charts.get(key);
  if (chart) {
    chart.plot.destroy();
    charts.delete(key);
  }
}

window.addEventListener("resize", () => {
  for (const chart of charts.values()) {
    chart.plot.setSize({ width: chartWidth(chart.box), height: chart.height });
  }
});

function renderNodeLoad(nodes) {
  const box = document.getElementById("load-nodes");
  const shown = nodes.filter((n) => n.points.length);
  if (!shown.length) {
    dropChart("nodes");
    box.replaceChildren(h("p", { class: "empty" }, "no load samples yet"));
    return;
  }
  // One x for all: each node's heartbeats arrive at their own instants; uPlot.join leaves the
  // other nodes' values undefined there, and a line spans those.
  const data = uPlot.join(shown.map((n) => [n.points.map((p) => p[0]), n.points.map((p) => p[1])]));
  syncChart("nodes", box, shown.map((n) => n.node_id).join("\n"), data, NODE_CHART_HEIGHT, () => ({
    series: [
      timeSeries(),
      ...shown.map((n, i) => ({
        label: n.node_id,
        scale: "load",
        stroke: NODE_COLORS[i % NODE_COLORS.length],
        width: 2,
        value: legendValue((v) => v.toFixed(2)),
      })),
    ],
    scales: { load: { range: [0, 1] } },
    axes: [{}, { scale: "load", label: "load", values: (u, ticks) => ticks.map((t) => t.toFixed(1)) }],
  }));
}

const CLASS_ORDER = ["critical", "standard", "best-effort"];

// The replica's batching at the latest point: rows per batch, the wait for a batch, and
// each priority class's share of the batches' compute time.
function batchingText(b) {
  const shares = CLASS_ORDER.filter((c) => c in b.class_shares)
    .map((c) => `${c} ${Math.round(b.class_shares[c] * 100)}%`)
    .join(", ");
  return `batches of ${fixed(b.batch_size_mean, 1)} rows, queue delay p99 ` +
    `${ms(b.queue_delay_p99_ms)}` + (shares ? ` \u00b7 compute ${shares}` : "");
}

function newLoadCard(d) {
  const card = h(
    "article",
    { class: "load-card", "data-load-deployment": d.deployment_id },
    h("header", {}, h("h4", {}, h("code", {}, d.deployment_id)), h("span", { class: "load-facts" })),
    h("p", { class: "batch-facts", hidden: "" }),
    h(
      "div",
      { class: "chart-row" },
      h("div", { class: "chart", "data-chart": "requests" }),
      h("div", { class: "chart", "data-chart": "cpu" }),
    ),
  );
  loadCards.set(d.deployment_id, card);
  return card;
}

function updateLoadCard(card, d) {
  const id = d.deployment_id;
  const points = d.points;
  const last = points[points.length - 1];
  const slo = d.latency_slo_ms;
  card.querySelector(".load-facts").textContent =
    ` on ${d.node_id} \u00b7 priority ${d.priority} \u00b7 ` +
    `SLO ${slo ? `p99 \u2264 ${ms(slo)}` : "none"} \u00b7 now ${fixed(last[1], 1)} req/s, ` +
    `p99 ${last[3] === null ? "\u2014" : ms(last[3])}, ` +
    `CPU ${fixed(last[4], 2)} of ${last[5] === null ? "\u2014" : cores(last[5])} cores`;
  const batchFacts = card.querySelector(".batch-facts");
  batchFacts.hidden = !d.batching;
  batchFacts.textContent = d.batching ? batchingText(d.batching) : "";

  const xs = points.map((p) => p[0]);
  const requests = [
    xs,
    points.map((p) => p[1]),
    points.map((p) => p[6]),
    points.map((p) => p[2]),
    points.map((p) => p[3]),
  ];
  if (slo) requests.push(xs.map(() => slo)); // the SLO: a horizontal line on the ms axis
  syncChart(`requests:${id}`, card.querySelector('[data-chart="requests"]'), `slo ${slo}`,
    requests, CHART_HEIGHT, () => ({
      title: "requests and latency",
      series: [
        timeSeries(),
        { label: "requests/s", scale: "req", stroke: cssVar("--pcie"), width: 2, value: legendValue((v) => v.toFixed(1)) },
        { label: "failed/s", scale: "req", stroke: FAILED_COLOR, width: 1.5, value: legendValue((v) => v.toFixed(1)) },
        { label: "p50 ms", scale: "ms", stroke: P50_COLOR, width: 1.5, dash: [4, 3], value: legendValue((v) => v.toFixed(1)) },
        { label: "p99 ms", scale: "ms", stroke: cssVar("--used-edge"), width: 2, value: legendValue((v) => v.toFixed(1)) },
        ...(slo
          ? [{
              label: "p99 SLO", scale: "ms", stroke: cssVar("--bad"), width: 2,
              dash: [8, 4], points: { show: false }, value: () => `${slo} ms`,
            }]
          : []),
      ],
      // Different headroom: a rate and a latency at their peaks do not draw over each other.
      scales: { req: { range: upTo(1.1) }, ms: { range: upTo(1.35) } },
      axes: [
        {},
        { scale: "req", label: "requests/s" },
        { scale: "ms", label: "ms", side: 1, grid: { show: false } },
      ],
    }));

  // The limit steps where a resize took effect (0, unlimited, is drawn as a gap).
  const cpu = [xs, points.map((p) => p[4]), points.map((p) => (p[5] ? p[5] : null))];
  syncChart(`cpu:${id}`, card.querySelector('[data-chart="cpu"]'), "cpu", cpu, CHART_HEIGHT,
    () => ({
      title: "CPU (cores)",
      series: [
        timeSeries(),
        { label: "CPU used", scale: "cores", stroke: cssVar("--free-edge"), width: 2, value: legendValue((v) => v.toFixed(2)) },
        {
          label: "CPU limit", scale: "cores", stroke: cssVar("--ink"), width: 2,
          paths: uPlot.paths.stepped({ align: 1 }), value: legendValue(cores),
        },
      ],
      scales: { cores: { range: upTo(1.2) } },
      axes: [{}, { scale: "cores", label: "cores" }],
    }));
}

function renderDeploymentLoad(deployments) {
  const box = document.getElementById("load-deployments");
  const ids = new Set(deployments.map((d) => d.deployment_id));
  for (const [id, card] of loadCards) {
    if (ids.has(id)) continue;
    dropChart(`requests:${id}`);
    dropChart(`cpu:${id}`);
    card.remove();
    loadCards.delete(id);
  }
  if (!deployments.length) {
    box.replaceChildren(h("p", { class: "empty" }, "no deployment has reported load yet"));
    return;
  }
  const cards = deployments.map((d) => loadCards.get(d.deployment_id) ?? newLoadCard(d));
  if (cards.length !== box.children.length || cards.some((card, i) => box.children[i] !== card)) {
    box.replaceChildren(...cards); // in the DOM before a chart is made: it takes its width
  }
  deployments.forEach((d, i) => updateLoadCard(cards[i], d));
}

const RESIZE_COLUMNS = [
  ["time", (r) => new Date(r.at * 1000).toLocaleTimeString()],
  ["deployment", (r) => h("code", {}, r.deployment_id)],
  ["node", (r) => r.node_id],
  ["cores", (r) => `${cores(r.cpus_before)} \u2192 ${cores(r.cpus_after)}`],
  ["policy", (r) => r.policy],
  ["reason", (r) => r.reason || "\u2014"],
];

function renderResizes(resizes) {
  const box = document.getElementById("resizes");
  const newest = [...resizes].sort((a, b) => b.at - a.at).slice(0, MAX_RESIZES);
  document.getElementById("resizes-summary").textContent = resizes.length
    ? `${resizes.length} recent` +
      (resizes.length > newest.length ? `, newest ${newest.length} shown` : ", newest first")
    : "";
  if (!resizes.length) {
    box.replaceChildren(h("p", { class: "empty" }, "no resizes yet"));
    return;
  }
  const head = h("tr", {}, ...RESIZE_COLUMNS.map(([title]) => h("th", { scope: "col" }, title)));
  const rows = newest.map((r) =>
    h("tr", { "data-resize-id": r.event_id }, ...RESIZE_COLUMNS.map(([, cell]) => h("td", {}, cell(r)))),
  );
  box.replaceChildren(
    h("table", { class: "deployments resizes" }, h("thead", {}, head), h("tbody", {}, ...rows)),
  );
}

function showLoadPanels(shown) {
  document.getElementById("load-missing").hidden = shown;
  document.getElementById("load-panels").hidden = !shown;
}

function renderLoad(load) {
  showLoadPanels(true);
  loadSpan = timeSpan(load); // before setData: the charts' x range reads it
  renderNodeLoad(load.nodes);
  renderDeploymentLoad(load.deployments);
  renderResizes(load.resizes);
  loadUpdated = new Date();
  const summary = document.getElementById("load-summary");
  summary.className = "summary";
  summary.textContent =
    `last ${Math.round(load.window_s)} s \u00b7 ${load.nodes.length} node(s), ` +
    `${load.deployments.length} deployment(s), ${load.resizes.length} resize(s)`;
}

function loadFailed(err) {
  const summary = document.getElementById("load-summary");
  if (err.status === 404) {
    // A broker older than the load history: nothing to chart, and nothing wrong.
    for (const key of [...charts.keys()]) dropChart(key);
    loadCards.clear();
    document.getElementById("load-deployments").replaceChildren();
    showLoadPanels(false);
    summary.className = "summary";
    summary.textContent = "";
    return;
  }
  if (err.status === undefined) console.error(err); // not the API's: a bug here, say where
  const stale = loadUpdated ? `; showing data from ${loadUpdated.toLocaleTimeString()}` : "";
  summary.className = "summary status-error";
  summary.textContent = `update failed: ${err.message}${stale}`;
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
    const error = new Error(`${path}: ${message}`);
    error.status = response.status;
    throw error;
  }
  return response.json();
}

function setStatus(ok, text) {
  const status = document.getElementById("status");
  status.className = ok ? "status status-ok" : "status status-error";
  status.textContent = text;
}

async function refresh() {
  // Load is polled beside the rest and fails on its own: a broker that predates /api/load
  // (404), or a failing load view, leaves the other panels as they are.
  const load = fetchJson("/api/load").then(renderLoad).catch(loadFailed);
  const services = fetchJson("/api/services").then(renderServices).catch(servicesFailed);
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
    await Promise.all([load, services]); // "last updated" once every panel has drawn
    lastUpdated = new Date();
    setStatus(true, `last updated ${lastUpdated.toLocaleTimeString()}`);
  } catch (err) {
    const stale = lastUpdated ? `; showing data from ${lastUpdated.toLocaleTimeString()}` : "";
    setStatus(false, `update failed: ${err.message}${stale}`);
  } finally {
    await Promise.all([load, services]);
    setTimeout(refresh, POLL_MS);
  }
}

refresh();
