"""Train an unmodified Hugging Face causal LM (built from a small config) on bytes of text.

    torchrun --standalone --nproc-per-node 4 examples/train_hf.py --model llama --mesh dp=2,tp=2
    torchrun --standalone --nproc-per-node 4 examples/train_hf.py --model gpt2 --mesh dp=2,tp=2 \\
        --sequence-parallel --data path/to/plays --val-files hamlet.txt,tempest.txt
    torchrun --standalone --nproc-per-node 4 examples/train_hf.py --model gemma --mesh pp=2,tp=2
    torchrun --standalone --nproc-per-node 4 examples/train_hf.py --model qwen3 --mesh pp=2,dp=2

``--model`` is one of llama, mistral, qwen2, qwen3, gemma, gemma2, mixtral, phi, phi3, gpt_neox,
opt, gpt2: the family's ``transformers`` class with random initialization (no download), a byte
vocabulary (256) and the size flags (``--hidden``, ``--layers``, ``--heads``; key/value heads are
heads / 2 for an even ``--heads`` where the family has grouped-query attention; Mixtral has 4
experts of which 2 per token). On a mesh with ``tp`` the layout is
:func:`shardlib.models.hf_preset` (Megatron tensor parallelism read from the model's config,
proven exact at ``shard()`` time); ZeRO on ``dp``. On a mesh with ``pp`` the model runs as a
pipeline of its own layers (:mod:`shardlib.models.hf`), ``--microbatches`` per step by
``forward_backward``, each stage sharded over the other axes, the loss computed on the last
stage. Refused with one usage line, before any rank starts: a family without pipeline layers on
``pp``, ``--sequence-parallel`` with ``pp`` (an HF pipeline builds its masks and positions from
each layer's input), key/value heads that ``tp`` does not divide.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from tqdm import tqdm

import shardlib
from shardlib.cli import ArgumentParser, data_ranks, main_guard, mesh_of, mesh_shape, nonnegative_float, positive_int
from shardlib.data import open_corpus
from shardlib.models import hf_preset
from shardlib.models.hf import HF_PIPELINE_FAMILIES
from shardlib.models.hf_build import FAMILIES, GQA, hf_model, kv_heads

def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__)  # defaults in --help; a usage error is one line
    p.add_argument("--model", choices=list(FAMILIES), default="llama")
    p.add_argument("--data", default=None, help="a text file or folder (default: the Python standard library)")
    p.add_argument("--val-files", default="", help="comma-separated file names held out for validation")
    p.add_argument("--mesh", type=mesh_shape, default=None, help="e.g. dp=2,tp=2 or pp=2,dp=2 (default: dp=WORLD_SIZE)")
    p.add_argument("--zero-stage", type=int, default=1, choices=[0, 1, 2, 3])
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b"],
                   help="pipeline schedule when the mesh has a pp axis")
    p.add_argument("--microbatches", type=positive_int, default=4,
                   help="pipeline microbatches per step (must divide the batch of each data rank)")
    p.add_argument("--steps", type=positive_int, default=200)
    p.add_argument("--batch-size", type=positive_int, default=16, help="global sequences per step")
    p.add_argument("--block-size", type=positive_int, default=128)
    p.add_argument("--hidden", type=positive_int, default=128)
    p.add_argument("--layers", type=positive_int, default=4)
    p.add_argument("--heads", type=positive_int, default=4)
    p.add_argument("--lr", type=nonnegative_float, default=2e-3)
    p.add_argument("--eval-every", type=positive_int, default=50)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    # what the flags cannot say one at a time: one usage line, before any rank starts
    if args.hidden % args.heads:
        p.error(f"--hidden {args.hidden} must be divisible by --heads {args.heads} (head size hidden / heads)")
    shape = mesh_of(args)
    tp, pp = shape.get("tp", 1), shape.get("pp", 1)
    kv = kv_heads(args.model, args.heads)
    if kv % tp:
        gqa = args.model in GQA
        rule = "heads / 2" if kv != args.heads else "as many as heads, --heads being odd" if gqa else "one per head"
        p.error(f"--heads {args.heads} gives --model {args.model} {kv} key/value heads ({rule}), which tp={tp} of "
                f"--mesh {shape} does not divide: each tp rank holds whole heads. Fix: --heads a multiple of "
                f"{2 * tp if gqa else tp}, or a smaller tp")
    if pp > 1 and args.model not in HF_PIPELINE_FAMILIES:
        p.error(f"--model {args.model} with pp={pp} in --mesh {shape}: shardlib has no pipeline layers for "
                f"{args.model} (it has them for {', '.join(sorted(HF_PIPELINE_FAMILIES))}). Fix: another --model, "
                "or a mesh without pp")
    if pp > 1 and args.sequence_parallel:
        p.error(f"--sequence-parallel with pp={pp} in --mesh {shape}: a Hugging Face model's pipeline layers build "
                "masks and rotary positions from each decoder layer's input, which under sequence parallelism is a "
                "sequence shard. Fix: drop --sequence-parallel (tensor parallelism inside each stage works without "
                "it), or the pp axis")
    ranks = data_ranks(p, args.batch_size, shape)  # this script passes no data_axes: the plan's default ones
    if pp > 1 and (args.batch_size // ranks) % args.microbatches:
        p.error(f"--microbatches {args.microbatches} must divide the batch of each data rank: --batch-size "
                f"{args.batch_size} over {ranks} data rank(s) of the mesh {shape} is {args.batch_size // ranks} rows")
    return args


def build(args):
    """A randomly initialized (seeded: the same on every rank) Hugging Face causal LM of ``--model``
    at the size flags, with a byte vocabulary (:func:`shardlib.models.hf_build.hf_model`)."""
    return hf_model(args.model, args.hidden, args.layers, args.heads, args.block_size, seed=args.seed)


def lm_criterion(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy of logits ``(B, T, 256)`` against ``y`` ``(B, T)``."""
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def lm_loss(smodel, x, y, backward: bool) -> torch.Tensor:
    """This rank's mean loss on its batch ``x``, ``y`` local ``(B / dp, T)`` (backward done if
    asked); a pipeline runs its schedule of microbatches and shares the last stage's loss with
    every stage."""
    if isinstance(smodel, shardlib.PipelineModule):
        run = smodel.forward_backward if backward else smodel.evaluate
        losses, _ = run(x, criterion=lm_criterion, labels=(y,))
        loss = torch.stack(losses).mean() if losses is not None else torch.zeros(())
        return shardlib.all_reduce(loss, smodel.pp_axis)  # zero on every stage but the last
    loss = lm_criterion(smodel(input_ids=x).logits, y)  # logits gathered over tp by the output layer
    if backward:
        loss.backward()
    return loss


