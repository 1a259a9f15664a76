"""The side-by-side benchmarks: their theory formulas against hand-computed values (tier 0), and
a smoke run at a tiny size: the harness runs both sides, the JSON has its fields, counted bytes
equal the paper's formula plus the plan's itemized differences exactly, model state equals the
plan and the ZeRO formula, and both sides see the same model and data (equal first losses). No
timing is asserted."""

import importlib.util
import json
import math
import random
from fractions import Fraction

import pytest
import torch

import shardlib
from benchmarks import data_parallel, overhead, pipeline, tensor_parallel
from benchmarks.common import FULL, SMOKE, Settings, ratio_ci
from benchmarks.report import print_table, summarize, write_outputs
from benchmarks.run import targets
from benchmarks.theory import megatron_paper_bytes, tp_plan_differences, zero_paper_bytes, zero_plan_differences
from shardlib import P
from shardlib.mesh import AbstractMesh
from shardlib.models import GPT, GPTConfig, tp_specs
from shardlib.testing import run_on

SETTINGS = Settings(**SMOKE)

# The smoke GPT (SIZES["tiny"]): 2 layers, width 32, block 16, vocabulary 256, tied head; its
# parameters counted by hand: wte 256*32 + wpe 16*32 + ln_f 2*32, and per block two LayerNorms
# (2*32 each), q/k/v/o (32*32 + 32 each), fc_in (32*128 + 128) and fc_out (128*32 + 32).
BLOCK = 2 * 64 + 4 * (32 * 32 + 32) + (32 * 128 + 128) + (128 * 32 + 32)
PSI = 256 * 32 + 16 * 32 + 64 + 2 * BLOCK  # 34176
TOKENS = SETTINGS.batch * SETTINGS.seq  # 32: one micro-batch on a tensor rank


def _tiny(**config):
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=16, **config))


def _plan_bytes(plan, **kw):
    return sum(b for _, b in plan.comm_per_step(**kw).values())


def test_zero_paper_formula_by_hand():
    """Regression (issue 15): ZeRO's section-7 figures on the model's own parameter count."""
    assert _tiny().num_params() == PSI == 34176
    # N = 2, fp32: 2 psi (N-1)/N at stages 0-2 (stage 1/2: reduce-scatter + all-gather), 3 psi (N-1)/N at 3
    assert zero_paper_bytes(0, PSI, 2) == zero_paper_bytes(1, PSI, 2) == zero_paper_bytes(2, PSI, 2) == 136704
    assert zero_paper_bytes(3, PSI, 2) == 205056
    # N = 4, bf16 gathers, fp32 reduce-scatter: 2 * PSI * 2 * 3/4 + PSI * 4 * 3/4
    assert zero_paper_bytes(3, PSI, 4, gather_itemsize=2, reduce_itemsize=4) == 102528 + 102528
    assert zero_paper_bytes(1, PSI, 4, gather_itemsize=2, reduce_itemsize=4) == 51264 + 102528
    assert zero_paper_bytes(2, PSI, 1) == 0
    with pytest.raises(ValueError, match="stage must be 0-3, got 4"):
        zero_paper_bytes(4, PSI, 2)


