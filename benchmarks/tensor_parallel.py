"""Tensor and sequence parallelism: shardlib against ``torch.distributed.tensor.parallel``.

Both sides split the same GPT blocks the Megatron way (arXiv 1909.08053): q/k/v and ``fc_in``
column parallel, ``o_proj`` and ``fc_out`` row parallel; embeddings, norms and the tied LM head
stay replicated. shardlib takes :func:`shardlib.models.tp_specs`; PyTorch takes
``parallelize_module`` with ``ColwiseParallel``/``RowwiseParallel`` on the same module names.

With ``sequence parallel`` (arXiv 2205.05198) the residual stream between the layers is split
along the sequence: shardlib's ``sequence_parallel=True`` (entry at ``drop``, exit gathered at
``ln_f``); PyTorch's torchtitan-style plan: ``PrepareModuleInput`` (Replicate -> Shard(1)) on the
first block, ``SequenceParallel`` on ``ln_1``/``ln_2``/``ln_f``, ``PrepareModuleInput`` (Shard(1)
-> Replicate) on ``attn``/``mlp``/``lm_head``, and ``RowwiseParallel(output_layouts=Shard(1))``.

Theory (the paper's formula on the model's shapes, not the plan's cost model): 4 all-reduces
of ``(tokens, hidden)`` per layer per micro-batch, ``8 b s h (t-1)/t`` elements per rank per
layer (with SP: 4 all-gathers + 4 reduce-scatters, the same volume); the embedding and the tied
LM head are replicated here, so they add nothing (a split one would add Megatron's terms, see
:func:`benchmarks.theory.megatron_paper_bytes`). With SP the plan also pays the region's entry
(backward all-gather) and exit (forward all-gather, backward reduce-scatter) and the gradient
sums of the replicated norm weights and row biases: the "plan - paper" column, itemized in
``theory.plan_minus_paper_items``.

    python -m benchmarks.tensor_parallel --quick
"""

from __future__ import annotations

import argparse
from fractions import Fraction

import torch

from .common import Settings, Side, train_step, add_common_args, batches, compare, make_gpt, run_benchmark, settings_from_args, \
    torch_state_bytes
from .theory import megatron_paper_bytes, theory_entry, tp_plan_differences, zero_state_formula

CASES = ("tp_vs_parallelize_module", "tp_sp_vs_parallelize_module_sp")


