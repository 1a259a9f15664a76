"""Tier 0 tests of shardlib/data.py: byte corpora, splits and seeded batches."""

from pathlib import Path

import pytest
import torch

from shardlib.data import ByteCorpus, default_corpus, load_corpus

SHAKESPEARE = Path(__file__).parents[1].parent / "shared" / "data" / "shakespeare"


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"a" * 100)
    (tmp_path / "b.py").write_bytes(b"b" * 50)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_bytes(b"c" * 70)
    (tmp_path / "notes.md").write_bytes(b"ignored")
    return tmp_path


def test_single_file_fraction_split(tmp_path):
    f = tmp_path / "t.txt"
    f.write_bytes(bytes(range(256)) * 4)
    corpus = load_corpus(f, val_fraction=0.25)
    assert len(corpus.train) == 768 and len(corpus.val) == 256
    assert corpus.train.dtype == torch.uint8
    assert bytes(corpus.val.tolist()) == bytes(range(256))  # the tail is held out


def test_folder_fraction_split_reads_txt_and_py_only(folder):
    corpus = load_corpus(folder, val_fraction=0.5)
    assert corpus.train_files == ("a.txt", "b.py", "sub/c.txt")
    total = 100 + 50 + 70 + 2  # two newline separators
    assert len(corpus.train) + len(corpus.val) == total
    assert b"ignored" not in bytes(corpus.train.tolist() + corpus.val.tolist())


def test_held_out_files_are_separate(folder):
    corpus = load_corpus(folder, val_files=("c.txt",))
    assert corpus.val_files == ("sub/c.txt",) and corpus.train_files == ("a.txt", "b.py")
    assert set(corpus.val.tolist()) == {ord("c")}
    assert ord("c") not in set(corpus.train.tolist())


def test_unknown_held_out_file_is_an_error(folder):
    with pytest.raises(ValueError, match=r"held-out files \['nope.txt'\]"):
        load_corpus(folder, val_files=("nope.txt",))


def test_bad_paths_and_arguments(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_corpus(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="holds no"):
        load_corpus(tmp_path)
    f = tmp_path / "t.txt"
    f.write_bytes(b"x" * 10)
    with pytest.raises(ValueError, match="needs a folder"):
        load_corpus(f, val_files=("t.txt",))
    with pytest.raises(ValueError, match="val_fraction"):
        load_corpus(f, val_fraction=1.5)


def _toy():
    data = torch.arange(200, dtype=torch.uint8)
    return ByteCorpus(train=data, val=data[:40])


def test_get_batch_shapes_and_shift():
    x, y = _toy().get_batch("train", 5, 16, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (5, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(y, x + 1)  # the toy data counts up, so each target is the next byte


def test_get_batch_is_deterministic_under_a_seed():
    c = _toy()
    a = c.get_batch("train", 4, 8, torch.Generator().manual_seed(7))
    b = c.get_batch("train", 4, 8, torch.Generator().manual_seed(7))
    d = c.get_batch("train", 4, 8, torch.Generator().manual_seed(8))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], d[0])


def test_get_batch_windows_stay_inside_the_split():
    x, y = _toy().get_batch("val", 64, 39, torch.Generator().manual_seed(0))
    assert y.max() <= 39
    with pytest.raises(ValueError, match="too few"):
        _toy().get_batch("val", 1, 40, torch.Generator())
    with pytest.raises(ValueError, match="unknown split"):
        _toy().get_batch("test", 1, 4, torch.Generator())


def test_default_corpus_needs_no_download():
    corpus = default_corpus()
    assert 2_000_000 < len(corpus.train) + len(corpus.val) < 4_500_000
    assert len(corpus.val) > 10_000 and corpus.val_files
    assert not set(corpus.val_files) & set(corpus.train_files)
    assert corpus.train_files == tuple(sorted(corpus.train_files))
    assert default_corpus().val_files == corpus.val_files  # deterministic


def test_shakespeare_split():
    if not SHAKESPEARE.is_dir():
        pytest.skip(f"shared data folder {SHAKESPEARE} is absent")
    corpus = load_corpus(SHAKESPEARE, val_files=("hamlet.txt", "tempest.txt"))
    assert corpus.val_files == ("hamlet.txt", "tempest.txt")
    assert len(corpus.train_files) == 40
    assert len(corpus.train) > 4_000_000 and len(corpus.val) > 200_000