def test_zero_plan_differences_padding_and_kept_chunk():
    """The plan's deliberate differences from the paper, by hand: on 5 ranks the tied embedding's
    chunk of 256 x 32 = 8192 elements is padded by 3 (8195 = 5 * 1639) and the chunk of the rest,
    25984 elements, by 1 (25985 = 5 * 5197); at stage 3 the embedding's chunk, as small as the
    tensor, stays gathered from forward to backward (no backward all-gather). Paper + items
    equals the plan's own cost model (:mod:`shardlib.cost`, another code path)."""
    mesh = AbstractMesh({"dp": 5})
    for stage in range(4):
        plan = shardlib.plan(_tiny(), mesh, zero_stage=stage)
        assert [(c.numel, c.padded_numel) for c in plan.chunks] == [(8192, 8195), (25984, 25985)]
        items = dict(zero_plan_differences(plan))
        pad = next(b for why, b in items.items() if why.startswith("padding"))
        # 4 padded elements x 4 bytes x (N-1)/N per pass: stage 0 all-reduce (2 passes), 1-2 RS + AG,
        # 3: the embedding's chunk one gather (kept) + RS, the other chunk three passes
        passes = [(2, 2), (2, 2), (2, 2), (2, 3)][stage]
        assert pad == Fraction((3 * passes[0] + 1 * passes[1]) * 4 * 4, 5)
        kept = [b for why, b in items.items() if why.startswith("kept gathered")]
        assert kept == ([-Fraction(8192 * 4 * 4, 5)] if stage == 3 else [])  # 4 bytes x (N-1)/N of the tensor
        assert float(zero_paper_bytes(stage, PSI, 5) + sum(items.values())) == pytest.approx(_plan_bytes(plan), rel=1e-12)


def test_zero3_at_10m_counts_0997_of_the_paper():
    """At 10.8M parameters the plan's ZeRO-3 bytes are 0.997 of 3 psi: the chunk kept gathered
    from forward to backward holds the tied embedding alone (256 x 384 elements). It was 0.872
    with 4 Mi-element chunks filled in parameter order (wte, wpe, blocks 0-1 and part of 2 kept)."""
    cfg = Settings(**FULL).gpt_config()
    with torch.device("meta"):
        model = GPT(cfg)
    c = cfg.n_embd  # 384
    block = 2 * 2 * c + 4 * (c * c + c) + (c * 4 * c + 4 * c) + (4 * c * c + c)
    psi = 256 * c + cfg.block_size * c + 2 * c + cfg.n_layer * block
    kept = 256 * c
    assert (model.num_params(), kept) == (psi, 98304) == (10795008, 98304)
    plan = shardlib.plan(model, AbstractMesh({"dp": 2}), zero_stage=3)
    assert zero_plan_differences(plan) == [(zero_plan_differences(plan)[0][0], -Fraction(kept * 4, 2))]
    ratio = (zero_paper_bytes(3, psi, 2) - Fraction(kept * 4, 2)) / zero_paper_bytes(3, psi, 2)
    assert round(float(ratio), 3) == 0.997 and float(ratio) == pytest.approx(_plan_bytes(plan) / (3 * psi * 4 / 2))


def test_megatron_paper_formula_by_hand():
    """Megatron's 4 all-reduces of (b s, h) per layer per micro-batch, b s = 32, h = 32, fp32:
    an all-reduce of 32*32*4 = 4096 bytes costs 2 * 4096 * (t-1)/t per rank."""
    assert megatron_paper_bytes(2, 32, 32, 2) == 2 * 4 * 4096
    assert megatron_paper_bytes(2, 32, 32, 4) == 2 * 4 * 6144
    # + the vocab-parallel embedding's forward all-reduce, the head input's backward all-reduce and
    # the fused loss's three all-reduces of b s fp32 values (2 * 32 * 4 * 1/2 = 128 bytes each)
    assert megatron_paper_bytes(2, 32, 32, 2, vocab_parallel_embedding=True, parallel_head=True) == 32768 + 4096 + 4096 + 384
    assert megatron_paper_bytes(2, 32, 32, 1) == 0


