"""Train a small byte-level GPT with shardlib: ZeRO data parallel, optionally tensor parallel.

Launch:
    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py             # ZeRO-3 over dp=4
    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py --mesh dp=2,tp=2
    python examples/train_gpt.py --mesh dp=1                                  # one process
    torchrun ... examples/train_gpt.py --data ../shared/data/shakespeare --val-files hamlet.txt,tempest.txt

Every rank draws the same *global* batch from a generator seeded with ``--seed`` and keeps its
slice (``shardlib.distribute``), so ``--check N`` can replay the first N steps in one process,
unsharded, on exactly the same batches, and compare the losses.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
from tqdm import tqdm

import shardlib
from shardlib.data import ByteCorpus, default_corpus, load_corpus
from shardlib.models import GPT, GPTConfig, tp_specs

CHECK_RTOL = 1e-4


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", help="a text file or a folder of *.txt/*.py files (default: Python stdlib source)")
    p.add_argument("--val-files", default="", help="comma-separated held-out file names in --data")
    p.add_argument("--mesh", default=None, help="mesh axes, e.g. dp=4 or dp=2,tp=2 (default: dp=WORLD_SIZE)")
    p.add_argument("--zero-stage", type=int, default=3, choices=[0, 1, 2, 3])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=32, help="GLOBAL batch size (sequences per step)")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0, help="max global grad norm (0: off)")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--check", type=int, default=0, metavar="N",
                   help="replay the first N steps unsharded on rank 0 and compare losses")
    p.add_argument("--log-json", default=None, metavar="PATH", help="write the loss curve here")
    return p.parse_args(argv)


def parse_mesh(text: str | None) -> dict[str, int]:
    """``"dp=2,tp=2"`` -> ``{"dp": 2, "tp": 2}``; None -> ``{"dp": WORLD_SIZE or 1}``."""
    if not text:
        return {"dp": int(os.environ.get("WORLD_SIZE", "1"))}
    shape = {}
    for item in text.split(","):
        name, _, size = item.partition("=")
        if not size.strip().isdigit():
            raise SystemExit(f"--mesh {text!r}: expected axis=size pairs such as dp=2,tp=2")
        shape[name.strip()] = int(size)
    return shape


def model_config(args) -> GPTConfig:
    return GPTConfig(block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head,
                     n_embd=args.n_embd, dropout=args.dropout)


def build_model(args) -> GPT:
    """The same initial weights on every rank and in the --check replay: seeded, on CPU."""
    torch.manual_seed(args.seed)
    return GPT(model_config(args))


def load_data(args) -> ByteCorpus:
    if args.data is None:
        return default_corpus()
    return load_corpus(args.data, val_files=tuple(f for f in args.val_files.split(",") if f))


def train_batches(corpus: ByteCorpus, args):
    """Yield the GLOBAL training batches ``(x, y)``, int64 ``(batch_size, block_size)``."""
    g = torch.Generator().manual_seed(args.seed)
    while True:
        yield corpus.get_batch("train", args.batch_size, args.block_size, g)


def optimizer_kwargs(args) -> dict:
    return dict(lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95))


def reference_losses(args, corpus: ByteCorpus, steps: int) -> list[float]:
    """Train an unsharded copy in this process on the same global batches; per-step losses."""
    model = build_model(args)
    opt = torch.optim.AdamW(model.parameters(), **optimizer_kwargs(args))
    losses = []
    for _, (x, y) in zip(range(steps), train_batches(corpus, args)):
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
        print(f"{step:>5} {a:>12.6f} {b:>12.6f} {rel:>10.2e}")
    return worst


def specs_for(mesh, args) -> dict:
    """Megatron tensor-parallel specs when the mesh has a ``tp`` axis; ZeRO handles the rest."""
    if "tp" not in mesh.axis_names:
        return {}
    if args.n_head % mesh.size("tp"):
        raise SystemExit(f"--n-head {args.n_head} must be divisible by tp={mesh.size('tp')}: "
                         "tensor parallelism splits whole attention heads")
    return tp_specs("tp")


@torch.no_grad()
def evaluate(smodel, corpus, args, mesh, data_axes, device) -> float:
    """Validation loss in nats/byte, averaged over the data axes; the same windows every call."""
    smodel.eval()
    g = torch.Generator().manual_seed(args.seed + 1)
    total = 0.0
    for _ in range(args.eval_batches):
        x, y = corpus.get_batch("val", args.batch_size, args.block_size, g)
        _, loss = smodel(local(x, mesh, data_axes, device), local(y, mesh, data_axes, device))
        total += global_mean(loss, data_axes)
    smodel.train()
    return total / args.eval_batches


def local(batch, mesh, data_axes, device):
    """This rank's rows of a global batch ``(B, T)``: local ``(B // |data axes|, T)``."""
    spec = shardlib.P(data_axes) if data_axes else shardlib.P()
    return shardlib.distribute(batch, mesh, spec).to(device)


