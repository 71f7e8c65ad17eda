// Inline SVG views: stacked bars per strategy against the budget, and the sweep over
// GPU counts with the ZeRO-1/2 floors (first source document, sections 2 and 3).
// Colour is never the only cue: categories also differ by fill pattern and text label,
// strategies in the sweep by marker shape and a label at the end of each line.
"use strict";

const Charts = (() => {
  const NS = "http://www.w3.org/2000/svg"; // an XML namespace name, never fetched
  // The colours of render.plot, so the page and `--plot` look alike.
  const CATEGORIES = [
    { key: "weights", label: "weights", color: "#4C72B0", pattern: null },
    { key: "grads", label: "grads", color: "#DD8452", pattern: "stripes" },
    { key: "optimizer", label: "optim", color: "#55A868", pattern: "dots" },
    { key: "activations", label: "activ", color: "#C44E52", pattern: "cross" },
  ];
  const MARKERS = { DDP: "circle", "ZeRO-1": "square", "ZeRO-2": "triangle", "ZeRO-3": "diamond" };
  const LINE_COLORS = {
    DDP: "#555", "ZeRO-1": "#4C72B0", "ZeRO-2": "#DD8452", "ZeRO-3": "#2a7a3b",
  };

  function el(name, attrs = {}, parent = null, text = null) {
    const node = document.createElementNS(NS, name);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
    if (text != null) node.textContent = text;
    if (parent) parent.append(node);
    return node;
  }

  // The fill patterns, defined once in a hidden SVG that every chart and swatch uses.
  function defs() {
    if (document.getElementById("chart-defs")) return;
    const svg = el("svg", { id: "chart-defs", class: "defs", width: 0, height: 0 });
    svg.setAttribute("aria-hidden", "true");
    document.body.append(svg);
    const d = el("defs", {}, svg);
    const pattern = (id) => el("pattern",
      { id, width: 6, height: 6, patternUnits: "userSpaceOnUse" }, d);
    el("path", { d: "M0,6 L6,0", stroke: "#fff", "stroke-opacity": 0.45, "stroke-width": 1.5 },
      pattern("pat-stripes"));
    el("circle", { cx: 3, cy: 3, r: 1.1, fill: "#fff", "fill-opacity": 0.5 }, pattern("pat-dots"));
    el("path", { d: "M0,0 L6,6 M6,0 L0,6", stroke: "#fff", "stroke-opacity": 0.35 },
      pattern("pat-cross"));
  }

  // A category's fill: its colour, then its pattern on top.
  function fill(parent, cat, box) {
    const rect = el("rect", { ...box, fill: cat.color }, parent);
    if (cat.pattern) {
      el("rect", { ...box, fill: `url(#pat-${cat.pattern})`, "pointer-events": "none" }, parent);
    }
    return rect;
  }

  function legend(ul) {
    defs();
    for (const cat of CATEGORIES) {
      const svg = el("svg", { width: 14, height: 14, "aria-hidden": "true" });
      fill(svg, cat, { width: 14, height: 14 });
      const li = document.createElement("li");
      li.append(svg, cat.key === "optimizer" ? "optimizer state" : cat.key);
      ul.append(li);
    }
    const svg = el("svg", { width: 22, height: 14, "aria-hidden": "true" });
    el("line", { x1: 0, y1: 7, x2: 22, y2: 7, class: "budget" }, svg);
    const li = document.createElement("li");
    li.append(svg, "memory budget");
    ul.append(li);
  }

  // A round axis step (1, 2 or 5 × 10^k) giving about `n` ticks up to `max`.
  function niceStep(max, n = 5) {
    const raw = max / n;
    const mag = 10 ** Math.floor(Math.log10(raw));
    return [1, 2, 5, 10].map((k) => k * mag).find((step) => step >= raw);
  }

  function yAxis(g, x0, x1, y, max, unitName) {
    const step = niceStep(max);
    for (let v = 0; v <= max + 1e-9; v += step) {
      el("line", { x1: x0, x2: x1, y1: y(v), y2: y(v), class: "grid" }, g);
      el("text", { x: x0 - 6, y: y(v) + 4, class: "tick", "text-anchor": "end" }, g,
        Format.general(v));
    }
    el("text", { x: 4, y: 14, class: "axis-title" }, g, `${unitName} per GPU`);
  }

  // An SVG as wide as its card (redrawn on resize), so text keeps its size at 360 px.
  function frame(container, height, label) {
    defs();
    const width = Math.max(300, container.clientWidth || 600);
    const svg = el("svg", { width, height, viewBox: `0 0 ${width} ${height}`, role: "img" });
    svg.setAttribute("aria-label", label);
    container.replaceChildren(svg);
    return { svg, width };
  }

  function budgetLine(g, x0, x1, yb, s) {
    el("line", { x1: x0, x2: x1, y1: yb, y2: yb, class: "budget", "data-bytes": s.budget,
      id: `${g.id}-budget` }, g);
    el("text", { x: x1, y: yb - 5, class: "budget-label", "text-anchor": "end" }, g,
      `budget ${Format.general(s.mem)} ${s.unitName}`);
  }

  // One stacked bar, bottom to top weights, grads, optimizer, activations; a segment
  // tall enough carries its name and figure.
  function bar(g, s, p, x, bw, y) {
    const group = el("g", { "data-strategy": p.strategy }, g);
    const small = bw < 56 ? "seg small" : "seg";
    let base = 0;
    for (const cat of CATEGORIES) {
      const bytes = p[cat.key];
      const v = Number(bytes ?? 0n) / s.unit;
      const top = y(base + v), h = Math.max(0, y(base) - top), cx = x + bw / 2;
      const rect = fill(group, cat, { x, y: top, width: bw, height: h });
      rect.setAttribute("data-strategy", p.strategy);
      rect.setAttribute("data-category", cat.key);
      rect.setAttribute("data-bytes", bytes ?? "");
      const num = Format.bytes(bytes, s.unit, v < 1 ? 3 : 2);
      el("title", {}, rect, `${p.strategy} ${cat.key}: ${num} ${s.unitName}`);
      if (h >= 30 && bw >= 40) {
        el("text", { x: cx, y: top + h / 2 - 2, class: small }, group, cat.label);
        el("text", { x: cx, y: top + h / 2 + 11, class: small }, group, num);
      } else if (h >= 15) {
        el("text", { x: cx, y: top + h / 2 + 4, class: small }, group,
          bw >= 70 ? `${cat.label} ${num}` : cat.label);
      }
      base += v;
    }
    return group;
  }

  // The bars view; `zoom` scales to 1.5× the budget and marks the bars it cuts with ▲.
  function bars(container, s, plans, zoom) {
    const height = 360;
    const { svg, width } = frame(container, height, "Memory per GPU for each strategy");
    const g = el("g", { id: "bars-plot" }, svg);
    const m = { l: 52, r: 12, t: 26, b: 46 };
    const budget = Number(s.budget) / s.unit;
    const tallest = Math.max(...plans.map((p) => Number(p.total) / s.unit));
    const max = zoom ? budget * 1.5 : Math.max(budget, tallest) * 1.1;
    const y = (v) => height - m.b - (Math.min(v, max) / max) * (height - m.t - m.b);
    yAxis(g, m.l, width - m.r, y, max, s.unitName);
    const slot = (width - m.l - m.r) / plans.length;
    const bw = Math.min(110, slot * 0.72);
    plans.forEach((p, i) => {
      const x = m.l + slot * i + (slot - bw) / 2, cx = x + bw / 2;
      const group = bar(g, s, p, x, bw, y);
      const total = Number(p.total) / s.unit;
      el("text", { x: cx, y: y(total) - 6, class: "total" }, group,
        `${total > max ? "▲ " : ""}${Format.bytes(p.total, s.unit)}`);
      el("text", { x: cx, y: height - m.b + 17, class: "name" }, group, p.strategy);
      el("text", { x: cx, y: height - m.b + 33, class: p.fits ? "fit yes" : "fit no" }, group,
        p.fits ? "✓ fits" : "✗ over");
    });
    budgetLine(g, m.l, width - m.r, y(budget), s);
  }

  function marker(g, shape, x, y, color) {
    const r = 4, q = r + 1;
    const node = {
      circle: () => el("circle", { cx: x, cy: y, r }, g),
      square: () => el("rect", { x: x - r, y: y - r, width: 2 * r, height: 2 * r }, g),
      triangle: () => el("path",
        { d: `M${x},${y - q} L${x + q},${y + r} L${x - q},${y + r} Z` }, g),
      diamond: () => el("path",
        { d: `M${x},${y - q} L${x + q},${y} L${x},${y + q} L${x - q},${y} Z` }, g),
    }[shape]();
    node.setAttribute("fill", color);
    return node;
  }

  // Total per GPU over 1..1024 GPUs (log2 x axis); the ZeRO-1/2 floors (advice.floor_bytes
  // plus the unsharded activations) dashed. Lines above the scale are cut and marked ▲.
  function sweep(container, s, rows) {
    const height = 340, narrow = container.clientWidth < 500;
    const { svg, width } = frame(container, height, "Total memory per GPU against the GPU count");
    const g = el("g", { id: "sweep-plot" }, svg);
    const m = { l: 52, r: 112, t: 26, b: 40 };
    const act = Number(rows[0].plans[0].activations ?? 0n) / s.unit;
    const floors = ["ZeRO-1", "ZeRO-2"].map(
      (name) => ({ name, bytes: Planner.floorBytes(s.model, s.recipe, name) }));
    const budget = Number(s.budget) / s.unit;
    const max = Math.max(budget, Number(floors[0].bytes) / s.unit + act) * 1.3;
    const y = (v) => height - m.b - (Math.min(v, max) / max) * (height - m.t - m.b);
    const last = Math.log2(rows[rows.length - 1].gpus);
    const x = (n) => m.l + (Math.log2(n) / last) * (width - m.l - m.r);
    yAxis(g, m.l, width - m.r, y, max, s.unitName);
    for (const { gpus } of rows) {
      if (narrow && Math.log2(gpus) % 2) continue;
      el("text", { x: x(gpus), y: height - m.b + 16, class: "tick", "text-anchor": "middle" }, g,
        String(gpus));
    }
    el("text", { x: (m.l + width - m.r) / 2, y: height - 6, class: "axis-title",
      "text-anchor": "middle" }, g, "GPUs N (log scale)");
    for (const f of floors) {
      const v = y(Number(f.bytes) / s.unit + act);
      el("line", { x1: m.l, x2: width - m.r, y1: v, y2: v, class: "floor",
        stroke: LINE_COLORS[f.name], "data-floor": f.name, "data-bytes": f.bytes }, g);
      el("text", { x: m.l + 4, y: v - 4, class: "floor-label" }, g,
        `${f.name} floor ${Format.bytes(f.bytes, s.unit)} ${s.unitName}${act ? " + activ." : ""}`);
    }
    budgetLine(g, m.l, width - m.r, y(budget), s);
    // The GPU count chosen above, so the bars can be found on the curves.
    const xn = x(s.gpus);
    el("line", { x1: xn, x2: xn, y1: m.t, y2: height - m.b, class: "current" }, g);
    el("text", { x: xn + 4, y: m.t + 24, class: "current-label" }, g, `N = ${s.gpus}`);
    const ends = Planner.STRATEGIES.map((name, k) => {
      const pts = rows.map((r) => [x(r.gpus), y(Number(r.plans[k].total) / s.unit)]);
      el("polyline", { points: pts.map((p) => p.join(",")).join(" "), class: "line",
        stroke: LINE_COLORS[name] }, g);
      rows.forEach((r, i) => {
        const node = marker(g, MARKERS[name], pts[i][0], pts[i][1], LINE_COLORS[name]);
        node.setAttribute("data-strategy", name);
        node.setAttribute("data-gpus", r.gpus);
        node.setAttribute("data-bytes", r.plans[k].total);
      });
      const end = rows[rows.length - 1].plans[k].total;
      const cut = Number(end) / s.unit > max ? " ▲" : "";
      const text = `${name}${cut} ${Format.bytes(end, s.unit)}`;
      return { name, y: pts[pts.length - 1][1], text };
    });
    // Line-end labels, nudged apart so lines that end close together stay readable.
    ends.sort((a, b) => a.y - b.y);
    for (let i = 1; i < ends.length; i++) ends[i].y = Math.max(ends[i].y, ends[i - 1].y + 13);
    for (const e of ends) {
      el("text", { x: width - m.r + 6, y: e.y + 4, class: "end-label", fill: LINE_COLORS[e.name] },
        g, e.text);
    }
  }

  return { bars, sweep, legend };
})();
