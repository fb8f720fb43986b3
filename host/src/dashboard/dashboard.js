// Fief's live dashboard: renders the `snapshot` events of
// /v1/cluster/events (see host/src/dashboard.rs). No dependencies.
"use strict";

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

  // Limbo.
  const lbody = document.querySelector("#limbo tbody");
  lbody.replaceChildren(...view.limbo.map((e) =>
    el("tr", {}, el("td", {}, `${e.module}/${e.key}`), el("td", {}, e.partition),
      el("td", {}, e.mode), el("td", {}, e.since))));
  document.getElementById("limbo-count").textContent = `${view.limbo.length} entries`;

  previous = view;
  document.body.setAttribute("data-snapshots", String(Number(document.body.getAttribute("data-snapshots") || 0) + 1));
}

function connect() {
  const status = document.getElementById("connection");
  const source = new EventSource("/v1/cluster/events");
  source.addEventListener("open", () => {
    status.textContent = "live";
    status.setAttribute("data-state", "live");
  });
  source.addEventListener("snapshot", (e) => render(JSON.parse(e.data)));
  source.addEventListener("error", () => {
    // EventSource reconnects by itself.
    status.textContent = "disconnected, retrying";
    status.setAttribute("data-state", "disconnected");
  });
}

connect();
