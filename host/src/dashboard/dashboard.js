// Fief's live dashboard: polls GET /v1/cluster once a second and renders
// the snapshot (see host/src/dashboard.rs). With tokens configured it asks
// for one (kept in sessionStorage, sent as `Authorization: Bearer`). The
// plots are inline SVG drawn here. No dependencies.
"use strict";

const POLL_MS = 1000;
const WINDOW_MS = 5 * 60 * 1000;   // what the plots show
const TOKEN_KEY = "fief-dashboard-token";
// The SVG namespace, from the HTML parser (no URL spelled in the page).
const SVG = (() => { const d = document.createElement("div"); d.innerHTML = "<svg></svg>"; return d.firstChild.namespaceURI; })();

const palette = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948",
  "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac", "#1f77b4", "#8c564b"];
const colours = new Map();   // node id -> colour, stable for the page's life
const seen = new Map();      // node id -> last snapshot that listed it
let previous = null;         // the last snapshot, for rates and moves

function colour(node) {
  if (!colours.has(node)) colours.set(node, palette[colours.size % palette.length]);
  return colours.get(node);
}

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v;
    else if (k === "style") e.style.cssText = v;
    else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}

function leaseBar(remaining, ttl) {
  const share = ttl > 0 ? Math.max(0, Math.min(1, remaining / ttl)) : 0;
  const bar = el("span", { class: share < 0.34 ? "bar low" : "bar", title: `${remaining} ms of ${ttl} ms` },
    el("span", { style: `width:${(share * 100).toFixed(1)}%` }));
  return el("span", {}, bar, ` ${(remaining / 1000).toFixed(1)} s`);
}

function render(view) {
  document.getElementById("where").textContent =
    `node ${view.node_id} · namespace ${view.namespace}`;
  document.title = `Fief · ${view.node_id}`;

  const summary = document.getElementById("summary");
  summary.replaceChildren();
  const row = (k, v) => summary.append(el("dt", {}, k), el("dd", {}, v));
  row("lease", el("span", { class: "badge", id: "self-lease", "data-state": view.lease }, view.lease));
  row("time to fence point", leaseBar(Number(view.lease_remaining_ms), Number(view.lease_ttl_ms)));
  row("fences so far", view.fences);
  row("leader term", view.leader_term === null ? "not leader" : view.leader_term);
  row("table epoch", view.epoch);

  // Nodes: the live members, and those seen before that are gone.
  const live = new Set(view.nodes.map((n) => n.id));
  for (const n of view.nodes) seen.set(n.id, n);
  const counts = new Map();
  for (const o of view.owners) if (o !== null) counts.set(o, (counts.get(o) || 0) + 1);
  const tbody = document.querySelector("#nodes tbody");
  tbody.replaceChildren();
  for (const id of [...seen.keys()].sort()) {
    const n = seen.get(id);
    let state = "live";
    if (!live.has(id)) state = "gone";
    else if (id === view.node_id && view.lease !== "current") state = view.lease;
    else if (n.leaving) state = "leaving";
    const lease = state === "gone" ? "lease expired or released"
      : leaseBar(id === view.node_id ? Number(view.lease_remaining_ms) : Number(n.lease_remaining_ms),
                 Number(view.lease_ttl_ms));
    const name = id + (n.leader && state !== "gone" ? " ★ leader" : "") + (id === view.node_id ? " (this node)" : "");
    tbody.append(el("tr", { class: state, "data-node": id, "data-state": state },
      el("td", {}, el("span", { class: "swatch", style: `background:${colour(id)}` })),
      el("td", {}, name),
      el("td", {}, el("span", { class: "badge", "data-state": state }, state)),
      el("td", {}, lease),
      el("td", { class: "partitions" }, counts.get(id) || 0)));
  }

  // The partition grid, coloured by owner; a cell that changed owner since
  // the last snapshot is outlined.
  const grid = document.getElementById("grid");
  if (grid.children.length !== view.owners.length) {
    grid.replaceChildren(...view.owners.map((_, p) => el("div", { class: "cell", "data-partition": p })));
  }
  view.owners.forEach((owner, p) => {
    const cell = grid.children[p];
    const before = cell.getAttribute("data-owner");
    const now = owner === null ? "" : owner;
    cell.classList.toggle("moved", previous !== null && before !== null && before !== now);
    cell.setAttribute("data-owner", now);
    cell.style.background = owner === null ? "" : colour(owner);
    cell.title = `partition ${p}: ${owner === null ? "unassigned" : owner}`;
  });
  const unassigned = view.owners.filter((o) => o === null).length;
  document.getElementById("grid-caption").textContent =
    `${view.owners.length} partitions, epoch ${view.epoch}` + (unassigned ? `, ${unassigned} unassigned` : "");

  // Modules, with call rates from the previous snapshot.
  const mbody = document.querySelector("#modules tbody");
  mbody.replaceChildren();
  for (const m of view.modules) {
    let rate = "";
    const before = previous && previous.modules.find((x) => x.name === m.name);
    if (before && view.at_ms > previous.at_ms) {
      rate = ((m.calls_served - before.calls_served) * 1000 / (view.at_ms - previous.at_ms)).toFixed(1);
    }
    mbody.append(el("tr", { "data-module": m.name },
      el("td", {}, m.name), el("td", {}, m.version), el("td", {}, m.live_keys),
      el("td", {}, m.calls_served), el("td", {}, rate)));
  }

  document.getElementById("modules-caption").textContent =
    view.viewer.startsWith("tenant:") ? `(on this node, ${view.viewer.slice(7)}'s own)` : "(on this node)";
  renderPlots(view);

  // Limbo.
  const lbody = document.querySelector("#limbo tbody");
  lbody.replaceChildren(...view.limbo.map((e) =>
    el("tr", {}, el("td", {}, `${e.module}/${e.key}`), el("td", {}, e.partition),
      el("td", {}, e.mode), el("td", {}, e.since))));
  document.getElementById("limbo-count").textContent = `${view.limbo.length} entries`;

  previous = view;
  document.body.setAttribute("data-snapshots", String(Number(document.body.getAttribute("data-snapshots") || 0) + 1));
}

