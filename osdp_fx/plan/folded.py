"""A plan view that reads at scale: repeated blocks folded into one line per distinct pattern.

A GPT-2 XL plan has 580 parameter groups, 48 blocks of 12 that are the same but for their index.
:func:`fold` groups parameter names into blocks: the block of ``model.transformer.h.12.attn.
c_attn.weight`` is ``model.transformer.h.12`` (the first all-digit name component whose
container holds two or more indices), and blocks of one container whose members match (same
relative names, shapes, dtypes, strategies, notes, bytes per rank and collectives: a
:func:`param_signature`) make one pattern, printed as one line ``h.0-47`` (under the prefix
common to every name, ``model.transformer.``; indices need not be consecutive:
``h.0-30,32``). A container whose blocks all differ (an MLP ``layers.0/1/2`` of different
widths) folds nothing: its parameters keep a line each.

:func:`folded_table` prints a Plan that way, with totals and the predicted peak memory by
category, in lines under ``width`` columns; ``Plan.table()`` (``str(plan)``) keeps the full
per-group view. This module imports no torch: it reads a Plan through its attributes and
methods (``plan`` imports torch, so it is imported here for type checking only).
"""

from __future__ import annotations

import dataclasses
import textwrap
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any

from tabulate import tabulate

from ..units import format_bytes
from .table import params_line

if TYPE_CHECKING:
    from .plan import ParamPlan, Plan

__all__ = ["Fold", "common_prefix", "fold", "folded_table", "format_indices", "param_signature"]

NAME_WIDTH = 40
"""Names are cut to this many characters (losing their start, keeping their tail) before
strategy lists are abbreviated, when a table is too wide; the prefix common to every name is
dropped first (:func:`common_prefix`)."""
_SHORT = {"replicate": "rep", "shard_grad_op": "sgo", "full_shard": "fs",
          "hybrid_shard": "hs", "hierarchical": "hier"}
"""Strategy abbreviations, used when a block's strategy list would be too long."""
STRATEGY_WIDTH = 30
"""Longest strategy list written with full names."""


@dataclasses.dataclass(frozen=True)
class Fold:
    """One line of the folded view: a parameter, or blocks of one pattern."""

    label: str
    """The parameter's name, or the container and block indices, e.g. 'h.0-47'."""
    blocks: tuple[tuple[int, ...], ...]
    """Positions (in the input) of each block's members, block by block; one block of one
    position for a single parameter."""
    indices: tuple[int, ...] = ()
    """Block indices folded (empty for a single parameter)."""

    @property
    def folded(self) -> bool:
        """Whether the line stands for two or more blocks."""
        return len(self.blocks) > 1


def format_indices(indices: Sequence[int], *, max_runs: int = 6) -> str:
    """'0-47', '0-30,32,34-47'; more than ``max_runs`` runs are cut: '0,2,4,6,8,...,94'."""
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    parts = [f"{a}-{b}" if b > a else str(a) for a, b in runs]
    if len(parts) > max_runs:
        parts = parts[:max_runs - 1] + ["...", parts[-1]]
    return ",".join(parts)


def _block_position(parts: list[str], containers: dict[tuple[str, ...], set[str]]) -> int | None:
    for i, part in enumerate(parts):
        if part.isdigit() and len(containers.get(tuple(parts[:i]), ())) > 1:
            return i
    return None


def fold(items: Sequence[tuple[str, Hashable]]) -> list[Fold]:
    """Fold ``(name, signature)`` pairs (in model order) into lines: blocks of one container with
    equal member signatures become one :class:`Fold`; a pattern of one block and every name
    outside blocks get one line per name. Lines are in the order of their first member."""
    split = [name.split(".") for name, _ in items]
    containers: dict[tuple[str, ...], set[str]] = {}
    for parts in split:
        for i, part in enumerate(parts):
            if part.isdigit():
                containers.setdefault(tuple(parts[:i]), set()).add(part)
    # container -> block index -> positions of its members
    blocks: dict[tuple[str, ...], dict[int, list[int]]] = {}
    singles: list[int] = []
    for pos, parts in enumerate(split):
        at = _block_position(parts, containers)
        if at is None:
            singles.append(pos)
        else:
            blocks.setdefault(tuple(parts[:at]), {}).setdefault(int(parts[at]), []).append(pos)
    lines: list[tuple[int, Fold]] = [(pos, Fold(items[pos][0], ((pos,),))) for pos in singles]
    for container, members in blocks.items():
        depth = len(container) + 1
        patterns: dict[tuple[Any, ...], list[int]] = {}
        for index, positions in members.items():
            key = tuple((".".join(split[p][depth:]), items[p][1]) for p in positions)
            patterns.setdefault(key, []).append(index)
        for indices in patterns.values():
            if len(indices) == 1:  # nothing to fold: one line per member
                lines += [(p, Fold(items[p][0], ((p,),))) for p in members[indices[0]]]
                continue
            label = ".".join((*container, format_indices(indices)))
            fold_ = Fold(label, tuple(tuple(members[i]) for i in indices), tuple(indices))
            lines.append((min(members[indices[0]]), fold_))
    return [f for _, f in sorted(lines, key=lambda x: x[0])]


