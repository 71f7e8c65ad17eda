"""The engine's own memory-bound copies per unit (packing, averaging, unpacking, casts),
which the step-time model charges at the accelerator's memory rate on the compute
stream (``steptime.py``; the table in docs/steptime.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..spec.config import ZeroConfig
from ..spec.dims import ParallelDims
from ..spec.formulas import GLOO_BROADCAST_MAX
from .layout import secondary

#: Bytes per element of ``runtime/quantize._quantize_rows`` (and ``_pack``) over an input
#: of a bytes an element, its unfused torch ops one by one: the zeroed fp32 copy (4, then
#: a + 4), ``abs`` (8), ``amax`` (4), ``div_``, ``round_``, ``clamp_`` (8 each),
#: ``masked_fill_`` (4), the int8 cast (5), ``contiguous`` (2) and the pack (2): 57 + a.
QUANTIZE_BYTES = 57
#: Bytes per element of ``_dequantize_rows`` into fp32: the zeroed fp32 buffer (4), the
#: int8 copied in (1 + 4), the scales' ``mul_`` (8): 17, before its consumer copies out.
DEQUANTIZE_BYTES = 17


def _cast(n: float, a: str, b: str, a_bytes: int, b_bytes: int) -> float:
    """Bytes of ``Tensor.to`` over ``n`` elements from dtype a to b: none when they are
    the same dtype (``.to`` returns the tensor itself), else a read and a write."""
    return 0.0 if a == b else n * (a_bytes + b_bytes)


@dataclass(frozen=True)
class CopyBytes:
    """Bytes (read + write) of the engine's memory-bound copies for one unit of Q
    parameters over N ranks, per occurrence (``runtime/unit.py``,
    ``runtime/schedule.py``); w, g, r, m: bytes per element of weights,
    gradients, reduce dtype, master. ``.to`` between equal dtypes copies nothing.
    Padding and the presence flags are left out."""

    pack: float
    """Each backward, ``issue_reduce``: ``_chunk_cat`` reads the local gradients and
    writes the [N, S+F] buffer, ``Q·(g + r)``. qgZ adds the buffer quantized,
    ``(57 + r)·Q``, and in the wait its K copies of this rank's slot dequantized,
    ``17·Q``, and summed in fp32 (a clone, K - 1 adds, the copy out: ``(12·K + r)·Q/N``);
    charged here, with the reduction."""
    land: float
    """The step's first backward, ``wait_reduce``: stage 0 ``_land_full_grads`` divides
    the [N, ·] buffer by N into the full gradients in one pass (``Q·(r + g)``); stages 1-3
    divide the [S] slot (``2·Q·r/N``: in place, or on gloo as it is copied out of the
    all-reduced buffer; between two gloo ranks after adding this rank's own part to the
    received one, ``3·Q·r/N`` more) and make ``grad_shard`` by a cast if r ≠ g (``Q·(r+g)/N``), else
    as a view of the result."""
    land_more: float
    """Later backwards of the step: stages 2-3 ``add_`` into ``grad_shard``
    (``Q·(r + 2g)/N`` after the divide); stages 0-1 as :attr:`land`."""
    gather: float
    """Stage 3, each forward gather: ``unpack_into`` ``2·Q·w``; on gloo also the shard
    copied into its slot of the output (``2·Q·w/N``), or above ``GLOO_BROADCAST_MAX``
    ranks torch's copy out of its flat buffer (``2·Q·w``). qwZ (any backend): the shard
    quantized, ``(57 + w)·Q/N``, and the K slots dequantized into the output,
    ``(17 + 4 + w)·Q``, beside ``unpack_into``."""
    sync_input: float
    """Stages 1-2 after the step, ``refresh_compute``: the all-gather input, written
    into its slot of the output, a master cast ``Q·(m + w)/N`` (if m ≠ w) or
    ``torch.cat`` of this rank's rows ``2·Q·w/N``."""
    sync_unpack: float
    """Stages 1-2, ``wait_sync``: ``unpack_into`` of the gathered [N, S], ``2·Q·w``; with
    no master only the other ranks' rows, ``2·(Q - Q/N)·w``; on gloo above
    ``GLOO_BROADCAST_MAX`` ranks also torch's copy out of its flat buffer (``2·Q·w``)."""
    gather_back: float = 0.0
    """Stage 3, each backward gather: :attr:`gather`, but under hpZ the secondary
    group's (unquantized; on gloo the kept ``[K/K2, S]`` slots copied into the output,
    ``2·Q·w/K2``)."""
    step: float = 0.0
    """Once per step with a master: ``assign_step_grads``' cast to it if g ≠ m
    (``Q·(g + m)`` at stage 0, ``/N`` above) and ``refresh_compute``'s master copy into
    the weights at stage 0 (``Q·(m + w)``) and into ``w_shard`` at stage 3 (``/N``).
    Offloaded, both casts leave the device: the gradient is cast at each landing (in
    :attr:`land`, before it is copied down) and the master on the host."""

    def per_step(self, units: int, micro_batches: int) -> float:
        """Bytes of a step of ``micro_batches`` passes over ``units`` units (stage 3
        gathers twice per micro-batch: forward and backward)."""
        a = micro_batches
        return units * (a * self.pack + self.land + (a - 1) * self.land_more
                        + a * (self.gather + self.gather_back) + self.sync_input
                        + self.sync_unpack + self.step)


