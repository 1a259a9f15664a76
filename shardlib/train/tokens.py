"""Tokenized data: byte-level BPE tokenizers and memory-mapped token files.

A corpus is tokenized once into ``train.bin`` and ``val.bin`` (the token ids, ``uint16`` when
the vocabulary fits, else ``uint32``) plus ``meta.json``, nanoGPT's and Megatron's
pre-tokenized format, and read back through ``numpy.memmap``: a run touches only the windows it
draws, however large the corpus. The tokenizer is the user's ``tokenizer.json`` or a byte-level
BPE (GPT-2's scheme, Radford et al. 2019; trained with the ``tokenizers`` library) learned on the
training split. Both are cached under ``data.cache_dir`` (default ``$SHARDLIB_CACHE/tokens`` or
``~/.cache/shardlib/tokens``) in folders named by a hash of their inputs, so a second run, or
another mesh, reads the same files. One process per node (``LOCAL_RANK`` 0) writes them, into a
folder of its own that it then renames into place; the others wait for the folder, bounded by
``SHARDLIB_TOKENIZE_WAIT`` seconds (default 1800).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..config import Config, ConfigError
from ..data import ByteCorpus

__all__ = ["train_bpe", "load_tokenizer", "TokenCorpus", "pretokenize", "tokenized", "cache_root", "EOT"]

EOT = "<|endoftext|>"  # GPT-2's end-of-text token, id 0 in a tokenizer trained here
_LINES_PER_BATCH = 4096


def train_bpe(texts: list[str], vocab_size: int):
    """A byte-level BPE tokenizer (``tokenizers.Tokenizer``) learned on ``texts``.

    Byte-level: the 256 byte values are the base alphabet, so any text encodes and decodes
    exactly; ``<|endoftext|>`` is added as a special token.

    Args:
        texts: the training text (e.g. one string per file).
        vocab_size: the vocabulary size, at least 257 (the bytes and the special token).

    Raises:
        ValueError: ``vocab_size`` below 257.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise ValueError(f"train_bpe: vocab_size must be >= 257 (256 bytes + {EOT}), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[EOT], show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return tok


def load_tokenizer(path: str):
    """The ``tokenizers.Tokenizer`` saved at ``path`` (a ``tokenizer.json``, e.g. a Hugging Face model's).

    Raises:
        ConfigError: the file is missing or not a tokenizer.
    """
    from tokenizers import Tokenizer

    if not os.path.isfile(path):
        raise ConfigError(f"config key 'data.tokenizer' names {path!r}, which is not a file (give 'bytes', 'bpe' or "
                          f"the path of a tokenizer.json)")
    try:
        return Tokenizer.from_file(path)
    except Exception as exc:  # noqa: BLE001 - the user's file: name it
        raise ConfigError(f"config key 'data.tokenizer': {path!r} is not a tokenizer.json ({exc})") from exc


@dataclass(frozen=True)
class TokenCorpus:
    """Token ids split into train and validation, memory-mapped from a pre-tokenized folder.

    Attributes:
        train: ``(n_train,)`` token ids (``numpy.memmap``, uint16 or uint32).
        val: ``(n_val,)`` token ids.
        vocab_size: V, the tokenizer's vocabulary size.
        folder: the folder of ``train.bin``, ``val.bin``, ``meta.json`` and ``tokenizer.json``.
        source: where the text came from, for printing.
    """

    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    folder: str
    source: str = ""

    @classmethod
    def open(cls, folder: str, source: str = "") -> "TokenCorpus":
        """Map the files of a folder :func:`pretokenize` wrote."""
        with open(os.path.join(folder, "meta.json")) as f:
            meta = json.load(f)
        dtype = np.dtype(meta["dtype"])
        arrays = [np.memmap(os.path.join(folder, f"{s}.bin"), dtype=dtype, mode="r", shape=(meta[f"{s}_tokens"],))
                  if meta[f"{s}_tokens"] else np.zeros(0, dtype) for s in ("train", "val")]
        return cls(arrays[0], arrays[1], int(meta["vocab_size"]), folder, source or meta.get("source", ""))

    def tokenizer(self):
        """The ``tokenizers.Tokenizer`` the ids come from."""
        return load_tokenizer(os.path.join(self.folder, "tokenizer.json"))

    def split(self, name: str) -> np.ndarray:
        """The ids of ``"train"`` or ``"val"``; raises ValueError for any other name."""
        if name == "train":
            return self.train
        if name in ("val", "validation"):
            return self.val
        raise ValueError(f"unknown split {name!r}; use 'train' or 'val'")

    def get_batch(self, split: str, batch_size: int, block_size: int,
                  generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Random windows of ``block_size + 1`` tokens, as :meth:`shardlib.data.ByteCorpus.get_batch`:
        ``(x, y)`` int64 ``(B, T)``, ``y`` the next tokens of ``x``.

        Raises:
            ValueError: the split holds ``block_size`` tokens or fewer.
        """
        data = self.split(split)
        n_starts = len(data) - block_size
        if n_starts < 1:
            raise ValueError(f"the {split!r} split has {len(data)} tokens, too few for windows of seq_len={block_size} "
                             f"(+1 target); use a shorter train.seq_len or more held-out text")
        starts = torch.randint(n_starts, (batch_size,), generator=generator).tolist()
        windows = torch.from_numpy(np.stack([np.asarray(data[s:s + block_size + 1], dtype=np.int64) for s in starts]))
        return windows[:, :-1], windows[:, 1:]

    def __str__(self) -> str:
        return (f"{self.source}: {len(self.train):,} train tokens, {len(self.val):,} val tokens, vocabulary "
                f"{self.vocab_size:,} ({self.folder})")


def _encode(tokenizer, data: torch.Tensor) -> np.ndarray:
    text = bytes(data.numpy().tobytes()).decode("utf-8", errors="replace")
    lines = text.splitlines(keepends=True)
    ids: list[np.ndarray] = []
    for i in range(0, len(lines), _LINES_PER_BATCH):
        for enc in tokenizer.encode_batch(lines[i:i + _LINES_PER_BATCH], add_special_tokens=False):
            ids.append(np.asarray(enc.ids, dtype=np.int64))
    return np.concatenate(ids) if ids else np.zeros(0, np.int64)


def _publish(folder: str, write) -> None:
    """Fill ``folder`` through ``write(tmp)``: into ``<folder>.partial-<host>-<pid>`` (this
    process's own), renamed to ``folder`` at the end; when another process renamed its copy
    first (its ``meta.json`` is there), this copy is removed and theirs stands. On any failure
    this process's folder is removed."""
    tmp = f"{folder}.partial-{socket.gethostname()}-{os.getpid()}"
    os.makedirs(tmp)
    try:
        write(tmp)
        try:
            os.rename(tmp, folder)
        except OSError:
            if not os.path.isfile(os.path.join(folder, "meta.json")):
                raise
            shutil.rmtree(tmp)  # another process finished first: read theirs
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def pretokenize(corpus: ByteCorpus, tokenizer, folder: str) -> TokenCorpus:
    """Tokenize ``corpus`` into ``folder`` (which must not exist) and map it back.

    Written into ``<folder>.partial-<host>-<pid>`` and renamed to ``folder`` at the end; when
    another process renamed its copy first, this copy is removed and theirs is read.

    Returns:
        The :class:`TokenCorpus` at ``folder``.
    """
    def write(tmp: str) -> None:
        vocab = tokenizer.get_vocab_size()
        dtype = np.uint16 if vocab <= 2**16 else np.uint32
        meta: dict[str, Any] = dict(writer="shardlib", vocab_size=vocab, dtype=np.dtype(dtype).name, source=corpus.source)
        for split in ("train", "val"):
            ids = _encode(tokenizer, corpus.split(split)).astype(dtype)
            ids.tofile(os.path.join(tmp, f"{split}.bin"))
            meta[f"{split}_tokens"] = int(ids.size)
            meta[f"{split}_bytes"] = int(corpus.split(split).numel())
        tokenizer.save(os.path.join(tmp, "tokenizer.json"))
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1)

    _publish(folder, write)
    return TokenCorpus.open(folder, corpus.source)


def cache_root(data: Config) -> str:
    """Where token files and trained tokenizers go: ``data.cache_dir``, else
    ``$SHARDLIB_CACHE/tokens``, else ``~/.cache/shardlib/tokens``."""
    if data.cache_dir:
        return os.path.expanduser(data.cache_dir)
    return os.path.join(os.environ.get("SHARDLIB_CACHE", os.path.expanduser("~/.cache/shardlib")), "tokens")


def _digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(hashlib.sha256(p).digest())
    return h.hexdigest()[:20]


def _wait_for(folder: str, what: str) -> None:
    limit = float(os.environ.get("SHARDLIB_TOKENIZE_WAIT", "1800"))
    deadline = time.monotonic() + limit
    while not os.path.isfile(os.path.join(folder, "meta.json")):
        if time.monotonic() > deadline:
            raise ConfigError(f"waited {limit:.0f} s for {what} in {folder!r}, which the node's LOCAL_RANK 0 writes. "
                              f"On several nodes the cache must be on a file system every node sees, or on each "
                              f"node's own disk: set data.cache_dir (SHARDLIB_TOKENIZE_WAIT sets the wait)")
        time.sleep(0.2)


def tokenized(data: Config, corpus: ByteCorpus, writer: bool | None = None, log=print) -> TokenCorpus:
    """The token files of ``corpus`` under the config's tokenizer (``data.tokenizer`` is
    ``"bpe"``: a byte-level BPE of ``data.vocab_size`` learned on the training split, or the path
    of a ``tokenizer.json``), made once and cached (see the module).

    Args:
        data: the config's ``data`` section.
        corpus: the text, as bytes (:func:`~shardlib.train.batches.open_data`).
        writer: whether this process writes missing files (default: ``LOCAL_RANK`` is 0); the
            others wait for them.
        log: where the writer's lines go.

    Raises:
        ConfigError: an unreadable ``tokenizer.json``; a wait for the writer past its bound.
    """
    writer = int(os.environ.get("LOCAL_RANK", "0")) == 0 if writer is None else writer
    root = cache_root(data)
    train_bytes = corpus.train.numpy().tobytes()
    if data.tokenizer == "bpe":
        tok_dir = os.path.join(root, f"bpe-{data.vocab_size}-{_digest(train_bytes)}")
        if not os.path.isfile(os.path.join(tok_dir, "meta.json")):
            if writer:
                t0 = time.perf_counter()
                tok = train_bpe([train_bytes.decode("utf-8", errors="replace")], data.vocab_size)
                os.makedirs(root, exist_ok=True)

                def write(tmp: str) -> None:
                    tok.save(os.path.join(tmp, "tokenizer.json"))
                    with open(os.path.join(tmp, "meta.json"), "w") as f:
                        json.dump(dict(writer="shardlib", vocab_size=tok.get_vocab_size()), f)

                _publish(tok_dir, write)
                log(f"tokenizer: byte-level BPE of {tok.get_vocab_size():,} tokens learned on {len(train_bytes):,} "
                    f"bytes in {time.perf_counter() - t0:.1f} s: {os.path.join(tok_dir, 'tokenizer.json')}")
            else:
                _wait_for(tok_dir, "the BPE tokenizer")
        tok_path = os.path.join(tok_dir, "tokenizer.json")
    else:
        tok_path = os.path.expanduser(data.tokenizer)
    tokenizer = load_tokenizer(tok_path)
    key = _digest(train_bytes, corpus.val.numpy().tobytes(), tokenizer.to_str().encode())
    folder = os.path.join(root, f"corpus-{key}")
    if not os.path.isfile(os.path.join(folder, "meta.json")):
        if writer:
            os.makedirs(root, exist_ok=True)
            t0 = time.perf_counter()
            out = pretokenize(corpus, tokenizer, folder)
            log(f"tokenized {len(out.train) + len(out.val):,} tokens in {time.perf_counter() - t0:.1f} s: {folder}")
            return out
        _wait_for(folder, "the token files")
    return TokenCorpus.open(folder, corpus.source)
