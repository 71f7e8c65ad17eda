"""Hardware for the step-time model: accelerators, links and networks, with presets.

Every rate is a nominal figure from the vendor's data sheet, in bytes or FLOPs per
second (decimal units), one direction, per GPU:

- **accelerator peak**: dense bf16 tensor-core FLOP/s without sparsity (A100 SXM 312 T,
  H100 SXM 989 T, H200 SXM 989 T: NVIDIA's A100, H100 and H200 data sheets) and HBM
  bandwidth (2.039, 3.35 and 4.8 TB/s). The step-time model multiplies the peak by an
  *efficiency* factor (model FLOPs utilisation) and charges activation checkpointing's
  recomputed FLOPs at a share ``recompute_charge`` of their count, both calibrated on
  published FSDP runs (``plan/published.py``): A100 0.59, H100 and H200 0.44, recompute
  0.25 (PaLM reports 46 % MFU and Megatron-LM 52 % for large tuned runs).
- **links**: NVLink 4 (H100) moves 900 GB/s per GPU in both directions together, so 450
  GB/s each way; NVLink 3 (A100) 600 → 300 GB/s; PCIe 4.0 ×16 about 32 GB/s each way,
  PCIe 5.0 ×16 about 64 GB/s; InfiniBand NDR 400 Gb/s = 50 GB/s and HDR 200 Gb/s =
  25 GB/s per NIC, with one NIC per GPU (the DGX layout); RoCE 100 GbE = 12.5 GB/s.
- **latency** α per ring step: a few microseconds on NVLink or PCIe within a node, more
  across the network. These are order-of-magnitude assumptions (NCCL does not publish
  one figure); they matter only for small messages, i.e. many small units.

- **host** (offload, ``Host``): the GPU's PCIe link to host memory and the node's host
  memory bandwidth. PCIe 5.0 runs 32 GT/s per lane with 128b/130b encoding (PCI-SIG,
  PCI Express Base Specification 5.0, 2019): 16 lanes carry 32e9·16·128/130/8 = 63.0
  GB/s each way; transaction-layer headers, framing and flow control take about a tenth
  at 256-byte payloads, so a pinned ``cudaMemcpyAsync`` reaches about 55 GB/s, the
  preset's figure (PCIe 4.0: half, 27.5 GB/s). Host memory: a DGX H100's two Xeon
  Platinum 8480C have 8 DDR5-4800 channels each (Intel's product specification; NVIDIA
  DGX H100 user guide), 2·8·4800e6·8 = 614 GB/s, of which a STREAM-style kernel streams
  about 75 %: 460 GB/s for the node (a DGX A100's two EPYC 7742, 8 DDR4-3200 channels
  each: 410 GB/s, 300 GB/s streamed), shared by the node's GPUs' host steps.
- **disk** (disk offload, ``Host.disk_bandwidth``): one NVMe drive per GPU, as a DGX
  H100's eight U.2 cache drives (NVIDIA DGX H100 data sheet: 8 × 3.84 TB NVMe U.2). A
  PCIe 4.0 ×4 drive's link carries 16e9·4·128/130/8 = 7.88 GB/s each way (PCI-SIG,
  PCI Express Base Specification 4.0); data-center drives of that generation list
  sequential reads near 7 GB/s and writes of 4-6 GB/s. The presets take 5 GB/s per GPU
  for reads and for writes, one at a time (the drive serves the step's reading and
  writing threads in turn): an assumption, not a measurement here.

The ``cpu`` accelerator and ``loopback`` network hold what ``bench/steptime.py``
measured on the project's 2-core machine (docs/steptime.md); a run of that script on
another machine gives its own figures.
"""

from __future__ import annotations

from dataclasses import dataclass


