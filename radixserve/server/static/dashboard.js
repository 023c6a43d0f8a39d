// radixserve cache explorer. No build step, no dependency: plain DOM and SVG.
// Token text is only ever set through textContent (never innerHTML): prompts are untrusted.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const ROW = 30;
const state = { key: sessionStorage.getItem("radixserve-key") || "", path: [], crumbs: [], selected: null,
                tree: null, lastClock: null, lastTreeFetch: 0, zoom: 1, panX: 0, stats: null };

const $ = (id) => document.getElementById(id);
function el(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}
function sel(tag, attrs) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  return e;
}
function headers() {
  const h = { "Content-Type": "application/json" };
  if (state.key) h.Authorization = "Bearer " + state.key;
  return h;
}
async function getJSON(url, opts) {
  const r = await fetch(url, Object.assign({ headers: headers() }, opts || {}));
  const body = await r.json().catch(() => ({}));
  if (!r.ok) throw new Error((body.error && body.error.message) || r.status + " " + r.statusText);
  return body;
}
function fmtAge(s) {
  if (s === null || s === undefined) return "long ago";
  if (s < 1) return "just now";
  if (s < 120) return s.toFixed(0) + " s ago";
  if (s < 7200) return (s / 60).toFixed(0) + " min ago";
  return (s / 3600).toFixed(1) + " h ago";
}
function hue(age) {  // recent = red, minutes = green, cold = blue (log scale of seconds)
  if (age === null || age === undefined) return 220;
  const t = Math.min(Math.log10(1 + age) / Math.log10(1 + 600), 1);
  return 5 + t * 215;
}

