"use strict";
// heapscope's page: plain SVG, no library. Data comes from the daemon's JSON endpoints (live), or from the JSON
// embedded by `heapscope view` (a file); both have the shapes of agent/export/webdata.py.
(function () {
  const SVGNS = "http://www.w3.org/2000/svg";
  const PALETTE = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7",
    "#9c755f", "#86bcb6", "#d37295", "#a0cbe8"];
  const OTHER_COLOR = "#c9ccd3";
  const POLL_MS = 1000;
  const GROWTH_EVERY_MS = 5000;  // the growth panel reads up to 48 stored snapshots: not at every poll
  const GROWTH_ROWS = 20;
  const $ = (id) => document.getElementById(id);

  // ---- data sources ----------------------------------------------------------------------------------------
  function liveSource() {
    const m = /(?:^|[#&])token=([^&]+)/.exec(location.hash);
    if (m) { sessionStorage.setItem("heapscope-token", decodeURIComponent(m[1])); history.replaceState(null, "", location.pathname); }
    const token = sessionStorage.getItem("heapscope-token");
    async function get(path) {
      const r = await fetch(path, { headers: token ? { Authorization: "Bearer " + token } : {}, cache: "no-store" });
      const body = await r.json();
      if (!r.ok) throw new Error(body.detail || r.statusText);
      return body;
    }
    return {
      live: true,
      name: "live, " + location.host,
      targets: () => get("targets"),
      timeline: (pid) => get(`targets/${pid}/timeline`),
      tree: (pid, id) => get(`targets/${pid}/snapshots/${encodeURIComponent(id)}/tree`),
      diff: (pid, a, b) => get(`targets/${pid}/diff?a=${encodeURIComponent(a)}&b=${encodeURIComponent(b)}`),
      growth: async (pid) => {
        // Asked first, so that a target without a history (or none stored yet) costs no failed request.
        const h = await get(`targets/${pid}/history`);
        if (!h.enabled) throw new Error("this target keeps no history (serve keeps one unless --no-store; run and attach with --store DIR)");
        if (!h.snapshots_held) throw new Error("no snapshot stored yet");
        return get(`targets/${pid}/growth?top=${GROWTH_ROWS}`);
      },
    };
  }

  function fileSource(data) {
    const one = (x, what) => { if (x === undefined) throw new Error(what + " is not in this file"); return x; };
    return {
      live: false,
      name: data.file,
      targets: async () => data.targets,
      timeline: async (pid) => one(data.timelines[pid], "timeline"),
      tree: async (pid, id) => one((data.trees[pid] || {})[id], "the tree of snapshot " + id),
      diff: async (pid, a, b) => fileDiff(data.timelines[pid], one((data.diffdata[pid] || {})[a], "snapshot " + a),
        one((data.diffdata[pid] || {})[b], "snapshot " + b), a, b, data.diff_rows),
    };
  }

  // The diff a file's page computes itself, as agent/export/webdata.py diff_snapshots does on the server.
  function fileDiff(timeline, da, db, a, b, rows) {
    const ref = (id) => { const p = timeline.points.find((q) => q.id === id); return { id, index: p.index, time: p.time, kind: p.kind, heap: p.heap }; };
    function changes(before, after) {
      const m = new Map();
      for (const [path, v] of before) m.set(path.join("\u0001"), [path, v, 0]);
      for (const [path, v] of after) { const k = path.join("\u0001"); const e = m.get(k); if (e) e[2] = v; else m.set(k, [path, 0, v]); }
      const all = [];
      for (const [path, x, y] of m.values()) if (x !== y) all.push({ name: path[0], path, before: x, after: y, delta: y - x });
      const grew = all.filter((c) => c.delta > 0).sort((p, q) => q.delta - p.delta);
      const shrank = all.filter((c) => c.delta < 0).sort((p, q) => p.delta - q.delta);
      return [grew, shrank, all.length];
    }
    const [sg, ss, ns] = changes(da.sites.map(([n, v]) => [[n], v]), db.sites.map(([n, v]) => [[n], v]));
    const [pg, ps, np] = changes(da.paths, db.paths);
    return { a: ref(a), b: ref(b), estimate: timeline.estimate, grew: sg.reduce((s, c) => s + c.delta, 0),
      shrank: -ss.reduce((s, c) => s + c.delta, 0), sites_grew: sg.slice(0, rows), sites_shrank: ss.slice(0, rows),
      stacks_grew: pg.slice(0, rows), stacks_shrank: ps.slice(0, rows), n_sites_changed: ns, n_stacks_changed: np,
      truncated: da.truncated + db.truncated };
  }

  // How long the page took (ms): to its first drawing, and for the last tree and diff (bench/webpage.py reads it).
  const timings = window.heapscopeTimings = { ready: null, tree: null, diff: null };
  const embedded = $("heapscope-data");
  const source = embedded ? fileSource(JSON.parse(embedded.textContent)) : liveSource();

  // ---- formatting ------------------------------------------------------------------------------------------
  function fmtBytes(n) {
    if (n === null || n === undefined) return "–";
    const a = Math.abs(n);
    if (a < 1024) return n + " B";
    const units = ["KiB", "MiB", "GiB", "TiB"];
    let v = n / 1024, i = 0;
    while (Math.abs(v) >= 1024 && i < units.length - 1) { v /= 1024; i++; }
    return v.toFixed(Math.abs(v) < 10 ? 2 : 1) + " " + units[i];
  }
  function fmtTime(t, unit) {
    if (unit === "B") return fmtBytes(Math.round(t));
    if (unit === "ms") return t >= 10000 ? (t / 1000).toFixed(1) + " s" : Math.round(t) + " ms";
    return t >= 1e6 ? (t / 1e6).toFixed(1) + "M instr" : Math.round(t) + " instr";
  }
  const exact = (n) => n.toLocaleString("en-US") + " B";
  const pct = (n, of) => (of > 0 ? (100 * n / of).toFixed(2) : "0.00") + "%";
  const signed = (n) => (n > 0 ? "+" : n < 0 ? "−" : "") + fmtBytes(Math.abs(n));
  function el(name, attrs, parent, ns) {
    const e = ns ? document.createElementNS(SVGNS, name) : document.createElement(name);
    for (const k in attrs || {}) if (attrs[k] !== null && attrs[k] !== undefined) e.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(e);
    return e;
  }
  const svgEl = (name, attrs, parent) => el(name, attrs, parent, true);
  function nodeLabel(n) {
    if (n.kind !== "frame") return n.name;
    if (n.file && n.line) return `${n.name} (${n.file}:${n.line})`;
    if (n.obj) return `${n.name} (in ${n.obj})`;
    return n.name;
  }

  // ---- state -----------------------------------------------------------------------------------------------
  const state = { targets: [], pid: null, timeline: null, cursor: null, marks: [], treeId: null, tree: null,
    zoom: null, focus: null, busy: false, growth: null, growthAt: -Infinity, growthOpen: new Set(), growthFocus: null };
  const siteColor = (name) => {
    const i = state.timeline ? state.timeline.sites.indexOf(name) : -1;
    return i >= 0 && i < state.timeline.sites.length - 1 ? PALETTE[i % PALETTE.length] : OTHER_COLOR;
  };
  function status(text) { $("status").textContent = text; }

  // ---- targets ---------------------------------------------------------------------------------------------
  function renderTargets() {
    const ul = $("targets");
    ul.textContent = "";
    if (!state.targets.length) { el("li", {}, ul).textContent = "No target: attach one with POST /targets."; return; }
    for (const t of state.targets) {
      const li = el("li", {}, ul);
      const b = el("button", { type: "button", "data-pid": t.pid, "aria-current": t.pid === state.pid ? "true" : "false" }, li);
      el("div", { class: "t-cmd" }, b).textContent = t.pid ? `${t.command} (${t.pid})` : t.command;
      const meta = el("div", { class: "t-meta" }, b);
      const mode = t.mode || "exact";  // sampled mode adds `mode`; profiles without it are exact
      el("span", { class: "badge" + (mode === "sampled" ? " estimate" : "") }, meta).textContent = mode === "sampled" ? "sampled (estimates)" : mode;
      el("span", { class: "badge " + t.state }, meta).textContent = t.state;
      el("span", { class: "t-heap" }, meta).textContent = "heap " + fmtBytes(t.heap.useful_bytes);
      b.addEventListener("click", () => selectTarget(t.pid));
    }
  }

  async function selectTarget(pid) {
    if (pid === state.pid) return;
    Object.assign(state, { pid, timeline: null, cursor: null, marks: [], treeId: null, tree: null, zoom: null, focus: null,
      growth: null, growthAt: -Infinity, growthOpen: new Set(), growthFocus: null });
    for (const id of ["tree-panel", "diff-panel", "growth-panel"]) $(id).hidden = true;
    renderTargets();
    await refreshTimeline();
    await refreshGrowth();
  }

  // ---- timeline --------------------------------------------------------------------------------------------
  async function refreshTimeline() {
    if (state.pid === null) return;
    const tl = await source.timeline(state.pid);
    state.timeline = tl;
    const ids = new Set(tl.points.map((p) => p.id));
    state.marks = state.marks.filter((id) => ids.has(id));
    if (state.cursor !== null && !ids.has(state.cursor)) state.cursor = null;
    renderTimeline();
  }

  function renderTimeline() {
    const tl = state.timeline;
    const box = $("timeline");
    box.textContent = "";
    const target = state.targets.find((t) => t.pid === state.pid);
    const est = tl.estimate ? " Sampled profile: every figure is an estimate." : "";
    $("timeline-title").textContent = `Timeline of ${target ? target.command : "?"}` + (tl.estimate ? " (estimates)" : "");
    $("timeline-note").textContent = `${tl.points.length} snapshots (time in ${tl.time_unit}); sites stacked at the `
      + `${tl.points.filter((p) => p.sites).length} snapshots with a tree (●), heap only at the others (○); `
      + `${tl.n_sites} sites, the top ${tl.sites.length - 1} shown.` + est;
    const W = Math.max(600, box.clientWidth || 1000), H = 280, L = 70, R = 12, T = 12, B = 30;
    const svg = svgEl("svg", { viewBox: `0 0 ${W} ${H}`, height: H, tabindex: "0", role: "application",
      "aria-label": "Timeline: use the arrow keys to move between snapshots, Enter to show the tree" }, box);
    const pts = tl.points;
    if (!pts.length) { svgEl("text", { x: L, y: H / 2 }, svg).textContent = "no snapshot yet"; return; }
    const t0 = pts[0].time, t1 = Math.max(pts[pts.length - 1].time, t0 + 1);
    let ymax = 1;
    for (const p of pts) ymax = Math.max(ymax, p.heap + p.extra + p.stacks, p.mapped || 0, p.rss || 0);
    const x = (t) => L + (W - L - R) * (t - t0) / (t1 - t0);
    const y = (v) => H - B - (H - B - T) * v / ymax;
    for (let i = 0; i <= 4; i++) {
      const v = ymax * i / 4;
      svgEl("line", { class: "grid", x1: L, x2: W - R, y1: y(v), y2: y(v) }, svg);
      svgEl("text", { x: L - 6, y: y(v) + 4, "text-anchor": "end" }, svg).textContent = fmtBytes(Math.round(v));
    }
    for (let i = 0; i <= 5; i++) {
      const t = t0 + (t1 - t0) * i / 5;
      svgEl("text", { x: x(t), y: H - B + 16, "text-anchor": i === 0 ? "start" : i === 5 ? "end" : "middle" }, svg).textContent = fmtTime(t, tl.time_unit);
    }
    svgEl("line", { class: "axis", x1: L, x2: W - R, y1: H - B, y2: H - B }, svg);
    svgEl("line", { class: "axis", x1: L, x2: L, y1: T, y2: H - B }, svg);
    // Stacked sites, through the snapshots that have a tree.
    const tp = pts.filter((p) => p.sites);
    if (tp.length) {
      const base = tp.map(() => 0);
      tl.sites.forEach((name, k) => {
        const top = tp.map((p, j) => base[j] + p.sites[k]);
        let d;
        if (tp.length === 1) {
          const cx = x(tp[0].time);
          d = `M${cx - 3},${y(base[0])}L${cx - 3},${y(top[0])}L${cx + 3},${y(top[0])}L${cx + 3},${y(base[0])}Z`;
        } else {
          d = "M" + tp.map((p, j) => `${x(p.time)},${y(top[j])}`).join("L")
            + "L" + tp.map((p, j) => `${x(p.time)},${y(base[j])}`).reverse().join("L") + "Z";
        }
        const path = svgEl("path", { d, fill: siteColor(name), "fill-opacity": 0.85, class: "band", "data-site": name }, svg);
        svgEl("title", {}, path).textContent = name;
        top.forEach((v, j) => { base[j] = v; });
      });
    }
    const line = (get, color, dash, label) => {
      const have = pts.filter((p) => get(p) !== null && get(p) !== undefined);
      if (!have.length) return false;
      svgEl("polyline", { points: have.map((p) => `${x(p.time)},${y(get(p))}`).join(" "), fill: "none", stroke: color,
        "stroke-width": 1.6, "stroke-dasharray": dash, class: "line-" + label }, svg);
      return true;
    };
    const hasMapped = line((p) => p.mapped, "#6a3d9a", "6 3", "mapped");
    const hasRss = line((p) => p.rss, "#2b8a3e", "2 3", "rss");
    line((p) => p.heap, "#1d2330", null, "heap");
    // The peak.
    if (tl.peak_index !== null) {
      const p = pts[tl.peak_index];
      svgEl("line", { x1: x(p.time), x2: x(p.time), y1: T, y2: H - B, stroke: "#c05600", "stroke-dasharray": "3 3" }, svg);
      svgEl("text", { x: Math.min(x(p.time) + 4, W - 150), y: T + 10, class: "peak-label" }, svg).textContent =
        `${p.kind === "peak" ? "peak" : "highest"} ${fmtBytes(p.heap + p.extra + p.stacks)}`;
    }
    for (const p of pts) {
      const c = svgEl("circle", { cx: x(p.time), cy: y(p.heap), r: p.sites ? 4.5 : 3.5,
        class: "point " + (p.sites ? "tree" : "normal") + (p.id === state.cursor ? " cursor" : "") + (state.marks.includes(p.id) ? " mark" : ""),
        "data-id": p.id, "data-index": p.index, "data-kind": p.kind }, svg);
      svgEl("title", {}, c).textContent = describePoint(p);
      c.addEventListener("click", (ev) => { ev.stopPropagation(); state.cursor = p.id; if (ev.shiftKey) toggleMark(p.id); else showTree(p.id); renderTimeline(); });
    }
    svg.addEventListener("keydown", timelineKey);
    if (state.refocus) { svg.focus(); state.refocus = false; }
    // Legend.
    const lg = $("legend");
    lg.textContent = "";
    tl.sites.forEach((name) => {
      const s = el("span", { title: name }, lg);
      el("i", { style: `background:${siteColor(name)}` }, s);
      s.appendChild(document.createTextNode(name));
    });
    const extra = [["useful heap", "#1d2330"]];
    if (hasMapped) extra.push(["mapped (dashed)", "#6a3d9a"]);
    if (hasRss) extra.push(["RSS (dotted)", "#2b8a3e"]);
    for (const [name, color] of extra) {
      const s = el("span", {}, lg);
      el("i", { style: `background:${color};height:3px` }, s);
      s.appendChild(document.createTextNode(name));
    }
    renderCursor();
  }

  function describePoint(p) {
    const tl = state.timeline;
    const top = p.index === tl.peak_index ? (p.kind === "peak" ? ", the peak" : ", the highest point") : "";
    let s = `#${p.index} at ${p.time} ${tl.time_unit} (${p.kind}${top}): heap ${fmtBytes(p.heap)}, extra ${fmtBytes(p.extra)}`;
    if (p.stacks) s += `, stacks ${fmtBytes(p.stacks)}`;
    if (p.mapped !== null) s += `, mapped ${fmtBytes(p.mapped)}`;
    if (p.rss !== null) s += `, RSS ${fmtBytes(p.rss)}`;
    return s + (p.sites ? "" : " — no tree kept");
  }

  function renderCursor() {
    const tl = state.timeline;
    const p = tl && tl.points.find((q) => q.id === state.cursor);
    $("cursor-info").textContent = p ? describePoint(p) : "No snapshot selected.";
    const name = (id) => { const q = tl.points.find((r) => r.id === id); return q ? "#" + q.index : "?"; };
    $("marks").textContent = state.marks.length ? "Compare: " + state.marks.map((id, i) => (i ? "B=" : "A=") + name(id)).join(" ") : "";
    $("marks").dataset.ids = state.marks.join(" ");
    $("compare").disabled = state.marks.length !== 2;
  }

  function toggleMark(id) {
    const p = state.timeline.points.find((q) => q.id === id);
    if (!p || !p.sites) { status(`snapshot #${p ? p.index : "?"} has no tree: only snapshots with a tree (●) can be compared`); return; }
    const i = state.marks.indexOf(id);
    if (i >= 0) state.marks.splice(i, 1);
    else { state.marks.push(id); if (state.marks.length > 2) state.marks.shift(); }
    const at = (id) => state.timeline.points.findIndex((q) => q.id === id);
    state.marks.sort((a, b) => at(a) - at(b));
  }

  function timelineKey(ev) {
    const pts = state.timeline.points;
    let i = pts.findIndex((p) => p.id === state.cursor);
    const move = (j) => { state.cursor = pts[Math.max(0, Math.min(pts.length - 1, j))].id; };
    switch (ev.key) {
      case "ArrowRight": move(i < 0 ? 0 : i + 1); break;
      case "ArrowLeft": move(i < 0 ? pts.length - 1 : i - 1); break;
      case "Home": move(0); break;
      case "End": move(pts.length - 1); break;
      case "Enter": case " ": if (state.cursor) showTree(state.cursor); break;
      case "a": case "b": if (state.cursor) toggleMark(state.cursor); break;
      case "c": if (state.marks.length === 2) showDiff(); break;
      default: return;
    }
    ev.preventDefault();
    state.refocus = true;
    renderTimeline();
  }

  // ---- the tree: an icicle, allocation sites on top and their callers below ------------------------------
  async function showTree(id) {
    const p = state.timeline.points.find((q) => q.id === id);
    const panel = $("tree-panel");
    panel.hidden = false;
    if (!p.sites) {
      state.tree = null;
      $("tree").textContent = "";
      $("tree-title").textContent = `Tree of snapshot #${p.index}`;
      const near = state.timeline.points.filter((q) => q.sites).sort((a, b) => Math.abs(a.index - p.index) - Math.abs(b.index - p.index))[0];
      $("tree-info").textContent = `Snapshot #${p.index} is a normal snapshot: Massif keeps a tree only for detailed snapshots and the peak.`
        + (near ? ` The nearest with a tree is #${near.index}.` : "");
      return;
    }
    const started = performance.now();
    try {
      state.tree = await source.tree(state.pid, id);
    } catch (e) { status(String(e.message || e)); await refreshTimeline(); return; }
    state.treeId = id;
    state.zoom = state.tree.root;
    state.focus = state.tree.root;
    renderTree();
    timings.tree = performance.now() - started;
  }

  function parentsOf(root) {
    const m = new Map();
    const walk = (n) => { for (const c of n.children) { m.set(c, n); walk(c); } };
    walk(root);
    return m;
  }

  function siteOf(n, parents) {
    let cur = n, prev = n;
    while (parents.has(cur)) { prev = cur; cur = parents.get(cur); }
    return prev === state.tree.root ? null : prev;
  }

  function renderTree() {
    const t = state.tree;
    const box = $("tree");
    box.textContent = "";
    const total = t.heap + t.extra + t.stacks;
    $("tree-title").textContent = `Tree of snapshot #${t.index} (${t.kind}) at ${t.time} ${state.timeline.time_unit}` + (t.estimate ? " — estimates" : "");
    $("tree-info").textContent = `useful heap ${fmtBytes(t.heap)} (${exact(t.heap)}), extra ${fmtBytes(t.extra)}; `
      + `${t.n_nodes} nodes shown` + (t.n_merged ? `, ${t.n_merged} smaller ones summed into their parent or a "(N smaller call sites)" node` : "")
      + ". Percentages are of useful + extra + stacks, as in ms_print. Click a node to zoom, click the top bar to zoom out.";
    const parents = parentsOf(t.root);
    state.parents = parents;
    const zoom = state.zoom;
    const ROW = 20, W = Math.max(600, box.clientWidth || 1000);
    let depth = 0;
    const measure = (n, d) => { depth = Math.max(depth, d); for (const c of n.children) measure(c, d + 1); };
    measure(zoom, 0);
    const H = (Math.min(depth, 40) + 1) * ROW + 2;
    const svg = svgEl("svg", { viewBox: `0 0 ${W} ${H}`, height: H, tabindex: "0", role: "application",
      "aria-label": "Flame graph: arrow keys move, Enter zooms, Escape zooms out" }, box);
    const scale = W / Math.max(zoom.bytes, 1);
    const draw = (n, x0, d) => {
      if (d > 40) return;
      const w = n.bytes * scale;
      if (w < 0.5) return;
      const site = siteOf(n, parents);
      const color = n.kind === "root" ? "#d9dde4" : n.kind === "other" || n.kind === "below_threshold" ? OTHER_COLOR : siteColor(site ? nodeLabel(site) : "");
      const g = svgEl("g", { class: "node" }, svg);
      const r = svgEl("rect", { x: x0, y: d * ROW, width: Math.max(w - 0.5, 0.5), height: ROW - 1, fill: color,
        class: "cell" + (n === state.focus ? " focus" : ""), "data-name": nodeLabel(n), "data-bytes": n.bytes }, g);
      const text = `${nodeLabel(n)} — ${fmtBytes(n.bytes)} (${pct(n.bytes, total)})`;
      svgEl("title", {}, r).textContent = `${text}\n${exact(n.bytes)}`;
      if (w > 40) {
        const maxChars = Math.floor((w - 6) / 6.2);
        svgEl("text", { x: x0 + 3, y: d * ROW + 14, "pointer-events": "none" }, g).textContent = text.length > maxChars ? text.slice(0, maxChars - 1) + "…" : text;
      }
      r.addEventListener("click", () => { state.focus = n; state.zoom = n === state.zoom && parents.has(n) ? parents.get(n) : n; renderTree(); });
      r.addEventListener("mouseenter", () => nodeInfo(n));
      let cx = x0;
      for (const c of n.children) { draw(c, cx, d + 1); cx += c.bytes * scale; }
    };
    draw(zoom, 0, 0);
    childTable(zoom, total);
    svg.addEventListener("keydown", treeKey);
    if (state.refocusTree) { svg.focus(); state.refocusTree = false; }
    nodeInfo(state.focus);
  }

  // The zoomed node's biggest children as a table: readable where thousands of sites make the cells too thin.
  function childTable(zoom, total) {
    const tb = $("tree-table");
    tb.textContent = "";
    if (!zoom.children.length) return;
    const head = el("tr", {}, el("thead", {}, tb));
    for (const [h, num] of [[`below ${nodeLabel(zoom)}`, false], ["bytes", true], ["of the snapshot", true], ["of the parent", true]])
      el("th", { class: num ? "num" : "" }, head).textContent = h;
    const body = el("tbody", {}, tb);
    const LIMIT = 25;
    for (const c of zoom.children.slice(0, LIMIT)) {
      const tr = el("tr", { tabindex: "0", "data-name": nodeLabel(c), class: "zoomable" }, body);
      el("td", {}, tr).textContent = nodeLabel(c);
      el("td", { class: "num", title: exact(c.bytes) }, tr).textContent = fmtBytes(c.bytes);
      el("td", { class: "num" }, tr).textContent = pct(c.bytes, total);
      el("td", { class: "num" }, tr).textContent = pct(c.bytes, zoom.bytes);
      const go = () => { state.zoom = c; state.focus = c; renderTree(); };
      tr.addEventListener("click", go);
      tr.addEventListener("keydown", (ev) => { if (ev.key === "Enter") { ev.preventDefault(); go(); } });
    }
    if (zoom.children.length > LIMIT) {
      const rest = zoom.children.slice(LIMIT);
      const tr = el("tr", {}, body);
      el("td", {}, tr).textContent = `${rest.length} more`;
      el("td", { class: "num" }, tr).textContent = fmtBytes(rest.reduce((s, c) => s + c.bytes, 0));
    }
  }

  function nodeInfo(n) {
    const t = state.tree;
    const total = t.heap + t.extra + t.stacks;
    const parent = state.parents.get(n);
    $("node-info").textContent = `${nodeLabel(n)}: ${exact(n.bytes)} = ${fmtBytes(n.bytes)}, ${pct(n.bytes, total)} of the snapshot`
      + (parent ? `, ${pct(n.bytes, parent.bytes)} of its parent` : "") + (n.children.length ? `; ${n.children.length} callers below` : "");
  }

  function treeKey(ev) {
    const n = state.focus, parents = state.parents;
    const parent = parents.get(n);
    const sib = parent ? parent.children : [n];
    const i = sib.indexOf(n);
    switch (ev.key) {
      case "ArrowUp": if (parent) state.focus = parent; break;
      case "ArrowDown": if (n.children.length) state.focus = n.children[0]; break;
      case "ArrowLeft": if (i > 0) state.focus = sib[i - 1]; break;
      case "ArrowRight": if (i < sib.length - 1) state.focus = sib[i + 1]; break;
      case "Enter": state.zoom = n; break;
      case "Escape": if (parents.has(state.zoom)) state.zoom = parents.get(state.zoom); break;
      default: return;
    }
    // The focused node stays inside the zoomed part.
    let c = state.focus, inside = false;
    while (c) { if (c === state.zoom) { inside = true; break; } c = parents.get(c); }
    if (!inside) state.zoom = state.focus;
    ev.preventDefault();
    state.refocusTree = true;
    renderTree();
  }

  // ---- the diff --------------------------------------------------------------------------------------------
  async function showDiff() {
    const [a, b] = state.marks;
    const started = performance.now();
    let d;
    try { d = await source.diff(state.pid, a, b); } catch (e) { status(String(e.message || e)); return; }
    const panel = $("diff-panel");
    panel.hidden = false;
    $("diff-title").textContent = `Diff: snapshot #${d.a.index} (${d.a.time} ${state.timeline.time_unit}) → #${d.b.index} (${d.b.time} ${state.timeline.time_unit})` + (d.estimate ? " — estimates" : "");
    $("diff-info").textContent = `useful heap ${fmtBytes(d.a.heap)} → ${fmtBytes(d.b.heap)} (${signed(d.b.heap - d.a.heap)}); `
      + `sites that grew: ${signed(d.grew)}, that shrank: ${signed(-d.shrank)}; ${d.n_sites_changed} sites and ${d.n_stacks_changed} stacks changed`
      + (d.truncated ? `; this file keeps the biggest entries of each snapshot only (${d.truncated} smaller left out)` : "") + ".";
    const box = $("diff");
    box.textContent = "";
    const cols = el("div", { class: "diff-cols" }, box);
    const table = (parent, title, rows, cls, paths) => {
      const wrap = el("div", {}, parent);
      el("h3", {}, wrap).textContent = title;
      const tb = el("table", { class: "diff-" + cls }, wrap);
      const head = el("tr", {}, el("thead", {}, tb));
      for (const [h, num] of [[paths ? "stack (site, then callers)" : "site", false], ["before", true], ["after", true], ["change", true]])
        el("th", { class: num ? "num" : "" }, head).textContent = h;
      const body = el("tbody", {}, tb);
      if (!rows.length) el("td", { colspan: 4 }, el("tr", {}, body)).textContent = "nothing";
      for (const r of rows) {
        const tr = el("tr", { "data-name": r.name, "data-delta": r.delta }, body);
        const td = el("td", {}, tr);
        td.textContent = r.name;
        if (paths && r.path.length > 1) el("div", { class: "path" }, td).textContent = "← " + r.path.slice(1).join(" ← ");
        el("td", { class: "num" }, tr).textContent = fmtBytes(r.before);
        el("td", { class: "num" }, tr).textContent = fmtBytes(r.after);
        el("td", { class: "num " + cls, title: exact(r.delta) }, tr).textContent = signed(r.delta);
      }
    };
    table(cols, "Sites that grew", d.sites_grew, "grew", false);
    table(cols, "Sites that shrank", d.sites_shrank, "shrank", false);
    const cols2 = el("div", { class: "diff-cols" }, box);
    table(cols2, "Stacks that grew", d.stacks_grew, "grew", true);
    table(cols2, "Stacks that shrank", d.stacks_shrank, "shrank", true);
    panel.scrollIntoView({ block: "nearest" });
    timings.diff = performance.now() - started;
  }

  // ---- what is growing: the target's sites over its stored history, leak suspects first ------------------
  async function refreshGrowth() {
    if (!source.growth || state.pid === null || performance.now() - state.growthAt < GROWTH_EVERY_MS) return;
    state.growthAt = performance.now();
    const pid = state.pid;
    let g = null, error = null;
    try { g = await source.growth(pid); } catch (e) { error = String(e.message || e); }
    if (pid !== state.pid) return;  // another target was chosen meanwhile
    state.growth = g;
    renderGrowth(error);
  }

  function fmtSpan(s) {
    if (s >= 86400) return (s / 86400).toFixed(1) + " d";
    if (s >= 3600) return (s / 3600).toFixed(1) + " h";
    if (s >= 60) return (s / 60).toFixed(1) + " min";
    return Math.round(s) + " s";
  }

  // A site's live bytes over the window, scaled to its own range.
  function spark(values, times) {
    const W = 120, H = 22;
    const svg = svgEl("svg", { class: "spark", width: W, height: H, viewBox: `0 0 ${W} ${H}`, role: "img",
      "aria-label": `live bytes from ${fmtBytes(values[0])} to ${fmtBytes(values[values.length - 1])}` });
    const t0 = times[0], t1 = Math.max(times[times.length - 1], t0 + 1e-9);
    const lo = Math.min(...values), hi = Math.max(lo + 1, ...values);
    svgEl("polyline", { points: values.map((v, i) => `${1 + (W - 2) * (times[i] - t0) / (t1 - t0)},${H - 2 - (H - 4) * (v - lo) / (hi - lo)}`).join(" ") }, svg);
    return svg;
  }

  function renderGrowth(error) {
    $("growth-panel").hidden = false;
    const tb = $("growth-table");
    tb.textContent = "";
    const g = state.growth;
    if (!g) {
      $("growth-title").textContent = "What is growing";
      $("growth-info").textContent = "Nothing to show: " + error;
      return;
    }
    const span = fmtSpan(g.window_s);
    $("growth-title").textContent = `What is growing, over the last ${span}` + (g.mode === "sampled" ? " (estimates)" : "");
    const said = g.process.said.charAt(0).toUpperCase() + g.process.said.slice(1);
    $("growth-info").textContent = `${said}. ${g.suspects} leak suspect${g.suspects === 1 ? "" : "s"} among ${g.n_sites} sites: `
      + "suspects first, then by the bytes added. Click a site (or Enter) for its stack.";
    const head = el("tr", {}, el("thead", {}, tb));
    for (const [h, num] of [["site", false], ["verdict", false], ["rate", true], ["added", true], ["live", true],
      ["steady", true], ["age", true], [`live bytes over ${span}`, false]])
      el("th", { class: num ? "num" : "" }, head).textContent = h;
    const body = el("tbody", {}, tb);
    for (const s of g.sites.slice(0, GROWTH_ROWS)) {
      const open = state.growthOpen.has(s.site);
      const tr = el("tr", { class: "growth-row" + (s.suspect ? " suspect" : ""), tabindex: "0", "data-site": s.site,
        "data-verdict": s.verdict, "data-suspect": String(s.suspect), "aria-expanded": String(open) }, body);
      el("td", {}, tr).textContent = s.site;
      el("td", { class: "verdict" }, tr).textContent = s.verdict + (s.samples !== null ? ` (${s.samples} samples)` : "");
      el("td", { class: "num", title: `${Math.round(s.bytes_per_s)} B/s` }, tr).textContent = signed(Math.round(s.bytes_per_s)) + "/s";
      el("td", { class: "num", title: exact(s.added_B) }, tr).textContent = signed(s.added_B);
      el("td", { class: "num", title: exact(s.live_B) }, tr).textContent = fmtBytes(s.live_B);
      el("td", { class: "num" }, tr).textContent = s.steadiness.toFixed(2);
      el("td", { class: "num" }, tr).textContent = fmtSpan(s.age_s);
      el("td", {}, tr).appendChild(spark(s.line, g.times_s));
      const toggle = () => {
        if (open) state.growthOpen.delete(s.site); else state.growthOpen.add(s.site);
        state.growthFocus = s.site;
        renderGrowth(null);
      };
      tr.addEventListener("click", toggle);
      tr.addEventListener("keydown", (ev) => { if (ev.key === "Enter" || ev.key === " ") { ev.preventDefault(); toggle(); } });
      if (open) {
        const td = el("td", { colspan: 8 }, el("tr", { class: "growth-stack", "data-site": s.site }, body));
        td.appendChild(document.createTextNode("Its stack that added the most: the site, then its callers outwards"));
        const ol = el("ol", { "aria-label": "stack of " + s.site }, td);
        for (const frame of s.stack) el("li", {}, ol).textContent = frame;
      }
    }
    if (g.sites.length > GROWTH_ROWS || g.n_sites > g.sites.length)
      el("td", { colspan: 8 }, el("tr", {}, body)).textContent = `${g.n_sites - Math.min(g.sites.length, GROWTH_ROWS)} more sites (GET /targets/${g.pid}/growth?top=0 lists them all)`;
    if (state.growthFocus !== null) {
      const again = [...tb.querySelectorAll("tr.growth-row")].find((r) => r.dataset.site === state.growthFocus);
      if (again) again.focus();
      state.growthFocus = null;
    }
  }

  // ---- wiring ----------------------------------------------------------------------------------------------
  $("compare").addEventListener("click", showDiff);
  $("clear-marks").addEventListener("click", () => { state.marks = []; renderTimeline(); });
  $("source").textContent = source.name;
  let resizeTimer = null;
  window.addEventListener("resize", () => { clearTimeout(resizeTimer); resizeTimer = setTimeout(() => { if (state.timeline) renderTimeline(); if (state.tree) renderTree(); }, 150); });

  async function tick() {
    if (state.busy) return;
    state.busy = true;
    try {
      state.targets = await source.targets();
      renderTargets();
      if (state.pid !== null && !state.targets.some((q) => q.pid === state.pid)) {
        // Detached and forgotten by the daemon: show another target, or nothing.
        state.pid = null;
        state.timeline = null;
        state.growth = null;
        for (const id of ["tree-panel", "diff-panel", "growth-panel"]) $(id).hidden = true;
        $("timeline").textContent = "";
        $("legend").textContent = "";
        $("timeline-note").textContent = "The target was detached.";
      }
      if (state.pid === null && state.targets.length) await selectTarget(state.targets[0].pid);
      else if (state.pid !== null) {
        const t = state.targets.find((q) => q.pid === state.pid);
        if (t && (t.state === "profiling" || !state.timeline || state.lastState !== t.state)) await refreshTimeline();
        if (t && (t.state === "profiling" || !state.growth)) await refreshGrowth();
        if (t) state.lastState = t.state;
      }
      const live = state.targets.filter((q) => q.state === "profiling").length;
      status(source.live ? `${state.targets.length} target(s), ${live} profiling; updated ${new Date().toLocaleTimeString()}` : "");
      if (timings.ready === null && state.timeline) timings.ready = performance.now();
      document.body.dataset.ready = "true";
    } catch (e) {
      status("cannot read the daemon: " + (e.message || e));
    } finally {
      state.busy = false;
    }
  }
  tick();
  if (source.live) setInterval(tick, POLL_MS);
})();