def main(argv=None) -> int:
    args = parse_args(argv)  # every flag checked here, before the mesh exists
    mesh = shardlib.init_mesh(mesh_of(args))
    corpus = open_corpus(args.data, [f for f in args.val_files.split(",") if f])  # --val-files needs --data
    model = build(args)
    preset = hf_preset(model) if "tp" in mesh.axis_names else None
    options = dict(zero_stage=args.zero_stage, sequence_parallel=args.sequence_parallel, dropout_seed=args.seed,
                   **(preset.options if preset else {}))
    pipelined = mesh.shape.get("pp", 1) > 1
    if pipelined:  # stages over pp (the model's own layers), each sharded over the other axes
        options.update(schedule=args.schedule, microbatches=args.microbatches)
    plan = shardlib.plan(model, mesh, preset.specs if preset else None, **options)  # a PipelinePlan on a pp mesh
    if mesh.rank == 0:
        print(corpus)
        print(f"model: {type(model).__name__}, {sum(p.numel() for p in model.parameters()):,} parameters, "
              f"mesh {mesh.shape}, ZeRO stage {args.zero_stage}")
        local_rows = args.batch_size // plan.data_size  # tokens per (micro)batch on one rank, for the traffic
        print(plan.explain(tokens=(local_rows // args.microbatches if pipelined else local_rows) * args.block_size))
    smodel = plan.apply(model)  # proves the tensor-parallel layout exact first (shard(verify=True))
    if mesh.rank == 0 and smodel.verification and not smodel.verification["skipped"]:
        print(f"tensor parallelism verified exact on {len(smodel.verification['units'])} units "
              f"(max relative error {smodel.verification['max_error']:.1e})")
    opt = shardlib.ZeroOptimizer(smodel, torch.optim.AdamW, max_grad_norm=1.0, lr=args.lr, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.steps, pct_start=0.1)
    g = torch.Generator().manual_seed(args.seed)

    def local(t):
        return shardlib.distribute(t, mesh, smodel.batch_spec)

    def global_mean(loss):
        return (shardlib.all_reduce(loss.detach(), smodel.data_axes, op="avg") if smodel.data_axes else loss).item()

    bar = tqdm(range(args.steps), disable=mesh.rank != 0)
    val = float("nan")
    for step in bar:
        x, y = corpus.get_batch("train", args.batch_size, args.block_size, g)  # the same global batch everywhere
        train = global_mean(lm_loss(smodel, local(x), local(y), backward=True))
        opt.step()
        sched.step()
        opt.zero_grad()
        bar.set_postfix(loss=f"{train:.3f}")
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            smodel.eval()
            vg = torch.Generator().manual_seed(args.seed + 1)  # the same 4 validation batches every time
            with torch.no_grad():
                batches = [corpus.get_batch("val", args.batch_size, args.block_size, vg) for _ in range(4)]
                val = sum(global_mean(lm_loss(smodel, local(vx), local(vy), backward=False)) for vx, vy in batches) / 4
            smodel.train()
            if mesh.rank == 0:
                bar.write(f"step {step + 1}: train {train:.4f}, val {val:.4f} nats/byte")
    if mesh.rank == 0:
        print(f"final val loss {val:.3f} nats/byte (uniform guess {math.log(256):.3f})")
    return 0


@record  # under torchrun, a failing rank's traceback heads the error summary (crashes, not config errors)
def entry() -> int:
    return main_guard(main)  # a configuration error: one line, from the lowest failing rank


if __name__ == "__main__":
    sys.exit(entry())
