// openrld console: runs, curves, checkpoints, devices and the cluster, polled from the node's API.
//
// Every value that comes from a client (run ids, metadata, checkpoint names, errors) is written
// with textContent, never as markup, and the page's Content-Security-Policy forbids inline
// script. The API key lives in sessionStorage (this tab only) and goes out as X-API-Key, as the
// SDK sends it; every call is an API route under the same owner rules as the SDK's.
"use strict";

const POLL_MS = 2000; // how often the open page refreshes while the tab is visible
const KEY_STORE = "openrld.apiKey";
const RUN_PAGE = 100; // runs listed per page

// ------------------------------------------------------------------ DOM helpers

function el(tag, props, children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(props || {})) {
    if (value === undefined || value === null) continue;
    if (name === "text") node.textContent = String(value);
    else if (name === "class") node.className = value;
    else if (name === "data") Object.assign(node.dataset, value);
    else if (name === "href") node.setAttribute("href", value); // only "#/..." hrefs are ever built
    else node.setAttribute(name, value);
  }
  for (const child of children || []) {
    if (child !== null && child !== undefined) node.append(child);
  }
  return node;
}

// Replaces `root`'s children with `nodes`, leaving out the nulls of optional parts.
function show(root, ...nodes) {
  root.replaceChildren(...nodes.filter((node) => node !== null && node !== undefined));
}

function badge(state) {
  return el("span", { class: "badge state-" + String(state).replace(/[^a-z_]/g, ""), text: state });
}

function table(id, headings, rows) {
  const head = el("tr", {}, headings.map(([label, cls]) => el("th", { class: cls, text: label })));
  return el("table", { id }, [el("thead", {}, [head]), el("tbody", {}, rows)]);
}

function cell(value, cls) {
  return el("td", { class: cls }, [value instanceof Node ? value : document.createTextNode(value ?? "")]);
}

function bytes(n) {
  if (n === null || n === undefined) return "";
  const units = ["B", "kB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1000 && i < units.length - 1) { n /= 1000; i += 1; }
  return (i === 0 ? String(n) : n.toFixed(1)) + " " + units[i];
}

function when(iso) {
  if (!iso) return "";
  const d = new Date(iso);
  return d.toLocaleString();
}

function pairs(obj) {
  return Object.entries(obj || {}).map(([k, v]) => k + "=" + v).join(", ");
}

function runHref(id, tail) {
  return "#/runs/" + encodeURIComponent(id) + (tail || "");
}

// ------------------------------------------------------------------ API

class Unauthorized extends Error {}

async function api(path) {
  const headers = {};
  const key = sessionStorage.getItem(KEY_STORE);
  if (key) headers["X-API-Key"] = key;
  const response = await fetch(path, { headers, cache: "no-store" });
  if (response.status === 401) throw new Unauthorized("the node refused the key");
  const body = await response.json().catch(() => ({}));
  if (!response.ok) throw new Error(body.detail || "HTTP " + response.status);
  return body;
}

// ------------------------------------------------------------------ charts (canvas, drawn here)

function niceNumber(v) {
  if (v === 0) return "0";
  const a = Math.abs(v);
  if (a >= 1e4 || a < 1e-3) return v.toExponential(2);
  return Number(v.toPrecision(4)).toString();
}

// Draws one series (xs, ys ascending in x) with its axes' extremes labelled.
function drawSeries(canvas, xs, ys, xLabel) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth || 400;
  const height = canvas.clientHeight || 180;
  canvas.width = Math.round(width * ratio);
  canvas.height = Math.round(height * ratio);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  const left = 56, right = 8, top = 8, bottom = 22;
  ctx.strokeStyle = "#e4e7ec";
  ctx.strokeRect(left, top, width - left - right, height - top - bottom);
  ctx.fillStyle = "#667085";
  ctx.font = "11px system-ui, sans-serif";
  const finite = ys.map((y, i) => [xs[i], y]).filter(([, y]) => Number.isFinite(y));
  if (finite.length === 0) {
    ctx.fillText("no points yet", left + 8, top + 16);
    return;
  }
  let [xMin, xMax] = [finite[0][0], finite[finite.length - 1][0]];
  let yMin = Math.min(...finite.map(([, y]) => y));
  let yMax = Math.max(...finite.map(([, y]) => y));
  if (xMax === xMin) { xMin -= 1; xMax += 1; }
  if (yMax === yMin) { const pad = Math.abs(yMax) * 0.05 || 1; yMin -= pad; yMax += pad; }
  const px = (x) => left + ((x - xMin) / (xMax - xMin)) * (width - left - right);
  const py = (y) => top + (1 - (y - yMin) / (yMax - yMin)) * (height - top - bottom);
  ctx.textAlign = "right";
  ctx.fillText(niceNumber(yMax), left - 4, top + 10);
  ctx.fillText(niceNumber(yMin), left - 4, height - bottom);
  ctx.textAlign = "left";
  ctx.fillText(xLabel(xMin), left, height - 6);
  ctx.textAlign = "right";
  ctx.fillText(xLabel(xMax), width - right, height - 6);
  ctx.strokeStyle = "#2f6fdb";
  ctx.lineWidth = 1.5;
  ctx.beginPath();
  finite.forEach(([x, y], i) => (i === 0 ? ctx.moveTo(px(x), py(y)) : ctx.lineTo(px(x), py(y))));
  ctx.stroke();
  if (finite.length === 1) {
    ctx.fillStyle = "#2f6fdb";
    ctx.fillRect(px(finite[0][0]) - 2, py(finite[0][1]) - 2, 4, 4);
  }
}