def copy_bytes(config: ZeroConfig, dims: ParallelDims, unit_params: float,
               gloo: bool = False) -> CopyBytes:
    """:class:`CopyBytes` of one unit of ``unit_params`` parameters over the shard
    group's K ranks of ``dims``, as ``config`` runs it; ``gloo``: with the copies the
    engine adds around gloo's in-place all-gathers. Offloaded (the policy's placement,
    ``plan/placement.py``), every landing casts the reduced slot to the master dtype on
    the device before it goes to the host (CUDA converts, then copies across), and the
    step's casts and the stage 1-2 all-gather input are made on the host (the input
    arrives by PCIe, no device copy). ZeRO++: qwZ's and qgZ's quantize and dequantize
    passes, hpZ's backward gathers inside the secondary group."""
    policy, recipe, dp = config.policy, config.recipe, dims.shard_size
    Q, n = unit_params, unit_params / dp
    w, g, r, m = (recipe.weight_bytes, recipe.grad_bytes, recipe.reduce_bytes,
                  recipe.master_bytes)
    wd, gd, md = recipe.param_dtype, recipe.grad_dtype, recipe.master_dtype
    rd = recipe.reduce_dtype or gd
    gloo = gloo and dp > 1  # one rank: torch's own collectives, which are no-ops
    # gloo's reduce-scatter between two ranks: the received slot plus this rank's own,
    # added into the output before the divide (runtime/collectives.py)
    pairwise = 3 * n * r if gloo and dp == 2 and not config.quantize_grads else 0.0
    if policy.averages_grads:
        land = Q * (r + g)  # _land_full_grads: divide, cast and copy in one pass
        land_more = land
    else:
        land = 2 * n * r + pairwise + _cast(n, rd, gd, r, g)
        # stage 1 lands each reduction as the first; stages 2-3 add into the shard
        land_more = (land if policy.keeps_local_grads else
                     2 * n * r + pairwise + n * (r + 2 * g))
    # an all-gather on gloo: the input into its slot (stage 3; the stage 1-2 input is
    # written there) up to GLOO_BROADCAST_MAX ranks, above it torch's copy out of a flat
    # buffer
    broadcasts = dp <= GLOO_BROADCAST_MAX
    staged = 0.0 if not gloo or broadcasts else 2 * Q * w
    gather = gather_back = 0.0
    if policy.shards_params:
        gather = gather_back = 2 * Q * w + (2 * n * w if gloo and broadcasts else staged)
        if config.quantize_weights and dp > 1:  # all_gather_single of int8 rows, any backend
            gather = 2 * Q * w + (QUANTIZE_BYTES + w) * n + (DEQUANTIZE_BYTES + 4 + w) * Q
            gather_back = gather
        k2 = secondary(dims, config)
        if k2 is not None:  # on gloo as any gather, over K2 ranks of the kept K/K2 slots
            extra = 0.0
            if gloo and k2 > 1:
                extra = 2 * Q * w / k2 if k2 <= GLOO_BROADCAST_MAX else 2 * Q * w
            gather_back = 2 * Q * w + extra
    pack = Q * (g + r)
    if config.quantize_grads and dp > 1:
        pack += (QUANTIZE_BYTES + r) * Q + DEQUANTIZE_BYTES * Q + (12 * dp + r) * n
    offloaded = policy.offloads_optimizer
    if offloaded:  # the landing's cast before the copy down (an fp32 master offloaded)
        down = _cast(n, gd, md or "fp32", g, m or 4)
        land, land_more = land + down, land_more + down
    master = md is not None or offloaded  # offloaded: a host master even in fp32
    sync_input = sync_unpack = step = 0.0
    if policy.gathers_after_step:
        sync_input = 0.0 if offloaded else _cast(n, md, wd, m, w) if md else 2 * n * w
        # with a master every row is re-landed; without, the other ranks' rows only
        sync_unpack = (2 * Q * w if master else 2 * (Q - n) * w) + staged
    if md and not offloaded:
        owned = n if policy.shards_optimizer else Q
        # the master cast into the compute weights on this rank alone: the full weights
        # at stage 0, the weight shard at stage 3
        cast_back = owned * (m + w) if not policy.gathers_after_step else 0.0
        step = _cast(owned, gd, md, g, m) + cast_back
    return CopyBytes(pack, land, land_more, gather, sync_input, sync_unpack, gather_back, step)