function svg(tag, attrs, ...children) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}

// Four line plots of the last WINDOW_MS: one line per node, in its colour.
function renderPlots(view) {
  const section = document.getElementById("plots-section");
  const tenant = view.viewer.startsWith("tenant:");
  section.hidden = tenant;
  if (tenant) return;
  const W = 300, H = 110, left = 34, bottom = 14, top = 6;
  // The window is the last WINDOW_MS, or less while no node has samples
  // that old (a young cluster's lines fill the plot).
  const end = view.at_ms;
  let oldest = end;
  for (const h of view.history) if (h.samples && h.samples.length) oldest = Math.min(oldest, h.samples[0].at_ms);
  const start = Math.max(end - WINDOW_MS, Math.min(oldest, end - 10000));
  const span = end - start;
  const x = (t) => left + (W - left) * Math.max(0, t - start) / span;
  const ago = span >= 120000 ? `−${Math.round(span / 60000)} min` : `−${Math.round(span / 1000)} s`;
  for (const figure of document.querySelectorAll("#plots .plot")) {
    const metric = figure.dataset.metric;
    let max = 0;
    for (const h of view.history) for (const s of h.samples || []) {
      if (s.at_ms >= start && s[metric] !== null) max = Math.max(max, Number(s[metric]));
    }
    const top_value = max > 0 ? max : 1;
    const y = (v) => top + (H - top - bottom) * (1 - v / top_value);
    const label = max >= 100 ? max.toFixed(0) : max >= 10 ? max.toFixed(1) : max.toFixed(2).replace(/\.?0+$/, "") || "0";
    const chart = svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": figure.querySelector("figcaption").textContent },
      svg("line", { class: "axis", x1: left, y1: top, x2: left, y2: H - bottom }),
      svg("line", { class: "axis", x1: left, y1: H - bottom, x2: W, y2: H - bottom }),
      svg("text", { x: left - 3, y: top + 8, "text-anchor": "end", class: "max" }, label),
      svg("text", { x: left - 3, y: H - bottom, "text-anchor": "end" }, "0"),
      svg("text", { x: left, y: H - 2, class: "since" }, ago),
      svg("text", { x: W - 2, y: H - 2, "text-anchor": "end" }, "now"));
    for (const h of view.history) {
      if (!h.samples) continue;
      let d = "", pen = "M";
      for (const s of h.samples) {
        if (s.at_ms < start) continue;
        if (s[metric] === null) { pen = "M"; continue; }
        // A zero-length "l0 0" after each move: a lone point (a second
        // with calls between quiet ones) shows as a dot (round caps).
        d += `${pen}${x(s.at_ms).toFixed(1)} ${y(Number(s[metric])).toFixed(1)} ` + (pen === "M" ? "l0 0 " : "");
        pen = "L";
      }
      if (d === "") continue;
      chart.append(svg("path", { class: "line", "data-node": h.node, stroke: colour(h.node), d: d.trim() },
        svg("title", {}, h.node)));
    }
    figure.querySelector(".chart").replaceChildren(chart);
  }
  document.getElementById("plots-legend").replaceChildren(...view.history.map((h) =>
    el("span", { "data-node": h.node, class: h.samples ? "" : "nodata" },
      el("span", { class: "swatch", style: `background:${colour(h.node)}` }),
      ` ${h.node}` + (h.samples ? "" : " (no data)"))));
}