function chartBox(id, title) {
  const canvas = el("canvas", { id, data: { points: "0" } });
  const last = el("span", { class: "muted" });
  const box = el("div", { class: "chart" }, [el("div", { class: "title" }, [el("span", { text: title }), last]), canvas]);
  return { box, canvas, last };
}

// ------------------------------------------------------------------ views

const state = { generation: 0, timer: null, curves: null };

function setActiveNav(name) {
  for (const id of ["nav-runs", "nav-cluster"]) {
    document.getElementById(id).classList.toggle("active", id === "nav-" + name);
  }
}

function runRow(run) {
  const status = run.status;
  return el("tr", { data: { runId: run.training_run_id, state: status.state } }, [
    cell(el("a", { href: runHref(run.training_run_id), class: "mono", text: run.training_run_id })),
    cell(run.owner),
    cell(badge(status.state)),
    cell(run.base_model),
    cell(pairs(run.settings), "mono"),
    cell(pairs(run.user_metadata), "meta"),
    cell(String(status.step), "num"),
    cell(status.last_error || "", "error"),
    cell(when(run.last_request_time)),
    cell(run.node || "this node"),
  ]);
}

async function viewRuns(root) {
  setActiveNav("runs");
  const body = await api("/openrl/v1/runs?limit=" + RUN_PAGE);
  const rows = body.runs.map(runRow);
  show(root,
    el("h1", { text: "Runs" }),
    rows.length ? table("runs-table", [["Run"], ["Owner"], ["State"], ["Base model"], ["Settings"], ["Metadata"],
      ["Step", "num"], ["Last error"], ["Last request"], ["Node"]], rows)
      : el("p", { class: "empty", id: "no-runs", text: "No runs yet. Create one with the tinker SDK." }),
    el("p", { class: "muted", text: body.cursor.total_count + " runs" }),
  );
}

