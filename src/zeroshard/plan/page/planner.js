// The planner's memory and communication model, ported function by function from
// src/zeroshard/plan/memory.py, advice.py and arch.py (Architecture.params).
// Every byte count is a BigInt, so each figure is the same exact integer Python
// computes; numbers become floating point only for drawing and formatting.
// The page plans data parallelism alone: the Python functions with tp = 1.
// The constants (strategies, presets, recipes, the search limit) are not repeated
// here: page.py dumps them from the Python definitions into DATA.
"use strict";

const Planner = (() => {
  const STRATEGIES = DATA.strategies;

  // memory._ceil_div: sharded figures round up (a rank holds whole elements).
  const ceilDiv = (a, b) => (a + b - 1n) / b;
  const big = (x) => (typeof x === "bigint" ? x : BigInt(x));

  // arch.Architecture.params: embeddings, per-layer attention + MLP + norms (+ biases),
  // the final norm and an untied head. Used only for custom dimensions; presets carry
  // the count Python computed.
  function archParams(a) {
    const h = big(a.hidden), f = big(a.ffn);
    const headDim = big(a.head_dim || Math.floor(a.hidden / a.heads));
    const qWidth = big(a.heads) * headDim;
    const kvWidth = big(a.kv_heads || a.heads) * headDim;
    const attn = h * qWidth + 2n * h * kvWidth + qWidth * h;
    const mlp = (a.gated_mlp ? 3n : 2n) * h * f;
    const norm = h * (a.norm_bias ? 2n : 1n);
    let perLayer = attn + mlp + 2n * norm;
    if (a.linear_bias) {
      perLayer += qWidth + 2n * kvWidth + h; // q, k, v and output-projection biases
      perLayer += (a.gated_mlp ? 2n : 1n) * f + h; // MLP biases
    }
    const embed = big(a.vocab) * h + big(a.max_positions || 0) * h;
    const head = a.tied ? 0n : big(a.vocab) * h;
    return embed + big(a.layers) * perLayer + norm + head;
  }

  // memory.stage_of, for the names the page uses.
  function stageOf(strategy) {
    const stage = typeof strategy === "number" ? strategy : STRATEGIES.indexOf(strategy);
    if (stage < 0 || stage > 3) throw new Error(`unknown strategy ${strategy}`);
    return stage;
  }

  // memory.activation_bytes: checkpointing keeps L layer inputs plus one layer's
  // recompute, tokens·h·(L + 17)·bytes; without it Korthikanti et al.'s per-layer
  // 34·tokens·h (+ 5·a·s·tokens unless flash attention) 16-bit bytes.
  function activationBytes(model, recipe, work) {
    if (model.hidden == null || model.layers == null) return null;
    const h = big(model.hidden), layers = big(model.layers);
    const b = big(recipe.activation_bytes), tokens = big(work.tokens);
    if (work.checkpointing) return tokens * h * (layers + 17n) * b;
    let perLayer16bit = 34n * tokens * h;
    if (!work.flash_attention) {
      if (model.heads == null) return null;
      const s = big(work.seq_len || work.tokens);
      perLayer16bit += 5n * big(model.heads) * s * tokens;
    }
    return (layers * perLayer16bit * b) / 2n;
  }

  // memory.ring_all_reduce: 2(N-1)/N·t bytes sent per rank.
  const ringAllReduce = (t, n) => ceilDiv(2n * (big(n) - 1n) * t, big(n));
  // memory.ring_one_way: (N-1)/N·t bytes for a reduce-scatter or an all-gather.
  const ringOneWay = (t, n) => ceilDiv((big(n) - 1n) * t, big(n));

  // memory.model_state_bytes: stage k shards the first k of (optimizer, grads, weights).
  function modelStateBytes(params, gpus, recipe, stage) {
    const part = (perParam, sharded) => {
      const total = big(perParam) * params;
      return sharded ? ceilDiv(total, big(gpus)) : total;
    };
    return [
      part(recipe.weight_bytes, stage >= 3),
      part(recipe.grad_bytes, stage >= 2),
      part(recipe.optimizer_bytes, stage >= 1),
    ];
  }

  // memory.comm_bytes: DDP all-reduces gradients; ZeRO-1/2 reduce-scatter them and
  // gather the weights once; ZeRO-3 gathers for forward and again for backward.
  function commBytes(params, gpus, recipe, stage) {
    const grads = big(recipe.reduce_bytes) * params;
    const weights = big(recipe.weight_bytes) * params;
    if (stage === 0) return ringAllReduce(grads, gpus);
    const gathers = stage === 3 ? 2n : 1n;
    return ringOneWay(grads, gpus) + gathers * ringOneWay(weights, gpus);
  }

  // memory.plan_strategy (with StrategyPlan.total and .fits folded in).
  function planStrategy(model, gpus, recipe, strategy, work, budget) {
    const stage = stageOf(strategy);
    const [weights, grads, optimizer] = modelStateBytes(model.params, gpus, recipe, stage);
    const activations = activationBytes(model, recipe, work);
    const total = weights + grads + optimizer + (activations ?? 0n);
    return {
      strategy: STRATEGIES[stage], weights, grads, optimizer, activations, total,
      comm: commBytes(model.params, gpus, recipe, stage),
      budget, fits: budget == null ? null : total <= budget,
    };
  }

  // memory.plan_all: one plan per strategy, DDP first.
  const planAll = (model, gpus, recipe, work, budget) =>
    [0, 1, 2, 3].map((s) => planStrategy(model, gpus, recipe, s, work, budget));

  // advice.floor_bytes: the replicated categories, which no number of GPUs divides.
  function floorBytes(model, recipe, strategy) {
    const stage = stageOf(strategy);
    const perParam = (stage < 3 ? recipe.weight_bytes : 0)
      + (stage < 2 ? recipe.grad_bytes : 0) + (stage < 1 ? recipe.optimizer_bytes : 0);
    return big(perParam) * model.params;
  }

  // advice.gpu_counts: powers of two (step null), else 1 and the multiples of step.
  function gpuCounts(step, limit = DATA.max_gpus) {
    const counts = [];
    if (step == null) {
      for (let n = 1; n <= limit; n *= 2) counts.push(n);
      return counts;
    }
    if (step > 1) counts.push(1);
    for (let n = step; n <= limit; n += step) counts.push(n);
    return counts;
  }

  // advice.min_gpus: per-GPU memory never grows with N, so a binary search over the
  // candidate counts finds the smallest that fits.
  function minGpus(model, recipe, strategy, budget, work, step = null) {
    const name = STRATEGIES[stageOf(strategy)];
    const floor = floorBytes(model, recipe, strategy);
    const counts = gpuCounts(step);
    const total = (i) => planStrategy(model, counts[i], recipe, strategy, work, budget).total;
    if (total(counts.length - 1) > budget) {
      return { strategy: name, gpus: null, total: null, floor };
    }
    let lo = 0, hi = counts.length - 1;
    while (lo < hi) {
      const mid = (lo + hi) >> 1;
      if (total(mid) <= budget) hi = mid;
      else lo = mid + 1;
    }
    return { strategy: name, gpus: counts[lo], total: total(lo), floor };
  }

  // advice.first_fit: the first strategy in DDP → ZeRO-3 order that fits, or null.
  const firstFit = (plans) => (plans.find((p) => p.fits) || { strategy: null }).strategy;

  return {
    STRATEGIES, archParams, stageOf, activationBytes, ringAllReduce, ringOneWay,
    modelStateBytes, commBytes, planStrategy, planAll, floorBytes, gpuCounts, minGpus,
    firstFit,
  };
})();

// advice.why_none_fits: one sentence on why no strategy fits at `gpus` GPUs.
Planner.whyNoneFits = function whyNoneFits(model, recipe, gpus, budget, work) {
  const need = Planner.minGpus(model, recipe, "ZeRO-3", budget, work);
  if (need.gpus == null) {
    return "nothing fits: even ZeRO-3 tends to its activations alone, which are above the "
      + `budget of ${Format.count(budget)} bytes; `
      + "shorten the micro-batch or checkpoint activations";
  }
  return `nothing fits on ${gpus} GPUs; ZeRO-3 fits from ${need.gpus} GPUs`;
};
