// The controls and the readout: read the form, run the planner, draw every view.
// Each readout cell carries its exact integer in data-bytes (data-gpus for counts),
// so a test can compare the page with `zeroshard plan` digit for digit.
"use strict";

const App = (() => {
  const $ = (id) => document.getElementById(id);
  const UNITS = { GB: 1e9, GiB: 2 ** 30 };
  const SWEEP = Planner.gpuCounts(null, 1024); // the sweep view: 1, 2, 4, ..., 1024
  let bareName = "custom"; // a parameter count given by `zeroshard plan --html` keeps its name

  function option(select, value, text) {
    const o = document.createElement("option");
    o.value = value;
    o.textContent = text;
    select.append(o);
  }

  // A positive integer from a field; blank gives null when the field is optional.
  function integer(id, label, optional = false) {
    const text = $(id).value.trim().replace(/[,_\s]/g, "");
    if (text === "" && optional) return null;
    if (!/^\d+$/.test(text) || BigInt(text) <= 0n) throw new Error(`${label} must be a positive integer`);
    return BigInt(text) <= BigInt(Number.MAX_SAFE_INTEGER) ? Number(text) : BigInt(text);
  }

  function modelMode() {
    return document.querySelector('input[name="model-mode"]:checked').value;
  }

  // The ModelSpec the planner needs, from whichever source the mode selects.
  function readModel() {
    const mode = modelMode();
    if (mode === "preset") {
      const p = DATA.presets[$("preset").value];
      return { name: p.name, params: BigInt(p.params), hidden: p.hidden, layers: p.layers,
        heads: p.heads };
    }
    if (mode === "dims") {
      const arch = {
        hidden: integer("dim-hidden", "hidden"), layers: integer("dim-layers", "layers"),
        heads: integer("dim-heads", "heads"), kv_heads: integer("dim-kv-heads", "kv heads", true),
        ffn: integer("dim-ffn", "MLP width"), vocab: integer("dim-vocab", "vocabulary"),
        tied: $("dim-tied").checked, gated_mlp: true, max_positions: 0,
      };
      // arch.Architecture.__post_init__: the head width must divide evenly.
      if (arch.hidden % arch.heads) throw new Error(`hidden=${arch.hidden} is not divisible by heads=${arch.heads}`);
      return { name: "custom", params: Planner.archParams(arch), hidden: arch.hidden,
        layers: arch.layers, heads: arch.heads };
    }
    return {
      name: bareName, params: BigInt(integer("bare-params", "parameters P")),
      hidden: integer("bare-hidden", "hidden", true), layers: integer("bare-layers", "layers", true),
      heads: integer("bare-heads", "heads", true),
    };
  }

  // recipes.get_recipe("W/G/O"): explicit bytes per parameter. Recipe's properties with
  // custom_bytes: gradients travel in their stored size, activations in the weights'.
  function readRecipe() {
    if ($("recipe").value !== "custom") return DATA.recipes[$("recipe").value];
    const [w, g, o] = ["w", "g", "o"].map((k) => {
      const text = $(`recipe-${k}`).value.trim();
      if (!/^\d+$/.test(text)) throw new Error("custom bytes per parameter must be whole numbers >= 0");
      return Number(text);
    });
    return { name: `custom-${w}/${g}/${o}`, weight_bytes: w, grad_bytes: g, optimizer_bytes: o,
      master_bytes: 0, reduce_bytes: g, activation_bytes: w, total_bytes: w + g + o };
  }

  function readState() {
    const gpus = integer("gpus", "GPUs");
    if (gpus > 1024) throw new Error("GPUs must be between 1 and 1,024");
    const unitName = $("unit").value;
    const mem = $("gpu-mem").value === "custom" ? Number($("gpu-mem-custom").value) : Number($("gpu-mem").value);
    if (!(mem > 0)) throw new Error("memory per GPU must be positive");
    const work = {
      tokens: integer("tokens", "tokens"), seq_len: integer("seq-len", "sequence length", true),
      checkpointing: $("checkpointing").checked, flash_attention: $("flash-attention").checked,
    };
    // memory.Workload.__post_init__
    if (work.seq_len && work.tokens % work.seq_len) throw new Error(`tokens=${work.tokens} is not a multiple of seq_len=${work.seq_len}`);
    return {
      model: readModel(), gpus, mem, unitName, unit: UNITS[unitName],
      budget: BigInt(Math.trunc(mem * UNITS[unitName])), // command.run: int(gpu_mem * unit)
      recipe: readRecipe(), work, step: integer("gpu-step", "GPU step", true),
    };
  }

  function cell(row, text, attrs = {}) {
    const td = document.createElement("td");
    td.textContent = text;
    for (const [k, v] of Object.entries(attrs)) td.setAttribute(k, v == null ? "" : String(v));
    row.append(td);
    return td;
  }

  function table(el, header, rows) {
    el.replaceChildren();
    const head = el.createTHead().insertRow();
    header.forEach((h) => { const th = document.createElement("th"); th.scope = "col"; th.textContent = h; head.append(th); });
    const body = el.createTBody();
    for (const fill of rows) fill(body.insertRow());
  }

  function renderPlanTable(s, plans) {
    const u = s.unitName;
    const ddp = plans[0].comm;
    const fields = [["weights", 2], ["grads", 2], ["optimizer", 2], ["activations", 3], ["total", 2], ["comm", 2]];
    table($("plan-table"), ["strategy", "weights", "grads", "optim", "activ", `total ${u}`, `comm ${u}`, "vs DDP", `fits ${Format.general(s.mem)} ${u}`],
      plans.map((p) => (tr) => {
        tr.dataset.strategy = p.strategy;
        const th = document.createElement("th");
        th.scope = "row";
        th.textContent = p.strategy;
        tr.append(th);
        for (const [f, d] of fields) cell(tr, Format.bytes(p[f], s.unit, d), { "data-field": f, "data-bytes": p[f] });
        cell(tr, Format.ratio(p.comm, ddp), { "data-field": "ratio" });
        cell(tr, p.fits ? "yes" : "no", { "data-field": "fits", "data-fits": p.fits, class: p.fits ? "yes" : "no" });
      }));
    $("plan-note").textContent = plans[0].activations == null
      ? "activations: not modelled (give hidden and layers)"
      : "Activations are not sharded: every GPU runs its own micro-batch.";
  }

  function renderMinTable(s, mins) {
    const u = s.unitName;
    const how = s.step == null ? "powers of two" : `1 or multiples of ${s.step}`;
    $("min-title").textContent = `Fewest GPUs that fit ${Format.general(s.mem)} ${u} (${how})`;
    table($("min-table"), ["strategy", "GPUs", `per GPU ${u}`, `state floor ${u}`], mins.map((m) => (tr) => {
      tr.dataset.strategy = m.strategy;
      const th = document.createElement("th");
      th.scope = "row";
      th.textContent = m.strategy;
      tr.append(th);
      cell(tr, m.gpus == null ? "never" : String(m.gpus), { "data-field": "gpus", "data-gpus": m.gpus });
      cell(tr, Format.bytes(m.total, s.unit), { "data-field": "total", "data-bytes": m.total });
      cell(tr, Format.bytes(m.floor, s.unit, 1), { "data-field": "floor", "data-bytes": m.floor });
    }));
  }

  function renderSweepTable(s, sweep) {
    table($("sweep-table"), ["GPUs", ...Planner.STRATEGIES], sweep.map(({ gpus, plans }) => (tr) => {
      tr.dataset.gpus = gpus;
      cell(tr, String(gpus));
      for (const p of plans) {
        cell(tr, Format.bytes(p.total, s.unit) + (p.fits ? "" : " ✗"), { "data-strategy": p.strategy, "data-bytes": p.total });
      }
    }));
  }

  function renderHeadline(s, plans) {
    const fit = Planner.firstFit(plans);
    const el = $("headline");
    el.dataset.strategy = fit ?? "";
    el.classList.toggle("none", fit == null);
    el.textContent = fit == null
      ? Planner.whyNoneFits(s.model, s.recipe, s.gpus, s.budget, s.work)
      : `first fit on ${s.gpus} GPUs: ${fit}`;
    const p = plans.find((x) => x.strategy === fit);
    if (p) el.append(` (${Format.bytes(p.total, s.unit)} of ${Format.general(s.mem)} ${s.unitName} per GPU; sends ${Format.bytes(p.comm, s.unit)} ${s.unitName} per step, ${Format.ratio(p.comm, plans[0].comm)} DDP's bytes)`);
  }

  function render() {
    let s;
    try {
      s = readState();
    } catch (err) {
      $("status").textContent = err.message;
      document.body.dataset.ready = "error";
      return;
    }
    $("status").textContent = "";
    const plans = Planner.planAll(s.model, s.gpus, s.recipe, s.work, s.budget);
    const mins = Planner.STRATEGIES.map((x) => Planner.minGpus(s.model, s.recipe, x, s.budget, s.work, s.step));
    const sweep = SWEEP.map((n) => ({ gpus: n, plans: Planner.planAll(s.model, n, s.recipe, s.work, s.budget) }));
    $("model-summary").textContent = `${s.model.name}: P = ${Format.count(s.model.params)}`;
    $("model-summary").dataset.params = s.model.params;
    const r = s.recipe;
    $("recipe-summary").textContent = `${r.weight_bytes} + ${r.grad_bytes} + ${r.optimizer_bytes} = ${r.total_bytes} bytes per parameter (weights + grads + optimizer)`;
    renderHeadline(s, plans);
    renderPlanTable(s, plans);
    renderMinTable(s, mins);
    renderSweepTable(s, sweep);
    Charts.bars($("bars"), s, plans, $("zoom").checked);
    Charts.sweep($("sweep"), s, sweep);
    Exercises.refresh(s);
    App.state = s;
    document.body.dataset.ready = "yes";
  }

  function showMode() {
    const mode = modelMode();
    for (const m of ["preset", "dims", "params"]) $(`model-${m}`).hidden = m !== mode;
  }

  // Fill the dimension fields from a preset, so switching to "dimensions" starts there.
  function fillDims(p) {
    for (const f of ["hidden", "layers", "heads", "ffn", "vocab"]) $(`dim-${f}`).value = p[f];
    $("dim-kv-heads").value = p.kv_heads ?? "";
    $("dim-tied").checked = !!p.tied;
  }

  function setGpus(n, fromSlider) {
    if (!fromSlider) $("gpus-slider").value = String(Math.round(Math.log2(Math.max(1, n)) * 4));
    $("gpus").value = String(n);
    $("gpus-echo").textContent = `= ${n}`;
    $("gpus-slider").setAttribute("aria-valuetext", `${n} GPUs`);
  }

  // Custom memory starts from the figure last in use, so switching never shows an error.
  function showCustomMemory() {
    const custom = $("gpu-mem").value === "custom";
    $("gpu-mem-custom-label").hidden = !custom;
    if (custom && !$("gpu-mem-custom").value && App.state) $("gpu-mem-custom").value = App.state.mem;
  }

  function setMemory(gb) {
    const known = DATA.gpu_memory_gb.includes(gb);
    $("gpu-mem").value = known ? String(gb) : "custom";
    if (!known) $("gpu-mem-custom").value = String(gb);
    $("gpu-mem-custom-label").hidden = known;
  }

  // Set every control from a state of DATA.initial's shape; model null keeps the model.
  function applyInitial(init) {
    if (init.model) applyModel(init.model);
    setGpus(init.gpus, false);
    $("unit").value = init.unit;
    setMemory(init.gpu_mem);
    $("recipe").value = init.recipe;
    $("recipe-custom").hidden = init.recipe !== "custom";
    $("tokens").value = init.tokens;
    $("seq-len").value = init.seq_len ?? "";
    $("checkpointing").checked = init.checkpointing;
    $("flash-attention").checked = init.flash_attention;
    $("gpu-step").value = init.gpu_step ?? "";
  }

  function applyModel(m) {
    $(`mode-${m.mode}`).checked = true;
    $("preset").value = m.preset || "llama2-7b";
    fillDims(m.dims || DATA.presets[$("preset").value]);
    if (m.mode === "params") {
      bareName = m.name || "custom";
      $("bare-params").value = m.params;
      for (const f of ["hidden", "layers", "heads"]) $(`bare-${f}`).value = m[f] ?? "";
    }
    showMode();
  }

  function init() {
    for (const name of Object.keys(DATA.presets)) option($("preset"), name, `${name} (${Format.count(DATA.presets[name].params)})`);
    for (const gb of DATA.gpu_memory_gb) option($("gpu-mem"), gb, String(gb));
    option($("gpu-mem"), "custom", "custom…");
    for (const [name, r] of Object.entries(DATA.recipes)) option($("recipe"), name, `${name} (${r.weight_bytes}/${r.grad_bytes}/${r.optimizer_bytes})`);
    option($("recipe"), "custom", "custom W/G/O bytes…");
    applyInitial(DATA.initial);
    $("controls").addEventListener("input", (e) => {
      if (e.target.id === "gpus-slider") setGpus(Math.round(2 ** (Number(e.target.value) / 4)), true);
      if (e.target.id === "gpus" && /^\d+$/.test(e.target.value)) setGpus(Number(e.target.value), false);
      render();
    });
    $("controls").addEventListener("change", (e) => {
      if (e.target.name === "model-mode") showMode();
      if (e.target.id === "preset") fillDims(DATA.presets[e.target.value]);
      if (e.target.id === "gpu-mem") showCustomMemory();
      if (e.target.id === "recipe") $("recipe-custom").hidden = e.target.value !== "custom";
      if (e.target.closest("#model-params")) bareName = "custom";
      render();
    });
    $("zoom").addEventListener("change", render);
    Charts.legend($("legend"));
    Exercises.init($("exercise-list"));
    let pending;
    window.addEventListener("resize", () => { clearTimeout(pending); pending = setTimeout(render, 100); });
    render();
  }

  return { init, render, applyInitial, state: null };
})();

App.init();
