"""Tokenized data for the training tool: a byte-level BPE learned on the corpus, memory-mapped
token files made once and cached, and a run that trains on them."""

import json
import os

import numpy as np
import pytest
import torch

from shardlib.config import ConfigError, load_config
from shardlib.data import ByteCorpus
from shardlib.testing import run_on
from shardlib.train.build import check_run
from shardlib.train.tokens import TokenCorpus, pretokenize, tokenized, train_bpe

TEXT = ("To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n"
        "The slings and arrows of outrageous fortune,\nOr to take arms against a sea of troubles\n") * 40
VAL = "And by opposing end them. To die: to sleep;\nNo more; and by a sleep to say we end\n" * 10


def _corpus():
    t = lambda s: torch.frombuffer(bytearray(s.encode()), dtype=torch.uint8)
    return ByteCorpus(t(TEXT), t(VAL), source="hamlet")


def _data(tmp_path, **kw):
    return load_config(None, [f"data.cache_dir={str(tmp_path)!r}", "data.tokenizer='bpe'", "data.vocab_size=300",
                              *[f"data.{k}={v!r}" for k, v in kw.items()]]).data


def test_bpe_round_trips_and_token_files_hold_the_text(tmp_path):
    tok = train_bpe([TEXT], 300)
    assert tok.get_vocab_size() == 300
    assert tok.decode(tok.encode("Whether 'tis nobler, é ☃").ids) == "Whether 'tis nobler, é ☃"  # byte-level: exact
    out = pretokenize(_corpus(), tok, str(tmp_path / "c"))
    assert out.train.dtype == np.uint16 and len(out.train) < 0.6 * len(TEXT)  # 43 merges: 0.53 tokens per byte here
    assert tok.decode(out.train.tolist()) == TEXT and tok.decode(out.val.tolist()) == VAL
    x, y = out.get_batch("train", 4, 16, torch.Generator().manual_seed(0))
    assert x.shape == (4, 16) and x.dtype == torch.int64 and torch.equal(x[:, 1:], y[:, :-1])
    assert sorted(os.listdir(tmp_path)) == ["c"]  # the partial folder was renamed into place


def test_tokenized_is_made_once_and_cached(tmp_path):
    data = _data(tmp_path)
    lines = []
    first = tokenized(data, _corpus(), writer=True, log=lines.append)
    assert any("byte-level BPE of 300 tokens" in x for x in lines) and any("tokenized" in x for x in lines)
    stamp = os.path.getmtime(os.path.join(first.folder, "train.bin"))
    lines.clear()
    again = tokenized(data, _corpus(), writer=False, log=lines.append)  # a reader finds the files at once
    assert lines == [] and again.folder == first.folder
    assert os.path.getmtime(os.path.join(first.folder, "train.bin")) == stamp
    assert np.array_equal(np.asarray(again.train), np.asarray(first.train))
    # a user's tokenizer.json: the one just learned, by path
    same = tokenized(_data(tmp_path, tokenizer=os.path.join(first.folder, "tokenizer.json")), _corpus(), writer=True)
    assert same.folder == first.folder
    assert json.load(open(os.path.join(first.folder, "meta.json")))["vocab_size"] == 300


def test_a_reader_waits_bounded_and_bad_tokenizers_are_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDLIB_TOKENIZE_WAIT", "0.3")
    with pytest.raises(ConfigError, match="waited 0 s for the BPE tokenizer .* set data.cache_dir"):
        tokenized(_data(tmp_path), _corpus(), writer=False)
    with pytest.raises(ConfigError, match="is not a file"):
        tokenized(_data(tmp_path, tokenizer=str(tmp_path / "none.json")), _corpus(), writer=True)
    with pytest.raises(ConfigError, match=r"'model.vocab_size' \(256\) is below 'data.vocab_size' \(4096\)"):
        check_run(load_config(None, ["data.tokenizer='bpe'"]), 1)
    with pytest.raises(ConfigError, match="give 'bytes'"):
        from shardlib.train.batches import open_data

        open_data(load_config(None, ["data.tokenizer='wordpiece'"]).data)


def _bpe_run(cache):
    from shardlib.train import train

    cfg = load_config(None, ["parallel.mesh={'dp': -1}", "parallel.zero_stage=2", "model.n_layer=1", "model.n_embd=32",
                             "model.n_head=2", "model.vocab_size=512", "data.tokenizer='bpe'", "data.vocab_size=512",
                             f"data.cache_dir={cache!r}", "train.steps=2", "train.global_batch=4", "train.seq_len=32",
                             "train.eval_steps=1", "train.tensorboard=False", f"train.out_dir={cache + '/out'!r}"])
    out = train(cfg, log=lambda *_: None)
    return out["val_loss"], out["history"][0]["loss"], TokenCorpus.open(
        next(os.path.join(cache, d) for d in os.listdir(cache) if d.startswith("corpus-"))).vocab_size


@pytest.mark.multiprocess
def test_the_tool_trains_on_bpe_tokens_over_two_ranks(tmp_path):
    """The embedded corpus under a 512-token BPE: rank 0 tokenizes, rank 1 waits for the files;
    the first loss is near ln(512) (a fresh model guesses uniformly over the vocabulary)."""
    val, first, vocab = run_on(2, _bpe_run, str(tmp_path))[0]
    assert vocab == 512
    assert abs(first - np.log(512)) < 0.3 and val < first