def _positive(owner: str, field: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{owner}: {field}={value!r} must be a positive number")


@dataclass(frozen=True)
class Accelerator:
    """One GPU (or CPU process) as the compute model sees it."""

    name: str
    """Name accepted by ``--accelerator``."""
    peak_flops: float
    """Peak dense FLOP/s in the compute dtype (bf16 tensor cores for GPUs)."""
    memory_bandwidth: float
    """Bytes/s between the chip and its memory; bounds the optimizer step, which
    streams every byte of its state once, and the engine's own copies (pack, unpack,
    casts), which read and write every byte they move."""
    efficiency: float = 0.4
    """Fraction of ``peak_flops`` a transformer step achieves on its model FLOPs (model
    FLOPs utilisation, MFU: ``6·P + 12·L·h·s`` a token, recompute not counted)."""
    recompute_charge: float = 1.0
    """Share of the recomputed forward's FLOPs (activation checkpointing) that the step
    pays at ``efficiency``: 1 charges recompute like model FLOPs; published runs lose
    far less MFU to checkpointing than that (docs/steptime.md, calibration)."""

    def __post_init__(self) -> None:
        _positive(self.name, "peak_flops", self.peak_flops)
        _positive(self.name, "memory_bandwidth", self.memory_bandwidth)
        _positive(self.name, "efficiency", self.efficiency)
        if self.efficiency > 1:
            raise ValueError(f"{self.name}: efficiency={self.efficiency!r} must be in (0, 1]")
        if not 0 <= self.recompute_charge <= 1:
            raise ValueError(f"{self.name}: recompute_charge={self.recompute_charge!r} must "
                             "be in [0, 1]")


@dataclass(frozen=True)
class Link:
    """One level of the network: the alpha-beta parameters of a ring step on it."""

    name: str
    """Label shown in tables."""
    bandwidth: float
    """Bytes/s one GPU sends on this level, one direction (β in the alpha-beta model)."""
    latency: float
    """Seconds of start-up per ring step (α)."""

    def __post_init__(self) -> None:
        _positive(self.name, "bandwidth", self.bandwidth)
        if isinstance(self.latency, bool) or not isinstance(self.latency, (int, float)) \
                or self.latency < 0:
            raise ValueError(f"{self.name}: latency={self.latency!r} must be a number >= 0")


@dataclass(frozen=True)
class Network:
    """Two levels: GPUs of one node share ``intra``; nodes talk over ``inter``."""

    name: str
    """Name accepted by ``--network``."""
    intra: Link
    """Within a node (NVLink, PCIe)."""
    inter: Link
    """Between nodes (InfiniBand, RoCE), per GPU: one NIC per GPU."""
    overlap: bool = True
    """Collectives run beside compute (GPU copy engines and NCCL kernels). False: the
    transfers take the cores that compute runs on (gloo on a CPU), so nothing hides and
    every second of communication adds to the step."""
    gloo: bool = False
    """The collectives run on gloo, where the engine realises a reduce-scatter as an
    all-reduce in place (twice the ring bytes; its slot is divided on the way out; between
    two ranks an exchange of slots, the ring's bytes, added and divided after) and an
    all-gather as N broadcasts in place (the shard copied into its slot first; above
    ``GLOO_BROADCAST_MAX`` ranks torch's all-gather, its output copied out of a flat
    buffer); see ``runtime/collectives.py``."""


@dataclass(frozen=True)
class Host:
    """A node's host side, for offload: each GPU's link to host memory, and the host
    memory bandwidth the node's optimizer steps share."""

    name: str
    """Name accepted by ``--host``."""
    pcie: Link
    """One GPU's link to host memory, one direction (copies down and up each run at
    this rate; the engine makes them on the compute stream)."""
    memory_bandwidth: float = 460e9
    """Bytes/s the node's host memory streams (a STREAM-style figure, not the channels'
    peak); the GPUs of a node step at once, each at ``memory_bandwidth / gpus_per_node``.
    Default: a DGX H100's 614 GB/s of DDR5-4800 channels at 75 %."""
    disk_bandwidth: float = 5e9
    """Bytes/s one GPU's share of the node's drives reads, or writes (disk offload): the
    same rate each way, one way at a time. Default: one PCIe 4.0 ×4 NVMe drive's
    sequential rate (an assumption; see the module's docstring)."""

    def __post_init__(self) -> None:
        _positive(self.name, "memory_bandwidth", self.memory_bandwidth)
        _positive(self.name, "disk_bandwidth", self.disk_bandwidth)


@dataclass(frozen=True)
class Cluster:
    """What the step-time model runs on: an accelerator, a network, a node size."""

    accelerator: Accelerator
    """The chip every rank runs on."""
    network: Network
    """The links between chips."""
    gpus_per_node: int = 8
    """GPUs that share the intra-node level; a ring over more spans nodes."""
    host: Host | None = None
    """The host side for offload (None: ``HOSTS[DEFAULT_HOST]``)."""

    def __post_init__(self) -> None:
        n = self.gpus_per_node
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ValueError(f"gpus_per_node={n!r} must be a positive integer")

    @property
    def host_side(self) -> Host:
        """The host the offload model uses."""
        return self.host or HOSTS[DEFAULT_HOST]

    def host_bandwidth(self) -> float:
        """Bytes/s of host memory one GPU's host step gets: the node's, shared."""
        return self.host_side.memory_bandwidth / self.gpus_per_node

    def link(self, ranks: int, stride: int = 1) -> Link:
        """The level a ring of ``ranks`` GPUs ``stride`` apart is bound by (consecutive
        GPUs by default; hybrid sharding's replicas are a shard group's width apart):
        within a node if the ring's span fits in one; between nodes alone if every hop
        crosses (a stride of whole nodes); else the slower of the two (a ring is as
        fast as its slowest hop; with a NIC per GPU each GPU's share crosses its own
        NIC, which is how NCCL's bus bandwidth saturates at the NIC rate across nodes)."""
        if (ranks - 1) * stride + 1 <= self.gpus_per_node:
            return self.network.intra
        if stride % self.gpus_per_node == 0:
            return self.network.inter
        a, b = self.network.intra, self.network.inter
        return Link(f"{a.name}+{b.name}", min(a.bandwidth, b.bandwidth),
                    max(a.latency, b.latency))


_NVLINK4 = Link("NVLink 4", 450e9, 3e-6)
_NVLINK3 = Link("NVLink 3", 300e9, 3e-6)
_PCIE4 = Link("PCIe 4.0 x16", 32e9, 5e-6)
_PCIE5 = Link("PCIe 5.0 x16", 64e9, 5e-6)
_NDR = Link("InfiniBand NDR 400G", 50e9, 10e-6)
_HDR = Link("InfiniBand HDR 200G", 25e9, 10e-6)
_ROCE100 = Link("RoCE 100GbE", 12.5e9, 15e-6)
# bench/steptime.py on the project's machine: gloo all-reduce over 127.0.0.1 at N = 2
# (docs/steptime.md).
_LOOPBACK = Link("gloo loopback", 0.92e9, 149e-6)

ACCELERATORS: dict[str, Accelerator] = {
    a.name: a
    for a in (
        # efficiency and recompute_charge: calibrated on published FSDP runs
        # (plan/published.py, docs/steptime.md): median |error| 4.3 % over 18 rows
        Accelerator("a100", 312e12, 2.039e12, 0.59, 0.25),
        Accelerator("h100", 989e12, 3.35e12, 0.44, 0.25),
        Accelerator("h200", 989e12, 4.8e12, 0.44, 0.25),  # H100's chip: its calibration
        # bench/steptime.py: the GEMM rate of one thread, the efficiency of a one-process
        # GPT medium step against it, and AdamW's effective streaming rate (which the
        # model also charges the engine's copies at).
        Accelerator("cpu", 151.7e9, 6.04e9, efficiency=0.81),
    )
}

NETWORKS: dict[str, Network] = {
    n.name: n
    for n in (
        Network("nvlink4-ndr", _NVLINK4, _NDR),
        Network("nvlink3-hdr", _NVLINK3, _HDR),
        Network("pcie4-roce", _PCIE4, _ROCE100),
        Network("pcie5-ndr", _PCIE5, _NDR),
        Network("loopback", _LOOPBACK, _LOOPBACK, overlap=False, gloo=True),
    )
}

HOSTS: dict[str, Host] = {
    h.name: h
    for h in (
        Host("pcie5", Link("PCIe 5.0 x16 to host", 55e9, 10e-6), 460e9, 5e9),  # DGX H100-like
        Host("pcie4", Link("PCIe 4.0 x16 to host", 27.5e9, 10e-6), 300e9, 5e9),  # DGX A100-like
    )
}

DEFAULT_HOST = "pcie5"
DEFAULT_ACCELERATOR = "h100"
DEFAULT_NETWORK = "nvlink4-ndr"


def get_accelerator(name: str, efficiency: float | None = None) -> Accelerator:
    """A preset by name, optionally with another efficiency; the error lists them."""
    if name not in ACCELERATORS:
        raise ValueError(f"unknown accelerator {name!r}; expected one of "
                         f"{', '.join(ACCELERATORS)}")
    a = ACCELERATORS[name]
    if efficiency is None:
        return a
    return Accelerator(a.name, a.peak_flops, a.memory_bandwidth, efficiency,
                       a.recompute_charge)


def get_host(name: str, memory_bandwidth: float | None = None,
             disk_bandwidth: float | None = None) -> Host:
    """A host preset by name, optionally with another memory or disk bandwidth
    (bytes/s)."""
    if name not in HOSTS:
        raise ValueError(f"unknown host {name!r}; expected one of {', '.join(HOSTS)}")
    h = HOSTS[name]
    return Host(h.name, h.pcie,
                h.memory_bandwidth if memory_bandwidth is None else memory_bandwidth,
                h.disk_bandwidth if disk_bandwidth is None else disk_bandwidth)


def get_network(name: str) -> Network:
    """A preset by name; the error lists them."""
    if name not in NETWORKS:
        raise ValueError(f"unknown network {name!r}; expected one of {', '.join(NETWORKS)}")
    return NETWORKS[name]
