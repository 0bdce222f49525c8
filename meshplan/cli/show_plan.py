"""Terminal rendering of the `plan` report."""

from __future__ import annotations

from meshplan.driver.job_report import JobReport


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB"


def print_plan(r: JobReport, model: str, size: str, timings: dict, capture_s: float,
               capacity: str = "") -> None:
    """The report; `capacity`: a mixture of experts' bound on its dispatched
    buffers, in words."""
    print(f"{model} {size} on {r.nodes}x{r.devices_per_node} = {r.world} ranks: "
          f"dp={r.dp} tp={r.tp} pp={r.pp} vpp={r.vpp}" + (f" ep={r.ep}" if r.ep > 1 else "")
          + f", schedule {r.schedule}, "
          f"{r.num_microbatches} micro-batches, {r.ops} ops, {r.precision}, "
          f"recompute {r.recompute}" + (f", zero {int(r.zero)}" if r.zero else ""))
    print(f"\n{'stage':>5} {'chunk':>5} {'ops':>6} {'params':>11}  layers")
    for c in r.chunks:
        layers = ", ".join(c["layers"]) or "-"
        print(f"{c['stage']:>5} {c['chunk']:>5} {c['ops']:>6} {_mib(c['param_bytes']):>11}  "
              f"{layers}")
    print(f"\n{'communication':<36} {'count':>6}")
    for key, n in sorted(r.comm_counts.items()):
        print(f"{key.kind + ' over ' + key.axis + ' (' + key.phase + ')':<36} {n:>6}")
    print(f"\nper step: {r.comm_ops_per_step} communication ops, "
          f"{_mib(r.comm_bytes_per_step)} "
          "(logical bytes of the tensors communicated)")
    cats = ("param", "grad", "optimizer", "activation", "temp", "total")
    if r.memory:
        print("\nplanned peak per rank  " + " ".join(f"{c:>11}" for c in cats))
    for m in r.memory:
        print(f"stage {m['stage']} (rank {m['rank']}):".ljust(23)
              + " ".join(f"{_mib(m[c]):>11}" for c in cats))
    if r.experts:
        x = r.experts
        print(f"experts: {x['experts']} per block, {x['per_rank']} per rank (ep {x['ep']}); "
              f"all-to-all {x['all_to_all_ops_per_step']} ops, "
              f"{_mib(x['all_to_all_bytes_per_step'])} per step")
        if x["dispatch_bytes_per_rank"]:
            print(f"dispatched tokens: {_mib(x['dispatch_bytes_per_rank'])} per rank per "
                  f"micro-batch and block, planned at their static size"
                  + (f": {capacity}" if capacity else ""))
        if x.get("routed_worst_bytes_per_rank"):
            print(f"routed rows: up to {_mib(x['routed_worst_bytes_per_rank'])} arrive per "
                  "rank per micro-batch and block (its experts' rows, with their gradients "
                  "in the backward), planned at the worst case: every token of its ep line "
                  "at its experts (dropless)")
    for name, stages in r.shared.items():
        print(f"shared: '{name}' has a copy on stages {stages}; its gradient is all-reduced "
              "across them once per step")
    o = r.optimizer
    if o and o["kind"]:
        wd = o["weight_decay_groups"]
        sched = o["lr_schedule"]
        print(f"optimizer {o['kind']}: weight decay on {wd['decay']['params']} parameters "
              f"({wd['decay']['elements']:,} elements), none on {wd['no_decay']['params']} "
              f"({wd['no_decay']['elements']:,} elements); "
              + (f"clipped to global norm {o['max_grad_norm']:g}; " if o["max_grad_norm"]
                 else "no clipping; ")
              + (f"lr {sched['lr']:g}, {sched['kind']} after {sched['warmup_steps']} warmup "
                 f"steps" if sched else "constant lr"))
    for note in r.notes:
        print(f"note: {note}")
    passes = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in timings.items())
    print(f"capture {capture_s:.2f} s; passes: {passes}; job {r.job_digest[:16]}")
