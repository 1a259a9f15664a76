"""Readable plans at scale (issue 14, item 9): explain() puts the totals first, folds repeated
blocks in long tables, stays within 100 characters, and shows each parameter's bytes per rank
(its average share under ZeRO-3, not rank 0's slice of the flat chunk)."""

import re

import pytest
import torch

import shardlib
from shardlib import AbstractMesh
from shardlib.models import GPT, GPTConfig, llama_preset
from shardlib.testing import TiedLM

transformers = pytest.importorskip("transformers")

LAYERS = 80
RULES = {"*norm*": ("ones",), "*": ("normal", 0.02)}  # a meta model needs init rules to be planned


@pytest.fixture(scope="module")
def plan70b():
    """LLaMA-70B shapes on the meta device, planned on an abstract {dp: 16, tp: 8} at ZeRO-3
    (no tensor is allocated; building it took 1.3-8 s on the shared 2-core machine, planning 0.03-0.1 s),
    built once for the module."""
    config = transformers.LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=LAYERS,
                                      num_attention_heads=64, num_key_value_heads=8, vocab_size=32000)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    preset = llama_preset()
    return shardlib.plan(model, AbstractMesh({"dp": 16, "tp": 8}), preset.specs, zero_stage=3, init_rules=RULES,
                         **preset.options)


def _table(text: str) -> list[str]:
    """The lines of the per-parameter table: after its rule of dashes, up to the next section."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("-----")) + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("tensor-parallel layers") or ": " in lines[i]),
               len(lines))  # rows and block lines hold no ": "; the next section's heading does
    return lines[start:end]


def _rows(text: str) -> dict[str, list[str]]:
    """``{name or folded pattern: [global shape, spec, strategy, local shape, bytes]}``: block
    lines give their children's prefix, and a name printed on a line of its own (too long for
    the column) joins the cells on the next line."""
    rows, blocks, pending = {}, [], None
    for line in _table(text):
        depth = (len(line) - len(line.lstrip())) // 2
        if pending is not None:
            depth, name = pending
            pending = None
            cells = re.split(r"\s{2,}", line.strip())
        else:
            fields = re.split(r"\s{2,}", line.strip())
            if line.endswith(":"):  # a block: "model.layers.{0..79} (80x), each 9 tensors, ... B per rank:"
                del blocks[depth:]
                blocks.append(fields[0].split(" (")[0])
                continue
            if len(fields) == 1:
                pending = (depth, fields[0])
                continue
            name, cells = fields[0], fields[1:]
        del blocks[depth:]
        rows[".".join(blocks + [name])] = cells
    return rows


def _bytes(cells: list[str]) -> int:
    return int(cells[-1].replace(",", ""))


def test_70b_plan_prints_a_short_summary_with_the_totals_first(plan70b):
    text = plan70b.explain()
    lines = text.splitlines()
    assert len(lines) < 66, len(lines)  # 63 here (9 of them the 162 chunks, folded); was 1,456 lines
    assert "  1-158  106,954,752 + 16,384  model.layers.{0..78}, 1 per 2 chunks" in text  # a block's 2 groups
    assert max(map(len, lines)) <= 100, max(lines, key=len)  # was 142 characters
    head = "\n".join(lines[:10])
    p = plan70b
    assert f"  bytes: {p.model_state_bytes:,} = {p.param_bytes:,} + {p.grad_bytes:,} + {p.optimizer_bytes:,}" in head
    assert "model state per rank: 8.03 GiB = params 2.01 GiB + grads 2.01 GiB + optimizer 4.02 GiB" in head
    comm = p.comm_per_step()
    gather = comm[("dp", "all_gather")]
    assert f"  dp     all_gather     {gather[0]:>6} calls  {gather[1]:>16,.0f} B" in head
    assert str(plan70b) == text
    # one line for the 80 decoder layers, with per-block figures and their total
    assert "  model.layers.{0..79} (80x): 9 tensors, 856M elements, 25.5 MiB each, 1.99 GiB in all (99.2%)" in lines
    assert "model.layers.{0..79} (80x), each 9 tensors, 26,742,784 B per rank:" in lines
    assert "largest tensors (bytes per rank of one):" in lines
    assert any(line.startswith("  model.layers.{0..79}.mlp.gate_proj.weight") and line.endswith("7,340,032 B  (80x)")
               for line in lines)
    assert "  column+zero-3  401 tensors  1,392,312,320 B   1.3 GiB  64.6%" in lines
    rows = _rows(text)
    assert len(rows) == 12  # embed, 9 rows of the folded block, norm, head
    assert all(_bytes(cells) > 0 for cells in rows.values())  # was 0 for v_proj (not in rank 0's slice)
    assert rows["model.layers.{0..79}.self_attn.v_proj.weight"] == [
        "(1024, 8192)", "P('tp', None)", "column+zero-3", "(128, 8192)", "262,144"]  # 128 x 8192 x 4 B / 16


def test_70b_full_table_has_every_parameter_and_the_folded_rows_are_exact(plan70b):
    full = _rows(plan70b.explain(full=True))
    names = [p.name for p in plan70b.params]
    assert list(full) == names  # one row per parameter, in model order
    assert all(_bytes(cells) > 0 for cells in full.values())
    # each parameter's bytes per rank: its tensor-parallel shard over the 16 data ranks; the rows
    # sum to the plan's parameter bytes per rank less the padding's share, which is measured at 0
    # elements for these shapes (every chunk divides by 16), so the sum is exact
    pad = sum((c.padded_numel - c.numel) * c.element_size for c in plan70b.chunks) // plan70b.data_size
    assert pad == 0
    assert sum(_bytes(cells) for cells in full.values()) + pad == plan70b.param_bytes == 2_155_808_768
    # every folded row is exactly what each of its 80 copies prints, and the fold misses nothing
    expanded = {}
    for pattern, cells in _rows(plan70b.explain()).items():
        copies = [pattern.replace("{0..79}", str(i)) for i in range(LAYERS)] if "{0..79}" in pattern else [pattern]
        expanded.update({name: cells for name in copies})
    assert expanded == full


def test_per_parameter_bytes_are_the_average_share_not_one_ranks_slice():
    """ZeRO-3 over 4 ranks with small chunks, a tied and a frozen parameter: every rank prints the
    same bytes column, each parameter's elements x 4 B / 4, and the rows sum to param_bytes less
    the padding's share (13 padding elements over 4 ranks: 13 B)."""
    model = TiedLM()
    texts = [shardlib.plan(model, AbstractMesh({"dp": 4}, rank=r), zero_stage=3, chunk_size=100).explain()
             for r in range(4)]
    tables = [_rows(t) for t in texts]
    assert all(t == tables[0] for t in tables)  # was rank-dependent: rank 0 held 372 B of wte, rank 3 blank rows
    p = shardlib.plan(model, AbstractMesh({"dp": 4}), zero_stage=3, chunk_size=100)
    want = {pp.name + (" (= lm_head.weight)" if pp.aliases else "") + ("" if pp.requires_grad else " [frozen]"): pp.numel
            for pp in p.params}
    assert {name: _bytes(cells) for name, cells in tables[0].items()} == want  # numel x 4 B / 4 ranks
    pad = sum(c.padded_numel - c.numel for c in p.chunks)
    assert pad == 13 and sum(want.values()) + pad * 4 // 4 == p.param_bytes