function runFacts(run) {
  const status = run.status;
  const facts = [
    ["State", badge(status.state)], ["Waiting for", status.waiting_for || ""], ["Base model", run.base_model],
    ["Owner", run.owner], ["Fine-tuning", status.fine_tuning_type + (run.lora_rank ? " (rank " + run.lora_rank + ")" : "")],
    ["Settings", pairs(run.settings)], ["Metadata", pairs(run.user_metadata)], ["Step", String(status.step)],
    ["Queued ops", String(status.queues.training_ops_waiting)],
    ["Samples waiting / running", status.queues.samples_waiting + " / " + status.queues.samples_running],
    ["Last error", status.last_error || ""], ["Last checkpoint", status.last_checkpoint || ""],
    ["Node", run.node || "this node"], ["Moved", status.adopted_from ? status.adopted_from.detail : ""],
  ];
  return el("dl", { class: "facts", id: "run-facts" }, facts.flatMap(([k, v]) => [
    el("dt", { text: k }), el("dd", { data: { fact: k } }, [v instanceof Node ? v : document.createTextNode(v)]),
  ]));
}

function runHeader(run, tab) {
  const id = run.training_run_id;
  return [
    el("h1", { id: "run-title", class: "mono", text: id }),
    el("div", { class: "tabs" }, [
      el("a", { href: runHref(id), id: "tab-curves", text: "Curves" }),
      el("a", { href: runHref(id, "/checkpoints"), id: "tab-checkpoints", text: "Checkpoints" }),
      el("a", { href: "#/runs", text: "All runs" }),
    ]),
    runFacts(run),
  ];
}

// The curves of the open run: points are fetched incrementally (after the last seq seen).
async function viewRun(root, runId, generation) {
  setActiveNav("runs");
  if (!state.curves || state.curves.runId !== runId) {
    state.curves = { runId, points: [], lastSeq: -1, charts: new Map(), sampling: null };
  }
  const curves = state.curves;
  const [detail, fresh] = await Promise.all([
    api("/openrl/v1/runs/" + encodeURIComponent(runId)),
    api("/openrl/v1/runs/" + encodeURIComponent(runId) + "/curves?after=" + curves.lastSeq),
  ]);
  if (generation !== state.generation) return;
  for (const point of fresh.points) curves.points.push(point);
  if (curves.points.length > fresh.max_points) curves.points.splice(0, curves.points.length - fresh.max_points);
  if (fresh.points.length) curves.lastSeq = fresh.points[fresh.points.length - 1].seq;
  if (!root.querySelector("#charts") || root.dataset.run !== runId) {
    root.dataset.run = runId;
    curves.charts = new Map();
    const sampling = chartBox("chart-sampling", "sampled tokens / s");
    curves.sampling = sampling;
    show(root,
      el("div", { id: "run-header" }), el("h2", { text: "Training curves" }),
      el("div", { class: "charts", id: "charts" }), el("h2", { text: "Sampling throughput" }),
      el("div", { class: "charts", id: "sampling" }, [sampling.box]),
    );
  }
  root.querySelector("#run-header").replaceChildren(...runHeader(detail.run, "curves"));
  drawCurves(root.querySelector("#charts"), curves);
  drawSampling(curves.sampling, fresh);
}

function metricNames(points) {
  const names = new Set();
  for (const p of points) for (const name of Object.keys(p.metrics)) names.add(name);
  // The loss first, then the rest by name.
  return [...names].sort((a, b) => (a.startsWith("loss") ? -1 : b.startsWith("loss") ? 1 : a.localeCompare(b)));
}

function drawCurves(container, curves) {
  const names = metricNames(curves.points);
  if (names.length === 0 && !container.querySelector(".empty")) {
    container.replaceChildren(el("p", { class: "empty", id: "no-curves", text: "No training steps yet." }));
  }
  names.forEach((name, i) => {
    let chart = curves.charts.get(name);
    if (!chart) {
      container.querySelector(".empty")?.remove();
      chart = chartBox("chart-" + i, name);
      chart.canvas.dataset.metric = name;
      curves.charts.set(name, chart);
      container.append(chart.box);
    }
    const xs = [], ys = [];
    for (const p of curves.points) {
      if (name in p.metrics) { xs.push(p.step); ys.push(p.metrics[name]); }
    }
    chart.canvas.dataset.points = String(xs.length);
    chart.last.textContent = xs.length ? "step " + xs[xs.length - 1] + ": " + niceNumber(ys[ys.length - 1]) : "";
    drawSeries(chart.canvas, xs, ys, (x) => "step " + Math.round(x));
  });
}

