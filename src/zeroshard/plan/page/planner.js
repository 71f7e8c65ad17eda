// The planner's memory and communication model, ported function by function from
// src/zeroshard/plan/state.py, comm.py, memory.py, activations.py, advice.py and arch.py
// (Architecture.params).
// Every byte count is a BigInt, so each figure is the same exact integer Python
// computes; numbers become floating point only for drawing and formatting.
// The page plans data parallelism alone: the Python functions with tp = 1, sharded over
// all N GPUs or (hybrid sharding) over shard groups of K of them (comm.py).
// The constants (strategies, presets, recipes, the search limit) are not repeated
// here: page.py dumps them from the Python definitions into DATA, and what a stage
// means (which categories it shards, its reduction, what follows the step) is
// DATA.policies, spec/policy.py's ShardPolicy per stage: no stage number is compared.
"use strict";

const Planner = (() => {
  const STRATEGIES = DATA.strategies;
  const POLICIES = DATA.policies;

  // memory._ceil_div: sharded figures round up (a rank holds whole elements).
  const ceilDiv = (a, b) => (a + b - 1n) / b;
  const big = (x) => (typeof x === "bigint" ? x : BigInt(x));

  // arch.Architecture.block_params / root_params / params: per block attention
  // h·q + 2·h·kv + q·h, the MLP, `norms` norms, Qwen3's q and k norms and the biases
  // the family has; the root unit holds the embeddings, the final norm and an untied head.
  const headDim = (a) => a.head_dim || Math.floor(a.hidden / a.heads);
  const qWidth = (a) => a.heads * headDim(a);
  const kvWidth = (a) => (a.kv_heads || a.heads) * headDim(a);
  function blockParams(a) {
    const h = big(a.hidden), f = big(a.ffn), q = big(qWidth(a)), kv = big(kvWidth(a));
    let perLayer = h * q + 2n * h * kv + q * h + (a.gated_mlp ? 3n : 2n) * f * h;
    perLayer += big(a.norms ?? 2) * h * (a.norm_bias ? 2n : 1n);
    if (a.qk_norm) perLayer += 2n * big(headDim(a));
    if (a.linear_bias || a.qkv_bias) perLayer += q + 2n * kv;
    if (a.linear_bias || a.o_bias) perLayer += h;
    if (a.linear_bias || a.mlp_bias) perLayer += (a.gated_mlp ? 2n : 1n) * f + h;
    return perLayer;
  }
  function rootParams(a) {
    const h = big(a.hidden), v = big(a.vocab);
    return (v + big(a.max_positions || 0)) * h + h * (a.norm_bias ? 2n : 1n)
      + (a.tied ? 0n : v * h);
  }
  const archParams = (a) => rootParams(a) + big(a.layers) * blockParams(a);

  // memory.stage_of, for the names the page uses.
  function stageOf(strategy) {
    const stage = typeof strategy === "number" ? strategy : STRATEGIES.indexOf(strategy);
    if (POLICIES[stage] === undefined) throw new Error(`unknown strategy ${strategy}`);
    return stage;
  }

  // activations.py, per token: norms (LayerNorm's statistics; RMSNorm's fp32 input,
  // rstd and normalised tensor; Gemma-2's fp32 normalised tensor), attention (flash: q,
  // k, v, output, log-sum-exp; eager: q, k, v, output copy and the s×s probabilities),
  // the MLP, and the output layer with the fp32 log-softmax of the loss.
  const eagerSoftmax = (b) => 4n + (b < 4n ? b : 0n);
  function norm(a, b, width, groups = 1n) {
    if (a.norm_bias) return 2n * b * groups;
    if (a.family === "gemma2") return 8n * width + 4n * groups;
    return (4n + b) * width + 4n * groups;
  }
  function blockParts(a, b, seq, flash, batch) {
    const h = big(a.hidden), f = big(a.ffn), q = big(qWidth(a)), kv = big(kvWidth(a));
    const heads = big(a.heads), fam = a.family;
    let norms;
    if (fam === "gpt") norms = 2n * (b * h + norm(a, b, h) + b * h);
    else if (fam === "neox") norms = b * h + 2n * (norm(a, b, h) + b * h);
    else if (fam === "gemma2") norms = 4n * norm(a, b, h) + 2n * b * h;
    else norms = 2n * (norm(a, b, h) + b * h);
    if (a.qk_norm) norms += norm(a, b, q, heads) + norm(a, b, kv, big(a.kv_heads || a.heads));
    let attn;
    if (flash) {
      const lse = 4n * heads;
      if (fam === "gpt") attn = 4n * b * q + lse;
      else if (fam === "neox") attn = 7n * b * q + lse;
      else attn = b * (2n * q + 2n * kv) + lse;
    } else {
      let probs = heads * seq * (fam === "gpt" ? b : eagerSoftmax(b));
      if (fam === "gemma2") probs += heads * seq * b;
      attn = 4n * b * q + probs;
      if (fam === "neox" && batch === 1n) attn += 2n * b * q;
    }
    let mlp = (a.gated_mlp ? 4n : 2n) * b * f;
    if (a.gelu_tanh_unfused) mlp += 3n * b * f;
    return [norms, attn + mlp];
  }
  function headBytes(a, b) {
    const h = big(a.hidden), v = big(a.vocab);
    const n = norm(a, b, h) + b * h + (a.norm_bias ? b * h : 0n);
    return n + (a.family === "gemma2" ? b * v : 0n) + 4n * v + 16n;
  }
  // activations._linear_outputs, _saved_again and _rotary_tables (tp = 1): what a
  // checkpointed block keeps beyond its input under "selective", what its recompute
  // saves that it kept, and a rotary model's cos and sin tables shared by every block.
  function linearOutputs(a, b) {
    const h = big(a.hidden), f = big(a.ffn), q = big(qWidth(a)), kv = big(kvWidth(a));
    const fused = a.family === "gpt" || a.family === "neox";
    return 2n * b * h + b * ((fused ? 3n * q : q + 2n * kv) + (a.gated_mlp ? 2n : 1n) * f);
  }
  function savedAgain(a, b, flash, keep, batch) {
    if (keep === "host") return 0n;
    const h = big(a.hidden), f = big(a.ffn), q = big(qWidth(a)), kv = big(kvWidth(a));
    let same = a.norm_bias || b === 4n ? b * h : 0n;
    if (keep === "input") return same;
    let split;
    if (a.family === "gpt" || a.family === "neox") {
      split = flash || (a.family === "neox" && batch === 1n) ? 3n * q : 0n;
    } else {
      const repeated = !flash && (a.kv_heads || a.heads) !== a.heads;
      split = repeated ? 0n : kv;
      if (a.qk_norm && b === 4n) split += q + kv;
    }
    split += (a.gated_mlp ? 2n : 1n) * f;
    if (a.family === "gemma2" && b === 4n) same += 2n * b * h;
    return same + b * split;
  }
  const rotaryTables = (a, b, seq) => (a.max_positions ? 0n
    : 2n * seq * big(Math.floor(headDim(a) * (a.rotary_fraction ?? 1))) * b);
  // The page plans a device: an offloaded input is in host memory (memory.Workload.keep).
  const KEEP = { full: "input", selective: "linear", "full+offload": "host" };

  // activations.family_saved with checkpoint_every = 1, and Saved.peak; ``mode`` is the
  // page's checkpointing: none, full, selective or full+offload.
  function familyBytes(a, b, tokens, seq, flash, mode) {
    const [replicated, split] = blockParts(a, b, seq, flash, tokens / seq);
    const block = tokens * (replicated + split);
    const head = tokens * headBytes(a, b);
    const kept = tokens * 8n; // the embedding's input ids
    const layers = big(a.layers), shared = rotaryTables(a, b, seq);
    if (mode === "none") return layers * block + shared + head;
    const keep = KEEP[mode];
    const holds = keep === "host" ? 0n : b * big(a.hidden)
      + (keep === "linear" ? linearOutputs(a, b) : 0n);
    const masks = flash ? 0n : tokens * seq * b * (a.family === "gemma2" ? 2n : 1n);
    const recompute = block - tokens * savedAgain(a, b, flash, keep, tokens / seq) + kept;
    return layers * tokens * holds + shared + masks + (head > recompute ? head : recompute);
  }

  // memory.activation_bytes: the family's model when the architecture is known, else
  // activations.korthikanti_bytes: checkpointing keeps L layer inputs (selective: 10
  // elements of tokens·h a layer; offloaded: none) plus one layer's recompute,
  // 34·tokens·h 16-bit bytes (+ 5·a·s·tokens unless flash attention, when the heads are
  // known); without it L such layers.
  function activationBytes(model, recipe, work) {
    if (model.hidden == null || model.layers == null) return null;
    const b = big(recipe.activation_bytes), tokens = big(work.tokens);
    const seq = big(work.seq_len || work.tokens);
    const mode = work.checkpointing;
    if (model.arch) {
      return familyBytes(model.arch, b, tokens, seq, work.flash_attention, mode);
    }
    const h = big(model.hidden), layers = big(model.layers);
    let perLayer16bit = 34n * tokens * h;
    if (!work.flash_attention) {
      if (model.heads == null) {
        if (mode === "none") return null;
      } else {
        perLayer16bit += 5n * big(model.heads) * seq * tokens;
      }
    }
    if (mode === "none") return (layers * perLayer16bit * b) / 2n;
    const holds = { full: 1n, selective: 10n, "full+offload": 0n }[mode];
    return tokens * h * layers * b * holds + (perLayer16bit * b) / 2n;
  }

  // memory.ring_all_reduce: 2(N-1)/N·t bytes sent per rank.
  const ringAllReduce = (t, n) => ceilDiv(2n * (big(n) - 1n) * t, big(n));
  // memory.ring_one_way: (N-1)/N·t bytes for a reduce-scatter or an all-gather.
  const ringOneWay = (t, n) => ceilDiv((big(n) - 1n) * t, big(n));

  // ParallelDims.shard_size (spec/dims.py): K, the ranks a stage shards over: all N, or
  // a shard group of K, in the same words when it does not divide them.
  function shardDegree(gpus, shardGroup = null) {
    if (shardGroup == null) return gpus;
    if (gpus % shardGroup) {
      const ok = [];
      for (let d = 1; d <= gpus; d++) if (gpus % d === 0) ok.push(d);
      throw new Error(`shard_group=${shardGroup} gives shard groups of ${shardGroup} ranks, `
        + `which do not divide the ${gpus} data-parallel ranks; expected one of `
        + `[${ok.join(", ")}], 'node' (ranks per machine) or None (all)`);
    }
    return shardGroup;
  }

  // state.model_state_bytes: each category the stage's policy shards is cut over the N
  // GPUs, or over a shard group of K of them.
  function modelStateBytes(params, gpus, recipe, stage, shardGroup = null) {
    const k = big(shardDegree(gpus, shardGroup));
    const shards = POLICIES[stage].shards;
    const part = (perParam, sharded) => {
      const total = big(perParam) * params;
      return sharded ? ceilDiv(total, k) : total;
    };
    return [
      part(recipe.weight_bytes, shards.params),
      part(recipe.grad_bytes, shards.grads),
      part(recipe.optimizer_bytes, shards.optimizer),
    ];
  }

  // comm.comm_bytes_by_level: inside a shard group of K, DDP all-reduces the gradients,
  // ZeRO-1/2 reduce-scatter them and gather the weights once, ZeRO-3 gathers for forward
  // and again for backward; across the R = N/K groups each rank's reduced shard (stage 0:
  // the whole gradients) is all-reduced over its R replicas (0 when plain, R = 1).
  function commBytesByLevel(params, gpus, recipe, stage, shardGroup = null) {
    const k = shardDegree(gpus, shardGroup), replicas = gpus / k;
    const grads = big(recipe.reduce_bytes) * params;
    const weights = big(recipe.weight_bytes) * params;
    const policy = POLICIES[stage];
    if (policy.reduce === "all_reduce") {
      return { inside: ringAllReduce(grads, k), across: ringAllReduce(grads, replicas) };
    }
    // once after the step (stages 1-2), or for forward and again for backward (stage 3)
    const gathers = (policy.after_step === "all_gather" ? 1n : 0n)
      + (policy.shards.params ? 2n : 0n);
    return { inside: ringOneWay(grads, k) + gathers * ringOneWay(weights, k),
      across: ringAllReduce(ceilDiv(grads, big(k)), replicas) };
  }

  // comm.comm_bytes: both levels.
  function commBytes(params, gpus, recipe, stage, shardGroup = null) {
    const { inside, across } = commBytesByLevel(params, gpus, recipe, stage, shardGroup);
    return inside + across;
  }

  // memory.plan_strategy (with StrategyPlan.total, .fits and .comm_inside folded in).
  function planStrategy(model, gpus, recipe, strategy, work, budget, shardGroup = null) {
    const stage = stageOf(strategy);
    const [weights, grads, optimizer] = modelStateBytes(model.params, gpus, recipe, stage,
      shardGroup);
    const activations = activationBytes(model, recipe, work);
    const total = weights + grads + optimizer + (activations ?? 0n);
    const { inside, across } = commBytesByLevel(model.params, gpus, recipe, stage, shardGroup);
    return {
      strategy: STRATEGIES[stage], weights, grads, optimizer, activations, total,
      comm: inside + across, comm_inside: inside, comm_across: across,
      shard_group: shardGroup, budget, fits: budget == null ? null : total <= budget,
    };
  }

  // memory.plan_all: one plan per strategy, DDP first.
  const planAll = (model, gpus, recipe, work, budget, shardGroup = null) =>
    POLICIES.map((_, s) => planStrategy(model, gpus, recipe, s, work, budget, shardGroup));

  // advice.floor_bytes: the categories the stage replicates, which no number of GPUs
  // divides.
  function floorBytes(model, recipe, strategy) {
    const shards = POLICIES[stageOf(strategy)].shards;
    const perParam = (shards.params ? 0 : recipe.weight_bytes)
      + (shards.grads ? 0 : recipe.grad_bytes) + (shards.optimizer ? 0 : recipe.optimizer_bytes);
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

  // advice.min_shard_group: the smallest shard group (a divisor of N) in which ZeRO-3
  // fits; per-GPU memory falls as the group grows.
  function minShardGroup(model, recipe, gpus, budget, work) {
    for (let k = 1; k <= gpus; k++) {
      if (gpus % k === 0 && planStrategy(model, gpus, recipe, 3, work, budget, k).fits) return k;
    }
    return null;
  }

  // advice.first_fit: the first strategy in DDP → ZeRO-3 order that fits, or null.
  const firstFit = (plans) => (plans.find((p) => p.fits) || { strategy: null }).strategy;

  return {
    STRATEGIES, archParams, blockParams, rootParams, stageOf, activationBytes, ringAllReduce, ringOneWay,
    shardDegree, modelStateBytes, commBytesByLevel, commBytes, planStrategy, planAll,
    floorBytes, gpuCounts, minGpus, minShardGroup, firstFit,
  };
})();

// advice.why_none_fits: one sentence on why no strategy fits at `gpus` GPUs (in shard
// groups of `shardGroup`: more GPUs do not help there, a larger group does).
Planner.whyNoneFits = function whyNoneFits(model, recipe, gpus, budget, work, shardGroup = null) {
  if (shardGroup != null && shardGroup < gpus) {
    const k = Planner.minShardGroup(model, recipe, gpus, budget, work);
    if (k != null) {
      return `nothing fits in shard groups of ${shardGroup} on ${gpus} GPUs; ZeRO-3 `
        + `fits in groups of ${k}`;
    }
    return `nothing fits in shard groups of ${shardGroup} on ${gpus} GPUs, nor does `
      + "ZeRO-3 over all of them; " + Planner.whyNoneFits(model, recipe, gpus, budget, work);
  }
  const need = Planner.minGpus(model, recipe, "ZeRO-3", budget, work);
  if (need.gpus == null) {
    const most = Planner.planStrategy(model, DATA.max_gpus, recipe, "ZeRO-3", work, budget);
    if (most.activations != null && most.activations > budget) {
      return "nothing fits: even ZeRO-3 tends to its activations alone, which are above the "
        + `budget of ${Format.count(budget)} bytes; `
        + "shorten the micro-batch or checkpoint activations";
    }
    return `nothing fits: even ZeRO-3 on ${Format.count(DATA.max_gpus)} GPUs, the most the `
      + `planner searches, needs ${Format.count(most.total)} bytes per GPU, above the budget `
      + `of ${Format.count(budget)}`;
  }
  return `nothing fits on ${gpus} GPUs; ZeRO-3 fits from ${need.gpus} GPUs`;
};
