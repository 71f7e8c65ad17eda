// The readout: the headline (first fit), the per-strategy table, the fewest GPUs that
// fit, and the sweep as a table. The columns and decimals are render.py's, so the page
// prints what `zeroshard plan` prints. Each cell also carries its exact integer in
// data-bytes (data-gpus for counts).
"use strict";

const Readout = (() => {
  const $ = (id) => document.getElementById(id);
  // render.plan_table's columns: the field and its decimals.
  const PLAN_FIELDS = [
    ["weights", 2], ["grads", 2], ["optimizer", 2], ["activations", 3], ["total", 2], ["comm", 2],
  ];

  function cell(row, text, attrs = {}) {
    const td = document.createElement("td");
    td.textContent = text;
    for (const [k, v] of Object.entries(attrs)) td.setAttribute(k, v == null ? "" : String(v));
    row.append(td);
  }

  function rowHeader(row, text) {
    const th = document.createElement("th");
    th.scope = "row";
    th.textContent = text;
    row.append(th);
  }

  // A table from its header and one filling function per body row.
  function table(el, header, rows) {
    el.replaceChildren();
    const head = el.createTHead().insertRow();
    for (const h of header) {
      const th = document.createElement("th");
      th.scope = "col";
      th.textContent = h;
      head.append(th);
    }
    const body = el.createTBody();
    for (const fill of rows) fill(body.insertRow());
  }

  const gb = (s, bytes) => `${Format.bytes(bytes, s.unit)} ${s.unitName}`;

  // command.run's closing line: "first fit on N GPUs: X", or advice.why_none_fits.
  function headline(s, plans) {
    const fit = Planner.firstFit(plans);
    const el = $("headline");
    el.dataset.strategy = fit ?? "";
    el.classList.toggle("none", fit == null);
    el.textContent = fit == null
      ? Planner.whyNoneFits(s.model, s.recipe, s.gpus, s.budget, s.work, s.shardGroup)
      : `first fit on ${s.gpus} GPUs: ${fit}`;
    const offer = fit == null ? Planner.offloadOffer(s.model, s.recipe, s.gpus, s.budget,
      s.work, s.shardGroup, s.unit, s.unitName) : null;
    $("offload-offer").textContent = offer ?? "";
    $("offload-offer").hidden = offer == null;
    const p = plans.find((x) => x.strategy === fit);
    if (p) {
      const ratio = Format.ratio(p.comm, plans[0].comm);
      const budget = `${Format.general(s.mem)} ${s.unitName}`;
      const split = s.shardGroup == null ? ""
        : `: ${gb(s, p.comm_inside)} inside, ${gb(s, p.comm_across)} across`;
      el.append(` (${Format.bytes(p.total, s.unit)} of ${budget} per GPU; `
        + `sends ${gb(s, p.comm)} per step${split}, ${ratio} DDP's bytes)`);
    }
  }

  // render.plan_table: with a shard group, the bytes inside and across the groups too
  function planTable(s, plans) {
    const u = s.unitName;
    const ddp = plans[0].comm;
    const hybrid = s.shardGroup != null;
    const fields = hybrid ? [...PLAN_FIELDS, ["comm_inside", 2], ["comm_across", 2]]
      : PLAN_FIELDS;
    const header = ["strategy", "weights", "grads", "optim", "activ", `total ${u}`, `comm ${u}`,
      ...(hybrid ? [`inside ${u}`, `across ${u}`] : []), "vs DDP",
      `fits ${Format.general(s.mem)} ${u}`];
    table($("plan-table"), header, plans.map((p) => (tr) => {
      tr.dataset.strategy = p.strategy;
      rowHeader(tr, p.strategy);
      for (const [f, d] of fields) {
        cell(tr, Format.bytes(p[f], s.unit, d), { "data-field": f, "data-bytes": p[f] });
      }
      cell(tr, Format.ratio(p.comm, ddp), { "data-field": "ratio" });
      cell(tr, p.fits ? "yes" : "no",
        { "data-field": "fits", "data-fits": p.fits, class: p.fits ? "yes" : "no" });
    }));
    const replicas = hybrid ? s.gpus / s.shardGroup : 0;
    const groups = !hybrid ? "" : ` Shard groups of ${s.shardGroup} (${replicas} replica`
      + `${replicas > 1 ? "s" : ""}): the state is sharded over K, and only the reduced `
      + "gradient shards cross between groups.";
    $("plan-note").textContent = (plans[0].activations == null
      ? "activations: not modelled (give hidden and layers)"
      : "Activations are not sharded: every GPU runs its own micro-batch.") + groups;
  }

  // render.min_gpus_table
  function minTable(s, mins) {
    const u = s.unitName;
    const how = s.step == null ? "powers of two" : `1 or multiples of ${s.step}`;
    $("min-title").textContent = `Fewest GPUs that fit ${Format.general(s.mem)} ${u} (${how})`;
    const header = ["strategy", "GPUs", `per GPU ${u}`, `state floor ${u}`];
    table($("min-table"), header, mins.map((m) => (tr) => {
      tr.dataset.strategy = m.strategy;
      rowHeader(tr, m.strategy);
      const gpus = m.gpus == null ? "never" : String(m.gpus);
      cell(tr, gpus, { "data-field": "gpus", "data-gpus": m.gpus });
      cell(tr, Format.bytes(m.total, s.unit), { "data-field": "total", "data-bytes": m.total });
      cell(tr, Format.bytes(m.floor, s.unit, 1), { "data-field": "floor", "data-bytes": m.floor });
    }));
  }

  // render.sweep_table: totals over GPU counts, ✗ where a strategy does not fit.
  function sweepTable(s, sweep) {
    const header = ["GPUs", ...Planner.STRATEGIES];
    table($("sweep-table"), header, sweep.map(({ gpus, plans }) => (tr) => {
      tr.dataset.gpus = gpus;
      cell(tr, String(gpus));
      for (const p of plans) {
        const text = Format.bytes(p.total, s.unit) + (p.fits ? "" : " ✗");
        cell(tr, text, { "data-strategy": p.strategy, "data-bytes": p.total });
      }
    }));
  }

  return { headline, planTable, minTable, sweepTable };
})();