def torch_tp_plan(n_layer: int, sequence_parallel: bool) -> dict:
    """The ``parallelize_module`` plan for :class:`shardlib.models.GPT` (Megatron layout)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    plan: dict = {}
    for i in range(n_layer):
        b = f"blocks.{i}"
        for name in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.fc_in"):
            plan[f"{b}.{name}"] = ColwiseParallel()
        for name in ("attn.o_proj", "mlp.fc_out"):
            plan[f"{b}.{name}"] = RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel else RowwiseParallel()
        if sequence_parallel:
            plan[f"{b}.ln_1"] = SequenceParallel()
            plan[f"{b}.ln_2"] = SequenceParallel()
            for name in ("attn", "mlp"):
                plan[f"{b}.{name}"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                                                 use_local_output=True)
    if sequence_parallel:
        plan["blocks.0"] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True)
        plan["ln_f"] = SequenceParallel()
        plan["lm_head"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True)
    return plan


def shardlib_side(settings: Settings, mesh, sp: bool, data) -> Side:
    import shardlib
    from shardlib.models import tp_specs

    options = dict(sequence_parallel=True, sp_exit="ln_f") if sp else {}
    smodel = shardlib.shard(make_gpt(settings), mesh, tp_specs("tp"), **options)
    opt = shardlib.ZeroOptimizer(smodel, torch.optim.AdamW, lr=settings.lr)
    return Side("shardlib tp+sp" if sp else "shardlib tp", train_step(smodel, opt, data), [smodel], [opt.optimizer],
                lambda: shardlib.model_state_bytes(smodel, opt), mesh)


def torch_side(settings: Settings, sp: bool, data) -> Side:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    model = make_gpt(settings)
    dm = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    parallelize_module(model, dm, torch_tp_plan(model.config.n_layer, sp))
    opt = torch.optim.AdamW(model.parameters(), lr=settings.lr)
    return Side("parallelize_module+SP" if sp else "parallelize_module", train_step(model, opt, data), [model], [opt],
                lambda: torch_state_bytes(model, opt))


def theory(settings: Settings, mesh, sp: bool, tokens: int) -> dict:
    """Megatron's formula on the model's shapes (:func:`~benchmarks.theory.megatron_paper_bytes`),
    the plan's deliberate differences from it (:func:`~benchmarks.theory.tp_plan_differences`),
    and the model-state formula, for one step (one micro-batch of ``tokens`` tokens)."""
    import numpy as np

    import shardlib
    from shardlib.mesh.comm import ring_bytes
    from shardlib.models import tp_specs
    from shardlib.parallel.tensor_cost import tensor_parallel_collectives

    options = dict(sequence_parallel=True, sp_exit="ln_f") if sp else {}
    model = make_gpt(settings)
    plan = shardlib.plan(model, mesh, tp_specs("tp"), **options)
    t = mesh.size("tp")
    cfg = model.config
    itemsize = next(model.parameters()).dtype.itemsize  # fp32 activations: 4 bytes an element
    kinds = {layer.path: layer for layer in plan.tp_layers}
    vocab_embedding = any(layer.kind == "vocab" for layer in kinds.values())
    head = any(layer.kind == "column" and layer.output_layer for layer in kinds.values())
    paper = megatron_paper_bytes(cfg.n_layer, tokens, cfg.n_embd, t, itemsize, vocab_embedding, head)
    formula = (f"Megatron (arXiv 1909.08053 s.3): 4 all-reduces of b s h per layer per microbatch "
               f"{'(SP, 2205.05198 s.4: 4 all-gathers + 4 reduce-scatters, the same bytes) ' if sp else ''}"
               f"x {cfg.n_layer} layers; b s = {tokens} tokens, h = {cfg.n_embd}, t = {t}, {itemsize} bytes (fp32)"
               + ("; + vocab-parallel embedding all-reduce" if vocab_embedding else "")
               + ("; + head input all-reduce and fused loss (3 all-reduces of b s)" if head else
                  "; embedding and LM head replicated (tp_specs): nothing for them"))
    predicted = plan.comm_per_step(tokens=tokens)
    out = theory_entry(paper, formula, tp_plan_differences(plan, tokens), sum(b for _, b in predicted.values()))
    # the plan's per-layer part against the paper's (equal by construction of both, checked exactly)
    layer_bytes = sum((ring_bytes(c.kind, c.payload(tokens) * itemsize, t) for c in tensor_parallel_collectives(plan)
                       if c.layer.startswith("blocks.") and c.per_token), Fraction(0))
    megatron = megatron_paper_bytes(cfg.n_layer, tokens, cfg.n_embd, t, itemsize)
    psi_local = sum(int(np.prod(plan.local_shape(p))) for p in plan.params)
    out.update({
        "calls_plan": sum(c for c, _ in predicted.values()),
        "megatron_layers_bytes": float(megatron),
        "plan_layers_bytes": float(layer_bytes),
        "plan_layers_equal_megatron": layer_bytes == megatron,
        "state_formula": zero_state_formula(0, psi_local, 1),
        "state_plan": plan.model_state_bytes,
        "params_local": psi_local,
        "tokens": tokens,
    })
    return out


def worker(settings: Settings, cases=CASES) -> list[dict]:
    import shardlib

    mesh = shardlib.init_mesh({"tp": 2})
    data = batches(settings, settings.batch, settings.warmup + settings.steps + 4)
    rows = []
    for case in cases:
        sp = "_sp" in case
        th = theory(settings, mesh, sp, settings.batch * settings.seq)
        rows.append(compare(case, lambda: shardlib_side(settings, mesh, sp, data), lambda: torch_side(settings, sp, data),
                            settings, th))
    return rows


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--cases", nargs="*", default=list(CASES), choices=CASES)
    args = p.parse_args(argv)
    return run_benchmark("tensor_parallel", worker, settings_from_args(args), args.out, cases=tuple(args.cases))


if __name__ == "__main__":
    main()