function token() {
  return sessionStorage.getItem(TOKEN_KEY);
}

function showLogin(message) {
  document.getElementById("login").hidden = false;
  document.getElementById("main").hidden = true;
  document.getElementById("login-error").textContent = message || "";
  const status = document.getElementById("connection");
  status.textContent = "token needed";
  status.setAttribute("data-state", "disconnected");
}

function showMain() {
  document.getElementById("login").hidden = true;
  document.getElementById("main").hidden = false;
  document.getElementById("sign-out").hidden = token() === null;
}

// One poll of GET /v1/cluster; the next is due POLL_MS later whatever
// happened, except while the page waits for a token.
async function poll() {
  const status = document.getElementById("connection");
  const headers = {};
  const t = token();
  if (t !== null) headers.Authorization = `Bearer ${t}`;
  let response;
  try {
    response = await fetch("/v1/cluster", { headers, cache: "no-store" });
  } catch (e) {
    status.textContent = "disconnected, retrying";
    status.setAttribute("data-state", "disconnected");
    return true;
  }
  if (response.status === 401 || response.status === 403) {
    let message = "";
    try { message = ((await response.json()).error || {}).message || ""; } catch (e) { /* not JSON */ }
    if (t !== null) sessionStorage.removeItem(TOKEN_KEY);
    showLogin(t === null ? "" : `That token was refused: ${message || response.status}`);
    return false;
  }
  if (!response.ok) {
    status.textContent = `error ${response.status}, retrying`;
    status.setAttribute("data-state", "disconnected");
    return true;
  }
  const view = await response.json();
  showMain();
  status.textContent = "live";
  status.setAttribute("data-state", "live");
  document.getElementById("who").textContent = `as ${view.viewer}`;
  render(view);
  return true;
}

async function loop() {
  if (await poll()) setTimeout(loop, POLL_MS);
}

document.getElementById("login").addEventListener("submit", (e) => {
  e.preventDefault();
  const value = document.getElementById("token").value.trim();
  if (value === "") return;
  sessionStorage.setItem(TOKEN_KEY, value);
  document.getElementById("token").value = "";
  loop();
});

document.getElementById("sign-out").addEventListener("click", () => {
  sessionStorage.removeItem(TOKEN_KEY);
  location.reload();
});

loop();