def param_signature(plan: Plan, p: ParamPlan) -> tuple[Any, ...]:
    """What two blocks' members must share to fold: everything but names and times (tied
    names are compared with their indices blanked)."""
    fwd, bwd = plan.collectives_of(p)
    aliases = tuple(".".join("#" if c.isdigit() else c for c in a.split("."))
                    for a in p.aliases)
    return (tuple(p.shape), p.dtype, p.strategy, p.note, p.regathered, aliases,
            p.shard_bytes(plan.world_size, plan.ranks_per_node),
            tuple(map(str, fwd)), tuple(map(str, bwd)))


def common_prefix(names: Sequence[str]) -> str:
    """The leading components every name shares, with their dot ('base_model.model.' for a peft
    model's parameters), never a name's last component nor the container of an index (what
    is left never starts with a block index: 'layers.0.weight' keeps 'layers.'); '' when there
    is none."""
    parents = [name.split(".")[:-1] for name in names]
    if not parents:
        return ""
    common: list[str] = []
    for parts in zip(*parents):
        if any(part != parts[0] for part in parts):
            break
        common.append(parts[0])
    while common and any(name.split(".")[len(common)].isdigit() for name in names):
        common.pop()
    return "".join(part + "." for part in common)


def _short_name(name: str, width: int = NAME_WIDTH) -> str:
    """``name``, or '...' and its last ``width - 3`` characters when it is longer than ``width``
    (the tail tells a parameter from its neighbours)."""
    if len(name) <= width:
        return name
    return "..." + name[len(name) - (width - 3):]


def _count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(int(n))


def _strategies(members: Sequence[ParamPlan], order: Sequence[str], *,
                short: bool) -> str:
    """'8 replicate, 4 hybrid_shard' (``short``: '8 rep, 4 hs') for one block's members,
    strategies in ``order``."""
    counts = {s: sum(p.strategy == s for p in members) for s in order}
    return ", ".join(f"{n} {_SHORT.get(s, s) if short else s}" for s, n in counts.items() if n)


def _ms(values: list[float | None], blocks: int) -> str:
    if any(v is None for v in values):
        return "-"
    return f"{sum(v for v in values if v is not None) * 1e3 / blocks:.3f}"


