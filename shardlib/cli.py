"""Command-line glue for training scripts run under ``torchrun``: one error line, not 150.

:class:`ArgumentParser` shows every option's default in ``--help`` and turns a usage error into
one line; :func:`main_guard` prints a configuration error once, from the lowest failing rank.
Used by ``examples/train_gpt.py`` and ``examples/train_hf.py``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Callable

__all__ = [
    "ArgumentParser",
    "main_guard",
    "positive_int",
    "nonnegative_int",
    "nonnegative_float",
    "dropout_rate",
    "mesh_shape",
    "mesh_shape_rest",
    "CONFIG_ERRORS",
]

# What a bad configuration raises before training: plan checks (ShardingError and
# CheckpointError are ValueErrors), bad values (ValueError), missing files (FileNotFoundError);
# and a script's own ``raise SystemExit("message")``.
CONFIG_ERRORS = (ValueError, FileNotFoundError)
_QUIET_EXIT_DELAY_S = 3.0  # a rank that does not print waits this long, so torchrun does not kill the printer first


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and ``(default: ...)`` after every option's help that
    does not already say its default."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text.lower() or _no_default(action.default):
            return text
        return super()._get_help_string(action)


def _no_default(value) -> bool:
    """None, False, "" or SUPPRESS: nothing worth showing (0 and 0.0 are shown)."""
    return value is None or value is False or value == "" or value is argparse.SUPPRESS


def positive_int(text: str) -> int:
    """An argparse ``type``: an integer > 0 (``--steps 0`` is refused at parse time, not by a
    crash after training).

    Raises:
        argparse.ArgumentTypeError: not an integer, or <= 0 (argparse names the option).
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def nonnegative_int(text: str) -> int:
    """An argparse ``type``: an integer >= 0 (counts where 0 means none or off, e.g.
    ``--warmup 0``, ``--save-every 0``).

    Raises:
        argparse.ArgumentTypeError: not an integer, or negative.
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def _finite_float(text: str, wanted: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected {wanted}, got {value} (not finite)")
    return value


def nonnegative_float(text: str) -> float:
    """An argparse ``type``: a finite number >= 0 (``--lr``, ``--weight-decay``, ``--grad-clip``
    where 0 means off): a negative learning rate or clipping norm reverses the update.

    Raises:
        argparse.ArgumentTypeError: not a number, NaN or infinite, or negative.
    """
    value = _finite_float(text, "a finite number >= 0")
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {value}")
    return value


def dropout_rate(text: str) -> float:
    """An argparse ``type``: a probability in [0, 1) (``--dropout``; 1 would drop everything,
    ``nn.Dropout`` then divides by zero).

    Raises:
        argparse.ArgumentTypeError: not a number, or outside [0, 1).
    """
    value = _finite_float(text, "a probability in [0, 1)")
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a probability in [0, 1), got {value}")
    return value


def mesh_shape(text: str, rest: bool = False) -> dict[str, int]:
    """An argparse ``type``: ``"dp=2,tp=2"`` -> ``{"dp": 2, "tp": 2}`` (axis order kept: outer
    to inner).

    Each axis is named once, with an identifier for a name and an integer >= 1 for a size (a
    repeated axis used to collapse silently into one entry of the dict). ``rest``: one axis may
    be ``-1``, the rest of the ranks, as in a config's ``parallel.mesh`` (:func:`mesh_shape_rest`).

    Raises:
        argparse.ArgumentTypeError: an item that is not ``name=size``, a name that is not an
            identifier, a size that is not an integer >= 1 (or -1 once, with ``rest``), or an
            axis given twice.
    """
    shape: dict[str, int] = {}
    for item in text.split(","):
        name, eq, size = (part.strip() for part in item.partition("="))
        if not eq or not name or not size:
            raise argparse.ArgumentTypeError(f"{text!r}: {item.strip()!r} is not axis=size; expected e.g. dp=2,tp=2")
        if not name.isidentifier():
            raise argparse.ArgumentTypeError(f"{text!r}: axis name {name!r} is not an identifier; use e.g. dp, tp, pp")
        try:
            value = int(size)
        except ValueError:
            value = None
        if rest and value == -1 and -1 not in shape.values():
            pass  # the rest of the ranks, resolved with the world size
        elif value is None or value < 1:
            raise argparse.ArgumentTypeError(
                f"{text!r}: axis {name!r} has size {size!r}; every size must be an integer >= 1"
                + (" (or -1 for the rest of the ranks, on one axis)" if rest else ""))
        if name in shape:
            raise argparse.ArgumentTypeError(f"{text!r}: axis {name!r} is given twice; name each axis once, e.g. dp=2,tp=2")
        shape[name] = value
    return shape


def mesh_shape_rest(text: str) -> dict[str, int]:
    """:func:`mesh_shape` where one axis may be ``-1`` (the rest of the ranks): the ``--mesh`` of
    ``shardlib.eval``, which becomes the config's ``parallel.mesh``."""
    return mesh_shape(text, rest=True)


