"""Hardware presets: the figures of clusters users have, to plan for them from a laptop.

A preset is a :class:`~osdp_fx.core.devices.Devices` written by hand from public figures: datasheet
peak FLOP/s per dtype, memory size and bandwidth, link bandwidth per scope, each multiplied by an
efficiency factor stated below, with the sources written next to the figures. ``Devices.preset
(name)`` builds one for a given world size; ``python -m osdp_fx devices`` lists them.

[Note: preset efficiencies]
Datasheet peaks are not reachable; the cost models need sustained figures, so every peak is
multiplied by an efficiency:

- compute: the best dense bf16 matmul throughput measured on that GPU over its peak, from the
  "Maximum Achievable Matmul FLOPS" (MAMF) table of Stas Bekman's *Machine Learning Engineering*
  (github.com/stas00/ml-engineering, ``compute/accelerator/README.md``, BF16 v2 table): A100 SXM
  271.2 of 312 TFLOP/s (0.869), H100 SXM 794.5 of 989 (0.803). GPUs not in that table take
  H100 SXM's 0.80 (an assumption, marked per preset). It is the *best* shape's rate, so
  predicted compute is a lower bound on what a model's smaller matmuls take; the same factor
  is applied to every dtype.
- memory bandwidth: 0.85 of the datasheet figure (assumed: large copies typically reach 80-90 %
  of HBM/GDDR peak; not taken from a cited measurement).
- links: 0.78 of the per-direction link rate: NCCL's own tuning model caps the ring bus
  bandwidth of A100s at 235 GB/s of NVLink 3's 300 GB/s (github.com/NVIDIA/nccl
  ``src/graph/tuning.cc``: ``if (compCap80) busBw = std::min(busBw, 235.0f)``); the same
  factor is assumed for PCIe and InfiniBand.
- latency per ring step: NCCL's tuning model's hardware latencies for ring/Simple (same file,
  ``hwLat``): 3.4 us over NVLink, 5.7 us over PCIe, 9.6 us over the network.

- memory margin: ``GPU_MEMORY_MARGIN`` of the memory limit kept free for what the caching
  allocator reserves beyond what tensors hold (``Devices.memory_margin``).

``float32`` figures are the GPUs' non-tensor-core FP32 peaks: PyTorch does not use TF32 for
float32 matmuls unless ``torch.backends.cuda.matmul.allow_tf32`` is set. Inter-node bandwidth is
per rank: the node's network bandwidth divided by its GPUs (on DGX systems each GPU has its own
NIC). This module imports no torch.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

from ..errors import InputError
from ..units import parse_bytes

GPU_MEMORY_MARGIN = 0.12
"""``Devices.memory_margin`` of every preset and of ``detect_devices`` on a GPU whose caching
allocator runs with its default settings: the share of the memory limit the search keeps free
for what the allocator reserves beyond the tensors it holds ([Note: the allocator's margin]).
Fitted on the rows of ``benchmarks/gpu_check.py``'s memory part under the default allocator
(the 350M GPT and the LoRA Llama, world 1 and 2, every plan; ``docs/cost-models.md``, "The
allocator"): the largest ``max_memory_reserved`` over the predicted peak, ``f``, asks for a share
of at least ``f / (1 + f)`` of the limit, rounded up to the next hundredth."""

GPU_MEMORY_MARGIN_EXPANDABLE = 0.07
"""``Devices.memory_margin`` of ``detect_devices`` on a GPU whose caching allocator runs with
``expandable_segments:True`` (``PYTORCH_ALLOC_CONF``, or ``PYTORCH_CUDA_ALLOC_CONF``), fitted the
same way on the rows that ran with it (the GPT and the LoRA Llama at world 1, every plan;
``docs/cost-models.md``, "The allocator")."""

# Note [the allocator's margin]
# PyTorch's caching allocator keeps the memory of freed tensors for reuse, in segments it asked
# the driver for; a segment is returned only by ``torch.cuda.empty_cache()``. With its default
# settings a segment has a fixed size, and blocks freed inside it can be too small or too
# scattered for the next request, which then takes a new segment: ``max_memory_reserved`` (what
# the process holds on the device) exceeds ``max_memory_allocated`` (what its tensors hold,
# what the memory model predicts) by the fragmentation of the step's sequence of allocations.
# With ``expandable_segments:True`` a segment grows and shrinks in place by mapping pages, and
# the fragmentation left is a few pages. The search plans a predicted peak of at most
# ``limit * (1 - memory_margin)``: a fragmentation ``f`` (reserved = (1 + f) * predicted) keeps
# ``max_memory_reserved`` under the limit while ``memory_margin >= f / (1 + f)``. The margin is
# fitted per allocator setting, not per plan: the rows measured show no plan kind whose
# fragmentation stands apart from the others by more than the rounding.

GiB = 2**30
TERA = 1e12
GB = 1e9

COMPUTE_EFFICIENCY_H100_SXM = 794.5 / 989
"""MAMF / peak, H100 SXM bf16 (stas00/ml-engineering, see [Note: preset efficiencies])."""
COMPUTE_EFFICIENCY_A100_SXM = 271.2 / 312
"""MAMF / peak, A100 SXM bf16 (same table)."""
COMPUTE_EFFICIENCY_ASSUMED = 0.80
"""For GPUs without a MAMF measurement: H100 SXM's, rounded (an assumption)."""
ATTENTION_EFFICIENCY = 0.314
"""Share of the matmul rate a fused attention kernel reaches where its time is estimated
(``Devices.attention_efficiency``). Fitted, the one constant fitted to published runs: by
``python benchmarks/published.py --fit`` on five rows of llm-foundry's MPT tables, the
smallest models, where attention is the largest share of the step (``published.FIT_ROWS``:
A100 125m on 16 and 128 GPUs, A100 350m on 64, H100 760m on 16, H100 1b on 8); every other
row is validation (``docs/cost-models.md``)."""
MEMORY_EFFICIENCY = 0.85
"""Sustained over datasheet memory bandwidth (an assumption, see the note)."""
LINK_EFFICIENCY = 235 / 300
"""Sustained ring bus bandwidth over the per-direction link rate (NCCL's A100 cap)."""
NVLINK_STEP_LATENCY_S = 3.4e-6
"""NCCL tuning model, ring/Simple, per step over NVLink."""
PCIE_STEP_LATENCY_S = 5.7e-6
"""NCCL tuning model, ring/Simple, per step over PCIe."""
NETWORK_STEP_LATENCY_S = 9.6e-6
"""NCCL tuning model, ring/Simple, per step over the network."""

_NCCL_TUNING = ("NCCL tuning model: github.com/NVIDIA/nccl src/graph/tuning.cc (ring/Simple "
                "hwLat; A100 bus bandwidth cap 235 GB/s)")
_MAMF = ("MAMF table: github.com/stas00/ml-engineering compute/accelerator/README.md "
         "(Maximum Achievable Matmul FLOPS, BF16)")


@dataclasses.dataclass(frozen=True)
class Preset:
    """One cluster kind: datasheet figures, efficiencies and where the figures come from."""

    name: str
    """What ``--devices`` and ``Devices.preset`` take, e.g. 'h100-sxm-8x'."""
    summary: str
    """One line: the GPU, how many per node and the links."""
    ranks_per_node: int
    """GPUs per node (one rank each)."""
    memory_bytes: int
    """Memory of one GPU (datasheet); the default memory limit per rank."""
    peak_flops_per_s: dict[str, float]
    """Datasheet dense peak per torch dtype name (no sparsity)."""
    memory_bandwidth_bytes_per_s: float
    """Datasheet memory bandwidth of one GPU."""
    intra_node_link_bytes_per_s: float
    """Per-direction bandwidth of one GPU's links to the other GPUs of its node."""
    intra_node_latency_s: float
    """Latency of one ring step inside a node."""
    inter_node_link_bytes_per_s: float
    """Per-direction network bandwidth per GPU (the node's NICs over its GPUs)."""
    inter_node_latency_s: float
    """Latency of one ring step across nodes."""
    compute_efficiency: float
    """Sustained over peak matmul throughput ([Note: preset efficiencies])."""
    sources: tuple[str, ...]
    """Where the figures come from, one entry per document."""
    notes: str = ""
    """Assumptions particular to this preset."""
    memory_efficiency: float = MEMORY_EFFICIENCY
    """Sustained over datasheet memory bandwidth."""
    link_efficiency: float = LINK_EFFICIENCY
    """Sustained ring bus bandwidth over the link rate."""

    def devices_figures(self) -> dict[str, Any]:
        """The :class:`~osdp_fx.core.devices.Devices` fields these figures give (no world size)."""
        sustained = {d: f * self.compute_efficiency for d, f in self.peak_flops_per_s.items()}
        return {
            "memory_bytes": self.memory_bytes,
            "compute_flops_per_s": sustained["float32"],
            "compute_flops_per_s_by_dtype": sustained,
            "memory_bandwidth_bytes_per_s":
                self.memory_bandwidth_bytes_per_s * self.memory_efficiency,
            "intra_node_bandwidth_bytes_per_s":
                self.intra_node_link_bytes_per_s * self.link_efficiency,
            "intra_node_latency_s": self.intra_node_latency_s,
            "inter_node_bandwidth_bytes_per_s":
                self.inter_node_link_bytes_per_s * self.link_efficiency,
            "inter_node_latency_s": self.inter_node_latency_s,
            "memory_margin": GPU_MEMORY_MARGIN,
            "attention_efficiency": ATTENTION_EFFICIENCY,
            "all_reduce_trees": True,
            "source": f"preset:{self.name}",
        }


def _flops(fp32: float, tensor16: float) -> dict[str, float]:
    """Dense peaks in TFLOP/s: float32 (no TF32) and bf16/fp16 tensor cores."""
    return {"float32": fp32 * TERA, "bfloat16": tensor16 * TERA, "float16": tensor16 * TERA}


_H100_SXM = ("NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100): SXM5 "
             "FP32 67 TFLOPS, BF16/FP16 1,979 TFLOPS with sparsity (989.5 dense), 80 GB HBM3 at "
             "3.35 TB/s, NVLink 900 GB/s (450 GB/s per direction)")
_A100 = ("NVIDIA A100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/a100): FP32 19.5 "
         "TFLOPS, BF16/FP16 312 TFLOPS dense, 40 GB HBM2 at 1,555 GB/s or 80 GB HBM2e at "
         "2,039 GB/s, NVLink 600 GB/s (300 GB/s per direction)")
_DGX_A100 = ("NVIDIA DGX A100 datasheet: 8 single-port ConnectX-6 200 Gb/s HDR InfiniBand for "
             "compute, one per GPU (25 GB/s per GPU per direction)")

PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset(
        name="h100-sxm-8x",
        summary="8 x H100 SXM5 80 GB per node, NVLink 4 / NVSwitch, 8 x 400 Gb/s InfiniBand "
                "(DGX/HGX H100)",
        ranks_per_node=8, memory_bytes=80 * GiB,
        peak_flops_per_s=_flops(67, 989.5), memory_bandwidth_bytes_per_s=3.35e12,
        intra_node_link_bytes_per_s=450 * GB, intra_node_latency_s=NVLINK_STEP_LATENCY_S,
        inter_node_link_bytes_per_s=50 * GB, inter_node_latency_s=NETWORK_STEP_LATENCY_S,
        compute_efficiency=COMPUTE_EFFICIENCY_H100_SXM,
        sources=(_H100_SXM,
                 "NVIDIA DGX H100 datasheet: 8 single-port ConnectX-7 400 Gb/s InfiniBand "
                 "for compute, one per GPU (50 GB/s per GPU per direction)",
                 _MAMF, _NCCL_TUNING)),
    Preset(
        name="h100-pcie-8x",
        summary="8 x H100 PCIe 80 GB per node on PCIe Gen5, 400 Gb/s network per node",
        ranks_per_node=8, memory_bytes=80 * GiB,
        peak_flops_per_s=_flops(51, 756), memory_bandwidth_bytes_per_s=2.0e12,
        intra_node_link_bytes_per_s=64 * GB, intra_node_latency_s=PCIE_STEP_LATENCY_S,
        inter_node_link_bytes_per_s=50 * GB / 8, inter_node_latency_s=NETWORK_STEP_LATENCY_S,
        compute_efficiency=COMPUTE_EFFICIENCY_ASSUMED,
        sources=("NVIDIA H100 Tensor Core GPU datasheet: PCIe FP32 51 TFLOPS, BF16/FP16 1,513 "
                 "TFLOPS with sparsity (756 dense), 80 GB HBM2e at 2 TB/s, PCIe Gen5 128 GB/s "
                 "(64 GB/s per direction); NVLink bridges join pairs only", _NCCL_TUNING),
        notes="collectives run over PCIe (NVLink bridges join only pairs of GPUs); one 400 Gb/s "
              "NIC per node is assumed; compute efficiency assumed (no MAMF measurement)"),
    Preset(
        name="a100-sxm-40gb-8x",
        summary="8 x A100 SXM4 40 GB per node, NVLink 3 / NVSwitch, 8 x 200 Gb/s InfiniBand "
                "(DGX A100)",
        ranks_per_node=8, memory_bytes=40 * GiB,
        peak_flops_per_s=_flops(19.5, 312), memory_bandwidth_bytes_per_s=1.555e12,
        intra_node_link_bytes_per_s=300 * GB, intra_node_latency_s=NVLINK_STEP_LATENCY_S,
        inter_node_link_bytes_per_s=25 * GB, inter_node_latency_s=NETWORK_STEP_LATENCY_S,
        compute_efficiency=COMPUTE_EFFICIENCY_A100_SXM,
        sources=(_A100, _DGX_A100, _MAMF, _NCCL_TUNING),
        notes="AWS p4d.24xlarge has the same GPUs but 400 Gb/s of EFA per node (6.25 GB/s per "
              "GPU): lower inter_node_bandwidth_bytes_per_s for it"),
    Preset(
        name="a100-sxm-80gb-8x",
        summary="8 x A100 SXM4 80 GB per node, NVLink 3 / NVSwitch, 8 x 200 Gb/s InfiniBand "
                "(DGX A100 80GB)",
        ranks_per_node=8, memory_bytes=80 * GiB,
        peak_flops_per_s=_flops(19.5, 312), memory_bandwidth_bytes_per_s=2.039e12,
        intra_node_link_bytes_per_s=300 * GB, intra_node_latency_s=NVLINK_STEP_LATENCY_S,
        inter_node_link_bytes_per_s=25 * GB, inter_node_latency_s=NETWORK_STEP_LATENCY_S,
        compute_efficiency=COMPUTE_EFFICIENCY_A100_SXM,
        sources=(_A100, _DGX_A100, _MAMF, _NCCL_TUNING)),
    Preset(
        name="l4-8x",
        summary="8 x L4 24 GB per node on PCIe Gen4, 100 Gb/s network per node "
                "(GCP g2-standard-96, AWS g6.48xlarge)",
        ranks_per_node=8, memory_bytes=24 * GiB,
        peak_flops_per_s=_flops(30.3, 121), memory_bandwidth_bytes_per_s=300 * GB,
        intra_node_link_bytes_per_s=32 * GB, intra_node_latency_s=PCIE_STEP_LATENCY_S,
        inter_node_link_bytes_per_s=12.5 * GB / 8, inter_node_latency_s=NETWORK_STEP_LATENCY_S,
        compute_efficiency=COMPUTE_EFFICIENCY_ASSUMED,
        sources=("NVIDIA L4 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/l4): FP32 "
                 "30.3 TFLOPS, BF16/FP16 242 TFLOPS with sparsity (121 dense), 24 GB GDDR6 at "
                 "300 GB/s, PCIe Gen4 x16 64 GB/s (32 GB/s per direction), no NVLink",
                 "GCP g2-standard-96 and AWS g6.48xlarge: 8 L4, 100 Gbps network per machine",
                 _NCCL_TUNING),
        notes="compute efficiency assumed (no MAMF measurement; the L4's 72 W limit may hold "
              "its clocks lower)"),
    Preset(
        name="titan-rtx-pcie3-8x",
        summary="8 x TITAN RTX 24 GB per node on PCIe 3.0, 100 Gb/s network per node (a box "
                "like the OSDP paper's)",
        ranks_per_node=8, memory_bytes=24 * GiB,
        peak_flops_per_s={"float32": 16.3 * TERA, "float16": 130 * TERA,
                          "bfloat16": 16.3 * TERA},
        memory_bandwidth_bytes_per_s=672 * GB,
        intra_node_link_bytes_per_s=15.75 * GB, intra_node_latency_s=PCIE_STEP_LATENCY_S,
        inter_node_link_bytes_per_s=12.5 * GB / 8, inter_node_latency_s=NETWORK_STEP_LATENCY_S,
        compute_efficiency=COMPUTE_EFFICIENCY_ASSUMED,
        sources=("NVIDIA TITAN RTX product page (nvidia.com/en-us/deep-learning-ai/products/"
                 "titan-rtx): 130 Tensor TFLOPS (FP16), 16.3 TFLOPS FP32, 24 GB GDDR6 at "
                 "672 GB/s",
                 "PCI-SIG: PCIe 3.0 x16 is 8 GT/s x 16 lanes with 128b/130b coding, 15.75 GB/s "
                 "per direction",
                 "OSDP (Jiang et al., IJCAI 2023) ran on 8-GPU PCIe 3.0 servers of 24 GB GPUs "
                 "(benchmarks/paper_setting.py)", _NCCL_TUNING),
        notes="Turing has no bf16 tensor cores: bfloat16 runs at the FP32 rate, use "
              "--mixed-precision fp16; the 100 Gb/s network per node and the compute "
              "efficiency are assumptions"),
)}
"""Every preset by name."""


def closest_presets(name: str) -> list[str]:
    """The presets ``name`` most likely meant: those it begins (``h100``: both H100 presets),
    else the closest by spelling (difflib), else none."""
    key = name.strip().lower()
    starting = [p for p in PRESETS if key and p.startswith(key)]
    return starting or difflib.get_close_matches(key, list(PRESETS), n=1)


def unknown_preset_message(name: str, what: str = "unknown device preset") -> str:
    """'unknown device preset NAME; did you mean ...? presets are ...' and the fixes."""
    close = closest_presets(name)
    guess = f"; did you mean {' or '.join(map(repr, close))}?" if close else ";"
    return (f"{what} {name!r}{guess} presets are {', '.join(PRESETS)} (python -m "
            "osdp_fx devices lists them), or give a Devices JSON file (Devices.to_json; "
            "python -m osdp_fx devices NAME --json FILE writes one to edit)")


def get_preset(name: str) -> Preset:
    """The preset called ``name``; InputError listing the names (and the closest) otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise InputError(unknown_preset_message(name)) from None


def preset_figures(name: str, *, world_size: int | None = None,
                   memory_limit: int | str | None = None) -> dict[str, Any]:
    """Keyword arguments of ``Devices`` for ``world_size`` ranks of preset ``name``: whole nodes
    of its ranks per node (fewer ranks than a node: one node, ``ranks_per_node`` None), memory
    limit ``memory_limit`` (default: the GPU's memory)."""
    preset = get_preset(name)
    per_node = preset.ranks_per_node
    world = per_node if world_size is None else world_size
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise InputError(f"world_size must be a positive int, got {world!r}")
    if world > per_node and world % per_node:
        raise InputError(
            f"preset {name!r} has {per_node} GPUs per node, and world size {world} is not whole "
            f"nodes of them: use a multiple of {per_node} (or a world of at most one node)"
        )
    figures = preset.devices_figures()
    if memory_limit is not None:
        figures["memory_bytes"] = parse_bytes(memory_limit)
    # ranks_per_node is kept for one whole node too, so that a Devices JSON written for one
    # node still describes the nodes when a world size of several is set on it
    return {"world_size": world, "ranks_per_node": per_node if world >= per_node else None,
            **figures}