def test_tp_plan_differences_by_hand():
    """Sequence parallelism's region ends and gradient sums, and a split head's logits gather,
    by hand (b s = 32, h = 32, t = 2, fp32); paper + items equals the plan's own cost model."""
    mesh = AbstractMesh({"tp": 2})
    plan = shardlib.plan(_tiny(), mesh, tp_specs("tp"))
    assert tp_plan_differences(plan, TOKENS) == []
    assert float(megatron_paper_bytes(2, TOKENS, 32, 2)) == _plan_bytes(plan, tokens=TOKENS) == 32768
    plan = shardlib.plan(_tiny(), mesh, tp_specs("tp"), sequence_parallel=True, sp_exit="ln_f")
    items = [b for _, b in tp_plan_differences(plan, TOKENS)]
    # entry: backward all-gather of 32*32*4 bytes x 1/2; exit: its forward all-gather (its backward slices
    # the replicated gradient); gradient sums of 14 tensors of 32 (ln_1, ln_2 weight and bias, o_proj and
    # fc_out biases per block; ln_f's two). The counted bytes of a real run equal paper + these
    # (test_tensor_parallel_smoke).
    assert items == [2048, 2048, 14 * 32 * 4 * 2 // 2]
    specs = dict(tp_specs("tp"), **{"wte.weight": P("tp", None)})  # vocab-parallel embedding, tied split head
    plan = shardlib.plan(_tiny(), mesh, specs)
    (why, logits), = tp_plan_differences(plan, TOKENS)
    assert "lm_head" in why and logits == 32 * 256 * 4 // 2 - 3 * 128  # gathered logits instead of the fused loss
    paper = megatron_paper_bytes(2, TOKENS, 32, 2, vocab_parallel_embedding=True, parallel_head=True)
    assert float(paper + logits) == _plan_bytes(plan, tokens=TOKENS)


def _check_rows(rows, tmp_path, name):
    for row in rows:
        assert "error" not in row["a"] and "error" not in row["b"], row
        for key in ("a", "b"):
            side = row[key]
            assert side["median_s"] > 0 and len(side["times_s"]) == SETTINGS.steps
            assert all("comm" in r and "backend" in r and "state_bytes" in r for r in side["ranks"])
            assert len(side["faults_median"]) == len(side["ranks"]) and min(side["faults_median"]) >= 0
        assert row["ratio"] == pytest.approx(row["a"]["median_s"] / row["b"]["median_s"])
        a0, b0 = row["a"]["losses"][0], row["b"]["losses"][0]
        assert math.isclose(a0, b0, rel_tol=1e-5), (row["name"], a0, b0)  # same model, same batch
        theory = row["theory"]
        per_rank = theory.get("bytes_per_rank", [theory["bytes_rank0"]] * len(row["a"]["ranks"]))
        for rank, r in enumerate(row["a"]["ranks"]):
            # counted == the paper's formula + the plan's itemized differences, exactly
            expected = Fraction(theory["expected_exact"]) if "expected_exact" in theory else Fraction(per_rank[rank])
            assert Fraction(r["comm"]["exact_bytes"]) == expected, (row["name"], rank, r["comm"], theory)
        s = summarize(row)
        assert s["counted_matches_account"] and s["paper_bytes"] == theory["bytes_rank0"]
        if "expected_exact" in theory:
            assert s["plan_minus_paper"] == theory["plan_minus_paper"]
        assert s["a_state"] == theory["state_plan"]
        assert abs(s["state_over_formula"] - 1) <= 0.02, s
        assert s["a_act"] and s["b_act"]
    paths = write_outputs(name, {"rows": rows}, str(tmp_path))
    loaded = json.loads(open(paths["json"]).read())
    assert [r["name"] for r in loaded["rows"]] == [r["name"] for r in rows]
    if importlib.util.find_spec("matplotlib") is None:
        return
    assert (tmp_path / f"{name}_time.png").stat().st_size > 0 and (tmp_path / f"{name}_bytes.png").stat().st_size > 0


def _columns(rows):
    text = print_table(rows)
    assert all(col in text.splitlines()[0] for col in ("paper MB", "pl-pap MB", "b/pap"))
    return text


@pytest.mark.multiprocess
def test_data_parallel_smoke(tmp_path):
    rows = run_on(2, data_parallel.worker, SETTINGS, cases=("zero0_vs_ddp", "zero3_vs_fsdp2"))[0]
    _check_rows(rows, tmp_path, "data_parallel")
    # the theory column is ZeRO's formula on the model's own 34176 fp32 parameters (N = 2), not the plan's
    zero0, zero3 = summarize(rows[0]), summarize(rows[1])
    assert (zero0["paper_bytes"], zero0["plan_minus_paper"], zero0["bytes_over_paper"]) == (2 * PSI * 4 / 2, 0, 1.0)
    # regression (issue 15): the chunk kept gathered forward->backward is its own column, and counted /
    # paper shows it: the tied embedding's chunk (256 x 32 = 8192 of the 34176 elements, issue 16: as
    # small as the tensor) skips 1 of its 3 passes
    assert zero3["paper_bytes"] == 3 * PSI * 4 / 2 and zero3["plan_minus_paper"] == -8192 * 4 / 2
    assert zero3["bytes_over_paper"] == pytest.approx(1 - 8192 / (3 * PSI), rel=1e-12)
    assert "plan - paper -0.016 MB: kept gathered forward->backward" in _columns(rows)
    assert all(r["theory"]["unexplained_bytes"] == 0 for r in rows)  # the plan's cost model agrees with the account
    zero3 = rows[1]
    calls = zero3["a"]["ranks"][0]["comm"]["table"]
    assert set(calls) == {"dp/all_gather", "dp/reduce_scatter"}
    # FSDP2 (per block + root) is counted by the dispatcher probe: gathers and reduce-scatters
    assert set(zero3["b"]["ranks"][0]["comm"]["table"]) == {"all_gather", "reduce_scatter"}
    assert all(t["met"] for t in targets(rows) if "bytes" in t["target"] or "state" in t["target"])


@pytest.mark.multiprocess
def test_tensor_parallel_smoke(tmp_path):
    rows = run_on(2, tensor_parallel.worker, SETTINGS)[0]
    _check_rows(rows, tmp_path, "tensor_parallel")
    th = rows[0]["theory"]
    assert th["plan_layers_equal_megatron"] and th["plan_layers_bytes"] == th["megatron_layers_bytes"] == th["bytes_rank0"]
    # Megatron's 4 all-reduces of (32 tokens, 32) fp32 per layer, 2 layers, t = 2: 2 * 4 * 4096 bytes
    tp, sp = summarize(rows[0]), summarize(rows[1])
    assert (tp["paper_bytes"], tp["plan_minus_paper"], tp["bytes_over_paper"]) == (32768, 0, 1.0)
    # regression (issue 15): with SP the theory stays the paper's (the same bytes), and the region's
    # ends and gradient sums are the plan's own, itemized column: 2048 + 2048 + 1792 bytes
    assert (sp["paper_bytes"], sp["plan_minus_paper"]) == (32768, 2048 + 2048 + 1792)
    assert sp["bytes_over_paper"] == (32768 + 5888) / 32768
    assert [why.split(":")[0] for why, _ in sp["plan_minus_paper_items"]] == [
        "SP entry at 'drop'", "SP exit at 'ln_f' (replicated head)",
        "SP gradient sums of 14 replicated norm/bias tensors (448 elements), one all-reduce each"]
    assert rows[0]["theory"]["unexplained_bytes"] == 0
    _columns(rows)


@pytest.mark.multiprocess
def test_pipeline_and_overhead_smoke(tmp_path):
    rows = run_on(2, pipeline.worker, SETTINGS, cases=("1f1b_vs_Schedule1F1B",), control=True)[0]
    _check_rows(rows[:1], tmp_path, "pipeline")
    assert rows[0]["b"]["ranks"][0]["comm"]["bytes"] == rows[0]["theory"]["bytes_rank0"]  # torch sends the same
    # the A/A control: torch's 1F1B on both sides, each counted as the paper's bytes, first losses equal
    control = rows[1]
    assert control["name"] == "control_Schedule1F1B_vs_itself" and control["a"]["label"] == control["b"]["label"]
    assert [s["ranks"][0]["comm"]["bytes"] for s in (control["a"], control["b"])] == [control["theory"]["bytes_rank0"]] * 2
    assert control["a"]["losses"][0] == control["b"]["losses"][0]
    from benchmarks.run import targets
    checks = {c["target"]: c for c in targets(rows)}
    assert checks["pipeline 1F1B / Schedule1F1B step time <= 1.0"]["control"] == control["ratio"]
    rows = run_on(1, overhead.worker, SETTINGS)[0]
    _check_rows(rows, tmp_path, "overhead")


def test_bubble_benchmark_reports_a_missed_target_without_failing(monkeypatch, capsys):
    """Regression (issue 12): the default run exited 1 on timing noise; it now reports the miss
    and exits 0, and only ``--strict`` turns a miss into exit status 1."""
    import benchmarks.pipeline_bubble as bench

    rows = [{"schedule": "1f1b", "pp": 4, "microbatches": 8, "v": 1, "theory": 0.273,
             "measured": [0.4, 0.4, 0.4, 0.4], "max_abs_error": 0.127}]
    monkeypatch.setattr(bench, "measure", lambda *a, **k: rows)
    assert bench.main([]) == 0
    assert "target <= 0.05: MISSED" in capsys.readouterr().out
    assert bench.main(["--strict"]) == 1
    rows[0]["max_abs_error"] = 0.01
    assert bench.main(["--strict"]) == 0 and "target <= 0.05: met" in capsys.readouterr().out


@pytest.mark.multiprocess
def test_memory_benchmark_smoke():
    """benchmarks.memory at the smoke size: ZeRO-3 against FSDP2 and full recompute against none
    give peaks above the model state, saved bytes for both sides, and the same all-gather bytes
    with and without recompute (a target the row prints as met or MISS, never a failure here)."""
    from benchmarks import memory

    rows = run_on(2, memory.worker, SETTINGS, cases=("zero3_vs_fsdp2", "zero3_recompute"))[0]
    assert [r["comparison"] for r in rows] == [f"zero3 vs FSDP2 ({SETTINGS.size})", "zero3 full recompute vs none"]
    for r in rows:
        assert r["shardlib peak MB"] > 0 and r["torch peak MB"] > 0 and r["target"].count(":") >= 1, r
    assert rows[1]["shardlib saved MB"] < rows[1]["torch saved MB"]  # recompute keeps less for backward
    assert "vs" in rows[1]["target"] and rows[1]["target"].endswith("met"), rows[1]["target"]  # all-gather bytes equal


def test_recompute_formula_factor_and_a_block_saves_what_it_counts():
    """benchmarks.memory.formula_factor is Korthikanti et al.'s (34 + 5as/h)/2 with dropout and
    unfused attention (22 at a=6, s=128, h=384, the paper's terms), 18 without dropout and 16
    with a fused kernel as well; and a block of our GPT (no dropout, flash attention on CPU)
    saves the formula's 32 s b h 16-bit bytes, i.e. 16 s b h fp32 elements, without recompute
    and its s b h input with full recompute. Measured: 1.0039 x the formula (the layer norms'
    mean and rstd, 2 x 2 x s b floats, and attention's log-sum-exp, a s b floats, are below the
    formula's resolution: (16 + 4a) / (64 h) = 0.4% here), hence the 1% bound."""
    from benchmarks.common import saved_activation_bytes
    from benchmarks.memory import formula_factor

    assert formula_factor(6, 128, 384, dropout=True, fused_attention=False) == (34 + 5 * 6 * 128 / 384) / 2 == 22
    assert formula_factor(6, 128, 384, dropout=False, fused_attention=False) == 18
    assert formula_factor(6, 128, 384, dropout=False, fused_attention=True) == 16
    b, s, h, a, n = 2, 32, 128, 4, 3
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=s, n_layer=n, n_head=a, n_embd=h))
    x = torch.randint(0, 64, (b, s))

    def step():
        model(x, x)[1].backward()

    inside, _ = saved_activation_bytes(step, [model], list(model.blocks))
    # the factor is the saved elements per s b h (the input under full recompute is s b h of them)
    per_block = 4 * s * b * h * formula_factor(a, s, h, dropout=False, fused_attention=True)
    assert per_block <= inside / n <= 1.01 * per_block, (inside / n / per_block)
    from torch.utils.checkpoint import checkpoint

    for blk in model.blocks:  # full recompute: each block keeps its input only
        blk.forward = lambda t, f=blk.forward: checkpoint(f, t, use_reentrant=False)
    inside, _ = saved_activation_bytes(step, [model], list(model.blocks))
    assert inside == n * 4 * s * b * h


