"""Train a small byte-level GPT with shardlib: ZeRO data parallel, optionally tensor parallel.

Launch:
    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py             # ZeRO-3 over dp=4
    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py --mesh dp=2,tp=2
    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py --mesh pp=2,tp=2 --sequence-parallel
    python examples/train_gpt.py --mesh dp=1                                  # one process
    torchrun ... examples/train_gpt.py --data path/to/plays --val-files hamlet.txt,tempest.txt  # your own text
    torchrun ... examples/train_gpt.py --ckpt-dir runs/ckpt --save-every 100      # sharded checkpoints
    torchrun ... examples/train_gpt.py --resume runs/ckpt                         # newest one, any mesh
    torchrun ... examples/train_gpt.py --resume runs/ckpt --eval-only             # validation loss only
    torchrun ... examples/train_gpt.py --resume runs/ckpt --ckpt-dir runs/ckpt    # continue, saving there too

Every rank draws the same *global* batch from a generator seeded with ``--seed`` and keeps its
slice (``shardlib.distribute``), so ``--check N`` can replay the first N steps in one process,
unsharded, on exactly the same batches, and compare the losses.

Checkpoints (``shardlib.checkpoint``) hold the sharded parameters and AdamW state, the step, the
batch generator's state and the loss history: ``--resume`` continues exactly where the run
stopped (on the same mesh bit for bit; on another mesh or ZeRO stage up to rounding). A
``--ckpt-dir`` that already holds anything (an older run's checkpoints) is refused at start unless
``--resume`` points into it (a continued run replaces the checkpoints of the steps it repeats) or
``--overwrite-ckpt`` is given; so is an existing ``--export-safetensors`` file.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
from torch.distributed.elastic.multiprocessing.errors import record
from tqdm import tqdm

import shardlib
from shardlib.cli import (ArgumentParser, data_ranks, dropout_rate, main_guard, mesh_of, mesh_shape, nonnegative_float,
                          nonnegative_int, positive_int)
from shardlib.data import ByteCorpus, open_corpus
from shardlib.models import GPT, GPTConfig, gpt_preset
from shardlib.parallel.schedules import SCHEDULES
from shardlib.random import mesh_independent_dropout

CHECK_RTOL = 1e-4


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__)  # defaults in --help; a usage error is one line
    p.add_argument("--data", help="a text file or a folder of *.txt/*.py files (default: Python stdlib source)")
    p.add_argument("--val-files", default="", help="comma-separated held-out file names in the --data folder")
    p.add_argument("--mesh", type=mesh_shape, default=None,
                   help="mesh axes, e.g. dp=4 or dp=2,tp=2 (default: dp=WORLD_SIZE)")
    p.add_argument("--schedule", default="1f1b", choices=sorted(SCHEDULES),
                   help="pipeline schedule when the mesh has a pp axis (zbv and dualpipev: two chunks per rank in a V)")
    p.add_argument("--microbatches", type=positive_int, default=4,
                   help="pipeline microbatches per step (must divide the batch of each data rank)")
    p.add_argument("--timeline", default="runs/timeline.svg", help="pipeline timeline picture of the last step")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="Megatron sequence parallelism on the tp axis (norms/dropout on sequence shards)")
    p.add_argument("--zero-stage", type=int, default=3, choices=[0, 1, 2, 3])
    p.add_argument("--activation-checkpointing", default="none", choices=["none", "full", "selective"],
                   help="recompute each block's activations in backward: full (keep its input) or selective "
                        "(also keep its matmul outputs)")
    p.add_argument("--steps", type=positive_int, default=300)
    p.add_argument("--batch-size", type=positive_int, default=16, help="GLOBAL batch size (sequences per step)")
    p.add_argument("--block-size", type=positive_int, default=128)
    p.add_argument("--n-layer", type=positive_int, default=4)
    p.add_argument("--n-head", type=positive_int, default=4)
    p.add_argument("--n-embd", type=positive_int, default=128)
    p.add_argument("--dropout", type=dropout_rate, default=0.0)
    p.add_argument("--lr", type=nonnegative_float, default=2e-3)
    p.add_argument("--warmup", type=nonnegative_int, default=30, help="linear warmup steps, then cosine decay to lr/10")
    p.add_argument("--weight-decay", type=nonnegative_float, default=0.1)
    p.add_argument("--grad-clip", type=nonnegative_float, default=1.0, help="max global grad norm (0: off)")
    p.add_argument("--eval-every", type=positive_int, default=100)
    p.add_argument("--eval-batches", type=positive_int, default=8)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--check", type=nonnegative_int, default=0, metavar="N",
                   help="replay the first N steps unsharded on rank 0 and compare losses")
    p.add_argument("--sample", type=nonnegative_int, default=200, metavar="BYTES",
                   help="rank 0 prints this many sampled bytes from the trained model (0: none)")
    p.add_argument("--log-json", default=None, metavar="PATH", help="write the loss curve here")
    p.add_argument("--ckpt-dir", default=None, metavar="DIR", help="write sharded checkpoints DIR/step_NNNNNN")
    p.add_argument("--overwrite-ckpt", action="store_true",
                   help="allow a --ckpt-dir that is not empty (its checkpoints of the steps this run saves are "
                        "replaced, the others kept) and an existing --export-safetensors file")
    p.add_argument("--save-every", type=nonnegative_int, default=0, metavar="N",
                   help="checkpoint every N steps and at the end (needs --ckpt-dir; 0: only at the end)")
    p.add_argument("--resume", default=None, metavar="PATH",
                   help="a checkpoint folder, or a --ckpt-dir (its newest checkpoint), to continue from")
    p.add_argument("--eval-only", action="store_true",
                   help="evaluate the validation loss of the model (from --resume) and exit")
    p.add_argument("--export-safetensors", default=None, metavar="FILE",
                   help="at the end, write the full weights (original names) to one .safetensors file")
    args = p.parse_args(argv)
    # what the flags cannot say one at a time, refused here too: one usage line, before any rank starts
    if args.eval_only and not args.resume:
        p.error("--eval-only evaluates a trained model: it needs --resume CHECKPOINT (without it the model is freshly "
                "initialized)")
    if args.save_every and not args.ckpt_dir:
        p.error(f"--save-every {args.save_every} needs --ckpt-dir DIR (where the checkpoints go)")
    if args.n_embd % args.n_head:
        p.error(f"--n-embd {args.n_embd} must be divisible by --n-head {args.n_head} (head size n_embd / n_head)")
    shape = mesh_of(args)
    ranks = data_ranks(p, args.batch_size, shape)  # this script passes no data_axes: the plan's default ones
    if shape.get("pp", 1) > 1 and (args.batch_size // ranks) % args.microbatches:
        p.error(f"--microbatches {args.microbatches} must divide the batch of each data rank: --batch-size "
                f"{args.batch_size} over {ranks} data rank(s) of the mesh {shape} is {args.batch_size // ranks} rows")
    return args


def model_config(args) -> GPTConfig:
    return GPTConfig(block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head,
                     n_embd=args.n_embd, dropout=args.dropout)


def build_model(args) -> GPT:
    """The same initial weights on every rank and in the --check replay: seeded, on CPU."""
    torch.manual_seed(args.seed)
    return GPT(model_config(args))


def load_data(args) -> ByteCorpus:
    return open_corpus(args.data, [f for f in args.val_files.split(",") if f])  # --val-files needs --data


def train_batches(corpus: ByteCorpus, args, g: torch.Generator | None = None):
    """Yield the GLOBAL training batches ``(x, y)``, int64 ``(batch_size, block_size)``, drawn
    from ``g`` (default: a generator seeded with ``--seed``; its state is the data position)."""
    g = torch.Generator().manual_seed(args.seed) if g is None else g
    while True:
        yield corpus.get_batch("train", args.batch_size, args.block_size, g)


def optimizer_kwargs(args) -> dict:
    return dict(lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95))


def learning_rate(step: int, args) -> float:
    """nanoGPT's schedule for 0-based ``step``: linear warmup, then cosine decay to ``lr / 10``."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
    return args.lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * progress)))


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    """Set the learning rate of every parameter group (ZeroOptimizer shares its inner groups)."""
    for group in opt.param_groups:
        group["lr"] = lr