def test_mixed_precision_rows_count_the_compute_copy():
    """At ZeRO-1 over 4 ranks with bf16 compute copies a row is the fp32 master shard plus the
    full bf16 copy, as param_bytes counts them: elements x (4 B / 4 ranks + 2 B)."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    p = shardlib.plan(model, AbstractMesh({"dp": 4}), zero_stage=1, param_dtype=torch.bfloat16)
    rows = _rows(p.explain())
    assert {name: _bytes(cells) for name, cells in rows.items()} == {"0.weight": 192, "0.bias": 24, "1.weight": 96,
                                                                     "1.bias": 12}  # was 4 B per element
    assert sum(_bytes(cells) for cells in rows.values()) == p.param_bytes == 324  # no padding: 108 elements over 4


def test_small_model_lists_every_parameter_after_the_summary():
    model = GPT(GPTConfig(vocab_size=37, block_size=8, n_layer=2, n_head=2, n_embd=16))
    p = shardlib.plan(model, AbstractMesh({"dp": 2}), zero_stage=3)
    text = p.explain()
    lines = text.splitlines()
    table = next(i for i, line in enumerate(lines) if line.startswith("parameter  "))
    assert any(line.startswith("model state per rank: ") for line in lines[:table])  # was after the table
    assert any(line.startswith("communication per step") for line in lines[:table])
    # 16 tensors of 3,280 elements per block, 3,280 x 4 B / 2 ranks = 6,560 B; 13,120 of the 14,624 B
    assert "  blocks.{0,1} (2x): 16 tensors, 3.28k elements, 6.41 KiB each, 12.8 KiB in all (89.7%)" in lines
    names = [n + (" (= lm_head.weight)" if n == "wte.weight" else "") for n, _ in model.named_parameters()]
    assert list(_rows(text)) == names and len(names) == 36  # nothing folded
    assert p.explain(full=True) == text


def test_fold_keeps_differing_copies_apart_and_folds_nested_blocks():
    from shardlib.explain_pipeline import compact_names
    from shardlib.explain_table import Block, Row, flatten, fold, index_set

    def layer(i, width=4, experts=3):
        rows = [Row(f"layers.{i}.norm.weight", (f"({width},)",), 1.0, width)]
        rows += [Row(f"layers.{i}.experts.{e}.w.weight", ("(4, 4)",), 2.0, 16) for e in range(experts)]
        return rows

    rows = [Row("embed.weight", ("(9, 4)",), 3.0, 36)] + [r for i in range(6) for r in layer(i, 8 if i == 2 else 4)]
    items = fold(rows)
    assert [type(i).__name__ for i in items] == ["Row", "Block", "Row", "Block", "Block"]
    assert items[1].name == "layers.{0,1}" and items[4].name == "layers.{3..5}" and items[4].count == 3
    assert items[2].name == "layers.2.norm.weight"
    assert items[3].name == "layers.2.experts.{0..2}" and isinstance(items[3], Block)
    inner = items[4].children
    assert inner[0].name == "norm.weight" and inner[1].name == "experts.{0..2}" and inner[1].children[0].name == "w.weight"
    assert items[4].tensors == 4 and items[4].weight == 7.0 and items[4].numel == 52
    assert [(name, n) for name, n, _ in flatten(items)] == [
        ("embed.weight", 1), ("layers.{0,1}.norm.weight", 2), ("layers.{0,1}.experts.{0..2}.w.weight", 6),
        ("layers.2.norm.weight", 1), ("layers.2.experts.{0..2}.w.weight", 3), ("layers.{3..5}.norm.weight", 3),
        ("layers.{3..5}.experts.{0..2}.w.weight", 9)]
    assert sum(r.weight * n for _, n, r in flatten(items)) == sum(r.weight for r in rows)
    assert index_set([0, 1, 2, 5, 7, 8]) == "0..2,5,7,8"
    assert compact_names(["embed", "blocks.0", "blocks.1", "blocks.2", "head"]) == ["embed", "blocks.{0..2}", "head"]
    assert compact_names(["embed", "blocks.0", "blocks.1"]) == ["embed", "blocks.0", "blocks.1"]


def test_pipeline_summary_fits_and_folds_its_stages():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=37, block_size=8, n_layer=16, n_head=2, n_embd=16, bias=False))
    pplan = shardlib.plan(model, AbstractMesh({"pp": 4, "dp": 2}), schedule="1f1b", microbatches=32, zero_stage=1)
    summary = pplan.summary().splitlines()
    assert max(map(len, summary)) <= 100, max(summary, key=len)  # the first line was 171 characters
    assert "  stage 1 on rank 1: blocks.{4..7} (4 layers, 49,664 parameter bytes)" in summary
    s1 = pplan.stages[1]
    assert s1.model_state_bytes == pplan.stages[2].model_state_bytes
    assert re.split(r"\s+", next(line for line in summary if line.startswith("  1,2 ")).strip())[:5] == [
        "1,2", f"{s1.param_bytes:,}", f"{s1.grad_bytes:,}", f"{s1.optimizer_bytes:,}", f"{s1.model_state_bytes:,}"]
    text = pplan.explain()
    assert "schedule: 70 steps x 4 ranks (forward and backward one step each); explain(full=True) draws the grid" in text
    assert " 0F0 " not in text
    full = pplan.explain(full=True)
    assert " 0F0 " in full and "  69 " in full  # the 70 steps of 2 (m + p - 1) drawn


def test_sizes_near_1024_of_a_unit_read_as_numbers():
    """explain() printed peaks like "1e+03 KiB" (three significant digits of 1000-1023; new-user pass)."""
    from shardlib.explain_summary import human

    assert [human(x) for x in (1000 * 1024, 999 * 1024, 1.5 * 1024, 8622080000, 1023)] == \
        ["1000 KiB", "999 KiB", "1.5 KiB", "8.03 GiB", "1023 B"]
