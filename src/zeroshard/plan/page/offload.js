// advice.offload_offer (plan/placement.py): when no strategy fits the device, the first
// that fits with the optimizer in host memory (stages 1, 2, 3), then with the weight
// shards there too (stage 3), its device and host bytes, and what a step of one
// micro-batch pays for it: the PCIe copies (the owned gradients down in the master
// dtype, m bytes, an fp32 master when the recipe has none; the updated shard up in the
// compute dtype, twice per micro-batch with the weight shards on the host) and the host
// step, 2·(m + S) + m (+ w for a cast) bytes per owned element at the node's host
// memory bandwidth shared by its GPUs. DATA.host is the planner's default host preset;
// DATA.offload_stages the stages that take each offload (spec/rules.py's rules).
"use strict";

Planner.offloadOffer = function offloadOffer(model, recipe, gpus, budget, work,
  shardGroup, unit, unitName) {
  const host = DATA.host;
  const ceilDiv = (a, b) => (a + b - 1n) / b;
  const k = BigInt(Planner.shardDegree(gpus, shardGroup));
  const m = recipe.master_bytes || 4; // offload.master_bytes
  const states = recipe.optimizer_bytes - recipe.master_bytes;
  const w = recipe.weight_bytes;
  const gb = (b) => `${Format.bytes(b, unit)} ${unitName}`;
  for (const [offload, stages] of Object.entries(DATA.offload_stages)) {
    for (const stage of stages) {
      const plain = Planner.planStrategy(model, gpus, recipe, stage, work, budget, shardGroup);
      const onHost = offload === "params";
      const n = ceilDiv(model.params, k); // offload.owned
      const hostBytes = (onHost ? plain.weights : 0n)
        + ceilDiv(model.params * BigInt(m + states), k) + n * BigInt(m);
      const device = (onHost ? 0n : plain.weights) + plain.grads + (plain.activations ?? 0n);
      if (device > budget) continue;
      const down = n * BigInt(m), up = (onHost ? 2n : 1n) * n * BigInt(w);
      const pcie = Number(down + up) / host.pcie_bandwidth;
      const streamed = 2 * (m + states) + m + (w !== m ? w : 0); // offload.host_step_bytes
      const step = Number(n * BigInt(streamed)) / (host.memory_bandwidth / host.gpus_per_node);
      return `with offload='${offload}' ${plain.strategy} fits: ${gb(device)} on the GPU, `
        + `${gb(hostBytes)} of host memory per GPU (${gb(hostBytes * BigInt(host.gpus_per_node))} `
        + `for a node of ${host.gpus_per_node}); each step of one micro-batch adds `
        + `${Format.fixed(pcie, 3)} s over ${host.pcie_name} (${gb(down)} of gradients down, `
        + `${gb(up)} of weights up) and a ${Format.fixed(step, 3)} s host step `
        + `(--offload ${offload})`;
    }
  }
  return null;
};
