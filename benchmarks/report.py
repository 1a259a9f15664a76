"""Output of the benchmarks: the one table, the flat summary of a row, JSON and matplotlib plots."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from fractions import Fraction

import torch

__all__ = ["summarize", "print_table", "write_outputs"]


def _mb(x) -> str:
    return "-" if x is None else f"{x / 2**20:.2f}"


def summarize(row: dict) -> dict:
    """One flat line of a row for the table: times, ratio, bytes vs the paper's formula and the
    plan's explained difference, memory vs formula."""
    a, b, th = row.get("a", {}), row.get("b", {}), row.get("theory", {})
    out = {"name": row["name"], "a": a.get("label", "error"), "b": b.get("label", "error")}
    out["a_ms"] = a["median_s"] * 1e3 if "median_s" in a else None
    out["b_ms"] = b["median_s"] * 1e3 if "median_s" in b else None
    out["ratio"] = row.get("ratio")
    out["cpu_ratio"] = row.get("cpu_ratio")
    out["floor_ratio"] = row.get("floor_ratio")  # plain model, no communication, over PyTorch's side
    rr = row.get("round_ratios") or []
    out["ratio_spread"] = (min(rr), max(rr)) if rr else None
    out["ratio_ci"] = row.get("ratio_ci")
    both = "faults_median" in a and "faults_median" in b
    out["faults"] = (max(a["faults_median"]), max(b["faults_median"])) if both else None  # the rank with most
    ranks = a.get("ranks") or []
    if ranks and "comm" in ranks[0]:
        out["a_bytes"] = ranks[0]["comm"]["bytes"]
        out["a_calls"] = ranks[0]["comm"]["calls"]
        out["a_backend_calls"] = ranks[0]["backend"]["calls"]
    branks = b.get("ranks") or []
    if branks and "comm" in branks[0]:
        out["b_bytes"] = branks[0]["comm"]["bytes"]
        out["b_calls"] = branks[0]["comm"]["calls"]
    # theory = the paper's closed formula; "plan - paper" = the plan's deliberate differences, itemized
    out["paper_bytes"] = th.get("bytes_rank0")
    out["plan_minus_paper"] = th.get("plan_minus_paper")
    out["plan_minus_paper_items"] = th.get("plan_minus_paper_items") or []
    out["unexplained_bytes"] = th.get("unexplained_bytes")
    if out.get("a_bytes") is not None and out["paper_bytes"] is not None:
        out["bytes_over_paper"] = out["a_bytes"] / out["paper_bytes"] if out["paper_bytes"] else float(out["a_bytes"] == 0)
        out["counted_matches_account"] = _counted_matches(ranks[0]["comm"], th)
        # the plan's own cost model (plan.comm_per_step): cost.py sums floats, under 100 terms here, so
        # its relative rounding error is below 100 * 2**-53 ~ 1e-14; 1e-12 leaves room and no more
        if th.get("plan_bytes") is not None:
            out["counted_matches_plan"] = abs(out["a_bytes"] - th["plan_bytes"]) <= 1e-12 * max(1.0, th["plan_bytes"])
    if ranks and "state_bytes" in ranks[0]:
        out["a_state"] = ranks[0]["state_bytes"]["total"]
    if branks and "state_bytes" in branks[0]:
        out["b_state"] = branks[0]["state_bytes"]["total"]
    out["formula_state"] = th.get("state_formula")
    out["plan_state"] = th.get("state_plan")
    if out.get("a_state") and out.get("formula_state"):
        out["state_over_formula"] = out["a_state"] / out["formula_state"]
    for key, side in (("a", ranks), ("b", branks)):
        mem = side[0].get("memory", {}) if side else {}
        out[f"{key}_act"] = mem.get("activation")
        out[f"{key}_peak"] = mem.get("peak_total")
    out["errors"] = {k: row[k]["error"] for k in ("a", "b") if "error" in row.get(k, {})}
    return out


def _counted_matches(comm: dict, th: dict) -> bool:
    """Rank 0's counted bytes equal the paper's formula plus the plan's itemized differences
    (exactly, as fractions, when both are recorded as such)."""
    if "exact_bytes" in comm and "expected_exact" in th:
        return Fraction(comm["exact_bytes"]) == Fraction(th["expected_exact"])
    return comm["bytes"] == th["bytes_rank0"] + (th.get("plan_minus_paper") or 0)