@pytest.mark.multiprocess
def test_predicted_peak_within_ten_percent_of_the_measured():
    """Plan.peak_estimate (PipelinePlan.peak_estimate per pp rank) against the peak measured on
    each of 2 ranks (benchmarks.memory._peak: the model state plus the profiler's running sum
    of allocations) for ZeRO 0-3, ZeRO-3 with full recompute, tp=2 + SP and pp=2 1F1B on the
    small GPT (2 x 128, batch 4 x 64): every ratio within 0.9-1.1 (the issue's bound; measured at the 10.8M size
    0.956-1.014, benchmarks/README.md)."""
    from benchmarks import memory

    settings = Settings(size="small", batch=4, seq=64, corpus_bytes=50_000)  # (the smoke size's state is below the noise)
    rows = run_on(2, memory.worker, settings, cases=("predicted",))[0]
    assert len(rows) == len(memory.PREDICTED)
    for r in rows:
        ratios = [float(x) for x in r["ratio"].split(" / ")]
        assert len(ratios) == 2 and all(0.9 <= x <= 1.1 for x in ratios), r
        if r["comparison"].endswith("zero-3 full recompute"):  # the peak in blocks.0's backward: measured
            assert all(0.97 <= x <= 1.03 for x in ratios), r  # 0.995 (0.931 from the start of backward alone)


