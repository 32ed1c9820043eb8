"""What a plan records about how its model was priced: the attention kernel of each attention call and the
work no FLOP formula priced (autoplan.tracing.flops), from a trace; and the refusal of a model whose
unpriced work is more than UNPRICED_LIMIT of its FLOPs.

Attention calls and unpriced ops are listed in rows of consecutive alike ones: the same label in modules
that differ only by block index ("model.layers.0-31.self_attn").
"""

from __future__ import annotations

import re
from typing import Any

from autoplan.errors import UsageError
from cost_models.records import ModelTrace, OpRecord

__all__ = ["UNPRICED_LIMIT", "attention_rows", "refuse_unpriced", "trace_notes", "unpriced_rows", "unpriced_share"]

UNPRICED_LIMIT = 0.01  # of the model's counted FLOPs, forward and backward


def _indexless(path: str) -> str:
    return re.sub(r"\.\d+(\.|$)", r".#\1", path, count=1)


def _ranges(numbers: list[int]) -> str:
    runs: list[list[int]] = []
    for n in sorted(set(numbers)):
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _rows(items: list[tuple[str, str]]) -> list[tuple[str, int, str]]:
    """(module, label) in order -> (modules, count, label), one row per label and module alike but for its
    first block index, in first-seen order ("model.layers.0-4,6-10.self_attn")."""
    groups: dict[tuple[str, str], list[str]] = {}
    for module, label in items:
        groups.setdefault((_indexless(module), label), []).append(module)
    rows = []
    for (pattern, label), modules in groups.items():
        indices = [int(m.group(1)) for m in (re.search(r"\.(\d+)(\.|$)", module) for module in modules) if m]
        span = pattern.replace(".#", "." + _ranges(indices), 1) if "#" in pattern and indices else modules[0]
        rows.append((span or "<root>", len(modules), label))
    return rows


def attention_rows(trace: ModelTrace) -> list[dict[str, Any]]:
    """One row per run of alike attention calls: modules, count, kernel, what the call is."""
    rows = []
    for modules, count, label in _rows([(op.module, op.attention) for op in trace.ops if op.attention]):
        kernel, _, detail = label.partition(": ")
        kernel, _, where = kernel.partition(" in ")
        rows.append({"modules": modules, "count": count, "kernel": kernel,
                     "detail": detail + (f"; in {where}" if where else "")})
    return rows


def unpriced_rows(trace: ModelTrace) -> list[dict[str, Any]]:
    """One row per unpriced aten op and run of modules: the op, where, how many calls, the guess of the FLOPs
    of the calls that ran it (at micro-batch 1, forward and backward)."""
    rows = []
    for modules, count, name in _rows([(op.module, name) for op in trace.ops for name in op.unpriced.split(",")
                                       if name]):
        rows.append({"op": name, "modules": modules, "count": count, "flops_guess": 0})
    guesses: dict[tuple[str, str], int] = {}
    for op in trace.ops:
        for name in filter(None, op.unpriced.split(",")):
            key = (name, _indexless(op.module))
            guesses[key] = guesses.get(key, 0) + op.unpriced_flops
    for row in rows:  # the guesses of the calls alike but for block indices
        modules = "" if row["modules"] == "<root>" else row["modules"]
        key = (row["op"], _indexless(re.sub(r"\.[\d,-]+(\.|$)", r".0\1", modules, count=1)))
        row["flops_guess"] = guesses.pop(key, 0)
    return rows


def unpriced_share(trace: ModelTrace) -> float:
    """Unpriced work (the guesses) over the FLOPs counted, forward and backward."""
    counted = sum(op.fwd_flops + op.bwd_flops for op in trace.ops)
    unpriced = sum(op.unpriced_flops for op in trace.ops)
    return unpriced / counted if counted else (1.0 if unpriced else 0.0)


def _named(ops: list[OpRecord]) -> str:
    names = list(dict.fromkeys(name for op in ops for name in op.unpriced.split(",") if name))
    return ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")


def refuse_unpriced(trace: ModelTrace, model_name: str) -> None:
    """UsageError when the trace's unpriced work is more than UNPRICED_LIMIT of its counted FLOPs."""
    share = unpriced_share(trace)
    if share > UNPRICED_LIMIT:
        raise UsageError(f"{model_name} runs ops no FLOP formula prices ({_named(trace.ops)}), about {share:.1%} of "
                         f"its counted FLOPs by a guess (2 x output elements x the contracted size), more than "
                         f"{UNPRICED_LIMIT:.0%}: a plan would take them as free. Give `allow_unpriced` to plan anyway "
                         "(the plan and the report list them)")


def trace_notes(pair, pricing, allow_unpriced: bool) -> dict[str, Any]:
    """The fields of the plan's ModelRef that say how the model was priced."""
    return {"attention": attention_rows(pair.at_1), "attention_request": pricing.attention,
            "unpriced": unpriced_rows(pair.at_1), "allow_unpriced": allow_unpriced,
            "capacity_factor": pricing.capacity_factor}