// ---- tree -------------------------------------------------------------------------------------------------------
function weigh(n) {  // width of a node: its pages plus everything shown or hidden below it
  let w = n.pages + n.hidden_children;
  for (const c of n.children) w += weigh(c);
  n._w = Math.max(w, 1);
  return n._w;
}
function layout(n, x, w, depth, out) {
  out.push({ n, x, w, depth });
  let cx = x;
  const total = n._w;
  for (const c of n.children) {
    const cw = w * c._w / total;
    layout(c, cx, cw, depth + 1, out);
    cx += cw;
  }
  if (n.hidden_children > 0) out.push({ hidden: n.hidden_children, x: cx, w: w * n.hidden_children / total, depth: depth + 1 });
}
function drawTree() {
  const svg = $("tree");
  svg.replaceChildren();
  const tree = state.tree;
  if (!tree) return;
  const width = svg.clientWidth || 800;
  weigh(tree.root);
  const items = [];
  layout(tree.root, 0, width * state.zoom, 0, items);
  const g = sel("g", { transform: `translate(${state.panX},0)` });
  svg.appendChild(g);
  let maxDepth = 0;
  for (const it of items) {
    maxDepth = Math.max(maxDepth, it.depth);
    const y = it.depth * ROW;
    if (it.hidden) {
      const hg = sel("g", { class: "hiddenbox" });
      hg.appendChild(sel("rect", { x: it.x, y, width: Math.max(it.w - 1, 1), height: ROW - 2 }));
      const t = sel("title"); t.textContent = `${it.hidden} children collapsed`; hg.appendChild(t);
      g.appendChild(hg);
      continue;
    }
    const n = it.n;
    const isRoot = it.depth === 0;
    const cls = ["node"];
    if (n.locked) cls.push("locked");
    if (n.retained_s != null) cls.push("retained");
    if (state.selected && state.selected.id === n.id) cls.push("selected");
    const ng = sel("g", { class: cls.join(" "), "data-id": n.id, "data-key": n.key });
    const fill = isRoot ? "#9aa0a8" : `hsl(${hue(n.age_s)}, ${n.hits > 0 ? 70 : 45}%, 62%)`;
    ng.appendChild(sel("rect", { x: it.x, y, width: Math.max(it.w - 1, 1), height: ROW - 2, fill }));
    if (it.w > 28) {
      const label = sel("text", { x: it.x + 4, y: y + 18 });
      const txt = isRoot ? (state.path.length ? "(zoomed node)" : "root") : n.text.replace(/\s+/g, " ");
      label.textContent = txt.slice(0, Math.floor(it.w / 6.5));
      ng.appendChild(label);
    }
    const title = sel("title");
    title.textContent = isRoot ? "root" : `${n.pages} pages, ${n.hits} hits, ${fmtAge(n.age_s)}` +
      (n.retained_s != null ? `, retained ${n.retained_s} s more` : "");
    ng.appendChild(title);
    ng.addEventListener("click", (ev) => { ev.stopPropagation(); showNode(n, it); });
    ng.addEventListener("dblclick", (ev) => { ev.stopPropagation(); if (!isRoot) zoomInto(it); });
    g.appendChild(ng);
  }
  svg.setAttribute("viewBox", `0 0 ${width} ${Math.max((maxDepth + 1) * ROW, 420)}`);
  svg.style.height = Math.max((maxDepth + 1) * ROW, 420) + "px";
  const info = `${tree.shown_nodes} nodes shown (the whole tree, all namespaces: ${tree.total_nodes} nodes, ` +
    `${tree.total_pages} pages)` +
    (tree.truncated ? " (collapsed: grey boxes)" : "") + `; snapshot ${tree.snapshot_ms} ms`;
  $("treeinfo").textContent = info;
}
function pathOf(it) {  // keys from the view root down to this item's node
  const keys = [];
  let found = null;
  (function walk(n, acc) {
    if (found) return;
    if (n === it.n) { found = acc; return; }
    for (const c of n.children) walk(c, acc.concat([c.key]));
  })(state.tree.root, []);
  return found || [];
}
function zoomInto(it) {
  state.path = state.path.concat(pathOf(it));
  state.crumbs.push({ path: state.path.slice(), label: it.n.text.slice(0, 16) || String(it.n.id) });
  state.zoom = 1; state.panX = 0;
  drawCrumbs();
  fetchTree();
}
function drawCrumbs() {
  const c = $("crumbs");
  c.replaceChildren();
  const root = el("a", {}, "root");
  root.addEventListener("click", () => { state.path = []; state.crumbs = []; drawCrumbs(); fetchTree(); });
  c.appendChild(root);
  state.crumbs.forEach((cr, i) => {
    c.appendChild(document.createTextNode("› "));
    const a = el("a", {}, cr.label.replace(/\s+/g, " "));
    a.addEventListener("click", () => { state.path = cr.path.slice(); state.crumbs = state.crumbs.slice(0, i + 1); drawCrumbs(); fetchTree(); });
    c.appendChild(a);
  });
}
function showNode(n, it) {
  state.selected = n;
  const d = $("details");
  d.replaceChildren(el("h2", {}, `Node ${n.id}`));
  const t = el("table", { id: "nodeinfo" });
  const rows = [["pages", n.pages], ["tokens", n.tokens], ["hits", n.hits], ["last access", fmtAge(n.age_s)],
    ["lock", n.locked ? `locked (${n.lock_ref} requests)` : "unlocked (evictable when a leaf)"],
    ["retention", n.retained_s != null ? `priority ${n.retention_priority}, ${n.retained_s} s left` : "none (LRU)"],
    ["children", `${n.num_children}` + (n.hidden_children ? ` (${n.hidden_children} collapsed)` : "")],
    ["namespace", n.namespace || "(default)"], ["key", n.key]];
  for (const [k, v] of rows) {
    const tr = el("tr"); tr.appendChild(el("th", {}, k)); tr.appendChild(el("td", {}, String(v))); t.appendChild(tr);
  }
  d.appendChild(t);
  d.appendChild(el("h2", {}, "Token text"));
  d.appendChild(el("pre", { class: "text", id: "nodetext" }, n.text));
  if (n.children.length) {
    d.appendChild(el("h2", {}, "Children"));
    const ul = el("ul");
    for (const c of n.children) ul.appendChild(el("li", {}, `${c.pages} p, ${c.hits} hits: ${c.text.slice(0, 60)}`));
    d.appendChild(ul);
  }
  if (it && it.depth > 0) {
    const b = el("button", { type: "button", id: "zoombtn" }, "zoom into this node");
    b.addEventListener("click", () => zoomInto(it));
    d.appendChild(b);
  }
  drawTree();
}
async function fetchTree() {
  state.lastTreeFetch = Date.now();
  const q = new URLSearchParams({ depth: $("depth").value, max_nodes: $("maxnodes").value });
  if ($("namespace").value) q.set("namespace", $("namespace").value);
  if (state.path.length) q.set("path", state.path.join(","));
  try {
    state.tree = await getJSON("/cache/tree?" + q);
    if (state.selected) state.selected = findNode(state.tree.root, state.selected.id) || state.selected;
    drawTree();
  } catch (e) {
    $("treeinfo").textContent = "tree: " + e.message;
  }
}
function findNode(n, id) {
  if (n.id === id) return n;
  for (const c of n.children) { const f = findNode(c, id); if (f) return f; }
  return null;
}