def print_table(rows: list[dict], title: str = "") -> str:
    """The one table: per comparison, median step times, ratio (with its bootstrap 95% confidence
    interval and its per-round spread; ``faults/step``: minor page faults a step, the median of the
    rank with most, shardlib / torch), bytes
    per step counted against the paper's formula (``paper MB``; ``b/pap`` = counted / paper) and
    the plan's deliberate difference from it (``pl-pap MB``, each item's reason on the line below
    the row), and rank 0's model-state and activation memory."""
    lines = []
    if title:
        lines.append(title)
    head = (f"{'comparison':<38} {'shardlib ms':>11} {'torch ms':>9} {'ratio':>6} {'95% CI':>11} {'spread':>11} "
            f"{'faults/step':>11} {'cpu r':>5} {'floor':>5} "
            f"{'bytes/step MB':>13} {'paper MB':>9} {'pl-pap MB':>9} {'b/pap':>5} {'calls':>5} {'tcalls':>6} "
            f"{'state MB':>8} {'formula':>8} {'s/f':>6} {'torch st':>8} {'act MB':>6} {'t act':>6} {'peak MB':>7} {'t peak':>6}")
    lines.append(head)
    lines.append("-" * len(head))
    for row in rows:
        s = summarize(row)
        sp, ci, flt = s["ratio_spread"], s["ratio_ci"], s["faults"]
        lines.append(
            f"{s['name']:<38} {_f(s['a_ms'], 11, 1)} {_f(s['b_ms'], 9, 1)} {_f(s['ratio'], 6, 2)} "
            f"{(f'{ci[0]:.3f}-{ci[1]:.3f}' if ci else '-'):>11} {(f'{sp[0]:.2f}-{sp[1]:.2f}' if sp else '-'):>11} "
            f"{(f'{flt[0]:.0f}/{flt[1]:.0f}' if flt else '-'):>11} {_f(s.get('cpu_ratio'), 5, 2)} "
            f"{_f(s.get('floor_ratio'), 5, 2)} "
            f"{_mb(s.get('a_bytes')):>13} {_mb(s.get('paper_bytes')):>9} {_mb(s.get('plan_minus_paper')):>9} "
            f"{_f(s.get('bytes_over_paper'), 5, 3)} {_i(s.get('a_calls'), 5)} {_i(s.get('b_calls'), 6)} "
            f"{_mb(s.get('a_state')):>8} {_mb(s.get('formula_state')):>8} {_f(s.get('state_over_formula'), 6, 4)} "
            f"{_mb(s.get('b_state')):>8} {_mb(s.get('a_act')):>6} {_mb(s.get('b_act')):>6} {_mb(s.get('a_peak')):>7} {_mb(s.get('b_peak')):>6}")
        for why, nbytes in s["plan_minus_paper_items"]:
            lines.append(f"    plan - paper {nbytes / 2**20:+.3f} MB: {why}")
        if s.get("unexplained_bytes") and abs(s["unexplained_bytes"]) > 1e-9 * max(1.0, abs(s["paper_bytes"] or 0)):
            lines.append(f"    the plan's cost model (plan.comm_per_step) predicts {s['unexplained_bytes'] / 2**20:+.4f} MB "
                         "beyond paper + items")
        if s.get("counted_matches_account") is False:
            lines.append("    counted bytes != paper + (plan - paper): the account above is incomplete or the code sends more")
        for k, msg in s["errors"].items():
            lines.append(f"    {'shardlib' if k == 'a' else 'torch'} side failed: {msg.splitlines()[0][:200]}")
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def _f(x, w, d) -> str:
    return f"{'-':>{w}}" if x is None else f"{x:>{w}.{d}f}"


def _i(x, w) -> str:
    return f"{'-':>{w}}" if x is None else f"{x:>{w}d}"


def write_outputs(name: str, result: dict, out_dir: str, plots: bool = True) -> dict[str, str]:
    """Write ``<out_dir>/<name>.json`` and the plots ``<name>_time.png`` (median step time per
    comparison with the interquartile range) and ``<name>_bytes.png`` (bytes counted vs the
    paper's formula)."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": os.path.join(out_dir, f"{name}.json")}
    with open(paths["json"], "w") as f:
        json.dump(result, f, indent=1, default=_json_default)
    if not plots:
        return paths
    try:
        paths.update(_plots(name, result["rows"], out_dir))
    except Exception as exc:  # noqa: BLE001 - a plot failing must not lose the numbers
        paths["plot_error"] = f"{type(exc).__name__}: {exc}"
    return paths


def _json_default(o):
    if isinstance(o, Fraction):
        return float(o)
    if isinstance(o, torch.Tensor):
        return o.tolist()
    if hasattr(o, "__dataclass_fields__"):
        return asdict(o)
    return str(o)


def _plots(name: str, rows: list[dict], out_dir: str) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = {}
    labels = [r["name"] for r in rows]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(5, 1.4 * len(rows)), 3.6))
    for off, key, color in ((-0.2, "a", "tab:blue"), (0.2, "b", "tab:orange")):
        med = [r[key]["median_s"] * 1e3 if "median_s" in r.get(key, {}) else 0 for r in rows]
        err = [r[key]["iqr_s"] * 1e3 / 2 if "iqr_s" in r.get(key, {}) else 0 for r in rows]
        ax.bar([x + off for x in xs], med, 0.4, yerr=err, color=color, label="shardlib" if key == "a" else "PyTorch")
    for x, r in zip(xs, rows):
        if r.get("ratio"):
            top = max(r["a"]["median_s"], r["b"]["median_s"]) * 1e3
            ax.text(x, top * 1.02, f"{r['ratio']:.2f}", ha="center", fontsize=8)
    ax.set_xticks(list(xs), labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("median step time (ms)")
    ax.set_title(f"{name}: shardlib vs PyTorch (ratio above bars)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths["time_png"] = os.path.join(out_dir, f"{name}_time.png")
    fig.savefig(paths["time_png"], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(max(5, 1.4 * len(rows)), 3.6))
    counted = [summarize(r).get("a_bytes") or 0 for r in rows]
    torch_b = [summarize(r).get("b_bytes") or 0 for r in rows]
    theory = [r.get("theory", {}).get("bytes_rank0") or 0 for r in rows]  # the paper's formula
    ax.bar([x - 0.27 for x in xs], [c / 2**20 for c in counted], 0.27, label="shardlib counted")
    ax.bar(list(xs), [t / 2**20 for t in theory], 0.27, label="paper formula")
    ax.bar([x + 0.27 for x in xs], [c / 2**20 for c in torch_b], 0.27, label="PyTorch (dispatcher)")
    ax.set_xticks(list(xs), labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("MiB per rank per step")
    ax.set_title(f"{name}: logical bytes communicated per step (rank 0)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths["bytes_png"] = os.path.join(out_dir, f"{name}_bytes.png")
    fig.savefig(paths["bytes_png"], dpi=110)
    plt.close(fig)
    return paths