function drawSampling(chart, fresh) {
  const xs = fresh.sampling.map((b) => b.start_s);
  const ys = fresh.sampling.map((b) => b.tokens / fresh.bucket_s);
  chart.canvas.dataset.points = String(xs.length);
  const tokens = fresh.sampling.reduce((sum, b) => sum + b.tokens, 0);
  chart.last.textContent = tokens ? tokens + " tokens in " + xs.length + " buckets of " + fresh.bucket_s + " s" : "";
  drawSeries(chart.canvas, xs, ys, (x) => new Date(x * 1000).toLocaleTimeString());
}

function copyButton(text) {
  const button = el("button", { type: "button", class: "copy", text: "Copy" });
  button.addEventListener("click", async () => {
    try {
      await navigator.clipboard.writeText(text);
      button.textContent = "Copied";
    } catch {
      button.textContent = "Select and copy";
    }
  });
  return button;
}

async function viewCheckpoints(root, runId) {
  setActiveNav("runs");
  const detail = await api("/openrl/v1/runs/" + encodeURIComponent(runId));
  delete root.dataset.run;
  const rows = detail.checkpoints.map((c) => el("tr", { data: { path: c.tinker_path } }, [
    cell(c.checkpoint_id, "mono"),
    cell(c.checkpoint_type),
    cell(bytes(c.size_bytes), "num"),
    cell(when(c.time)),
    cell(c.expires_at ? "expires " + when(c.expires_at) : "no TTL"),
    cell(c.public ? "published" : "private"),
    cell(el("span", {}, [el("code", { class: "path", text: c.tinker_path }), copyButton(c.tinker_path)])),
  ]));
  show(root,
    ...runHeader(detail.run, "checkpoints"),
    el("h2", { text: "Checkpoints" }),
    rows.length ? table("checkpoints-table", [["Checkpoint"], ["Type"], ["Size", "num"], ["Saved"], ["TTL"],
      ["Published"], ["tinker:// path"]], rows)
      : el("p", { class: "empty", id: "no-checkpoints", text: "No checkpoints saved." }),
  );
}

function memberRow(m, here) {
  return el("tr", { data: { node: m.name, state: m.state } }, [
    cell(el("a", { href: "#/cluster/" + encodeURIComponent(m.name), text: m.name + (m.name === here ? " (this node)" : "") })),
    cell(badge(m.state), "state"),
    cell(String(m.incarnation), "num"),
    cell(m.state_age_s.toFixed(1) + " s", "num"),
    cell(m.devices.map((d) => d.name + " (" + d.kind + ", " + d.groups + " groups" + (d.is_exclusive ? ", exclusive" : "") + ")").join("; ")),
    cell(m.groups.map((g) => g.base_model + ": " + g.adapters + " adapters, queue " + g.queue_depth).join("; ")),
    cell(String(m.jobs.length), "num"),
    cell(m.gossip_addr, "mono"),
  ]);
}

function gossipFacts(stats) {
  if (!stats) return null;
  const facts = [
    ["Members alive / suspect / dead / left", [stats.alive, stats.suspect, stats.dead, stats.left].join(" / ")],
    ["Awareness (0 is healthy)", String(stats.awareness_score)],
    ["Push-pulls ok / failed", stats.push_pulls_ok + " / " + stats.push_pulls_failed],
    ["Packets sent / received", stats.packets_sent + " / " + stats.packets_received],
    ["Refutations", String(stats.refutations)],
  ];
  return el("dl", { class: "facts", id: "gossip" }, facts.flatMap(([k, v]) => [el("dt", { text: k }), el("dd", { text: v })]));
}