def reference_losses(args, corpus: ByteCorpus, steps: int) -> list[float]:
    """Train an unsharded copy in this process on the same global batches; per-step losses."""
    model = build_model(args)
    mesh_independent_dropout(model, seed=args.seed)  # the masks the sharded run draws
    opt = torch.optim.AdamW(model.parameters(), **optimizer_kwargs(args))
    losses = []
    for step, (x, y) in zip(range(steps), train_batches(corpus, args)):
        set_lr(opt, learning_rate(step, args))
        _, loss = model(x, y)
        loss.backward()
        if args.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def compare_losses(sharded: list[float], reference: list[float]) -> float:
    """Print the two loss columns side by side; return the max relative difference."""
    print(f"{'step':>5} {'sharded':>12} {'reference':>12} {'rel diff':>10}")
    worst = 0.0
    for step, (a, b) in enumerate(zip(sharded, reference)):
        rel = abs(a - b) / max(abs(b), 1e-12)
        worst = max(worst, rel)
        print(f"{step + 1:>5} {a:>12.6f} {b:>12.6f} {rel:>10.2e}")
    return worst


def sample_text(args, state: dict, n_bytes: int) -> str:
    """Load full weights into a fresh unsharded GPT and sample ``n_bytes`` after a newline."""
    model = GPT(model_config(args))
    missing, unexpected = model.load_state_dict({k: v.cpu() for k, v in state.items()}, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:  # lm_head.weight may be left out: it IS wte.weight
        raise RuntimeError(f"full_state_dict does not fit GPT: missing {missing}, unexpected {unexpected}")
    prompt = torch.tensor([[ord("\n")]])
    out = model.eval().generate(prompt, n_bytes, temperature=0.8, generator=torch.Generator().manual_seed(args.seed))
    return bytes(out[0, 1:].tolist()).decode("utf-8", errors="replace")


def specs_for(mesh, args) -> tuple[dict, dict]:
    """Megatron tensor-parallel specs (and a vocabulary-parallel tied embedding) when the mesh has
    a ``tp`` axis, and the preset's options: the logits stay vocabulary-parallel into the loss
    (Megatron's layout), except on a pipeline mesh, whose criterion reads whole logits. ZeRO
    handles the data axes. The planner checks heads against the axis size."""
    if "tp" not in mesh.axis_names:
        return {}, {}
    preset = gpt_preset("tp")
    return preset.specs, ({} if mesh.shape.get("pp", 1) > 1 else dict(preset.options))


@torch.no_grad()
def evaluate(smodel, corpus, args, device) -> float:
    """Validation loss in nats/byte, averaged over the data axes; the same windows every call."""
    smodel.eval()
    g = torch.Generator().manual_seed(args.seed + 1)
    total = 0.0
    for _ in range(args.eval_batches):
        x, y = corpus.get_batch("val", args.batch_size, args.block_size, g)
        loss = forward_loss(smodel, local(x, smodel, device), local(y, smodel, device), backward=False)
        total += global_mean(loss, smodel)
    smodel.train()
    return total / args.eval_batches


def resume_path(path: str) -> str:
    """``path`` if it is a checkpoint, else the newest checkpoint in the folder ``path``."""
    from shardlib import checkpoint

    if os.path.exists(os.path.join(path, checkpoint.MARKER)):
        return path
    found = checkpoint.latest(path)
    if found is None:
        raise SystemExit(f"--resume {path}: not a checkpoint, and no finished checkpoint inside it")
    return found


def resumes_into(args) -> bool:
    """Whether ``--resume`` is the ``--ckpt-dir`` or a checkpoint directly inside it."""
    if not (args.resume and args.ckpt_dir):
        return False
    folder, resume = os.path.realpath(args.ckpt_dir), os.path.realpath(args.resume)
    return resume == folder or os.path.dirname(resume) == folder


def check_outputs(args) -> None:
    """Refuse, at start (every rank sees the same files, so every rank refuses), outputs that
    would replace or mix with an older run's: a --ckpt-dir that is not empty, unless --resume
    points into it or --overwrite-ckpt is given; an existing --export-safetensors file, unless
    --overwrite-ckpt. ``SystemExit``: one line through main_guard, exit status 2."""
    folder = args.ckpt_dir
    if folder and not args.eval_only and os.path.lexists(folder):
        if not os.path.isdir(folder):
            raise SystemExit(f"--ckpt-dir {folder}: it is a file, not a folder; name a folder for the checkpoints")
        names = sorted(os.listdir(folder))
        if names and not (args.overwrite_ckpt or resumes_into(args)):
            from shardlib import checkpoint

            ckpts = [n for n in names if os.path.exists(os.path.join(folder, n, checkpoint.MARKER))]
            others = [n for n in names if n not in ckpts]
            held = " and ".join(f"{what} {', '.join(group[:4])}{', ...' if len(group) > 4 else ''}"
                                for what, group in (("checkpoints", ckpts), ("other entries", others)) if group)
            raise SystemExit(
                f"--ckpt-dir {folder} already holds {held} (from an earlier run?): this run's checkpoints "
                f"would replace or mix with them. Fix: --resume {folder} to continue that run, --overwrite-ckpt to "
                f"save there anyway (replacing the checkpoints of the steps this run saves), or another --ckpt-dir")
    export = args.export_safetensors
    if export and os.path.isdir(export):
        raise SystemExit(f"--export-safetensors {export}: it is a folder; name the file to write, such as "
                         f"{os.path.join(export, 'model.safetensors')}")
    if export and os.path.lexists(export) and not args.overwrite_ckpt:
        raise SystemExit(f"--export-safetensors {export}: the file already exists. Fix: --overwrite-ckpt to replace "
                         f"it, or another file name")


def save_checkpoint(smodel, opt, args, step: int, data_gen: torch.Generator, history: list) -> str:
    """Sharded checkpoint after ``step`` steps (every rank): weights, AdamW state, data position.
    A checkpoint of this step already there is replaced only when allowed by check_outputs():
    --overwrite-ckpt, or a run resumed from this --ckpt-dir (which repeats the later steps)."""
    from shardlib import checkpoint

    path = os.path.join(args.ckpt_dir, f"step_{step:06d}")
    extra = dict(step=step, data_rng=data_gen.get_state(), history=history, args=vars(args))
    return checkpoint.save(path, smodel, opt, extra=extra, overwrite=args.overwrite_ckpt or resumes_into(args))


def local(batch, smodel, device):
    """This rank's rows of a global batch ``(B, T)``: local ``(B // |data axes|, T)``."""
    return shardlib.distribute(batch, smodel.mesh, smodel.batch_spec).to(device)


def lm_criterion(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy of logits ``(B, T, 256)`` against ``y`` ``(B, T)``."""
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def forward_loss(smodel, x, y, backward: bool) -> torch.Tensor:
    """This rank's mean loss on its batch (backward done if asked); a pipeline runs its schedule
    of microbatches and shares the last stage's loss with every stage."""
    if isinstance(smodel, shardlib.PipelineModule):
        run = smodel.forward_backward if backward else smodel.evaluate
        losses, _ = run(x, criterion=lm_criterion, labels=(y,))
        loss = torch.stack(losses).mean() if losses is not None else torch.zeros(())
        return shardlib.all_reduce(loss, smodel.pp_axis)  # zero on every stage but the last
    _, loss = smodel(x, y)
    if backward:
        loss.backward()
    return loss


def global_mean(loss: torch.Tensor, smodel) -> float:
    """Average a per-rank mean loss over the data axes: the loss on the global batch."""
    loss = loss.detach()
    return (shardlib.all_reduce(loss, smodel.data_axes, op="avg") if smodel.data_axes else loss).item()


def main(argv=None) -> int:
    args = parse_args(argv)  # every flag checked here, before the mesh exists
    check_outputs(args)  # before anything starts: an older run's checkpoints are not replaced
    mesh = shardlib.init_mesh(mesh_of(args))
    is_main = mesh.rank == 0
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    corpus = load_data(args)
    model = build_model(args).to(device)
    specs, preset_options = specs_for(mesh, args)
    if is_main:
        print(corpus)
        print(f"model: {model.num_params():,} parameters, mesh {mesh.shape}, ZeRO stage {args.zero_stage}")
    options = dict(zero_stage=args.zero_stage, sequence_parallel=args.sequence_parallel, dropout_seed=args.seed,
                   activation_checkpointing=None if args.activation_checkpointing == "none" else args.activation_checkpointing,
                   **preset_options)
    pipelined = mesh.shape.get("pp", 1) > 1
    if pipelined:  # stages over pp, each sharded over the other axes
        options.update(schedule=args.schedule, microbatches=args.microbatches)
    plan = shardlib.plan(model, mesh, specs, **options)  # checked on every rank; a PipelinePlan on a pp mesh
    if is_main:  # tokens per micro-batch on one rank, for the tensor-parallel and pipeline traffic
        local_rows = args.batch_size // plan.data_size
        print(plan.explain(tokens=(local_rows // args.microbatches if pipelined else local_rows) * args.block_size))
    smodel = plan.apply(model)  # == shardlib.shard(model, mesh, specs, **options)
    opt = shardlib.ZeroOptimizer(smodel, torch.optim.AdamW, max_grad_norm=args.grad_clip or None,
                                 **optimizer_kwargs(args))

    tokens_per_step = args.batch_size * args.block_size
    history = []  # one record per step, for --log-json and --check
    data_gen = torch.Generator().manual_seed(args.seed)
    start = 0
    if args.resume:
        from shardlib import checkpoint

        path = resume_path(args.resume)
        extra = checkpoint.load(path, smodel, opt)  # any mesh / ZeRO stage: resharded on load
        start, history = extra["step"], list(extra["history"])
        data_gen.set_state(extra["data_rng"])
        if is_main:
            print(f"resumed from {path} at step {start}")
    if args.eval_only:
        val_loss = evaluate(smodel, corpus, args, device)
        if is_main:
            print(f"val loss {val_loss:.4f} nats/byte after {start} steps ({args.eval_batches} batches of "
                  f"{args.batch_size} x {args.block_size} held-out bytes)")
        return 0
    batches = train_batches(corpus, args, data_gen)
    bar = tqdm(range(start, args.steps), disable=not is_main, dynamic_ncols=True)
    for step in bar:
        t0 = time.perf_counter()
        set_lr(opt, learning_rate(step, args))
        x, y = next(batches)  # the global batch, identical on every rank
        loss = forward_loss(smodel, local(x, smodel, device), local(y, smodel, device), backward=True)
        opt.step()
        opt.zero_grad()
        train_loss = global_mean(loss, smodel)
        tok_s = tokens_per_step / (time.perf_counter() - t0)
        val_loss = None
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            val_loss = evaluate(smodel, corpus, args, device)
            if is_main:
                bar.write(f"step {step + 1}: train {train_loss:.4f}, val {val_loss:.4f} nats/byte")
        bar.set_postfix(loss=f"{train_loss:.3f}", tok_s=f"{tok_s:,.0f}")
        history.append(dict(step=step + 1, lr=learning_rate(step, args), train_loss=train_loss,
                            val_loss=val_loss, tokens_per_s=tok_s))
        if args.ckpt_dir and ((args.save_every and (step + 1) % args.save_every == 0) or step + 1 == args.steps):
            path = save_checkpoint(smodel, opt, args, step + 1, data_gen, history)
            if is_main:
                bar.write(f"step {step + 1}: checkpoint {path}")
    bar.close()
    if args.export_safetensors:
        from shardlib import checkpoint

        if checkpoint.export_safetensors(args.export_safetensors, smodel, overwrite=args.overwrite_ckpt) and is_main:
            print(f"full weights: {args.export_safetensors}")

    if pipelined:  # every stage's actions of the last step, drawn on rank 0
        from shardlib.parallel.pipeline import timeline_svg

        timelines = [None] * mesh.size("pp")
        torch.distributed.all_gather_object(timelines, smodel.timeline, group=mesh.group("pp"))
        if is_main and args.timeline:
            os.makedirs(os.path.dirname(args.timeline) or ".", exist_ok=True)
            with open(args.timeline, "w") as f:
                f.write(timeline_svg(timelines))
            print(f"pipeline timeline of the last step: {args.timeline}")
    state = shardlib.full_state_dict(smodel)  # full tensors under the original names, every rank
    if not is_main:
        return 0
    print(f"final val loss {history[-1]['val_loss']:.3f} nats/byte (uniform guess {math.log(256):.3f})")
    if args.sample:
        print(f"sample: {sample_text(args, state, args.sample)!r}")
    if args.log_json:
        with open(args.log_json, "w") as f:
            json.dump(dict(args=vars(args), mesh=mesh.shape, history=history), f, indent=1)
    if args.check:
        n = min(args.check, len(history))
        print(f"--check: replaying {n} steps unsharded in one process")
        worst = compare_losses([h["train_loss"] for h in history[:n]], reference_losses(args, corpus, n))
        print(f"max relative loss difference {worst:.2e} (tolerance {CHECK_RTOL:.0e})")
        if worst > CHECK_RTOL:
            return 1
    return 0


@record  # under torchrun, a failing rank's traceback heads the error summary (crashes, not config errors)
def entry() -> int:
    return main_guard(main)  # a configuration error: one line, from the lowest failing rank


if __name__ == "__main__":
    sys.exit(entry())