def folded_table(plan: Plan, *, width: int = 120) -> str:
    """The plan with repeated blocks folded (module docstring), in lines under ``width``: names
    lose the prefix common to all of them (the header says which), and a table too wide
    abbreviates its strategy lists, then cuts long names at their start."""
    params = list(plan.params)
    prefix = common_prefix([p.name for p in params])

    def local(name: str) -> str:
        return name[len(prefix):] if name.startswith(prefix) else name

    order = list(plan.counts())
    predicted = plan.prediction is not None
    lines_, tied = [], []
    for f in fold([(p.name, param_signature(plan, p)) for p in params]):
        members = [params[i] for i in f.blocks[0]]
        everyone = [params[i] for block in f.blocks for i in block]
        p = members[0]
        if f.folded:
            strategy = {short: _strategies(members, order, short=short)
                        for short in (False, True)}
        else:
            strategy = dict.fromkeys((False, True), p.strategy + (f" ({p.note})" if p.note else ""))
            if p.aliases:
                tied.append(f"{local(p.name)} = {', '.join(map(local, p.aliases))}")
        moved = sum(st.nbytes for q in members for st in sum(plan.collectives_of(q), []))
        row = [str(len(f.blocks)) if f.folded else "", _count(sum(q.numel for q in members)),
               format_bytes(sum(q.shard_bytes(plan.world_size, plan.ranks_per_node)
                                for q in members)),
               format_bytes(moved) if moved else "-"]
        if predicted:
            row += [_ms([q.compute_s for q in everyone], len(f.blocks)),
                    _ms([q.comm_s for q in everyone], len(f.blocks))]
        label = local(f.label) + ("*" if not f.folded and p.aliases else "")
        lines_.append((label, strategy, row))
    head = ["parameters", "x", "strategy", "numel", "per rank", "moved"]
    if predicted:
        head += ["compute", "comm"]

    def render(name_width: int, short: bool) -> str:
        rows = [[_short_name(label, name_width), row[0],
                 strategy[short or len(strategy[False]) > STRATEGY_WIDTH], *row[1:]]
                for label, strategy, row in lines_]
        return tabulate(rows, headers=head, disable_numparse=True)

    # names as long as they are, down to NAME_WIDTH, then strategies abbreviated, then names
    # down to 16 characters, until the table fits
    name_width, short = max([NAME_WIDTH, *(len(label) for label, _, _ in lines_)]), False
    table = render(name_width, short)
    while max(map(len, table.splitlines())) >= width and (not short or name_width > 16):
        excess = max(map(len, table.splitlines())) - width + 1
        if name_width > NAME_WIDTH:
            name_width = max(NAME_WIDTH, name_width - excess)
        elif not short:
            short = True
        else:
            name_width = max(16, name_width - excess)
        table = render(name_width, short)
    abbreviated = any(strategy[False] != strategy[short or len(strategy[False]) >
                                                  STRATEGY_WIDTH]
                      for _, strategy, _ in lines_)
    lines = _header(plan, width, prefix)
    lines.append(table)
    notes = ["x: blocks folded into the line (numel, bytes and times are per block); moved: "
             "bytes of collectives per step" + ("; compute, comm: predicted ms per step"
                                                if predicted else "")]
    if abbreviated:
        notes.append("strategies: " + ", ".join(f"{v} = {k}" for k, v in _SHORT.items()))
    if tied:
        notes.append("* tied: " + "; ".join(tied))
    notes += _footer(plan)
    for note in notes:
        lines += textwrap.wrap(note, width=width - 1, subsequent_indent="  ",
                               break_on_hyphens=False)
    return "\n".join(lines)


def _header(plan: Plan, width: int, prefix: str = "") -> list[str]:
    mesh = (f" = {plan.num_nodes} nodes x {plan.ranks_per_node} ranks"
            if plan.num_nodes > 1 else "")
    counts = ", ".join(f"{n} {s}" for s, n in plan.counts().items() if n)
    text = (f"Plan for world size {plan.world_size}{mesh}: {len(plan.params)} parameter groups "
            f"({counts}); source: {plan.source or 'user'}; hash {plan.hash()}")
    if plan.splits:
        text += f"; {len(plan.splits)} linears split"
    if plan.param_dtype:
        text += f"; compute in {plan.param_dtype}, reduce in {plan.reduce_dtype}"
    text += (f"; prefetch {plan.schedule.prefetch}, buckets {format_bytes(plan.schedule.gather_bucket_bytes)} "
             f"(gather) / {format_bytes(plan.schedule.reduce_bucket_bytes)} (all-reduce), "
             f"{plan.schedule.scatters_in_flight} in flight")
    if prefix:
        text += f"; names under {prefix}"
    return textwrap.wrap(text, width=width - 1, subsequent_indent="  ")


def _footer(plan: Plan) -> list[str]:
    lines = [params_line(plan)]
    if plan.num_nodes > 1:
        by_link = {"inside nodes": 0, "across nodes": 0}
        for p in plan.params:
            fwd, bwd = plan.collectives_of(p)
            for st in fwd + bwd:
                by_link["across nodes" if st.spans_nodes(plan.num_nodes)
                        else "inside nodes"] += st.nbytes
        lines.append("collective buffers per step: "
                     + ", ".join(f"{format_bytes(b)} {k}" for k, b in by_link.items()))
    pr = plan.prediction
    if pr is not None:
        lines.append(
            f"predicted per rank ({pr.optimizer}, batch {pr.batch_size}"
            + (f", figures {pr.figures}" if pr.figures else "") + "): step "
            f"{pr.step_time_s * 1e3:.2f} ms ({pr.time_parts()}); peak memory "
            f"{format_bytes(pr.peak_memory_bytes)} at {pr.peak_at}")
        if pr.peak_by_category:
            lines.append(f"peak memory by category: {pr.breakdown()}")
    return lines