def global_mean(loss: torch.Tensor, data_axes) -> float:
    """Average a per-rank mean loss over the data axes: the loss on the global batch."""
    loss = loss.detach()
    return (shardlib.all_reduce(loss, data_axes, op="avg") if data_axes else loss).item()


def main(argv=None) -> int:
    args = parse_args(argv)
    mesh = shardlib.init_mesh(parse_mesh(args.mesh))
    is_main = mesh.rank == 0
    data_axes = tuple(a for a in mesh.axis_names if a in ("dp", "fsdp"))
    n_data = math.prod(mesh.size(a) for a in data_axes)
    if args.batch_size % n_data:
        raise SystemExit(f"--batch-size {args.batch_size} must be divisible by the data axes {data_axes} ({n_data})")
    if args.check and args.dropout:
        raise SystemExit("--check compares losses exactly; it needs --dropout 0")
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    corpus = load_data(args)
    model = build_model(args).to(device)
    specs = specs_for(mesh, args)
    if is_main:
        print(corpus)
        print(f"model: {model.num_params():,} parameters, mesh {mesh.shape}, ZeRO stage {args.zero_stage}")
        print(shardlib.plan(model, mesh, specs, zero_stage=args.zero_stage))
    smodel = shardlib.shard(model, mesh, specs, zero_stage=args.zero_stage)
    opt = shardlib.ZeroOptimizer(smodel, torch.optim.AdamW, max_grad_norm=args.grad_clip or None,
                                 **optimizer_kwargs(args))

    tokens_per_step = args.batch_size * args.block_size
    history, losses = [], []
    batches = train_batches(corpus, args)
    bar = tqdm(range(1, args.steps + 1), disable=not is_main, dynamic_ncols=True)
    for step in bar:
        t0 = time.perf_counter()
        x, y = next(batches)  # the global batch, identical on every rank
        _, loss = smodel(local(x, mesh, data_axes, device), local(y, mesh, data_axes, device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        train_loss = global_mean(loss, data_axes)
        tok_s = tokens_per_step / (time.perf_counter() - t0)
        losses.append(train_loss)
        val_loss = None
        if step % args.eval_every == 0 or step == args.steps:
            val_loss = evaluate(smodel, corpus, args, mesh, data_axes, device)
            if is_main:
                bar.write(f"step {step}: train {train_loss:.4f}, val {val_loss:.4f} nats/byte")
        bar.set_postfix(loss=f"{train_loss:.3f}", tok_s=f"{tok_s:,.0f}")
        history.append(dict(step=step, train_loss=train_loss, val_loss=val_loss, tokens_per_s=tok_s))
    bar.close()

    state = shardlib.full_state_dict(smodel)  # full tensors under the original names, every rank
    if not is_main:
        return 0
    print(f"final val loss {history[-1]['val_loss']:.3f} nats/byte (uniform guess {math.log(256):.3f})")
    print(f"full model: {sum(t.numel() for t in state.values()):,} elements in {len(state)} tensors")
    if args.log_json:
        with open(args.log_json, "w") as f:
            json.dump(dict(args=vars(args), mesh=mesh.shape, history=history), f, indent=1)
    if args.check:
        n = min(args.check, len(losses))
        print(f"--check: replaying {n} steps unsharded in one process")
        worst = compare_losses(losses[:n], reference_losses(args, corpus, n))
        print(f"max relative loss difference {worst:.2e} (tolerance {CHECK_RTOL:.0e})")
        if worst > CHECK_RTOL:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
