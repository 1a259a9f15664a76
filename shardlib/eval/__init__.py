"""Evaluation of a checkpoint: ``python -m shardlib.eval --config FILE --ckpt PATH [--mesh dp=2,tp=2]``.

Reports the validation loss (nats per token) of a checkpoint written by ``python -m
shardlib.train``, on any mesh: the checkpoint is resharded onto the mesh given (default: the
config's ``parallel.mesh``), and the loss is the mean over ``train.eval_steps`` fixed global
validation batches, the batches the training run evaluated on, so the figure equals the run's
last ``val_loss`` (to fp32 rounding across meshes).
"""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["validation_loss", "main", "entry"]


def validation_loss(cfg: Any, ckpt: str, log=print) -> dict[str, Any]:
    """The validation loss of checkpoint ``ckpt`` (a checkpoint folder, or a folder of them:
    its newest) for the model and data of ``cfg`` (every rank).

    Returns:
        ``{"val_loss": float, "step": the checkpoint's step, "checkpoint": path, "mesh": shape,
        "tokens": held-out tokens evaluated}``.

    Raises:
        CheckpointError: ``ckpt`` is no checkpoint and holds none, or does not fit the model.
        ConfigError: as :func:`shardlib.train.setup`.
    """
    from .. import checkpoint
    from ..train.loop import evaluate, setup

    path = os.path.expanduser(ckpt)
    if not os.path.exists(os.path.join(path, checkpoint.MARKER)):
        found = checkpoint.latest(path)
        if found is None:
            raise checkpoint.CheckpointError(f"--ckpt {ckpt!r}: not a checkpoint, and no finished checkpoint inside it")
        path = found
    cfg = type(cfg)({**cfg, "checkpoint": {**cfg.checkpoint, "dir": None, "resume": False, "interval": 0}})
    run = setup(cfg, log=log, load=path, verbose=False)
    t = cfg.train
    loss = evaluate(run.smodel, run.batches, t.eval_steps, run.device)
    return dict(val_loss=loss, step=run.start, checkpoint=path, mesh=dict(run.mesh.shape),
                tokens=t.eval_steps * t.global_batch * t.seq_len)


def main(argv: list[str] | None = None) -> int:
    """Parse ``--config``, ``--ckpt``, ``--mesh``, ``--set``/``--section.key=value`` and
    ``--json FILE``; print the validation loss on rank 0."""
    from ..cli import ArgumentParser, mesh_shape
    from ..config import load_config
    from ..train import parse_args as train_args

    p = ArgumentParser(prog="shardlib.eval", description=__doc__)
    p.add_argument("--ckpt", required=True, metavar="PATH", help="a checkpoint, or a folder of them (its newest)")
    p.add_argument("--mesh", type=mesh_shape, default=None, help="evaluate on this mesh, e.g. dp=2,tp=2 (default: "
                   "the config's parallel.mesh)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the result here (rank 0)")
    args, rest = p.parse_known_args(argv)
    if args.json and os.path.lexists(args.json):
        p.error(f"--json {args.json}: the file already exists; this tool does not replace it (name another file)")
    targs, overrides = train_args(rest)
    if args.mesh:
        overrides.append(f"parallel.mesh={dict(args.mesh)!r}")
    cfg = load_config(targs.config, overrides)
    out = validation_loss(cfg, args.ckpt)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"val loss {out['val_loss']:.4f} nats/token of {out['checkpoint']} (step {out['step']}) on mesh "
              f"{out['mesh']}, {out['tokens']:,} held-out tokens")
        if args.json:
            with open(args.json, "x") as f:
                json.dump(out, f, indent=1)
    return 0


def entry() -> int:
    """``python -m shardlib.eval``: :func:`main` under :func:`shardlib.cli.main_guard`."""
    from ..cli import main_guard

    return main_guard(main, prog="shardlib.eval")
