"""A device model: what one accelerator (or CPU process) of a cluster can do,
as data, and the seconds a computation or a collective takes on it.

Invariants:
- A `DeviceModel` is plain, hashable data (tuples, floats): the simulator
  caches per-op seconds keyed by it.
- Every rate is *achievable*, not datasheet peak: `flops` is what a large
  dense matmul reaches (peak times a measured efficiency, or measured here
  by `meshplan calibrate`); `peak_flops` is the datasheet figure, kept only
  for "% of peak" reports. Bandwidths are bytes/s per device, one direction.
- `collective_seconds` takes the full (unsharded) tensor's bytes and costs
  the collective by algorithm (ring or tree), the cheaper of the two, as
  NCCL's tuner picks (see [Note: ring vs tree]).
- A dtype without a rate of its own (float64, an integer) is costed at the
  float32 rate.

[Note: ring vs tree]
With S the full tensor's bytes, n the group, B the link bandwidth and a the
latency of one step (both intra- or inter-node, by `crosses_nodes`):

  ring all_reduce:     2(n-1) a + 2(n-1)/n S/B      (reduce-scatter + all-gather)
  tree all_reduce:     2 ceil(log2 n) a + 2 S/(t B) (reduce up, broadcast down;
                                                     NCCL's double binary tree)
  reduce_scatter, all_gather:  (n-1) a + (n-1)/n S/B          (ring only)
  all_to_all:          (n-1) a + (n-1)/n^2 S/B      (pairwise: each rank holds
                                                     S/n and keeps 1/n of it)
  broadcast:           ring (n-1) a + S/B, tree ceil(log2 n) a + S/(t B)

with t = 0.9, the tree's bandwidth efficiency. The ring's bandwidth term is
smaller and its latency term linear in n, so the tree wins for small
messages and large groups, the ring for large messages. The step counts, the
tree's algorithm bandwidth of half the bus bandwidth and t are those of
NCCL's tuning model (`src/graph/tuning.cc`: `nsteps = 2*(nRanks-1)` for
all-reduce, `nRanks-1` for reduce-scatter and all-gather; the tree for
all-reduce only; tree `busBw*.9` and `ratio = .5`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

DTYPES = ("float32", "bfloat16", "float16")  # the dtypes a device model rates
KINDS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast")
_TREE_KINDS = ("all_reduce", "broadcast")  # NCCL has a tree for these only
TREE_EFFICIENCY = 0.9  # NCCL's tuner: tree busBw = busBw * .9 ([Note: ring vs tree])


def dtype_name(dtype: torch.dtype | str | object) -> str:
    """"float32" for torch.float32, "torch.float32", "float32" or a meshplan
    `DType` (anything with a `.name`)."""
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    if isinstance(dtype, str):
        return dtype.removeprefix("torch.")
    return str(getattr(dtype, "name", dtype))


@dataclass(frozen=True, slots=True)
class DeviceModel:
    """One device of a cluster; see the module docstring for the units."""

    name: str
    flops: tuple[tuple[str, float], ...]       # (dtype, achievable dense matmul FLOP/s)
    peak_flops: tuple[tuple[str, float], ...]  # (dtype, datasheet peak FLOP/s)
    mem_bw: float             # achievable device-memory bandwidth, bytes/s
    memory_bytes: int         # device memory
    devices_per_node: int
    intra_bw: float           # bytes/s per device, one direction, within a node
    intra_latency: float      # s per message / collective step within a node
    inter_bw: float           # bytes/s per device, one direction, across nodes
    inter_latency: float
    sources: tuple[str, ...] = ()  # citations: URL + what figure it gave
    # Point-to-point within a node, when it differs from the collectives' link
    # (measured: gloo's send/recv on this 2-core machine waits ~2 ms a message,
    # its all-reduce ~40 us a step); None: the link's figures.
    p2p_latency: float | None = None
    p2p_bw: float | None = None
    # Seconds every kernel costs on top of its math or memory traffic: its
    # launch and the framework's dispatch (what a tiny op takes).
    kernel_overhead: float = 0.0
    # The CPU cores all ranks of one node share (processes on one host, as
    # `meshplan calibrate` measures them); 0: every rank has its own device.
    # With more ranks on a node than cores, a step takes at least the node's
    # busy time over its cores (`search/estimate.py`, `host_bound`).
    host_cores: int = 0

    def flops_for(self, dtype: torch.dtype | str) -> float:
        """Achievable FLOP/s for `dtype` (the float32 rate for a dtype the
        model does not rate)."""
        rates = dict(self.flops)
        return rates.get(dtype_name(dtype), rates["float32"])

    def peak_flops_for(self, dtype: torch.dtype | str) -> float:
        """The datasheet peak FLOP/s for `dtype` (float32's when not rated)."""
        rates = dict(self.peak_flops)
        return rates.get(dtype_name(dtype), rates["float32"])

    def compute_seconds(self, flops: float, nbytes: float, dtype) -> float:
        """A kernel's seconds: its launch, then bound by its math or by its
        memory traffic."""
        return self.kernel_overhead + max(flops / self.flops_for(dtype), nbytes / self.mem_bw)

    def link(self, crosses_nodes: bool) -> tuple[float, float]:
        """(bandwidth bytes/s, latency s) of the link a transfer uses."""
        if crosses_nodes:
            return self.inter_bw, self.inter_latency
        return self.intra_bw, self.intra_latency

    def collective_seconds(self, kind: str, nbytes: int, group: int,
                           crosses_nodes: bool) -> float:
        """Seconds of collective `kind` over `group` ranks on a tensor of
        `nbytes` (full, unsharded): the cheaper of ring and tree."""
        if group <= 1:
            return 0.0
        return min(self.algorithm_seconds(kind, a, nbytes, group, crosses_nodes)
                   for a in algorithms(kind))

    def collective_algorithm(self, kind: str, nbytes: int, group: int,
                             crosses_nodes: bool) -> str:
        """"ring" or "tree": the algorithm `collective_seconds` costs."""
        return min(algorithms(kind), key=lambda a: self.algorithm_seconds(
            kind, a, nbytes, group, crosses_nodes))

    def algorithm_seconds(self, kind: str, algorithm: str, nbytes: int, group: int,
                          crosses_nodes: bool) -> float:
        """Seconds of `kind` run by `algorithm` ("ring" | "tree"); the
        formulas are [Note: ring vs tree]."""
        if kind not in KINDS:
            raise ValueError(f"unknown collective kind {kind!r}; one of {KINDS}")
        if algorithm not in algorithms(kind):
            raise ValueError(f"{kind} has no {algorithm} algorithm; {algorithms(kind)}")
        n = group
        if n <= 1:
            return 0.0
        bw, lat = self.link(crosses_nodes)
        depth = math.ceil(math.log2(n))
        tree_bw = TREE_EFFICIENCY * bw
        if kind == "all_reduce":
            if algorithm == "tree":
                return 2 * depth * lat + 2 * nbytes / tree_bw
            return 2 * (n - 1) * lat + 2 * (n - 1) / n * nbytes / bw
        if kind == "broadcast":
            if algorithm == "tree":
                return depth * lat + nbytes / tree_bw
            return (n - 1) * lat + nbytes / bw
        if kind == "all_to_all":
            return (n - 1) * lat + (n - 1) / (n * n) * nbytes / bw
        return (n - 1) * lat + (n - 1) / n * nbytes / bw  # reduce_scatter, all_gather

    def p2p_seconds(self, nbytes: int, crosses_nodes: bool) -> float:
        """One point-to-point message of `nbytes` (a pipeline transfer)."""
        bw, lat = self.link(crosses_nodes)
        if not crosses_nodes:
            bw = self.p2p_bw if self.p2p_bw is not None else bw
            lat = self.p2p_latency if self.p2p_latency is not None else lat
        return lat + nbytes / bw


def algorithms(kind: str) -> tuple[str, ...]:
    """The algorithms costed for collective `kind`."""
    return ("ring", "tree") if kind in _TREE_KINDS else ("ring",)


def uniform(rate: float) -> tuple[tuple[str, float], ...]:
    """The same rate for every rated dtype."""
    return tuple((d, rate) for d in DTYPES)


# The CPU-class default: the constants the simulator used before device models
# (lowering/action_times.py), for a plan with no device model named.
CPU_DEFAULT = DeviceModel(
    name="cpu-default",
    flops=uniform(5e10), peak_flops=uniform(5e10),
    mem_bw=1e10, memory_bytes=16 * 2**30, devices_per_node=8,
    intra_bw=2e9, intra_latency=2e-5, inter_bw=2e9, inter_latency=2e-5,
    sources=("meshplan's former simulator constants: a CPU-class guess, not a measurement",),
)