// ---- panels -----------------------------------------------------------------------------------------------------
function drawPool(p) {
  const box = $("pool");
  box.replaceChildren();
  const bar = el("div", { class: "bar" });
  const parts = [["free", p.free, "free"], ["evictable", p.cached_evictable, "cached, evictable"],
    ["lockedp", p.locked, "cached, locked"], ["inflight", p.in_flight, "in flight (private)"]];
  for (const [cls, v] of parts) {
    const d = el("div", { class: cls, title: `${v} pages` });
    d.style.width = (100 * v / Math.max(p.total, 1)) + "%";
    bar.appendChild(d);
  }
  box.appendChild(bar);
  const t = el("table");
  for (const [cls, v, label] of parts) {
    const tr = el("tr");
    const sw = el("td"); sw.appendChild(el("i", { class: "sw " + cls })); sw.appendChild(document.createTextNode(label));
    tr.appendChild(sw); tr.appendChild(el("td", {}, `${v} pages`)); t.appendChild(tr);
  }
  const tr = el("tr"); tr.appendChild(el("th", {}, "total")); tr.appendChild(el("th", {}, `${p.total} pages × ${p.page_size} tokens`));
  t.appendChild(tr);
  box.appendChild(t);
}
function drawHitRate(h) {
  $("hitrate").textContent = `since start: ${(100 * h.total).toFixed(1)}% of prompt tokens served from the cache`;
  const svg = $("hitchart");
  svg.replaceChildren();
  const W = svg.clientWidth || 300, H = 120;
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  const pts = h.points;
  svg.appendChild(sel("line", { x1: 0, y1: H - 1, x2: W, y2: H - 1, stroke: "#ccc" }));
  if (pts.length < 1) return;
  const t0 = pts[0][0], t1 = Math.max(pts[pts.length - 1][0], t0 + 1);
  const xy = (t, v) => `${(W * (t - t0) / (t1 - t0)).toFixed(1)},${(H - 4 - (H - 8) * v).toFixed(1)}`;
  const interval = pts.filter((p) => p[1] !== null).map((p) => xy(p[0], p[1])).join(" ");
  const total = pts.map((p) => xy(p[0], p[2])).join(" ");
  svg.appendChild(sel("polyline", { points: total, fill: "none", stroke: "#999", "stroke-dasharray": "4 3" }));
  svg.appendChild(sel("polyline", { points: interval, fill: "none", stroke: "#2e7d32", "stroke-width": 2 }));
}
function drawRequests(r) {
  const box = $("requests");
  box.replaceChildren();
  const t = el("table", { id: "reqtable" });
  const head = el("tr");
  for (const h of ["state", "request", "prompt", "cached", "computed", "output", "age"]) head.appendChild(el("th", {}, h));
  t.appendChild(head);
  for (const st of ["running", "waiting"]) {
    for (const q of r[st]) {
      const tr = el("tr");
      for (const v of [st, q.rid, q.prompt_tokens, q.cached_tokens, q.computed_tokens, q.output_tokens, q.age_s.toFixed(1) + " s"])
        tr.appendChild(el("td", {}, String(v)));
      t.appendChild(tr);
    }
  }
  if (!r.running.length && !r.waiting.length) box.appendChild(el("p", { class: "muted" }, "No request running or waiting."));
  else box.appendChild(t);
}
function drawTimelines(tls) {
  const box = $("timelines");
  box.replaceChildren();
  if (!tls.length) { box.appendChild(el("p", { class: "muted" }, "No request yet.")); return; }
  const longest = Math.max(...tls.map((t) => t.duration_ms || Math.max(...t.spans.map((s) => s[2] || s[1]), 1)));
  for (const tl of tls.slice().reverse().slice(0, 30)) {
    const row = el("div", { class: "tl" });
    const label = `${tl.rid.slice(0, 12)} ${tl.cached_tokens}/${tl.prompt_tokens} cached, ${tl.decode_steps} decode` +
      (tl.retractions ? `, ${tl.retractions} retracted` : "") + (tl.duration_ms ? `, ${tl.duration_ms.toFixed(0)} ms` : " (live)");
    row.appendChild(el("div", { class: "rid", title: tl.rid }, label));
    const svg = sel("svg", { viewBox: "0 0 1000 16", preserveAspectRatio: "none" });
    for (const [kind, a, b, tokens] of tl.spans) {
      const end = b === null ? longest : b;
      const r = sel("rect", { class: "k-" + kind, x: 1000 * a / longest, y: 2, height: 12,
        width: Math.max(1000 * (end - a) / longest, kind === "retracted" ? 2 : 0.5) });
      const title = sel("title"); title.textContent = `${kind} ${tokens ? tokens + " tokens, " : ""}${(end - a).toFixed(1)} ms`;
      r.appendChild(title);
      svg.appendChild(r);
    }
    row.appendChild(svg);
    box.appendChild(row);
  }
}
function onStats(s) {
  state.stats = s;
  drawPool(s.pool);
  drawHitRate(s.hit_rate);
  drawRequests(s.requests);
  drawTimelines(s.timelines);
  const clock = s.tree.clock + ":" + s.tree.nodes + ":" + s.tree.pages;
  if (clock !== state.lastClock && Date.now() - state.lastTreeFetch > 2000) {
    state.lastClock = clock;
    fetchTree();
  }
}

