// The controls: read the form into the planner's inputs (a ModelSpec, a recipe, a
// Workload, N and the budget, as command.run builds them), run the planner, and hand
// the results to the readout, the charts and the exercises.
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
    if (!/^\d+$/.test(text) || BigInt(text) <= 0n) {
      throw new Error(`${label} must be a positive integer`);
    }
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
        heads: p.heads, arch: p };
    }
    if (mode === "dims") {
      const arch = {
        hidden: integer("dim-hidden", "hidden"), layers: integer("dim-layers", "layers"),
        heads: integer("dim-heads", "heads"), kv_heads: integer("dim-kv-heads", "kv heads", true),
        ffn: integer("dim-ffn", "MLP width"), vocab: integer("dim-vocab", "vocabulary"),
        tied: $("dim-tied").checked, gated_mlp: true, max_positions: 0, norms: 2,
        family: "llama",
      };
      // arch.Architecture.__post_init__: the head width must divide evenly.
      if (arch.hidden % arch.heads) {
        throw new Error(`hidden=${arch.hidden} is not divisible by heads=${arch.heads}`);
      }
      return { name: "custom", params: Planner.archParams(arch), hidden: arch.hidden,
        layers: arch.layers, heads: arch.heads, arch };
    }
    return {
      name: bareName, params: BigInt(integer("bare-params", "parameters P")),
      hidden: integer("bare-hidden", "hidden", true),
      layers: integer("bare-layers", "layers", true),
      heads: integer("bare-heads", "heads", true),
    };
  }

  // recipes.get_recipe("W/G/O"): explicit bytes per parameter. Recipe's properties with
  // custom_bytes: gradients travel in their stored size, activations in the weights'.
  function readRecipe() {
    if ($("recipe").value !== "custom") return DATA.recipes[$("recipe").value];
    const [w, g, o] = ["w", "g", "o"].map((k) => {
      const text = $(`recipe-${k}`).value.trim();
      if (!/^\d+$/.test(text)) {
        throw new Error("custom bytes per parameter must be whole numbers >= 0");
      }
      return Number(text);
    });
    return { name: `custom-${w}/${g}/${o}`, weight_bytes: w, grad_bytes: g, optimizer_bytes: o,
      master_bytes: 0, reduce_bytes: g, activation_bytes: w, total_bytes: w + g + o };
  }

  function readState() {
    const gpus = integer("gpus", "GPUs");
    if (gpus > 1024) throw new Error("GPUs must be between 1 and 1,024");
    const unitName = $("unit").value;
    const mem = Number($($("gpu-mem").value === "custom" ? "gpu-mem-custom" : "gpu-mem").value);
    if (!(mem > 0)) throw new Error("memory per GPU must be positive");
    const work = {
      tokens: integer("tokens", "tokens"), seq_len: integer("seq-len", "sequence length", true),
      checkpointing: $("checkpointing").value, flash_attention: $("flash-attention").checked,
    };
    // memory.Workload.__post_init__
    if (work.seq_len && work.tokens % work.seq_len) {
      throw new Error(`tokens=${work.tokens} is not a multiple of seq_len=${work.seq_len}`);
    }
    const shardGroup = integer("shard-group", "shard group", true);
    if (shardGroup != null) Planner.shardDegree(gpus, shardGroup); // comm.shard_degree
    return {
      model: readModel(), gpus, mem, unitName, unit: UNITS[unitName],
      budget: BigInt(Math.trunc(mem * UNITS[unitName])), // command.run: int(gpu_mem * unit)
      recipe: readRecipe(), work, step: integer("gpu-step", "GPU step", true), shardGroup,
    };
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
    // the readout and bars in shard groups of K; the fewest-GPU search and the sweep are
    // plain (under a group, memory depends on K alone)
    const plans = Planner.planAll(s.model, s.gpus, s.recipe, s.work, s.budget, s.shardGroup);
    const mins = Planner.STRATEGIES.map(
      (x) => Planner.minGpus(s.model, s.recipe, x, s.budget, s.work, s.step));
    const sweep = SWEEP.map(
      (n) => ({ gpus: n, plans: Planner.planAll(s.model, n, s.recipe, s.work, s.budget) }));
    $("model-summary").textContent = `${s.model.name}: P = ${Format.count(s.model.params)}`;
    $("model-summary").dataset.params = s.model.params;
    const r = s.recipe;
    $("recipe-summary").textContent = `${r.weight_bytes} + ${r.grad_bytes} + `
      + `${r.optimizer_bytes} = ${r.total_bytes} bytes per parameter (weights + grads + optimizer)`;
    Readout.headline(s, plans);
    Readout.planTable(s, plans);
    Readout.minTable(s, mins);
    Readout.sweepTable(s, sweep);
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
    if (custom && !$("gpu-mem-custom").value && App.state) {
      $("gpu-mem-custom").value = App.state.mem;
    }
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
    $("checkpointing").value = init.checkpointing;
    $("flash-attention").checked = init.flash_attention;
    $("gpu-step").value = init.gpu_step ?? "";
    $("shard-group").value = init.shard_group ?? "";
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
    for (const [name, p] of Object.entries(DATA.presets)) {
      option($("preset"), name, `${name} (${Format.count(p.params)})`);
    }
    for (const gb of DATA.gpu_memory_gb) option($("gpu-mem"), gb, String(gb));
    option($("gpu-mem"), "custom", "custom…");
    for (const [name, r] of Object.entries(DATA.recipes)) {
      option($("recipe"), name, `${name} (${r.weight_bytes}/${r.grad_bytes}/${r.optimizer_bytes})`);
    }
    option($("recipe"), "custom", "custom W/G/O bytes…");
    applyInitial(DATA.initial);
    $("controls").addEventListener("input", (e) => {
      // The slider moves in quarter octaves: position k is round(2^(k/4)) GPUs.
      const { id, value } = e.target;
      if (id === "gpus-slider") setGpus(Math.round(2 ** (Number(value) / 4)), true);
      if (id === "gpus" && /^\d+$/.test(value)) setGpus(Number(value), false);
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
    window.addEventListener("resize", () => {  // the charts are drawn to the card's width
      clearTimeout(pending);
      pending = setTimeout(render, 100);
    });
    render();
  }

  return { init, render, applyInitial, state: null };
})();

App.init();