function hostMemoryFacts(m) {
  // What the node keeps in host memory by choice, against its budget (host_memory_budget_bytes).
  if (!m) return el("p", { class: "empty", text: "This node reports no host memory (an older release)." });
  const used = m.prefix_cache_bytes + m.parked_bytes + m.state_bytes;
  const facts = [
    ["Budget", bytes(m.budget_bytes)],
    ["Budgeted in use", bytes(used) + (m.budget_bytes ? " (" + (100 * used / m.budget_bytes).toFixed(0) + "%)" : "")],
    ["Prefix caches", bytes(m.prefix_cache_bytes) + " in " + m.prefix_caches + " engines, at most "
      + bytes(m.prefix_cache_share_bytes) + " each"],
    ["Parked state", bytes(m.parked_bytes)],
    ["Parked state spilled to disk", bytes(m.spilled_bytes)],
    ["Engine state on the CPU", bytes(m.state_bytes)],
    ["Daemon resident set (all it holds)", bytes(m.rss_bytes)],
    ["Parks past the budget", String(m.over_budget_parks)],
  ];
  return el("dl", { class: "facts", id: "host-memory" }, facts.flatMap(([k, v]) => [el("dt", { text: k }), el("dd", { text: v })]));
}

function deviceTables(node) {
  const devices = node.devices.map((d) => el("tr", { data: { device: d.name } }, [
    cell(d.name, "mono"), cell(d.kind), cell(bytes(d.memory_bytes), "num"), cell(String(d.groups), "num"),
    cell(d.is_exclusive ? "yes" : "no"), cell(d.holder || "—"), cell(String(d.waiting), "num"),
    cell(d.last_error || "", "error"),
  ]));
  const workers = node.devices.flatMap((d) => d.workers.map((w) => el("tr", { data: { worker: w.worker } }, [
    cell(d.name, "mono"), cell(w.worker), cell(badge(w.state)), cell(w.lease_s.toFixed(1) + " s", "num"),
    cell(String(w.turns), "num"), cell(String(w.parks), "num"), cell(String(w.resumes), "num"),
  ])));
  const groups = node.groups.map((g) => el("tr", {}, [
    cell(g.base_model), cell(g.jobs.map((j) => j.model_id + " (" + j.waiting + " queued)").join("; "), "mono"),
    cell(g.trainer_device + " / " + g.sampler_device, "mono"), cell(g.trainer_busy ? "busy" : "idle"),
    cell(g.sampler_waiting + " / " + g.sampler_running, "num"), cell(String(g.sampler_replicas), "num"),
    cell(bytes(g.prefix_cache_bytes), "num"), cell(bytes(g.parked_bytes), "num"), cell(bytes(g.engine_state_bytes), "num"),
  ]));
  return [
    el("h2", { text: "Devices of " + (node.node || "this node") }),
    table("devices-table", [["Device"], ["Kind"], ["Memory", "num"], ["Groups", "num"], ["Exclusive"], ["Holder"],
      ["Waiting", "num"], ["Last error"]], devices),
    el("h2", { text: "Host memory" }),
    hostMemoryFacts(node.host_memory),
    el("h2", { text: "Time-slicer turns and parks" }),
    workers.length ? table("workers-table", [["Device"], ["Worker"], ["Lease"], ["Held", "num"], ["Turns", "num"],
      ["Parks", "num"], ["Resumes", "num"]], workers) : el("p", { class: "empty", text: "No workers on these devices." }),
    el("h2", { text: "Worker groups and queues" }),
    groups.length ? table("groups-table", [["Base model"], ["Jobs (queued ops)"], ["Trainer / sampler device"],
      ["Trainer"], ["Samples waiting / running", "num"], ["Replicas", "num"], ["Prefix cache", "num"],
      ["Parked", "num"], ["Engine state (CPU)", "num"]], groups)
      : el("p", { class: "empty", text: "No worker groups running." }),
  ];
}

