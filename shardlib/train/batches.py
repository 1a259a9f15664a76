"""The training tool's data: a corpus from the config's ``data`` section and its global batches.

Batch ``k`` of a run is drawn from a generator seeded with ``(seed, k)`` alone, so it is the same
on every rank and every mesh (each rank keeps its rows with :func:`shardlib.distribute`), and the
data position a checkpoint stores is one number: a resumed run continues on exactly the next
batch. Validation batches are a fixed set, the same at every evaluation.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import torch

from ..config import SCHEMA, Config, ConfigError
from ..data import ByteCorpus, default_corpus, load_corpus

__all__ = ["SOURCES", "TOKENIZERS", "open_data", "tokenizer_id", "Batches"]

SOURCES = ("embedded", "files")
TOKENIZERS = ("bytes", "bpe")  # or the path of a tokenizer.json
_STRIDE = 1_000_003  # a prime: (seed, k) -> seed * _STRIDE + k does not collide for k < _STRIDE


def open_data(data: Config, log=print):
    """The corpus of a config's ``data`` section: a :class:`~shardlib.data.ByteCorpus` for
    ``tokenizer="bytes"``, else a :class:`~shardlib.train.tokens.TokenCorpus` (``"bpe"``: a
    byte-level BPE of ``data.vocab_size`` tokens learned on the training split; or the path of a
    ``tokenizer.json``), pre-tokenized once into memory-mapped files (:mod:`shardlib.train.tokens`).

    ``source="embedded"``: the Python standard library's own source (:func:`shardlib.data.default_corpus`).
    ``source="files"``: ``files`` names one text file or folder (``*.txt``/``*.py`` under it),
    held out as the files named in ``val_files`` or else the last ``val_fraction`` of the bytes
    (:func:`shardlib.data.load_corpus`).

    Raises:
        ConfigError: an unknown source or tokenizer, ``files`` not one existing path, a
            ``val_fraction`` outside (0, 1) (any source), ``val_files`` naming no file of the
            folder, all of them, or given for a single file; each naming the key. ``val_fraction``
            or ``val_files`` set with the embedded source are logged as not used (its split is
            fixed), and ``val_fraction`` set beside ``val_files``.
    """
    if data.tokenizer not in TOKENIZERS and not data.tokenizer.endswith(".json"):
        raise ConfigError(f"config key 'data.tokenizer' is {data.tokenizer!r}; give 'bytes' (vocabulary 256), 'bpe' "
                          f"(learned on the corpus, data.vocab_size tokens) or the path of a tokenizer.json")
    if not 0.0 < data.val_fraction < 1.0:  # a bad value is refused whatever the source
        raise ConfigError(f"config key 'data.val_fraction' must be in (0, 1), got {data.val_fraction}")
    fraction_set = data.val_fraction != SCHEMA["data"]["val_fraction"][1]
    if data.source == "embedded":  # its split is fixed: say so rather than ignore a key set on purpose
        unused = ([f"data.val_fraction={data.val_fraction!r}"] if fraction_set
                  else []) + ([f"data.val_files={list(data.val_files)!r}"] if data.val_files else [])
        if unused:
            log(f"data: {', '.join(unused)} apply to data.source='files'; the embedded corpus holds out every 10th "
                "module of the standard library: not used")
    elif data.val_files and fraction_set:
        log(f"data: data.val_fraction={data.val_fraction!r} applies without data.val_files; the files "
            f"{list(data.val_files)!r} are held out instead: not used")
    corpus = _bytes(data)
    if data.tokenizer == "bytes":
        return corpus
    from .tokens import tokenized

    return tokenized(data, corpus, log=log)


def _bytes(data: Config) -> ByteCorpus:
    if data.source not in SOURCES:
        raise ConfigError(f"config key 'data.source' is {data.source!r}; the sources are: {', '.join(SOURCES)}")
    if data.source == "embedded":
        if data.files:
            raise ConfigError(f"config key 'data.files' is {list(data.files)} but data.source is 'embedded' (the "
                              f"standard library's source). Fix: data.source='files' to read them")
        return default_corpus()
    if len(data.files) != 1:
        raise ConfigError(f"config key 'data.files' must name one text file or folder for data.source='files', got "
                          f"{list(data.files)}")
    path = os.path.expanduser(str(data.files[0]))
    if not os.path.exists(path):
        raise ConfigError(f"config key 'data.files' names {path!r}, which does not exist")
    try:
        return load_corpus(path, tuple(data.val_files), data.val_fraction)
    except ValueError as exc:  # (val_fraction is checked before): the held-out files
        raise ConfigError(f"config key 'data.val_files' is {list(data.val_files)!r}: {exc}") from None


def tokenizer_id(corpus) -> str:
    """What a corpus' token ids mean: ``"bytes"`` for a byte corpus, else ``"sha256:<20 hex>"`` of
    the ``tokenizer.json`` its ids were made with (:class:`~shardlib.train.tokens.TokenCorpus`;
    one tokenizer gives one digest wherever its cache lies: a BPE learned twice on the same
    text is the same file)."""
    folder = getattr(corpus, "folder", None)
    if folder is None:
        return "bytes"
    with open(os.path.join(folder, "tokenizer.json"), "rb") as f:
        return "sha256:" + hashlib.sha256(f.read()).hexdigest()[:20]


class Batches:
    """Global next-token batches of a corpus, addressed by their index in the run.

    Args:
        corpus: the tokens (:class:`~shardlib.data.ByteCorpus`).
        global_batch: B, sequences per optimizer step (all ranks together).
        seq_len: T, tokens per sequence.
        seed: the run's seed.

    Raises:
        ValueError: a split with ``seq_len`` tokens or fewer.
    """

    def __init__(self, corpus: ByteCorpus, global_batch: int, seq_len: int, seed: int):
        self.corpus, self.global_batch, self.seq_len, self.seed = corpus, global_batch, seq_len, seed
        self.next = 0  # the index of the next training batch: the data position
        self.tokenizer = tokenizer_id(corpus)

    def _generator(self, index: int, split: int) -> torch.Generator:
        return torch.Generator().manual_seed(((self.seed * 2 + split) * _STRIDE + index) % (2**63))

    def train(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Training batch ``index``: ``(x, y)`` int64 ``(B, T)``, ``y`` the next tokens of ``x``."""
        return self.corpus.get_batch("train", self.global_batch, self.seq_len, self._generator(index, 0))

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.train(self.next)
        self.next += 1
        return batch

    def val(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Validation batch ``index`` (the same windows at every evaluation): int64 ``(B, T)``."""
        return self.corpus.get_batch("val", self.global_batch, self.seq_len, self._generator(index, 1))

    def state_dict(self) -> dict[str, Any]:
        """The data position, for a checkpoint: ``{"next": k, "seed": s, "global_batch": B, "seq_len": T}``,
        and what the token ids mean (``"tokenizer"``: :func:`tokenizer_id`, ``"vocab_size"``)."""
        return dict(next=self.next, seed=self.seed, global_batch=self.global_batch, seq_len=self.seq_len,
                    tokenizer=self.tokenizer, vocab_size=self.corpus.vocab_size)

    def check_tokens(self, state: dict[str, Any], saved_data: dict[str, Any] | None = None) -> None:
        """Refuse a checkpoint whose model learned on the ids of another tokenizer (a resume, or
        an evaluation): its embedding rows would mean other tokens, and the loss would be
        nonsense without an error. A checkpoint that did not record its tokenizer is not checked.

        Args:
            state: the checkpoint's data state (:meth:`state_dict`).
            saved_data: the checkpoint's config ``data`` section, named in the message.

        Raises:
            ConfigError: the tokenizers differ.
        """
        theirs = state.get("tokenizer")
        if theirs is None or theirs == self.tokenizer:
            return
        was = ""
        if saved_data:
            was = " (" + ", ".join(f"data.{k}={saved_data.get(k)!r}" for k in ("tokenizer", "vocab_size", "files")
                                   if k in saved_data) + ")"
        raise ConfigError(f"the checkpoint's model learned on the token ids of another tokenizer{was}: {theirs}, "
                          f"a vocabulary of {state.get('vocab_size')}; this config's data give {self.tokenizer}, a "
                          f"vocabulary of {self.corpus.vocab_size}, so its embedding rows would mean other tokens. "
                          f"Fix: the checkpoint's data section (data.tokenizer, data.vocab_size, data.files)")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at the saved position.

        Raises:
            ConfigError: the checkpoint's seed, global batch or sequence length differ from this
                run's (its next batch would not be the batch the run was going to see).
        """
        for key, mine in (("seed", self.seed), ("global_batch", self.global_batch), ("seq_len", self.seq_len)):
            if state.get(key, mine) != mine:
                where = "train.seed" if key == "seed" else f"train.{key}"
                raise ConfigError(f"the checkpoint's data were drawn with {where}={state[key]}, this config has "
                                  f"{mine}: the resumed run would not continue on the next batch. Fix: --set "
                                  f"{where}={state[key]}")
        self.next = int(state["next"])