def mesh_of(args) -> dict[str, int]:
    """An example script's mesh shape: its ``--mesh`` (parsed by :func:`mesh_shape`), else
    ``{"dp": WORLD_SIZE or 1}``."""
    return dict(args.mesh) if args.mesh else {"dp": int(os.environ.get("WORLD_SIZE", "1"))}


def data_ranks(parser: argparse.ArgumentParser, batch_size: int, shape: dict[str, int]) -> int:
    """The ranks a global ``--batch-size`` is split over (the plan's default data axes, ``dp``
    and ``fsdp``), refused through ``parser.error`` (one usage line) unless they divide it."""
    data = [a for a in shape if a in ("dp", "fsdp")]
    ranks = math.prod(shape[a] for a in data)
    if batch_size % ranks:
        parser.error(f"--batch-size {batch_size} must be divisible by the data axes {data} of the mesh {shape} "
                     f"({ranks} ranks): every rank trains on an equal share of the global batch (DDP's mean)")
    return ranks


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose ``--help`` shows the defaults and whose usage errors
    raise ``SystemExit("prog: error: ... (see --help)")``, one line that :func:`main_guard`
    prints once instead of once per rank."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _Help)
        super().__init__(*args, **kwargs)

    def add_argument(self, *args, **kwargs):
        if "help" not in kwargs and not _no_default(kwargs.get("default")):
            kwargs["help"] = "(default: %(default)s)"  # argparse shows no default for an option without help
        return super().add_argument(*args, **kwargs)

    def error(self, message: str):
        raise SystemExit(f"{self.prog}: error: {message} (see --help)")


def _lowest_failing_rank(rank: int, wait_s: float = 1.0) -> bool:
    """Whether no rank below ``rank`` reported a failure (through the process group's store,
    within ``wait_s`` seconds). Without an initialized process group only rank 0 says yes: what
    fails before it (argument parsing) fails the same way on every rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return rank == 0
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        store = _get_default_store()
        store.set(f"shardlib/failed/{rank}", "1")
        deadline = time.monotonic() + (wait_s if rank > 0 else 0.0)
        lower = [f"shardlib/failed/{r}" for r in range(rank)]
        while True:
            if any(store.check([key]) for key in lower):
                return False
            if time.monotonic() >= deadline:
                return True
            time.sleep(0.05)
    except Exception:  # no store to ask: better twice than never
        return True


def main_guard(main: Callable[[], int | None], prog: str | None = None) -> int:
    """Run a training script's ``main()``; print a configuration error once, as one line.

    Under ``torchrun`` every rank raises the same plan-time error; printed by each rank with its
    traceback, plus the launcher's summary, that was about 150 lines. Here an error of the kinds
    in :data:`CONFIG_ERRORS`, or a ``SystemExit`` carrying a message (as
    :class:`ArgumentParser` raises), is printed by the lowest failing rank only (found through
    the process group's store; before ``torch.distributed`` is initialized, by rank 0), as
    ``prog: error: <message>``, and the exit status is 2. ``SHARDLIB_TRACEBACK=1`` re-raises
    instead, with the traceback. Any other exception propagates unchanged.

    Args:
        main: the entry point; its return value is the exit status (None: 0).
        prog: the name that starts the message (default: the script's file name).

    Returns:
        The exit status, for ``sys.exit(main_guard(main))``.
    """
    prog = prog or os.path.basename(sys.argv[0] or "shardlib")
    try:
        return int(main() or 0)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            raise
        message = str(exc.code)
    except CONFIG_ERRORS as exc:
        if os.environ.get("SHARDLIB_TRACEBACK") == "1":
            raise
        message = f"{type(exc).__name__}: {exc}"
    rank = int(os.environ.get("RANK", "0"))
    if _lowest_failing_rank(rank):
        if not message.startswith(f"{prog}: "):
            where = f" on rank {rank}" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
            message = f"{prog}: error{where}: {message}"
        print(message, file=sys.stderr, flush=True)
    else:
        time.sleep(_QUIET_EXIT_DELAY_S)
    return 2

