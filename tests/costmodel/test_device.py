"""costmodel/device.py: compute and collective seconds, ring vs tree.

Expected seconds are computed here from the data files' raw numbers (peak
times efficiency) and the formulas of [Note: ring vs tree], not from the
code's own helpers, so a swapped link, a wrong step count or a wrong
bandwidth term fails."""

import json
import math
from pathlib import Path

import pytest
import torch

from meshplan.costmodel import CPU_DEFAULT, DeviceModel, load_device_model
from meshplan.costmodel.device import KINDS, algorithms, uniform
from meshplan.ir import DType

DEVICES = Path(__file__).resolve().parents[2] / "meshplan" / "costmodel" / "devices"
GPUS = ("a100-80gb", "h100-80gb", "h200-141gb")
GiB = 2**30


def raw(name: str, key: str) -> float:
    """A rate as the file states it: peak * efficiency, or the number."""
    v = json.loads((DEVICES / f"{name}.json").read_text())[key]
    return v["peak"] * v["efficiency"] if isinstance(v, dict) else v


def test_a_group_of_one_costs_nothing():
    dev = load_device_model("a100-80gb")
    for kind in KINDS:
        for group in (0, 1):
            assert dev.collective_seconds(kind, 10 * GiB, group, True) == 0.0


def test_intra_node_all_reduce_is_the_ring_over_nvlink():
    dev = load_device_model("a100-80gb")
    bw, lat = raw("a100-80gb", "intra_bw"), raw("a100-80gb", "intra_latency")
    n, s = 8, GiB
    want = 2 * (n - 1) * lat + 2 * (n - 1) / n * s / bw
    assert dev.collective_seconds("all_reduce", s, n, crosses_nodes=False) == pytest.approx(want)
    assert dev.collective_algorithm("all_reduce", s, n, False) == "ring"


def test_cross_node_collectives_use_infiniband():
    dev = load_device_model("h100-80gb")
    bw, lat = raw("h100-80gb", "inter_bw"), raw("h100-80gb", "inter_latency")
    n, s = 16, 4 * GiB
    assert dev.collective_seconds("all_gather", s, n, crosses_nodes=True) == pytest.approx(
        (n - 1) * lat + (n - 1) / n * s / bw)
    assert dev.collective_seconds("reduce_scatter", s, n, True) == pytest.approx(
        (n - 1) * lat + (n - 1) / n * s / bw)
    assert dev.collective_seconds("all_to_all", s, n, True) == pytest.approx(
        (n - 1) * lat + (n - 1) / n**2 * s / bw)
    assert dev.p2p_seconds(s, crosses_nodes=True) == pytest.approx(lat + s / bw)
    assert dev.p2p_seconds(s, crosses_nodes=False) == pytest.approx(
        raw("h100-80gb", "intra_latency") + s / raw("h100-80gb", "intra_bw"))


def test_a_small_message_on_a_large_group_takes_the_tree():
    dev = load_device_model("a100-80gb")
    n, s = 256, 4096
    lat, bw = raw("a100-80gb", "inter_latency"), raw("a100-80gb", "inter_bw")
    tree = 2 * math.ceil(math.log2(n)) * lat + 2 * s / (0.9 * bw)  # NCCL's tree: 0.9 busBw
    ring = 2 * (n - 1) * lat + 2 * (n - 1) / n * s / bw
    assert tree < ring
    assert dev.collective_algorithm("all_reduce", s, n, True) == "tree"
    assert dev.collective_seconds("all_reduce", s, n, True) == pytest.approx(tree)


def test_a_large_message_takes_the_ring():
    dev = load_device_model("a100-80gb")
    for n in (4, 8, 64, 256):
        for kind in ("all_reduce", "broadcast"):
            assert dev.collective_algorithm(kind, 8 * GiB, n, True) == "ring"
    # the crossover grows with the group: a few hundred MiB at 256 ranks
    assert dev.collective_algorithm("all_reduce", 64 * 2**20, 256, True) == "tree"
    assert dev.collective_algorithm("all_reduce", 512 * 2**20, 256, True) == "ring"


