"""``python -m shardlib.plot runs/x/metrics.jsonl [--out curves.png]``: loss and throughput curves.

Reads the training tool's metrics file (:mod:`shardlib.train.metrics`: one JSON record per
step) and draws two panels into a PNG with matplotlib: the training loss per step with the
validation loss at its evaluation steps (nats per token), and tokens per second (all ranks). A
resumed run's file already holds each step once. An existing ``--out`` is not replaced unless
``--overwrite``.
"""

from __future__ import annotations

import json
import os
import sys

__all__ = ["read_metrics", "plot_metrics", "main"]


def read_metrics(path: str) -> list[dict]:
    """The records of a metrics file, in step order (a step logged twice: its last record).

    Raises:
        FileNotFoundError: no file. ValueError: a line that is not a JSON record with a ``step``,
            naming the line.
    """
    records: dict[int, dict] = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                records[int(rec["step"])] = rec
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{n}: not a metrics record ({exc}): {line[:80]!r}") from exc
    return [records[s] for s in sorted(records)]


def plot_metrics(records: list[dict], out: str, title: str = "") -> str:
    """Draw ``records`` into the PNG ``out`` (loss panel, tokens/s panel); returns ``out``.

    Raises:
        ValueError: no records.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not records:
        raise ValueError("plot_metrics: no records to draw")
    steps = [r["step"] for r in records]
    fig, (ax_loss, ax_tps) = plt.subplots(1, 2, figsize=(11, 4))
    ax_loss.plot(steps, [r["loss"] for r in records], label="train", lw=1)
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    if val:
        ax_loss.plot(*zip(*val), "o-", label="validation")
    ax_loss.set(xlabel="step", ylabel="loss (nats/token)", title="loss")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    ax_tps.plot(steps, [r["tokens_per_s"] for r in records], lw=1)
    ax_tps.set(xlabel="step", ylabel="tokens/s (all ranks)", title="throughput")
    ax_tps.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    """The command line: ``METRICS [--out PNG] [--overwrite]``; exit status 2 on a usage error."""
    from .cli import ArgumentParser, main_guard

    def run() -> int:
        p = ArgumentParser(prog="shardlib.plot", description=__doc__)
        p.add_argument("metrics", help="a metrics.jsonl written by python -m shardlib.train")
        p.add_argument("--out", default=None, help="the PNG to write (default: next to METRICS, curves.png)")
        p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
        args = p.parse_args(argv)
        out = args.out or os.path.join(os.path.dirname(args.metrics) or ".", "curves.png")
        if os.path.lexists(out) and not args.overwrite:
            p.error(f"--out {out}: the file already exists; pass --overwrite to replace it, or another --out")
        plot_metrics(read_metrics(args.metrics), out, title=args.metrics)
        print(f"curves: {out}")
        return 0

    return main_guard(run, prog="shardlib.plot")


if __name__ == "__main__":
    sys.exit(main())
