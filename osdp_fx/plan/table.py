"""How a :class:`~osdp_fx.plan.plan.Plan` prints: the table ``print(plan)`` shows."""

from __future__ import annotations

from typing import Any

from tabulate import tabulate

from ..units import format_bytes


def params_line(plan: Any) -> str:
    """'parameters per rank: ...' (of them frozen, where any is), and the memory limit."""
    frozen = plan.persistent_param_bytes(frozen_only=True)
    return (f"parameters per rank: {format_bytes(plan.persistent_param_bytes())}"
            + (f" ({format_bytes(frozen)} of them frozen)" if frozen else "")
            + (f"; memory limit {format_bytes(plan.memory_limit_bytes)}"
               if plan.memory_limit_bytes is not None else ""))


def plan_table(plan: Any) -> str:
    """A Plan printed: its header, one row per parameter group, its predictions (``plan`` is
    untyped here: ``plan/plan.py`` prints itself with this module, which so imports nothing of it)."""
    rows = []
    predicted = plan.prediction is not None
    by_link = {"intra": 0, "inter": 0}
    for p in plan.params:
        fwd, bwd = plan.collectives_of(p)
        for stage in fwd + bwd:
            by_link["inter" if stage.spans_nodes(plan.num_nodes) else "intra"] += stage.nbytes
        row = [
            p.name + (f" (= {', '.join(p.aliases)})" if p.aliases else ""),
            "x".join(map(str, p.shape)) or "()",
            p.strategy + (f" ({p.note})" if p.note else ""),
            format_bytes(p.shard_bytes(plan.world_size, plan.ranks_per_node)),
            describe_collectives(fwd),
            describe_collectives(bwd),
        ]
        if predicted:
            row += [_ms(p.compute_s), _ms(p.comm_s)]
        rows.append(row)
    head = ["parameter", "shape", "strategy", "param bytes/rank", "forward", "backward"]
    if predicted:
        head += ["compute ms", "comm ms"]
    counts = ", ".join(f"{n} {s}" for s, n in plan.counts().items() if n)
    split = "; split: " + ", ".join(f"{n} in {k}" for n, k in plan.splits) if plan.splits else ""
    if plan.param_dtype:
        split += f"; compute in {plan.param_dtype}, reduce in {plan.reduce_dtype}"
    split += (f"; prefetch {plan.schedule.prefetch}, gather buckets {format_bytes(plan.schedule.gather_bucket_bytes)}"
              f", all-reduce buckets {format_bytes(plan.schedule.reduce_bucket_bytes)}"
              f", gradient collectives in flight {plan.schedule.scatters_in_flight}")
    if plan.recompute:
        split += "; recompute: " + ", ".join(f"{r} {p}" for r, p in plan.recompute)
    mesh = (f" = {plan.num_nodes} nodes x {plan.ranks_per_node} ranks"
            if plan.num_nodes > 1 else "")
    lines = [
        f"Plan for world size {plan.world_size}{mesh} ({counts}; source: "
        f"{plan.source or 'user'}; hash {plan.hash()}{split})",
        tabulate(rows, headers=head, disable_numparse=True),
        params_line(plan),
    ]
    if plan.num_nodes > 1:
        lines.append(
            f"collective buffers per step: {format_bytes(by_link['intra'])} inside nodes, "
            f"{format_bytes(by_link['inter'])} across nodes ([intra]: a node's ranks, "
            "[inter]: one rank per node, unmarked: all ranks)")
    if plan.prediction is not None:
        pr = plan.prediction
        lines.append(
            f"predicted per rank ({pr.optimizer}, batch {pr.batch_size}"
            + (f", figures {pr.figures}" if pr.figures else "")
            + (f" x sequence {pr.seq_len}" if pr.seq_len else "")
            + (f", memory of {pr.grad_accumulation} micro-batches per step with no_sync"
               if pr.grad_accumulation > 1 else "") + "): step "
            f"{pr.step_time_s * 1e3:.2f} ms ({pr.time_parts()}); peak memory "
            f"{format_bytes(pr.peak_memory_bytes)} at {pr.peak_at}"
        )
        if pr.peak_by_category:
            first = (f"; first step {format_bytes(pr.first_step_peak_bytes)} (before the "
                     "optimizer state exists)" if pr.first_step_peak_bytes is not None else "")
            lines.append(f"peak memory by category: {pr.breakdown()}{first}")
        if pr.regions:
            lines.append(_region_table(pr.regions))
    if plan.measured:
        kept = plan.hash()
        lines.append("autotuned (step median, peak; predicted in brackets): " + ", ".join(
            f"{t.hash} {t.measured_step_s * 1e3:.1f} ms ({t.predicted_step_s * 1e3:.1f}), "
            f"{format_bytes(t.measured_peak_bytes)} ({format_bytes(t.predicted_peak_bytes)})"
            f"{'' if t.role == 'alternative' else ', ' + t.role}"
            f"{', in force' if t.hash == kept else ''}" for t in plan.measured)
            + "; kept: the fastest measured under the memory limit, when it beats the predicted "
            "best by more than the timing's noise")
    return "\n".join(lines)


def _region_table(regions: tuple[Any, ...]) -> str:
    rows = [[r.region, r.policy, ", ".join(r.saved_ops) or "inputs only",
             ", ".join(r.recomputed_ops), format_bytes(r.kept_bytes),
             format_bytes(r.recomputed_bytes), _ms(r.recompute_s)] for r in regions]
    return tabulate(rows, headers=["recomputed region", "policy", "saved", "recomputed",
                                   "kept fwd->bwd", "re-created in bwd", "recompute ms"],
                    disable_numparse=True, maxcolwidths=[None, None, 40, 40, None, None, None])


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3f}"


def describe_collectives(stages: list[Any]) -> str:
    """Collective stages as one line, "-" for none."""
    return ", ".join(map(str, stages)) or "-"