def test_the_ratio_interval_resamples_rounds_in_pairs():
    """``ratio_ci`` draws each alternation round's A and B blocks together: A at 0.95 x B in every
    round, under a drift of the machine of 2x from the first round to the last, gives exactly 0.95
    at both ends (drawn apart, the drift alone would spread the ratio far around it); the same
    times give the same interval; fewer than 2 rounds give None."""
    rng = random.Random(1)
    b = [[(1 + i / 10) * rng.uniform(0.9, 1.1) for _ in range(5)] for i in range(11)]
    a = [[0.95 * t for t in blk] for blk in b]
    lo, hi = ratio_ci(a, b)
    assert math.isclose(lo, 0.95, rel_tol=1e-12) and math.isclose(hi, 0.95, rel_tol=1e-12)
    assert ratio_ci(a, b) == [lo, hi]
    assert ratio_ci(a[:1], b[:1]) is None


def test_the_ratio_interval_of_one_distribution_against_itself_holds_one():
    """Both sides drawn alike (lognormal steps, 5% spread, the same drift per round): the 95%
    interval contains 1.0 and is narrower with 4x the rounds (about half as wide)."""
    def sides(n, seed):
        rng = random.Random(seed)
        drift = [1 + 0.3 * rng.random() for _ in range(n)]
        return ([[d * rng.lognormvariate(0, 0.05) for _ in range(5)] for d in drift],
                [[d * rng.lognormvariate(0, 0.05) for _ in range(5)] for d in drift])
    lo, hi = ratio_ci(*sides(8, 2))
    assert lo <= 1.0 <= hi, (lo, hi)
    lo4, hi4 = ratio_ci(*sides(32, 2))
    assert lo4 <= 1.0 <= hi4, (lo4, hi4)
    assert hi4 - lo4 < 0.75 * (hi - lo), (hi - lo, hi4 - lo4)
