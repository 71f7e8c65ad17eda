// Inline SVG views: stacked bars per strategy against the budget, and the sweep over
// GPU counts with the ZeRO-1/2 floors (first source document, sections 2 and 3).
// Categories differ by fill pattern and text label as well as colour.
"use strict";

const Charts = (() => {
  const NS = "http://www.w3.org/2000/svg"; // an XML namespace name, never fetched
  const CATEGORIES = [
    { key: "weights", label: "weights", color: "#4C72B0", pattern: null },
    { key: "grads", label: "grads", color: "#DD8452", pattern: "stripes" },
    { key: "optimizer", label: "optim", color: "#55A868", pattern: "dots" },
    { key: "activations", label: "activ", color: "#C44E52", pattern: "cross" },
  ];
  const MARKERS = { DDP: "circle", "ZeRO-1": "square", "ZeRO-2": "triangle", "ZeRO-3": "diamond" };
  const LINE_COLORS = { DDP: "#555", "ZeRO-1": "#4C72B0", "ZeRO-2": "#DD8452", "ZeRO-3": "#2a7a3b" };

  function el(name, attrs = {}, parent = null, text = null) {
    const node = document.createElementNS(NS, name);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
    if (text != null) node.textContent = text;
    if (parent) parent.append(node);
    return node;
  }

  // Pattern overlays: a second cue beside colour for each category. Defined once, in a
  // hidden SVG, so every chart and legend swatch refers to the same ids.
  function defs() {
    if (document.getElementById("chart-defs")) return;
    const svg = el("svg", { id: "chart-defs", width: 0, height: 0, "aria-hidden": "true", class: "defs" });
    document.body.append(svg);
    const d = el("defs", {}, svg);
    const pat = (id, draw) => {
      const p = el("pattern", { id, width: 6, height: 6, patternUnits: "userSpaceOnUse" }, d);
      draw(p);
    };
    pat("pat-stripes", (p) => el("path", { d: "M0,6 L6,0", stroke: "#fff", "stroke-opacity": 0.45, "stroke-width": 1.5 }, p));
    pat("pat-dots", (p) => el("circle", { cx: 3, cy: 3, r: 1.1, fill: "#fff", "fill-opacity": 0.5 }, p));
    pat("pat-cross", (p) => el("path", { d: "M0,0 L6,6 M6,0 L0,6", stroke: "#fff", "stroke-opacity": 0.35 }, p));
  }

  function swatch(cat, size = 14) {
    defs();
    const svg = el("svg", { width: size, height: size, viewBox: `0 0 ${size} ${size}`, "aria-hidden": "true" });
    el("rect", { width: size, height: size, fill: cat.color }, svg);
    if (cat.pattern) el("rect", { width: size, height: size, fill: `url(#pat-${cat.pattern})` }, svg);
    return svg;
  }

  function legend(ul) {
    for (const cat of CATEGORIES) {
      const li = document.createElement("li");
      li.append(swatch(cat), ` ${cat.key === "optimizer" ? "optimizer state" : cat.key}`);
      ul.append(li);
    }
    const li = document.createElement("li");
    li.innerHTML = '<svg width="22" height="14" aria-hidden="true"><line x1="0" y1="7" x2="22" y2="7" stroke="#111" stroke-width="2" stroke-dasharray="5 3"/></svg> memory budget';
    ul.append(li);
  }

  // A round axis step (1, 2 or 5 × 10^k) giving about `n` ticks up to `max`.
  function niceStep(max, n = 5) {
    const raw = max / n;
    const mag = 10 ** Math.floor(Math.log10(raw));
    return [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= raw);
  }

  function yAxis(g, x0, x1, y, max, unitName) {
    const step = niceStep(max);
    for (let v = 0; v <= max + 1e-9; v += step) {
      el("line", { x1: x0, x2: x1, y1: y(v), y2: y(v), class: "grid" }, g);
      el("text", { x: x0 - 6, y: y(v) + 4, class: "tick", "text-anchor": "end" }, g, Format.general(v));
    }
    el("text", { x: 4, y: 14, class: "axis-title" }, g, `${unitName} per GPU`);
  }

  function frame(container, height, label) {
    const width = Math.max(300, container.clientWidth || 600);
    defs();
    const svg = el("svg", { width, height, viewBox: `0 0 ${width} ${height}`, role: "img", "aria-label": label });
    container.replaceChildren(svg);
    return { svg, width };
  }

  function budgetLine(g, x0, x1, yb, s) {
    el("line", { x1: x0, x2: x1, y1: yb, y2: yb, class: "budget", "data-bytes": s.budget, id: `${g.id}-budget` }, g);
    el("text", { x: x1, y: yb - 5, class: "budget-label", "text-anchor": "end" }, g, `budget ${Format.general(s.mem)} ${s.unitName}`);
  }

  // Stacked bars: one per strategy, bottom to top weights, grads, optimizer, activations.
  function bars(container, s, plans, zoom) {
    const height = 360;
    const { svg, width } = frame(container, height, "Stacked bars of memory per GPU for each strategy");
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
      const x = m.l + slot * i + (slot - bw) / 2;
      let base = 0;
      const bar = el("g", { "data-strategy": p.strategy }, g);
      for (const cat of CATEGORIES) {
        const bytes = p[cat.key];
        const v = Number(bytes ?? 0n) / s.unit;
        const top = y(base + v), bottom = y(base);
        const attrs = { x, y: top, width: bw, height: Math.max(0, bottom - top), fill: cat.color,
          "data-strategy": p.strategy, "data-category": cat.key, "data-bytes": bytes ?? "" };
        const rect = el("rect", attrs, bar);
        el("title", {}, rect, `${p.strategy} ${cat.key}: ${Format.bytes(bytes, s.unit, cat.key === "activations" ? 3 : 2)} ${s.unitName}`);
        if (cat.pattern) el("rect", { x, y: top, width: bw, height: Math.max(0, bottom - top), fill: `url(#pat-${cat.pattern})`, "pointer-events": "none" }, bar);
        const h = bottom - top, cx = x + bw / 2, num = Format.bytes(bytes, s.unit, v < 1 ? 3 : 2);
        const seg = bw < 56 ? "seg small" : "seg";
        if (h >= 30 && bw >= 40) {
          el("text", { x: cx, y: top + h / 2 - 2, class: seg }, bar, cat.label);
          el("text", { x: cx, y: top + h / 2 + 11, class: seg }, bar, num);
        } else if (h >= 15) {
          el("text", { x: cx, y: top + h / 2 + 4, class: seg }, bar, bw >= 70 ? `${cat.label} ${num}` : cat.label);
        }
        base += v;
      }
      const total = Number(p.total) / s.unit;
      const cut = total > max;
      el("text", { x: x + bw / 2, y: y(total) - 6, class: "total" }, bar, `${cut ? "▲ " : ""}${Format.bytes(p.total, s.unit)}`);
      el("text", { x: x + bw / 2, y: height - m.b + 17, class: "name" }, bar, p.strategy);
      el("text", { x: x + bw / 2, y: height - m.b + 33, class: p.fits ? "fit yes" : "fit no" }, bar, p.fits ? "✓ fits" : "✗ over");
    });
    budgetLine(g, m.l, width - m.r, y(budget), s);
  }

  function marker(g, shape, x, y, color, attrs) {
    const r = 4;
    const shapes = {
      circle: () => el("circle", { cx: x, cy: y, r }, g),
      square: () => el("rect", { x: x - r, y: y - r, width: 2 * r, height: 2 * r }, g),
      triangle: () => el("path", { d: `M${x},${y - r - 1} L${x + r + 1},${y + r} L${x - r - 1},${y + r} Z` }, g),
      diamond: () => el("path", { d: `M${x},${y - r - 1} L${x + r + 1},${y} L${x},${y + r + 1} L${x - r - 1},${y} Z` }, g),
    };
    const node = shapes[shape]();
    node.setAttribute("fill", color);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v ?? ""));
    return node;
  }

  // Total per GPU over 1..1024 GPUs (log2 x axis) with the ZeRO-1/2 floors dashed.
  function sweep(container, s, rows) {
    const height = 340;
    const { svg, width } = frame(container, height, "Total memory per GPU against the GPU count");
    const g = el("g", { id: "sweep-plot" }, svg);
    const m = { l: 52, r: 112, t: 26, b: 40 };
    const act = Number(rows[0].plans[0].activations ?? 0n) / s.unit;
    const floors = [1, 2].map((k) => ({
      strategy: Planner.STRATEGIES[k], bytes: Planner.floorBytes(s.model, s.recipe, k),
    }));
    const budget = Number(s.budget) / s.unit;
    const max = Math.max(budget, Number(floors[0].bytes) / s.unit + act) * 1.3;
    const y = (v) => height - m.b - (Math.min(v, max) / max) * (height - m.t - m.b);
    const last = Math.log2(rows[rows.length - 1].gpus);
    const x = (n) => m.l + (Math.log2(n) / last) * (width - m.l - m.r);
    yAxis(g, m.l, width - m.r, y, max, s.unitName);
    for (const { gpus } of rows) {
      if (Math.log2(gpus) % (width < 500 ? 2 : 1) === 0) el("text", { x: x(gpus), y: height - m.b + 16, class: "tick", "text-anchor": "middle" }, g, String(gpus));
    }
    el("text", { x: (m.l + width - m.r) / 2, y: height - 6, class: "axis-title", "text-anchor": "middle" }, g, "GPUs N (log scale)");
    for (const f of floors) {
      const v = Number(f.bytes) / s.unit + act;
      el("line", { x1: m.l, x2: width - m.r, y1: y(v), y2: y(v), class: "floor", stroke: LINE_COLORS[f.strategy], "data-floor": f.strategy, "data-bytes": f.bytes }, g);
      el("text", { x: m.l + 4, y: y(v) - 4, class: "floor-label" }, g, `${f.strategy} floor: ${Format.bytes(f.bytes, s.unit)} ${s.unitName}${act ? (width < 500 ? " + act." : " + activations") : ""}`);
    }
    budgetLine(g, m.l, width - m.r, y(budget), s);
    const ends = [];
    Planner.STRATEGIES.forEach((name, k) => {
      const pts = rows.map((r) => [x(r.gpus), y(Number(r.plans[k].total) / s.unit)]);
      el("polyline", { points: pts.map((p) => p.join(",")).join(" "), class: `line s${k}`, stroke: LINE_COLORS[name] }, g);
      rows.forEach((r, i) => marker(g, MARKERS[name], pts[i][0], pts[i][1], LINE_COLORS[name], { "data-strategy": name, "data-gpus": r.gpus, "data-bytes": r.plans[k].total }));
      const v = Number(rows[rows.length - 1].plans[k].total) / s.unit;
      ends.push({ name, y: pts[pts.length - 1][1], text: `${name}${v > max ? " ▲" : ""} ${Format.bytes(rows[rows.length - 1].plans[k].total, s.unit)}` });
    });
    // Line-end labels, nudged apart so close lines stay readable.
    ends.sort((a, b) => a.y - b.y);
    for (let i = 1; i < ends.length; i++) ends[i].y = Math.max(ends[i].y, ends[i - 1].y + 13);
    for (const e of ends) el("text", { x: width - m.r + 6, y: e.y + 4, class: "end-label", fill: LINE_COLORS[e.name] }, g, e.text);
  }

  return { bars, sweep, legend, CATEGORIES };
})();