// ---- server-sent events over fetch (EventSource cannot send the Authorization header) ----------------------------
let streamAbort = null;
async function connect() {
  if (streamAbort) streamAbort.abort();
  const ctl = new AbortController();
  streamAbort = ctl;
  const conn = $("conn");
  try {
    const r = await fetch("/cache/events", { headers: headers(), signal: ctl.signal });
    if (!r.ok) {
      const body = await r.json().catch(() => ({}));
      throw new Error((body.error && body.error.message) || String(r.status));
    }
    conn.textContent = "live"; conn.className = "conn on";
    const reader = r.body.getReader();
    const dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += dec.decode(value, { stream: true });
      let i;
      while ((i = buf.indexOf("\n\n")) >= 0) {
        const ev = buf.slice(0, i); buf = buf.slice(i + 2);
        const data = ev.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
        if (data) onStats(JSON.parse(data));
      }
    }
  } catch (e) {
    if (ctl.signal.aborted) return;
    conn.textContent = "offline: " + e.message; conn.className = "conn off";
  }
  if (!ctl.signal.aborted) setTimeout(connect, 2000);
}

// ---- why did this miss -------------------------------------------------------------------------------------------
async function whyMiss(ev) {
  ev.preventDefault();
  const out = $("missresult");
  out.replaceChildren();
  const body = { text: $("missprompt").value };
  if ($("misssalt").value) body.cache_salt = $("misssalt").value;
  try {
    const r = await getJSON("/cache/why_miss", { method: "POST", body: JSON.stringify(body) });
    out.appendChild(el("p", { id: "missexplain" }, r.explanation));
    out.appendChild(el("p", {}, `${r.cached_tokens} of ${r.prompt_tokens} tokens would come from the cache; ` +
      `${r.computed_tokens} computed. Path: ${r.path.map((p) => `node ${p.id} (${p.pages_matched}/${p.pages} pages)`).join(" → ") || "none"}`));
    if (r.matched_text) { out.appendChild(el("h2", {}, "…cached up to")); out.appendChild(el("pre", { class: "text" }, r.matched_text)); }
    if (r.next_text) { out.appendChild(el("h2", {}, "first tokens not cached")); out.appendChild(el("pre", { class: "text" }, r.next_text)); }
    if (r.tree_text) { out.appendChild(el("h2", {}, "where the tree holds instead")); out.appendChild(el("pre", { class: "text" }, r.tree_text)); }
    if (r.node !== undefined && r.node !== null && state.tree) {
      const n = findNode(state.tree.root, r.node);
      if (n) showNode(n, null);
    }
  } catch (e) {
    out.appendChild(el("p", { class: "error" }, e.message));
  }
}

// ---- wiring -------------------------------------------------------------------------------------------------------
$("apikey").value = state.key;
$("keyform").addEventListener("submit", (ev) => {
  ev.preventDefault();
  state.key = $("apikey").value.trim();
  sessionStorage.setItem("radixserve-key", state.key);
  state.path = []; state.crumbs = []; state.selected = null; drawCrumbs();
  fetchTree();
  connect();
});
$("refresh").addEventListener("click", fetchTree);
$("zoomreset").addEventListener("click", () => { state.zoom = 1; state.panX = 0; drawTree(); });
$("missform").addEventListener("submit", whyMiss);
$("tree").addEventListener("wheel", (ev) => {  // horizontal zoom around the pointer
  ev.preventDefault();
  const svg = $("tree");
  const x = ev.offsetX * (svg.viewBox.baseVal.width / svg.clientWidth);
  const f = ev.deltaY < 0 ? 1.25 : 0.8;
  const z = Math.min(Math.max(state.zoom * f, 1), 200);
  state.panX = Math.min(0, x - (x - state.panX) * (z / state.zoom));
  state.zoom = z;
  drawTree();
}, { passive: false });
window.addEventListener("resize", drawTree);
drawCrumbs();
if (document.body.dataset.auth === "1" && !state.key) {
  $("treeinfo").textContent = "This server needs an API key: enter yours above (you will see your own namespace only).";
  $("conn").textContent = "no key";
} else {
  fetchTree();
  connect();
}
