"""Train an unmodified Hugging Face LLaMA or GPT-2 (built from a small config) on bytes of text.

    torchrun --standalone --nproc-per-node 4 examples/train_hf.py --model llama --mesh dp=2,tp=2
    torchrun --standalone --nproc-per-node 4 examples/train_hf.py --model gpt2 --mesh dp=2,tp=2 \\
        --sequence-parallel --data path/to/plays --val-files hamlet.txt,tempest.txt

The model comes from ``transformers`` with random initialization (no download) and a byte
vocabulary (256). Its layout is a preset (:mod:`shardlib.models.presets`): Megatron tensor
parallelism on ``tp`` (GPT-2's fused q/k/v split per block), ZeRO on ``dp``.
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
from shardlib.models import gpt2_preset, llama_preset


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__)  # defaults in --help; a usage error is one line
    p.add_argument("--model", choices=["llama", "gpt2"], default="llama")
    p.add_argument("--data", default=None, help="a text file or folder (default: the Python standard library)")
    p.add_argument("--val-files", default="", help="comma-separated file names held out for validation")
    p.add_argument("--mesh", type=mesh_shape, default=None, help="e.g. dp=2,tp=2 (default: dp=WORLD_SIZE)")
    p.add_argument("--zero-stage", type=int, default=1, choices=[0, 1, 2, 3])
    p.add_argument("--sequence-parallel", action="store_true")
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
    if "pp" in shape and shape["pp"] > 1:
        p.error(f"--mesh {shape}: this script has no pipeline path for Hugging Face models; use dp and tp axes")
    data_ranks(p, args.batch_size, shape)  # this script passes no data_axes: the plan's default ones
    return args


def build(args):
    """(model, preset): a randomly initialized Hugging Face model with a byte vocabulary."""
    import transformers

    torch.manual_seed(args.seed)
    if args.model == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=256, hidden_size=args.hidden, intermediate_size=int(8 * args.hidden / 3) // 8 * 8,
            num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=max(1, args.heads // 2),
            max_position_embeddings=args.block_size, use_cache=False, bos_token_id=0, eos_token_id=0)
        return transformers.LlamaForCausalLM(cfg), llama_preset("tp")
    cfg = transformers.GPT2Config(vocab_size=256, n_embd=args.hidden, n_layer=args.layers, n_head=args.heads,
                                  n_positions=args.block_size, use_cache=False, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg), gpt2_preset("tp")


def lm_loss(smodel, x, y) -> torch.Tensor:
    """Mean next-byte cross-entropy; ``x``, ``y`` local ``(B / dp, T)``."""
    logits = smodel(input_ids=x).logits  # (B/dp, T, 256), gathered over tp by the output layer
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def main(argv=None) -> int:
    args = parse_args(argv)  # every flag checked here, before the mesh exists
    mesh = shardlib.init_mesh(mesh_of(args))
    corpus = open_corpus(args.data, [f for f in args.val_files.split(",") if f])  # --val-files needs --data
    model, preset = build(args)
    specs = preset.specs if "tp" in mesh.axis_names else None
    options = preset.options if specs else {}
    plan = shardlib.plan(model, mesh, specs, zero_stage=args.zero_stage, sequence_parallel=args.sequence_parallel,
                         dropout_seed=args.seed, **options)
    if mesh.rank == 0:
        print(corpus)
        print(plan.explain(tokens=args.batch_size // plan.data_size * args.block_size))
    smodel = plan.apply(model)
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
        loss = lm_loss(smodel, local(x), local(y))
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        bar.set_postfix(loss=f"{global_mean(loss):.3f}")
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            smodel.eval()
            vg = torch.Generator().manual_seed(args.seed + 1)
            with torch.no_grad():
                val = sum(global_mean(lm_loss(smodel, *map(local, corpus.get_batch("val", args.batch_size, args.block_size, vg))))
                          for _ in range(4)) / 4
            smodel.train()
            if mesh.rank == 0:
                bar.write(f"step {step + 1}: val {val:.4f} nats/byte")
    if mesh.rank == 0:
        print(f"final val loss {val:.3f} nats/byte (uniform guess {math.log(256):.3f})")
    return 0


@record  # under torchrun, a failing rank's traceback heads the error summary (crashes, not config errors)
def entry() -> int:
    return main_guard(main)  # a configuration error: one line, from the lowest failing rank


if __name__ == "__main__":
    sys.exit(entry())
