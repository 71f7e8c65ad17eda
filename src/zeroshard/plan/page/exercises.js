// The first source document's four "predict first, then check" exercises (section 2).
// Each answer is computed by the planner when "check" is pressed, with the page's
// current recipe, workload and unit; `data-answer` on the output holds the graded
// values (and exact bytes) so a test can hold them against Python.
"use strict";

const Exercises = (() => {
  const S = Planner.STRATEGIES;
  const CHANGE = ["grows", "shrinks", "stays the same"];
  const DOUBLINGS = [8, 16, 32, 64, 128, 256];
  const FLOORS = ["weights + grads (+ activations)", "optimizer state (+ activations)",
    "activations only", "nothing: it keeps shrinking"];

  const preset = (name) => {
    const p = DATA.presets[name];
    return { name, params: BigInt(p.params), hidden: p.hidden, layers: p.layers, heads: p.heads,
      arch: p };
  };
  const budgetOf = (s, amount) => BigInt(Math.trunc(amount * s.unit)); // as command.run does
  const gb = (s, bytes) => `${Format.bytes(bytes, s.unit)} ${s.unitName}`;
  const change = (a, b) => (b > a ? "grows" : b < a ? "shrinks" : "stays the same");

  // Each exercise: a prompt and prediction inputs ({u} is the unit chosen above), the
  // settings "show it" moves the controls to, and the answer computed from a state.
  const LIST = [
    {
      title: "1. Which strategy fits first?",
      prompt: "llama2-7b on 8 GPUs. Which strategy is the first (DDP → ZeRO-3) to fit in "
        + "80 {u} per GPU? And in 24 {u}?",
      inputs: [["fit80", "first fit at 80 {u}", [...S, "none"]],
        ["fit24", "first fit at 24 {u}", [...S, "none"]]],
      setup: { preset: "llama2-7b", gpus: 8, mem: 80 },
      answer(s) {
        const model = preset("llama2-7b");
        const at = (mem) => Planner.planAll(model, 8, s.recipe, s.work, budgetOf(s, mem));
        const p80 = at(80), p24 = at(24);
        return {
          values: {
            fit80: Planner.firstFit(p80) ?? "none", fit24: Planner.firstFit(p24) ?? "none",
          },
          bytes: p80.map((p) => String(p.total)),
          text: `Per GPU: ${p80.map((p) => `${p.strategy} ${gb(s, p.total)}`).join(", ")}.`,
          why: "Each stage divides one more category by N, and the optimizer state, the largest "
            + "(12 of the 16 bytes per parameter under mixed-precision AdamW), goes first; a "
            + "small card also needs the weights divided.",
        };
      },
    },
    {
      title: "2. Where does ZeRO-1 stop shrinking?",
      prompt: "Your current model under ZeRO-1, from 8 to 256 GPUs. From which GPU count on "
        + "does doubling N save less than 1 {u} per GPU, and what is left at the floor?",
      inputs: [["knee", "doubling saves < 1 {u} from", [...DOUBLINGS.map(String), "never"]],
        ["floor", "the floor is", FLOORS]],
      setup: { gpus: 256 },
      answer(s) {
        const total = (n) => Planner.planStrategy(s.model, n, s.recipe, "ZeRO-1", s.work).total;
        const knee = DOUBLINGS.find((n) => total(n) - total(2 * n) < budgetOf(s, 1));
        const floor = Planner.floorBytes(s.model, s.recipe, "ZeRO-1");
        return {
          values: { knee: knee == null ? "never" : String(knee), floor: FLOORS[0] },
          bytes: [String(total(8)), String(total(256)), String(floor)],
          text: `ZeRO-1 per GPU: ${gb(s, total(8))} at 8 GPUs, ${gb(s, total(256))} at 256; `
            + `the floor is weights + grads = ${gb(s, floor)}, plus activations.`,
          why: "ZeRO-1 divides only the optimizer state, so each doubling saves half of what is "
            + "left of it, while every GPU keeps whole weights and gradients and its own "
            + "activations.",
        };
      },
    },
    {
      title: "3. When does a 70B model fit?",
      prompt: "llama2-70b under ZeRO-3 with 80 {u} per GPU. What is the fewest GPU count that "
        + "fits (in the search the readout uses)?",
      inputs: [["gpus", "fewest GPUs", null]],
      setup: { preset: "llama2-70b", mem: 80, gpus: 16 },
      answer(s) {
        const model = preset("llama2-70b"), budget = budgetOf(s, 80);
        const need = Planner.minGpus(model, s.recipe, "ZeRO-3", budget, s.work, s.step);
        const z1 = Planner.floorBytes(model, s.recipe, "ZeRO-1");
        return {
          values: { gpus: need.gpus == null ? "never" : String(need.gpus) },
          bytes: [String(need.total ?? ""), String(z1)],
          text: need.gpus == null
            ? "ZeRO-3 never fits: the activations alone exceed the budget."
            : `ZeRO-3 fits from ${need.gpus} GPUs, at ${gb(s, need.total)} per GPU; `
              + `ZeRO-1's floor is ${gb(s, z1)}.`,
          why: "ZeRO-3 divides all of the model state by N, so only the unsharded activations "
            + "stay fixed; ZeRO-1 and ZeRO-2 keep replicated categories whose floor alone can "
            + "exceed a card.",
        };
      },
    },
    {
      title: "4. fp32 instead of mixed precision",
      prompt: "Your current model on your GPU count under DDP: switch from bf16-mixed-adamw to "
        + "fp32-adamw. Does the optimizer segment grow or shrink? And the total per GPU?",
      inputs: [["optimizer", "optimizer segment", CHANGE], ["total", "total per GPU", CHANGE]],
      setup: { recipe: "fp32-adamw" },
      answer(s) {
        const at = (r) => Planner.planStrategy(s.model, s.gpus, DATA.recipes[r], "DDP", s.work);
        const a = at("bf16-mixed-adamw"), b = at("fp32-adamw");
        return {
          values: { optimizer: change(a.optimizer, b.optimizer), total: change(a.total, b.total) },
          bytes: [a.optimizer, b.optimizer, a.total, b.total].map(String),
          text: `Optimizer ${gb(s, a.optimizer)} → ${gb(s, b.optimizer)}; `
            + `total ${gb(s, a.total)} → ${gb(s, b.total)}.`,
          why: "In fp32 the weights are themselves the master copy, so the optimizer keeps only "
            + "m and v (8 bytes, not 12), but weights and gradients double to 4 bytes each: the "
            + "state stays 16 bytes per parameter and the activations, now fp32, double.",
        };
      },
    },
  ];

  const make = (tag, props = {}) => Object.assign(document.createElement(tag), props);

  // A labelled prediction input: a select of the choices, or text ("never" may be right).
  function field(parent, [key, label, options], n) {
    const lab = make("label", { htmlFor: `ex${n}-${key}` });
    const text = make("span");
    text.dataset.template = label;
    let input;
    if (options) {
      input = make("select");
      input.append(new Option("— your prediction —", ""));
      for (const o of options) input.append(new Option(o, o));
    } else {
      input = make("input", { type: "text", placeholder: "a GPU count, or never" });
    }
    input.id = `ex${n}-${key}`;
    input.dataset.key = key;
    lab.append(text, " ", input);
    parent.append(lab);
  }

  function check(ex, article) {
    const s = App.state;
    if (!s) return;
    const a = ex.answer(s);
    const marks = Object.entries(a.values).map(([key, value]) => {
      const guess = article.querySelector(`[data-key="${key}"]`).value.trim();
      return guess === value ? `✓ ${value}` : `✗ ${guess || "no prediction"}; answer: ${value}`;
    });
    const out = article.querySelector("output");
    out.dataset.answer = JSON.stringify({ values: a.values, bytes: a.bytes });
    out.replaceChildren(
      make("p", { className: "marks", textContent: marks.join(" · ") }),
      make("p", { textContent: a.text }),
      make("p", { className: "why", textContent: `Why: ${a.why}` }));
  }

  // "Show it": move the controls to the exercise's settings; everything else stays.
  function show(ex) {
    const s = App.state;
    const state = {
      model: ex.setup.preset ? { mode: "preset", preset: ex.setup.preset } : null,
      gpus: ex.setup.gpus ?? s.gpus, gpu_mem: ex.setup.mem ?? s.mem, unit: s.unitName,
      recipe: ex.setup.recipe ?? document.getElementById("recipe").value,
      tokens: s.work.tokens, seq_len: s.work.seq_len, checkpointing: s.work.checkpointing,
      flash_attention: s.work.flash_attention, gpu_step: s.step,
    };
    App.applyInitial(state);
    App.render();
    document.getElementById("bars").scrollIntoView({ behavior: "smooth", block: "center" });
  }

  function init(container) {
    LIST.forEach((ex, i) => {
      const n = i + 1;
      const article = make("article", { className: "exercise" });
      article.dataset.exercise = n;
      const prompt = make("p", { className: "prompt" });
      prompt.dataset.template = ex.prompt;
      const predict = make("div", { className: "predict" });
      ex.inputs.forEach((spec) => field(predict, spec, n));
      const checkButton = make("button", { type: "button", className: "check", id: `ex${n}-check`,
        textContent: "check" });
      const showButton = make("button", { type: "button", className: "show",
        textContent: "show it above" });
      checkButton.addEventListener("click", () => check(ex, article));
      showButton.addEventListener("click", () => show(ex));
      const buttons = make("div", { className: "buttons" });
      buttons.append(checkButton, showButton);
      const out = make("output");
      out.setAttribute("aria-live", "polite");
      article.append(make("h3", { textContent: ex.title }), prompt, predict, buttons, out);
      container.append(article);
    });
  }

  // Prompts and labels name the unit chosen above ({u} in their templates).
  function refresh(s) {
    for (const node of document.querySelectorAll("#exercise-list [data-template]")) {
      node.textContent = node.dataset.template.replaceAll("{u}", s.unitName);
    }
  }

  return { init, refresh };
})();