async function viewCluster(root, nodeName) {
  setActiveNav("cluster");
  const cluster = await api("/openrl/v1/cluster");
  const target = nodeName || cluster.node;
  let node = null, nodeProblem = null;
  try {
    node = await api("/openrl/v1/node" + (target ? "?node=" + encodeURIComponent(target) : ""));
  } catch (error) {
    if (error instanceof Unauthorized) throw error;
    nodeProblem = error.message;
  }
  const members = cluster.members.map((m) => memberRow(m, cluster.node));
  show(root,
    el("h1", { text: "Devices and cluster" }),
    cluster.is_clustered
      ? table("members-table", [["Node"], ["State"], ["Incarnation", "num"], ["Since", "num"], ["Devices"],
        ["Groups"], ["Jobs", "num"], ["Gossip address"]], members)
      : el("p", { class: "muted", id: "single-node", text: "This node is in no cluster (no cluster_secret)." }),
    gossipFacts(cluster.statistics),
    ...(node ? deviceTables(node) : [el("p", { class: "error", text: "Devices of " + target + ": " + nodeProblem })]),
  );
}

// ------------------------------------------------------------------ routing, login, polling

function route() {
  const parts = location.hash.replace(/^#\/?/, "").split("/").map(decodeURIComponent);
  if (parts[0] === "runs" && parts[1]) {
    return parts[2] === "checkpoints"
      ? (root) => viewCheckpoints(root, parts[1])
      : (root, generation) => viewRun(root, parts[1], generation);
  }
  if (parts[0] === "cluster") return (root) => viewCluster(root, parts[1]);
  return viewRuns;
}

async function refresh() {
  const generation = state.generation;
  const root = document.getElementById("view");
  try {
    await route()(root, generation);
    if (generation !== state.generation) return;
    document.getElementById("refreshed").textContent = "Updated " + new Date().toLocaleTimeString();
    document.getElementById("problem").textContent = "";
  } catch (error) {
    if (error instanceof Unauthorized) {
      showLogin("The node refused this key.");
      return;
    }
    document.getElementById("problem").textContent = error.message;
  }
  schedule();
}

function schedule() {
  clearTimeout(state.timer);
  state.timer = setTimeout(() => {
    if (document.visibilityState === "visible") refresh();
    else schedule();
  }, POLL_MS);
}

function navigate() {
  state.generation += 1;
  clearTimeout(state.timer);
  refresh();
}

function showLogin(message) {
  clearTimeout(state.timer);
  sessionStorage.removeItem(KEY_STORE);
  document.getElementById("view").replaceChildren();
  document.getElementById("login").hidden = false;
  document.getElementById("logout").hidden = true;
  document.getElementById("who").textContent = "";
  document.getElementById("login-error").textContent = message || "";
}

async function enter() {
  document.getElementById("login").hidden = true;
  try {
    const me = await api("/api/v1/auth/apikey/me");
    document.getElementById("who").textContent = me.key_id ? me.name.replace(/ key \d+$/, "") : "open mode";
    document.getElementById("logout").hidden = !me.key_id;
  } catch (error) {
    if (error instanceof Unauthorized) {
      showLogin(sessionStorage.getItem(KEY_STORE) ? "The node refused this key." : "");
      return;
    }
  }
  navigate();
}

document.addEventListener("DOMContentLoaded", () => {
  document.getElementById("login-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const key = document.getElementById("key").value.trim();
    if (!key) return;
    sessionStorage.setItem(KEY_STORE, key);
    document.getElementById("key").value = "";
    enter();
  });
  document.getElementById("logout").addEventListener("click", () => showLogin(""));
  window.addEventListener("hashchange", navigate);
  enter();
});