def test_the_tree_wins_below_one_size_and_the_ring_above():
    dev = load_device_model("h100-80gb")
    picks = [dev.collective_algorithm("all_reduce", 2**k, 128, True) for k in range(2, 36)]
    first_ring = picks.index("ring")
    assert set(picks[:first_ring]) == {"tree"} and set(picks[first_ring:]) == {"ring"}


def test_only_all_reduce_and_broadcast_have_a_tree():
    assert algorithms("all_reduce") == algorithms("broadcast") == ("ring", "tree")
    for kind in ("reduce_scatter", "all_gather", "all_to_all"):
        assert algorithms(kind) == ("ring",)
    with pytest.raises(ValueError):
        CPU_DEFAULT.collective_seconds("gather", 1, 2, False)


@pytest.mark.parametrize("name", GPUS)
def test_collectives_grow_with_bytes_and_crossing_nodes_is_slower(name):
    dev = load_device_model(name)
    for kind in KINDS:
        for n in (2, 8, 64):
            for crosses in (False, True):
                times = [dev.collective_seconds(kind, 2**k, n, crosses) for k in range(0, 36, 3)]
                assert times == sorted(times) and times[-1] > times[0]
            for k in range(0, 36, 5):
                assert dev.collective_seconds(kind, 2**k, n, True) > \
                    dev.collective_seconds(kind, 2**k, n, False)
        assert dev.p2p_seconds(GiB, True) > dev.p2p_seconds(GiB, False)


def test_reduce_scatter_and_all_gather_are_half_an_all_reduce_on_the_ring():
    dev = load_device_model("a100-80gb")
    ar = dev.algorithm_seconds("all_reduce", "ring", GiB, 8, False)
    assert dev.collective_seconds("reduce_scatter", GiB, 8, False) + \
        dev.collective_seconds("all_gather", GiB, 8, False) == pytest.approx(ar)


def test_compute_is_bound_by_math_or_by_memory():
    dev = load_device_model("h200-141gb")
    entry = json.loads((DEVICES / "h200-141gb.json").read_text())["flops"]["bfloat16"]
    rate = entry["peak"] * entry["efficiency"]
    mem = raw("h200-141gb", "mem_bw")
    launch = raw("h200-141gb", "kernel_overhead")
    assert dev.compute_seconds(1e15, 1e6, torch.bfloat16) == pytest.approx(launch + 1e15 / rate)
    assert dev.compute_seconds(1e6, 1e12, "bfloat16") == pytest.approx(launch + 1e12 / mem)
    assert dev.compute_seconds(0, 0, "bfloat16") == launch > 0  # a kernel is never free
    assert dev.flops_for(DType("bfloat16")) == dev.flops_for(torch.bfloat16) == rate
    # float32 runs on CUDA cores: far slower than the tensor cores
    assert dev.flops_for(torch.float32) < rate / 10
    # a dtype the model does not rate is costed at float32's
    assert dev.flops_for(torch.float64) == dev.flops_for("float32")
    assert dev.flops_for(torch.int64) == dev.flops_for("float32")


def test_the_cpu_default_keeps_the_former_simulator_constants():
    assert CPU_DEFAULT.flops == uniform(5e10) and CPU_DEFAULT.mem_bw == 1e10
    assert CPU_DEFAULT.intra_bw == CPU_DEFAULT.inter_bw == 2e9
    assert CPU_DEFAULT.intra_latency == CPU_DEFAULT.inter_latency == 2e-5


def test_point_to_point_figures_of_their_own_apply_within_a_node():
    dev = DeviceModel("x", uniform(1e9), uniform(1e9), 1e9, 2**30, 2, intra_bw=1e9,
                      intra_latency=1e-5, inter_bw=1e8, inter_latency=1e-4,
                      p2p_latency=2e-3, p2p_bw=5e9)
    assert dev.p2p_seconds(5 * 10**9, False) == pytest.approx(2e-3 + 1.0)
    assert dev.p2p_seconds(10**8, True) == pytest.approx(1e-4 + 1.0)
    assert dev.collective_seconds("all_reduce", 10**9, 2, False) == pytest.approx(2e-5 + 1.0)


def test_a_device_model_is_hashable_data():
    a, b = load_device_model("a100-80gb"), load_device_model("a100-80gb")
    assert a == b and hash(a) == hash(b)
