"""The training tool: ``python -m shardlib.train --config FILE [--set section.key=value ...]``.

HAI-LLM's way of training, on shardlib: a Python config file (:mod:`shardlib.config`) names the
parallel layout, the model builder, the optimizer and its schedule, the data, the run and the
checkpoints; the same file trains on one process or under ``torchrun`` on many nodes::

    torchrun --standalone --nproc-per-node 2 -m shardlib.train --config configs/embedded_default.py
    torchrun --standalone --nproc-per-node 4 -m shardlib.train --config configs/embedded_default.py \\
        --set parallel.mesh='{"dp": 2, "tp": 2}' --set train.steps=50
    shardlib-train --config configs/embedded_default.py --train.steps=50   # torchtitan-style override

Overrides: ``--set section.key=value`` (repeatable; the value read as a Python literal, else as a
string) or ``--section.key=value``. ``--print-config`` prints the checked config and exits.

Pieces: :mod:`~shardlib.train.schedule` (warmup + cosine/linear decay),
:mod:`~shardlib.train.batches` (global batches addressed by step: identical on every mesh,
resumed on the exact next batch), :mod:`~shardlib.train.metrics` (the log line, JSONL,
TensorBoard, the terminal bar), :mod:`~shardlib.train.checkpoints` (interval, keep-last,
resume) and :mod:`~shardlib.train.loop` (the step).
"""

from __future__ import annotations

import argparse
import json
import os
from ..config import load_config
from .loop import Run, evaluate, setup, train
from .schedule import learning_rate

__all__ = ["main", "entry", "train", "setup", "evaluate", "learning_rate", "Run", "parse_args"]


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """``(args, overrides)`` of a command line: ``--config``, ``--print-config``, and every
    ``--set K=V`` or ``--section.key=value`` as an override string ``"section.key=value"``.

    Raises:
        SystemExit: a usage error (one line, through :func:`shardlib.cli.main_guard`).
    """
    from ..cli import ArgumentParser

    p = ArgumentParser(prog="shardlib.train", description=__doc__)
    p.add_argument("--config", default=None, metavar="FILE", help="a Python config file (default: every default)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", dest="overrides",
                   help="override one config key (repeatable)")
    p.add_argument("--print-config", action="store_true", help="print the checked config as JSON and exit")
    args, rest = p.parse_known_args(argv)
    overrides = list(args.overrides)
    i = 0
    while i < len(rest):
        item = rest[i]
        if item.startswith("--") and "." in item.split("=", 1)[0]:
            if "=" in item:
                overrides.append(item[2:])
            elif i + 1 < len(rest):
                overrides.append(f"{item[2:]}={rest[i + 1]}")
                i += 1
            else:
                p.error(f"{item} needs a value ({item}=VALUE)")
        else:
            p.error(f"unrecognized argument {item!r}; config keys are overridden as --set section.key=value")
        i += 1
    return args, overrides


def main(argv: list[str] | None = None) -> int:
    """The entry point's body: load the config, train, report; the exit status."""
    args, overrides = parse_args(argv)
    cfg = load_config(args.config, overrides)
    if args.print_config:
        if int(os.environ.get("RANK", "0")) == 0:
            print(json.dumps(cfg.to_dict(), indent=1, default=str))
        return 0
    train(cfg, args.config)
    return 0


def entry() -> int:
    """``shardlib-train`` / ``python -m shardlib.train``: :func:`main` under
    :func:`shardlib.cli.main_guard` (a config error is one line from the lowest failing rank,
    exit status 2) and torchrun's ``record`` (a crash's traceback heads the launcher's summary)."""
    from torch.distributed.elastic.multiprocessing.errors import record

    from ..cli import main_guard

    return record(lambda: main_guard(main, prog="shardlib.train"))()
