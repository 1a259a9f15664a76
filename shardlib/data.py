"""Byte-level text data for the examples: a corpus of uint8 bytes (vocabulary 256), split into
train and validation, and random training windows drawn from a seeded ``torch.Generator``.

Every rank draws the same *global* batch from the same seed and keeps its own slice
(``shardlib.distribute``), so a sharded run sees exactly the batches a single-process run sees.

Example:
    >>> corpus = default_corpus()  # the Python standard library's own source; no download
    >>> g = torch.Generator().manual_seed(0)
    >>> x, y = corpus.get_batch("train", batch_size=4, block_size=64, generator=g)
    >>> tuple(x.shape), x.dtype, bool((x[:, 1:] == y[:, :-1]).all())
    ((4, 64), torch.int64, True)
"""

from __future__ import annotations

import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar
from pathlib import Path

import torch

__all__ = ["open_corpus", "ByteCorpus", "load_corpus", "default_corpus", "TEXT_SUFFIXES"]

TEXT_SUFFIXES = (".txt", ".py")
_SEPARATOR = b"\n"  # between files, so one file's last line does not run into the next one's first


@dataclass(frozen=True)
class ByteCorpus:
    """A byte-level corpus split into train and validation.

    Attributes:
        train: uint8 ``(n_train,)``, the training bytes.
        val: uint8 ``(n_val,)``, the held-out bytes.
        train_files: names of the files in ``train`` (empty for a single file).
        val_files: names of the files in ``val`` (empty when split by fraction).
        source: where the text came from, for printing.
    """

    train: torch.Tensor
    val: torch.Tensor
    train_files: tuple[str, ...] = ()
    val_files: tuple[str, ...] = ()
    source: str = ""

    vocab_size: ClassVar[int] = 256  # every byte value is a token

    def split(self, name: str) -> torch.Tensor:
        """The bytes of ``"train"`` or ``"val"``; raises ValueError for any other name."""
        if name == "train":
            return self.train
        if name in ("val", "validation"):
            return self.val
        raise ValueError(f"unknown split {name!r}; use 'train' or 'val'")

    def get_batch(
        self, split: str, batch_size: int, block_size: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Random windows of ``block_size + 1`` bytes: inputs and next-byte targets.

        Args:
            split: ``"train"`` or ``"val"``.
            batch_size: B, the number of windows (the *global* batch in a sharded run).
            block_size: T, the window length.
            generator: the RNG; the same seed gives the same batch on every rank and machine.

        Returns:
            ``(x, y)``, both int64 ``(B, T)``, with ``y[:, t] == x[:, t + 1]`` for ``t < T - 1``.

        Raises:
            ValueError: the split holds ``block_size`` bytes or fewer.
        """
        data = self.split(split)
        n_starts = len(data) - block_size
        if n_starts < 1:
            raise ValueError(
                f"the {split!r} split has {len(data)} bytes, too few for windows of block_size="
                f"{block_size} (+1 target); use a smaller --block-size or more held-out text"
            )
        starts = torch.randint(n_starts, (batch_size, 1), generator=generator)  # (B, 1)
        windows = data[starts + torch.arange(block_size + 1)].long()  # (B, T + 1)
        return windows[:, :-1], windows[:, 1:]

    def __str__(self) -> str:
        files = f", {len(self.train_files)} train / {len(self.val_files)} val files" if self.val_files else ""
        return (
            f"{self.source}: {len(self.train):,} train bytes, {len(self.val):,} val bytes{files}"
        )


def _to_tensor(chunks: Sequence[bytes]) -> torch.Tensor:
    joined = _SEPARATOR.join(chunks)
    return torch.frombuffer(bytearray(joined), dtype=torch.uint8) if joined else torch.zeros(0, dtype=torch.uint8)


def _split_fraction(data: bytes, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    cut = int(len(data) * (1.0 - val_fraction))
    return _to_tensor([data[:cut]]), _to_tensor([data[cut:]])


def _from_files(files: Sequence[Path], root: Path, val_files: Sequence[str], val_fraction: float,
                source: str) -> ByteCorpus:
    names = [f.relative_to(root).as_posix() for f in files]
    if not val_files:  # hold out the tail of the concatenated text
        train, val = _split_fraction(_SEPARATOR.join(f.read_bytes() for f in files), val_fraction)
        return ByteCorpus(train, val, tuple(names), (), source)
    wanted = set(val_files)
    is_val = [name in wanted or Path(name).name in wanted for name in names]
    found = {n for n, v in zip(names, is_val) if v} | {Path(n).name for n, v in zip(names, is_val) if v}
    missing = sorted(wanted - found)
    if missing:
        raise ValueError(
            f"held-out files {missing} are not in {source} (it has {len(names)} files, e.g. "
            f"{names[:3]}); give names of files in the folder, e.g. {names[0]!r}"
        )
    train_files = [f for f, v in zip(files, is_val) if not v]
    val_paths = [f for f, v in zip(files, is_val) if v]
    if not train_files:
        raise ValueError(f"every file of {source} is held out; leave some for training")
    return ByteCorpus(
        train=_to_tensor([f.read_bytes() for f in train_files]),
        val=_to_tensor([f.read_bytes() for f in val_paths]),
        train_files=tuple(n for n, v in zip(names, is_val) if not v),
        val_files=tuple(n for n, v in zip(names, is_val) if v),
        source=source,
    )


def load_corpus(path: str | Path, val_files: Sequence[str] = (), val_fraction: float = 0.1) -> ByteCorpus:
    """Read a text file, or every ``*.txt`` / ``*.py`` file under a folder, as bytes.

    Files are read in sorted order of their path relative to the folder and joined with a
    newline. Validation is either the files named in ``val_files`` (matched by file name or by
    relative path) or, without them, the last ``val_fraction`` of the bytes.

    Args:
        path: a file, or a folder searched recursively.
        val_files: names of held-out files, e.g. ``("hamlet.txt", "tempest.txt")``; folders only.
        val_fraction: the held-out fraction at the end when ``val_files`` is empty.

    Returns:
        The corpus.

    Raises:
        FileNotFoundError: ``path`` does not exist or a folder holds no text files.
        ValueError: a held-out name matches no file, ``val_files`` with a single file, or a
            ``val_fraction`` outside (0, 1).
    """
    path = Path(path)
    if path.is_file():
        if val_files:
            raise ValueError(f"val_files={tuple(val_files)} needs a folder, but {path} is a file; "
                             "use val_fraction to hold out its end instead")
        train, val = _split_fraction(path.read_bytes(), val_fraction)
        return ByteCorpus(train, val, (), (), str(path))
    if not path.is_dir():
        raise FileNotFoundError(f"no such file or folder: {path}")
    files = sorted((f for f in path.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES),
                   key=lambda f: f.relative_to(path).as_posix())
    if not files:
        raise FileNotFoundError(f"{path} holds no {'/'.join(TEXT_SUFFIXES)} files")
    return _from_files(files, path, val_files, val_fraction, str(path))


def default_corpus(max_bytes: int = 3_000_000, val_every: int = 10) -> ByteCorpus:
    """The Python standard library's own source: a text corpus every machine already has.

    Takes the top-level ``*.py`` files of ``sysconfig.get_paths()["stdlib"]`` in sorted order
    until about ``max_bytes`` are collected, and holds out every ``val_every``-th of them (the
    10th, 20th, ...) as validation. Deterministic for a given Python version.

    Args:
        max_bytes: stop adding files once this many bytes are collected (3 MB: about 120 files).
        val_every: hold out one file in this many.

    Returns:
        The corpus; ``val_files`` names the held-out modules.

    Raises:
        FileNotFoundError: the standard library sources are not installed.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    chosen, total = [], 0
    for f in sorted(root.glob("*.py")):
        if total >= max_bytes:
            break
        chosen.append(f)
        total += f.stat().st_size
    if not chosen:
        raise FileNotFoundError(f"no Python sources under {root}; pass a text file or folder instead")
    held_out = [f.name for i, f in enumerate(chosen) if i % val_every == val_every - 1]
    if not held_out:  # fewer files than val_every: hold out the last one
        held_out = [chosen[-1].name]
    return _from_files(chosen, root, held_out, 0.1, f"Python {sysconfig.get_python_version()} stdlib")


def open_corpus(path: str | Path | None, val_files: Sequence[str] = ()) -> ByteCorpus:
    """``load_corpus(path, val_files)``, or :func:`default_corpus` when ``path`` is None.

    For command lines with ``--data`` and ``--val-files``.

    Raises:
        ValueError: ``val_files`` without ``path`` (the default corpus chooses its own held-out
            files, so the names would be silently ignored); and as :func:`load_corpus`.
    """
    if path is None:
        if val_files:
            raise ValueError(
                f"held-out files {', '.join(val_files)} (--val-files) name files of a --data folder, but no --data was "
                "given: the default corpus (the Python standard library's source) holds out every 10th file itself. "
                "Fix: pass --data FOLDER with those files, or drop --val-files")
        return default_corpus()
    return load_corpus(path, val_files=tuple(val_files))
