"""The training tool (python -m shardlib.train): its schedule, data positions, checkpoints and
metrics; the entry point end to end under torchrun (train, checkpoint, bit-exact resume, eval
on another mesh) on data and on tensor parallel ranks; and one config giving the same loss
curve on dp=4, dp=2 x tp=2, pp=2 x dp=2."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardlib import checkpoint
from shardlib.config import ConfigError, load_config
from shardlib.data import ByteCorpus
from shardlib.testing import run_on
from shardlib.train import learning_rate, parse_args
from shardlib.train.batches import Batches
from shardlib.train.build import check_run, mesh_shape
from shardlib.train.checkpoints import Checkpoints
from shardlib.train.metrics import MetricsLog, format_line

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = str(ROOT / "configs" / "embedded_default.py")
# the embedded default, shrunk to seconds: 2 blocks of width 64, 4 steps of 8 x 32 tokens
SMALL = ["model.n_layer=2", "model.n_embd=64", "train.steps=4", "train.global_batch=8", "train.seq_len=32",
         "train.eval_steps=2", "train.log_interval=1", "optim.warmup_steps=2", "train.tensorboard=False"]


# -- the schedule -------------------------------------------------------------------------------

def test_warmup_then_cosine_reaches_min_lr_at_the_last_step():
    lrs = [learning_rate(s, 1.0, 10, warmup_steps=4, decay="cosine", min_lr=0.1) for s in range(10)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]  # linear warmup, the first update not at 0
    assert lrs[4] == 1.0 and lrs[9] == pytest.approx(0.1)
    assert lrs[4] > lrs[5] > lrs[6] > lrs[7] > lrs[8] > lrs[9]
    mid = learning_rate(4 + 5 // 2, 1.0, 10, 4, "cosine", 0.0)  # p = 2.5/5: cos(pi/2) = 0: half way
    assert mid == pytest.approx(0.5 * (1 + math.cos(math.pi * 2 / 5)))


def test_linear_and_constant_decay_and_refusals():
    lin = [learning_rate(s, 2.0, 5, 0, "linear", 0.0) for s in range(5)]
    assert lin == pytest.approx([2.0, 1.5, 1.0, 0.5, 0.0])
    assert [learning_rate(s, 2.0, 5, 1, "constant") for s in range(5)] == [2.0] * 5
    with pytest.raises(ValueError, match="decay must be one of cosine, linear, constant"):
        learning_rate(0, 1.0, 5, decay="step")


# -- the data ---------------------------------------------------------------------------------

def _corpus(n=5000):
    data = torch.arange(n, dtype=torch.int64).remainder(251).to(torch.uint8)
    return ByteCorpus(data, data[:1000], source="test")


def test_batches_are_addressed_by_index_and_resume_on_the_next_one():
    a, b = Batches(_corpus(), 8, 16, seed=3), Batches(_corpus(), 8, 16, seed=3)
    seen = [next(a) for _ in range(3)]
    b.load_state_dict(dict(a.state_dict(), next=2))
    assert torch.equal(next(b)[0], seen[2][0])  # the position is the index of the next batch
    assert torch.equal(next(a)[0], a.train(3)[0])
    assert not torch.equal(seen[0][0], seen[1][0])
    assert torch.equal(a.val(0)[0], b.val(0)[0])  # evaluation batches are fixed
    other = Batches(_corpus(), 4, 16, seed=3)
    with pytest.raises(ConfigError, match=r"train.global_batch=8, this config has 4"):
        other.load_state_dict(a.state_dict())


# -- cross-key checks -------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, world, needle", [
    (["parallel.mesh={'dp': 2}"], 4, r"is \{'dp': 2\} \(2 ranks\), but this run has 4"),
    (["parallel.mesh={'dp': -1, 'tp': 3}"], 4, "not divisible by the fixed axes' product 3"),
    (["train.global_batch=6", "parallel.mesh={'dp': 4}"], 4, r"\(6\) must be divisible by 4 data rank\(s\)"),
    (["train.grad_accum=3", "parallel.mesh={'dp': 2}"], 2, "divisible by 2 data rank.s. x train.grad_accum=3 = 6"),
    (["parallel.mesh={'pp': 2, 'dp': 1}", "train.grad_accum=2"], 2, "parallel.microbatches=2"),
    (["train.seq_len=100", "model.block_size=64"], 1, r"'train.seq_len' \(100\) is longer than 'model.block_size'"),
    (["optim.decay='step'"], 1, "the decays are: cosine, linear, constant"),
    (["optim.min_lr=1.0", "optim.lr=0.1"], 1, "0 <= min_lr <= lr"),
    (["optim.betas=[0.9]"], 1, r"'optim.betas' must be two numbers in \[0, 1\).*got \[0.9\]"),  # (torch's IndexError)
    (["optim.betas=(0.9, 1.5)"], 1, r"'optim.betas' must be two numbers"),
    (["train.param_dtype='half'"], 1, "'train.param_dtype' must be 'bfloat16'"),
    (["train.peak_tflops=-1"], 1, r"'train.peak_tflops' must be > 0 .*got -1"),  # (it logged MFU -0.00025)
    (["model.n_embd=100", "model.n_head=3"], 1, "n_embd must be divisible by n_head"),
    (["model.builder='palm'", "parallel.mesh={'tp': 2}"], 2, r"'model.n_kv_head' \(1\) is not divisible by the tp"),
    (["model.builder='llama'", "model.n_kv_head=3"], 1, "n_head must be divisible by n_kv_head"),
    (["model.builder='hf'", "model.family='bert'"], 1, "'model.family' is 'bert'; the families are: llama"),
    (["model.builder='hf'", "model.family='phi'", "parallel.mesh={'pp': 2}"], 2, "no pipeline layers for it"),
    (["model.builder='hf'", "model.heads=2", "parallel.mesh={'tp': 2}"], 2, "give llama 1 key/value heads"),
])
def test_run_checks_name_the_keys(overrides, world, needle):
    hf = any("builder='hf'" in o for o in overrides)  # the default config's model keys are GPT's
    with pytest.raises(ConfigError, match=needle):
        check_run(load_config(None if hf else DEFAULT, overrides), world)


def test_pipeline_keys_on_a_mesh_without_pp_are_named_not_refused():
    """One config serves every mesh (its microbatches are read on a pp mesh only); the tool logs
    the keys it does not use (a new user saw parallel.schedule='gpipe' on a dp mesh do nothing,
    silently)."""
    from shardlib.train.build import pipeline_keys_unused

    cfg = load_config(DEFAULT, ["parallel.schedule='gpipe'", "parallel.microbatches=4"])
    assert pipeline_keys_unused(cfg, {"dp": 2}) == ["parallel.schedule='gpipe'", "parallel.microbatches=4"]
    assert pipeline_keys_unused(cfg, {"pp": 1, "dp": 2}) == ["parallel.schedule='gpipe'", "parallel.microbatches=4"]
    assert pipeline_keys_unused(cfg, {"pp": 2}) == []
    assert pipeline_keys_unused(load_config(DEFAULT, []), {"dp": 2}) == []
    # virtual_stages: None is the schedule's own (2 for interleaved_1f1b, which ran 1F1B with the old default 1)
    cfg = load_config(DEFAULT, ["parallel.virtual_stages=2"])
    assert pipeline_keys_unused(cfg, {"dp": 2}) == ["parallel.virtual_stages=2"]
    from shardlib.train.build import sharding

    opts = sharding(load_config(DEFAULT, ["parallel.schedule='interleaved_1f1b'"]), {"pp": 2})[1]
    assert "virtual_stages" not in opts and opts["schedule"] == "interleaved_1f1b"


def test_mesh_minus_one_takes_the_rest_of_the_world():
    assert mesh_shape(load_config(None, ["parallel.mesh={'dp': -1, 'tp': 2}"]), 8) == {"dp": 4, "tp": 2}


def test_the_eval_tools_mesh_takes_the_rest_of_the_ranks_as_the_config_does():
    """shardlib.eval --mesh dp=-1 was refused, though parallel.mesh={'dp': -1} works (new-user pass);
    the example scripts' --mesh keeps sizes >= 1."""
    import argparse

    from shardlib import cli

    assert cli.mesh_shape_rest("dp=-1,tp=2") == {"dp": -1, "tp": 2}
    assert mesh_shape(load_config(None, [f"parallel.mesh={cli.mesh_shape_rest('dp=-1,tp=2')!r}"]), 8) == {"dp": 4, "tp": 2}
    for text, match in (("dp=-1,tp=-1", "axis 'tp' has size '-1'"), ("dp=-2", "or -1 for the rest")):
        with pytest.raises(argparse.ArgumentTypeError, match=match):
            cli.mesh_shape_rest(text)
    with pytest.raises(argparse.ArgumentTypeError, match="every size must be an integer >= 1$"):
        cli.mesh_shape("dp=-1")


def test_overrides_in_both_spellings_and_unknown_arguments():
    args, overrides = parse_args(["--config", "c.py", "--set", "train.steps=3", "--optim.lr=0.1", "--train.seed", "4"])
    assert args.config == "c.py" and overrides == ["train.steps=3", "optim.lr=0.1", "train.seed=4"]
    with pytest.raises(SystemExit, match="unrecognized argument '--steps'"):
        parse_args(["--steps", "3"])


# -- checkpoints ------------------------------------------------------------------------------

def test_checkpoint_dir_of_another_run_is_refused_and_rotation_removes_only_checkpoints(tmp_path):
    section = load_config(None, [f"checkpoint.dir={str(tmp_path)!r}"]).checkpoint
    Checkpoints(section, 10)  # empty: fine
    # a run stopped at start may leave its shared-folder probe: ours, not an entry of another run (it
    # made the same command refuse the folder, resume or not: new-user pass)
    (tmp_path / ".shardlib_probe-4242").write_text("0123abcd")
    Checkpoints(section, 10)
    Checkpoints(load_config(None, [f"checkpoint.dir={str(tmp_path)!r}", "checkpoint.resume=True"]).checkpoint, 10)
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"already holds notes.txt .*checkpoint.resume=True"):
        Checkpoints(section, 10)
    with pytest.raises(ConfigError, match="'checkpoint.dir' is None"):
        Checkpoints(load_config(None, ["checkpoint.resume=True"]).checkpoint, 10)
    # --set checkpoint.dir=$CKPT with CKPT unset: it trained and saved nothing, exit status 0
    for blank in ("checkpoint.dir=", "checkpoint.dir=' '"):
        with pytest.raises(ConfigError, match="'checkpoint.dir' is '.*': a folder, or None for no checkpoints"):
            Checkpoints(load_config(None, [blank, "checkpoint.interval=2"]).checkpoint, 10)
    # checkpoint.remove deletes a finished checkpoint only
    with pytest.raises(checkpoint.CheckpointError, match="only a finished shardlib checkpoint is removed"):
        checkpoint.remove(tmp_path)
    fake = tmp_path / "step_000001"
    fake.mkdir()
    (fake / checkpoint.MARKER).write_text(json.dumps(dict(format=1, time=1.0)))
    (fake / "user.txt").write_text("keep")
    with pytest.raises(checkpoint.CheckpointError, match="user.txt, which save.. did not write; it is kept"):
        checkpoint.remove(fake)
    assert (fake / "user.txt").read_text() == "keep" and (tmp_path / "notes.txt").exists()
    (fake / "user.txt").unlink()
    checkpoint.remove(fake)
    assert not fake.exists()


def test_resume_from_a_checkpoint_itself_or_from_a_folder_of_other_files_is_refused(tmp_path):
    """Regression (a new user's pass): checkpoint.dir=ck/step_000004 with resume found no
    checkpoint in it, started again at step 0 (only a log line said so) and saved
    ck/step_000004/step_000006 inside it, which keep_last could then never remove. A folder of
    the user's files with resume likewise trained from scratch and saved among them."""
    step = tmp_path / "ck" / "step_000004"
    step.mkdir(parents=True)
    (step / checkpoint.MARKER).write_text(json.dumps(dict(format=1, time=1.0)))
    resume = lambda d: load_config(None, [f"checkpoint.dir={str(d)!r}", "checkpoint.resume=True"]).checkpoint
    with pytest.raises(ConfigError, match=r"step_000004', which is a checkpoint itself, not a folder of them.*"
                                          rf"Fix: --set checkpoint.dir={tmp_path / 'ck'} "):
        Checkpoints(resume(step), 6)
    assert sorted(os.listdir(step)) == [checkpoint.MARKER]
    Checkpoints(resume(tmp_path / "ck"), 6)  # the folder of checkpoints: fine
    Checkpoints(resume(tmp_path / "new"), 6)  # nothing there yet: a first run, fine
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"holds notes.txt but no checkpoint of this tool"):
        Checkpoints(resume(mine), 6)
    (mine / "notes.txt").unlink()
    (mine / "step_000002.partial").mkdir()  # a run killed in its first save: the tool's own, fine
    Checkpoints(resume(mine), 6)
    # two runs started on one empty folder: the second to save a step another wrote is told so
    # (the checkpoint package's message suggested overwrite=True, which the tool does not have)
    shared = tmp_path / "shared"
    second = Checkpoints(load_config(None, [f"checkpoint.dir={str(shared)!r}"]).checkpoint, 6)  # empty at its start
    (shared / "step_000004").mkdir(parents=True)  # the first run's save
    (shared / "step_000004" / checkpoint.MARKER).write_text(json.dumps(dict(format=1, time=1.0)))
    with pytest.raises(checkpoint.CheckpointError, match="holds step_000004, which this run .* did not write: another "
                                                         "run saves into the same folder. It is kept"):
        second.save(4, None, None, {}, True)
    assert sorted(os.listdir(shared / "step_000004")) == [checkpoint.MARKER]


# -- metrics ----------------------------------------------------------------------------------

def test_metrics_file_is_written_as_it_goes_and_never_replaced(tmp_path):
    rec = lambda s: dict(step=s, loss=2.0 / s, lr=1e-3, grad_norm=0.5, tokens_per_s=1000.0, mfu=None, peak_mem_mb=10.0)
    lines = []
    stream = type("S", (), {"write": lambda self, t: lines.append(t), "flush": lambda self: None})()
    log = MetricsLog(str(tmp_path), steps=4, log_interval=2, active=True, tensorboard=False, stream=stream)
    for s in range(1, 4):
        log.log(rec(s))
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    log.close()
    printed = "".join(lines)
    assert "step 2/4 | loss 1.0000 | lr 1.00e-03 | grad norm 0.500 | 1,000 tok/s | MFU n/a | peak 10 MiB" in printed
    assert "step 1/4" not in printed and "step 3/4" not in printed  # every log_interval steps
    with pytest.raises(FileExistsError, match="does not replace it"):
        MetricsLog(str(tmp_path), 4, 2, True, False, stream=stream)
    # a resume from step 2: the records of the steps it repeats are left out
    MetricsLog(str(tmp_path), 4, 2, True, False, resume_from=2, stream=stream).close()
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert "MFU 41.0%" in format_line(dict(rec(4), mfu=0.41), 4)


def test_an_out_dir_with_another_runs_metrics_is_refused_before_the_mesh(tmp_path):
    from shardlib.train.loop import _out_dir

    (tmp_path / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError, match="already holds metrics.jsonl .* does not replace it"):
        _out_dir(load_config(None, [f"train.out_dir={str(tmp_path)!r}"]), None)
    ck = tmp_path / "ck"
    with pytest.raises(ConfigError, match="already holds metrics.jsonl"):  # resume, but nothing to resume from
        _out_dir(load_config(None, [f"train.out_dir={str(tmp_path)!r}", f"checkpoint.dir={str(ck)!r}",
                                    "checkpoint.resume=True"]), None)
    assert _out_dir(load_config(None, []), "configs/x.py").startswith(os.path.join("runs", "x-"))
    with pytest.raises(ConfigError, match="'train.out_dir' is '': a folder, or None"):  # (no metrics were written)
        _out_dir(load_config(None, ["train.out_dir=''"]), None)


def test_a_resume_keeps_a_metrics_file_only_where_it_is_that_runs(tmp_path):
    """A resume from the checkpoint of step 2 drops the file's records after step 2: only where its
    record of step 2 is the checkpoint's (loss and lr saved with it), or nothing follows step 2 (a
    run killed between a save and its line). The end to end case is
    test_a_resume_into_another_runs_out_dir_is_refused."""
    from types import SimpleNamespace

    from shardlib.train.loop import _check_metrics_of_this_run

    rec = lambda step, loss: json.dumps(dict(step=step, loss=loss, lr=1e-3)) + "\n"
    run = SimpleNamespace(resumed_from="ck/step_000002", start=2, resumed_record=dict(step=2, loss=2.5, lr=1e-3))
    path = tmp_path / "metrics.jsonl"
    _check_metrics_of_this_run(str(tmp_path), run)  # no file: fine
    path.write_text(rec(1, 3.0) + rec(2, 2.5) + rec(3, 2.0))
    _check_metrics_of_this_run(str(tmp_path), run)  # this run's
    path.write_text(rec(1, 3.0))
    _check_metrics_of_this_run(str(tmp_path), run)  # killed before the line of step 2: nothing follows
    for text, why in [(rec(1, 3.0) + rec(2, 2.7) + rec(3, 2.0), "its step 2 has loss 2.7, the checkpoint's 2.5"),
                      (rec(1, 3.0) + rec(3, 2.0), "it has no record of step 2")]:
        path.write_text(text)
        with pytest.raises(ConfigError, match=f"does not look like the metrics of the run resumed from ck/step_000002 "
                                              f"\\({why}\\): the resume would drop its 1 record"):
            _check_metrics_of_this_run(str(tmp_path), run)
    run.resumed_record = None  # a checkpoint that saved no line: checked only where records would be dropped
    path.write_text(rec(1, 3.0) + rec(2, 2.5) + rec(3, 2.0))
    with pytest.raises(ConfigError, match="the checkpoint saved no metrics line to compare"):
        _check_metrics_of_this_run(str(tmp_path), run)
    path.write_text(rec(1, 3.0) + rec(2, 2.5))
    _check_metrics_of_this_run(str(tmp_path), run)


def test_a_checkpoint_of_another_tokenizer_is_refused():
    """Resuming (or evaluating) a BPE-500 checkpoint with BPE-300 or bytes went ahead silently:
    the embedding rows then mean other tokens."""
    batches = Batches(_corpus(), 8, 16, seed=3)
    assert batches.state_dict()["tokenizer"] == "bytes" and batches.state_dict()["vocab_size"] == 256
    batches.check_tokens(batches.state_dict())
    batches.check_tokens({"next": 3})  # a checkpoint that recorded no tokenizer: not checked
    with pytest.raises(ConfigError, match=r"another tokenizer \(data.tokenizer='bpe', data.vocab_size=500\): "
                                          r"sha256:0123, a vocabulary of 500; this config's data give bytes"):
        batches.check_tokens({"tokenizer": "sha256:0123", "vocab_size": 500}, {"tokenizer": "bpe", "vocab_size": 500})


def test_relative_output_folders_that_do_not_exist_yet_are_fine(tmp_path, monkeypatch):
    """out_dir and checkpoint.dir relative to the working folder, their top folder not there yet
    (the parent check walked up to '' and refused it)."""
    from shardlib.checkpoint._files import check_parent
    from shardlib.train.loop import _out_dir

    monkeypatch.chdir(tmp_path)
    assert _out_dir(load_config(None, ["train.out_dir='runs/a'"]), None) == "runs/a"
    Checkpoints(load_config(None, ["checkpoint.dir='runs/ck'"]).checkpoint, 10)
    check_parent("new/ck/step_000002", "checkpoint.save")  # the checkpoint package's own check
    (tmp_path / "f.txt").write_text("x")
    with pytest.raises(ConfigError, match="not a folder"):
        _out_dir(load_config(None, ["train.out_dir='f.txt/sub'"]), None)


def test_splits_too_short_for_seq_len_are_refused_before_the_mesh(tmp_path):
    from shardlib.train import setup

    (tmp_path / "a.txt").write_text("hello world, this is some text. " * 30)  # 960 bytes: 48 held out
    cfg = load_config(None, ["data.source='files'", f"data.files=[{str(tmp_path)!r}]", "train.seq_len=64",
                             "data.val_fraction=0.05"])
    with pytest.raises(ConfigError, match="the val split .* has 48 tokens, too few for windows of train.seq_len=64"):
        setup(cfg, world_size=1)



def test_val_fraction_is_checked_for_every_source_and_said_unused_with_the_embedded_one():
    """data.val_fraction=1.5 (or 0) was refused for data.source='files' only, and with the
    embedded corpus (the default source) it was accepted and ignored without a word (found by a
    new-user test): it is now refused whatever the source, and a valid value or val_files set
    with the embedded corpus (whose split is fixed) is logged as not used."""
    from shardlib.train.batches import open_data

    for bad in ("1.5", "0"):
        with pytest.raises(ConfigError, match=rf"'data.val_fraction' must be in \(0, 1\), got {bad}"):
            open_data(load_config(DEFAULT, [f"data.val_fraction={bad}"]).data, log=lambda *_: None)
    said = []
    open_data(load_config(DEFAULT, ["data.val_fraction=0.3", "data.val_files=['x.py']"]).data, log=said.append)
    assert said == ["data: data.val_fraction=0.3, data.val_files=['x.py'] apply to data.source='files'; the embedded "
                    "corpus holds out every 10th module of the standard library: not used"]
    said.clear()
    open_data(load_config(DEFAULT, []).data, log=said.append)
    assert said == []


def test_held_out_files_are_checked_under_their_key(tmp_path):
    """A wrong data.val_files raised a ValueError whose fix named --val-files, a flag the tool does
    not have (examples/train_gpt.py's); and data.val_fraction beside val_files was ignored without
    a word (found by a new-user pass)."""
    from shardlib.train.batches import open_data

    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_text(name * 50)
    files = ["data.source='files'", f"data.files=[{str(tmp_path)!r}]"]
    with pytest.raises(ConfigError, match=r"config key 'data.val_files' is \['nothere.txt'\]: held-out files "
                                          r"\['nothere.txt'\] are not in .* e.g. 'a.txt'") as caught:
        open_data(load_config(DEFAULT, [*files, "data.val_files=['nothere.txt']"]).data, log=lambda *_: None)
    assert "--val-files" not in str(caught.value)
    said = []
    corpus = open_data(load_config(DEFAULT, [*files, "data.val_files=['b.txt']", "data.val_fraction=0.3"]).data,
                       log=said.append)
    assert corpus.val_files == ("b.txt",)
    assert said == ["data: data.val_fraction=0.3 applies without data.val_files; the files ['b.txt'] are held out "
                    "instead: not used"]

def test_a_metrics_record_cut_short_by_a_kill_is_dropped_on_resume(tmp_path):
    rec = lambda s: json.dumps(dict(step=s, loss=1.0, lr=0.1, grad_norm=None, tokens_per_s=1.0, mfu=None,
                                    peak_mem_mb=1.0, val_loss=None))
    (tmp_path / "metrics.jsonl").write_text(rec(1) + "\n" + rec(2) + "\n" + rec(3)[:-9])
    MetricsLog(str(tmp_path), 4, 1, True, False, resume_from=2, stream=open(os.devnull, "w")).close()
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    (tmp_path / "metrics.jsonl").write_text("garbage\n" + rec(1) + "\n")
    with pytest.raises(ValueError, match="metrics.jsonl:1 is not a metrics record"):
        MetricsLog(str(tmp_path), 4, 1, True, False, resume_from=2, stream=open(os.devnull, "w"))


def test_hf_families_train_without_dropout_unless_asked():
    from shardlib.models.hf_build import hf_config

    c = hf_config("gpt2", 32, 1, 2, 16)
    assert (c.resid_pdrop, c.embd_pdrop, c.attn_pdrop) == (0.0, 0.0, 0.0)  # GPT-2's own default is 0.1
    assert hf_config("opt", 32, 1, 2, 16, dropout=0.2).dropout == 0.2
    # Mixtral as examples/train_hf.py --model mixtral builds it (its training on tp=2 is
    # test_hf_tp's preset case; its torchrun run of the example took 13 s of the suite)
    m = hf_config("mixtral", 32, 1, 4, 16)
    assert (m.num_local_experts, m.num_experts_per_tok, m.num_key_value_heads) == (4, 2, 2)


def test_tensorboard_scalars_when_installed(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = MetricsLog(str(tmp_path), steps=2, log_interval=1, active=True, tensorboard=True,
                     stream=open(os.devnull, "w"))
    for s in (1, 2):
        log.log(dict(step=s, loss=3.0 - s, lr=0.1, grad_norm=1.0, tokens_per_s=10.0, mfu=None, peak_mem_mb=1.0,
                     val_loss=2.5 if s == 2 else None))
    log.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.value for e in events.Scalars("train/loss")] == [2.0, 1.0]
    assert [(e.step, e.value) for e in events.Scalars("val/loss")] == [(2, 2.5)]


def test_plot_draws_the_curves_and_keeps_existing_files(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed")
    from shardlib.plot import main as plot_main, read_metrics

    path = tmp_path / "metrics.jsonl"
    recs = [dict(step=s, loss=3.0 / s, lr=0.1, grad_norm=1.0, tokens_per_s=100.0 + s, mfu=None, peak_mem_mb=1.0,
                 val_loss=1.0 if s == 3 else None) for s in (1, 2, 3)]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs) + json.dumps(dict(recs[1], loss=9.0)) + "\n")
    assert [r["loss"] for r in read_metrics(str(path))] == [3.0, 9.0, 1.0]  # a repeated step: its last record
    assert plot_main([str(path)]) == 0
    png = tmp_path / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_main([str(path)]) == 2  # refused: the PNG exists (one line on stderr)
    (tmp_path / "bad.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: not a metrics record"):
        read_metrics(str(tmp_path / "bad.jsonl"))


# -- the entry point under torchrun -------------------------------------------------------------

def _tool(tmp_path, module, *args):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", module, "--config", DEFAULT, *[f"--set={o}" for o in SMALL], *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def _records(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def _tool_in_pool(tmp_path, module, *args):
    """``_tool``'s run through the module's ``main`` on the pool's 2 ranks (tests/_inpool.py:
    each torchrun run costs 8-15 s of the suite); rank 0's stdout first, as torchrun shows it."""
    from _inpool import stdout_of

    return stdout_of(2, module, ["--config", DEFAULT, *[f"--set={o}" for o in SMALL], *args], cwd=tmp_path)


@pytest.mark.multiprocess
# 2 ranks each (a 4-rank case took 46 s of the suite; torchrun on 4 ranks is covered by
# test_examples' pipeline x tensor / sequence parallel runs): data parallel resumed and evaluated
# on tensor parallel, and tensor parallel evaluated on a 2-stage pipeline (its resume would repeat
# the first case's, 8-9 s of the suite: resharded resumes on tensor-parallel meshes are
# test_checkpoint's). Each entry point runs once under torchrun (the first case trains there, the
# second evaluates there); the other runs call the same main() on the pool's ranks
@pytest.mark.parametrize("mesh, eval_mesh, resume", [("{'dp': -1}", "dp=1,tp=2", True), ("{'tp': 2}", "pp=2", False)])
def test_entry_point_trains_checkpoints_resumes_bit_exact_and_evaluates(tmp_path, mesh, eval_mesh, resume):
    ck = tmp_path / "ck"
    args = (f"--set=parallel.mesh={mesh}", f"--set=checkpoint.dir={str(ck)!r}", "--set=checkpoint.interval=2")
    run = _tool if resume else _tool_in_pool
    out = run(tmp_path, "shardlib.train", *args, "--set=train.out_dir='a'", "--set=checkpoint.keep_last=0")
    assert "step 4/4 | loss" in out and "checkpoint" in out
    assert sorted(os.listdir(ck)) == ["step_000002", "step_000004"]
    straight = _records(tmp_path / "a" / "metrics.jsonl")
    assert [r["step"] for r in straight] == [1, 2, 3, 4] and straight[-1]["val_loss"] is not None
    if resume:
        _resume_bit_exact(tmp_path, ck, args, straight)
        # another global batch (in one process: what the tool's own torchrun eval does): it was
        # refused as a resume ("the resumed run would not continue on the next batch"), so a mesh
        # whose data size does not divide the training batch could not evaluate at all
        got = run_on(1, _eval_with_another_global_batch, str(ck))[0]
        assert got["step"] == 4 and math.isfinite(got["val_loss"]), got
    _evaluate_on_another_mesh(tmp_path, ck, eval_mesh, straight, _tool_in_pool if resume else _tool)


def _eval_with_another_global_batch(ck):
    from shardlib.eval import open_checkpoint, validation_loss

    run = open_checkpoint(load_config(DEFAULT, [*SMALL, "train.global_batch=4"]), ck, log=lambda *_: None)
    return validation_loss(run)


def _resume_bit_exact(tmp_path, ck, args, straight):
    # a run killed after step 2: its step-4 checkpoint never written (the test's own folder)
    checkpoint.remove(ck / "step_000004")
    out = _tool_in_pool(tmp_path, "shardlib.train", *args, "--set=train.out_dir='b'", "--set=checkpoint.resume=True",
                        "--set=checkpoint.keep_last=1")
    assert f"resumed from {ck / 'step_000002'} at step 2" in out
    resumed = _records(tmp_path / "b" / "metrics.jsonl")
    keys = ("step", "loss", "grad_norm", "lr", "val_loss")
    assert [[r[k] for k in keys] for r in resumed] == [[r[k] for k in keys] for r in straight[2:]]  # bit for bit
    assert sorted(os.listdir(ck)) == ["step_000004"]  # keep_last=1 removed step 2 after step 4 was saved
    # a second run into the same folder without resume is refused, naming the fix (checked where the
    # tool checks it, at start: a torchrun run of its own took 8 s; test_cli shows how a
    # configuration error reaches the user under torchrun)
    section = load_config(DEFAULT, [*SMALL, *(a.removeprefix("--set=") for a in args)]).checkpoint
    with pytest.raises(ConfigError, match=r"already holds step_000004 .*checkpoint\.resume=True"):
        Checkpoints(section, 4)


def _evaluate_on_another_mesh(tmp_path, ck, eval_mesh, straight, tool):
    # the checkpoint's validation loss, on another mesh: the training run's last figure
    res = tmp_path / "eval.json"
    out = tool(tmp_path, "shardlib.eval", "--ckpt", str(ck), "--mesh", eval_mesh,
                "--set=parallel.microbatches=2", "--json", str(res))
    got = json.loads(res.read_text())
    assert got["step"] == 4
    # another mesh's reduction order: measured 0 on both pairs of meshes here, and up to 4.7e-8
    # relative on the curve test's meshes; 2e-6 is ten times the worst loss deviation seen there
    assert got["val_loss"] == pytest.approx(straight[-1]["val_loss"], rel=2e-6)
    assert "val loss" in out


def _curve(shape, extra=()):
    from shardlib.train import train

    hf = any("builder='hf'" in o for o in extra)  # the model keys are a Hugging Face family's, not GPT's
    small = [o for o in SMALL if not (hf and o.startswith("model."))]
    cfg = load_config(None if hf else DEFAULT, [*small, f"parallel.mesh={shape!r}", "train.out_dir=None",
                                                "train.steps=3", "parallel.microbatches=2", *extra])
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        cfg.train.out_dir = d
        out = train(cfg, log=lambda *_: None)
    return [(r["loss"], r["grad_norm"]) for r in out["history"]], out["val_loss"]


@pytest.mark.multiprocess
def test_one_config_gives_one_loss_curve_on_every_mesh():
    """The same global config (batch, seed, schedule) on dp=4, dp=2 x tp=2 (with sequence
    parallelism), pp=2 x dp=2 (1F1B, 2 microbatches) and dp=2 with 2 accumulation slices trains
    like one process; so do the llama and hf builders on dp=2 x tp=2."""
    ref = run_on(1, _curve, {"dp": 1})[0]
    runs = {
        "dp=4": run_on(4, _curve, {"dp": 4})[0],
        "llama dp=2,tp=2": None,
        "dp=2,tp=2": run_on(4, _curve, {"dp": 2, "tp": 2}, ["parallel.sequence_parallel=True"])[0],
        "pp=2,dp=2": run_on(4, _curve, {"pp": 2, "dp": 2})[0],
        # two accumulation slices per step, the first backward under no_sync (ZeRO-3's full-size buffers)
        "dp=2 grad_accum=2": run_on(2, _curve, {"dp": 2}, ["train.grad_accum=2"])[0],
        # with dropout: each slice draws its rows of the whole batch's masks (MicrobatchDropout)
        "dp=2 grad_accum=2 dropout": run_on(2, _curve, {"dp": 2}, ["train.grad_accum=2", "model.dropout=0.1"])[0],
    }
    # the LLaMA builder through the tool: its tensor-parallel specs and vocabulary-parallel logits
    llama = ["model.builder='llama'", "model.n_kv_head=2"]
    runs["llama dp=2,tp=2"] = run_on(4, _curve, {"dp": 2, "tp": 2}, [*llama, "parallel.sequence_parallel=True"])[0]
    # an unmodified Hugging Face Qwen3 (the hf builder): hf_preset's layout, its own output layer
    qwen = ["model.builder='hf'", "model.family='qwen3'", "model.hidden=64", "model.layers=2", "model.heads=4"]
    runs["hf qwen3 dp=2,tp=2"] = run_on(4, _curve, {"dp": 2, "tp": 2}, qwen)[0]
    refs = {name: ref for name in runs}
    refs["llama dp=2,tp=2"] = run_on(1, _curve, {"dp": 1}, llama)[0]
    refs["hf qwen3 dp=2,tp=2"] = run_on(1, _curve, {"dp": 1}, qwen)[0]
    refs["dp=2 grad_accum=2 dropout"] = run_on(1, _curve, {"dp": 1}, ["model.dropout=0.1"])[0]
    assert refs["dp=2 grad_accum=2 dropout"][0] != ref[0]  # dropout changed the curve
    assert refs["llama dp=2,tp=2"][0] != ref[0]  # another model
    for name, (curve, val) in runs.items():
        ref = refs[name]
        for (loss, norm), (rloss, rnorm) in zip(curve, ref[0]):
            # measured worst over the three meshes, default and avx2 kernels: loss 1.9e-7, grad norm
            # 9.5e-8, val 4.7e-8 relative (fp32 reduction order); 2e-6 is ten times that
            assert loss == pytest.approx(rloss, rel=2e-6), name
            assert norm == pytest.approx(rnorm, rel=2e-6), name
        assert val == pytest.approx(ref[1], rel=2e-6), name


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.multiprocess
def test_two_nodes_through_c10d_rendezvous_train_like_one_process(tmp_path):
    """Two torchrun launchers ("nodes" of 2 ranks each on 127.0.0.1) meet through a c10d
    rendezvous, as on a cluster; dp=2 x tp=2 (tp inside a node) trains like one process."""
    port = _free_port()
    overrides = [*SMALL, "parallel.mesh={'dp': 2, 'tp': 2}", "train.steps=3", "parallel.microbatches=2"]
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
               "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", "shardlib-test", "-m", "shardlib.train", "--config", DEFAULT,
               *[f"--set={o}" for o in overrides], f"--set=train.out_dir={str(tmp_path / 'out')!r}"]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
                                      env=dict(os.environ, OMP_NUM_THREADS="1")))
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
    curve = [(r["loss"], r["grad_norm"]) for r in _records(tmp_path / "out" / "metrics.jsonl")]
    ref = run_on(1, _curve, {"dp": 1})[0][0]
    assert len(curve) == len(ref) == 3
    for (loss, norm), (rloss, rnorm) in zip(curve, ref):
        assert loss == pytest.approx(rloss, rel=2e-6) and norm == pytest.approx(rnorm, rel=2e-6)  # as the curve test


def _resume_with_new_hyperparameters(folder):
    from shardlib.train import setup, train

    base = [*SMALL, "parallel.mesh={'dp': 2}", f"checkpoint.dir={folder + '/ck'!r}", "train.steps=2",
            f"train.out_dir={folder + '/o'!r}"]
    train(load_config(DEFAULT, base), log=lambda *_: None)
    lines = []
    run = setup(load_config(DEFAULT, [*base, "checkpoint.resume=True", "optim.betas=(0.5, 0.6)",
                                      "optim.weight_decay=0.5"]), log=lines.append, verbose=False)
    return run.start, [(g["betas"], g["weight_decay"]) for g in run.optimizer.param_groups], lines


@pytest.mark.multiprocess
def test_a_resume_takes_the_configs_optimizer_hyperparameters(tmp_path):
    """The checkpoint's param_groups (betas, weight decay) would otherwise silently win."""
    start, groups, lines = run_on(2, _resume_with_new_hyperparameters, str(tmp_path))[0]
    assert start == 2 and set(groups) == {((0.5, 0.6), 0.5)}
    assert any("betas (0.9, 0.95) in the checkpoint, (0.5, 0.6) from the config (used)" in x for x in lines)


def _resume_into_another_runs_folder(folder):
    from shardlib.train import batches as tb
    from shardlib.train import train

    quiet = lambda *_: None
    base = [*SMALL, "parallel.mesh={'dp': 2}"]
    train(load_config(DEFAULT, [*base, "train.steps=3", f"train.out_dir={folder + '/a'!r}"]), log=quiet)
    b = [*base, "optim.lr=2e-3", f"checkpoint.dir={folder + '/ck'!r}"]  # another run: A's twin is not told apart
    train(load_config(DEFAULT, [*b, "train.steps=2", f"train.out_dir={folder + '/b'!r}"]), log=quiet)
    resume = [*b, "train.steps=3", "checkpoint.resume=True"]
    before, out = Path(folder, "a", "metrics.jsonl").read_text(), {}
    try:
        train(load_config(DEFAULT, [*resume, f"train.out_dir={folder + '/a'!r}"]), log=quiet)
    except ConfigError as e:
        out["into a"] = str(e)
    out["a kept"] = Path(folder, "a", "metrics.jsonl").read_text() == before
    original = tb.tokenizer_id  # the corpus of another tokenizer, without tokenizing one here
    tb.tokenizer_id = lambda corpus: "sha256:another"
    try:
        train(load_config(DEFAULT, [*resume, f"train.out_dir={folder + '/b'!r}"]), log=quiet)
    except ConfigError as e:
        out["tokenizer"] = str(e)
    finally:
        tb.tokenizer_id = original
    train(load_config(DEFAULT, [*resume, f"train.out_dir={folder + '/b'!r}"]), log=quiet)
    if torch.distributed.get_rank() == 0:  # the rank that writes it (another may return before its last line)
        out["b steps"] = [r["step"] for r in _records(Path(folder, "b", "metrics.jsonl"))]
    return out


@pytest.mark.multiprocess
def test_a_resume_into_another_runs_out_dir_is_refused(tmp_path):
    """Found by a new user (data loss): run B resumed from its own checkpoints with train.out_dir
    at run A's folder, and A's metrics.jsonl lost its records after B's step (the refusal of an
    out_dir with another run's metrics was skipped on any resume). B's own folder resumes."""
    outs = run_on(2, _resume_into_another_runs_folder, str(tmp_path))
    for out in outs:
        assert "does not look like the metrics of the run resumed from" in out["into a"] and out["a kept"], out
        assert "learned on the token ids of another tokenizer" in out["tokenizer"], out
    assert outs[0]["b steps"] == [1, 2, 3], outs[0]  # rank 0's, which writes the file


def _tool_history(folder, name, sets, grow):
    import shardlib
    from shardlib.train import train

    original = shardlib.GradScaler
    if grow:  # the scale doubles after every good step: a resume that did not restore it would differ
        # (from 2**8: the default 2**16 overflows this model's fp16 gradients in step 1, and is skipped)
        shardlib.GradScaler = lambda enabled=True: original(init_scale=2.0**8, growth_interval=1, enabled=enabled)
    try:
        cfg = load_config(DEFAULT, [*SMALL, "parallel.mesh={'dp': 2}", "train.steps=3", *sets,
                                    f"train.out_dir={folder + '/' + name!r}"])
        return train(cfg, log=lambda *_: None)["history"]
    finally:
        shardlib.GradScaler = original


@pytest.mark.multiprocess
def test_float16_scales_the_loss_and_a_resume_continues_the_scale(tmp_path):
    """train.param_dtype="float16" ran without loss scaling (found by a new-user pass; the library's
    docs say fp16 needs GradScaler): now a GradScaler scales every backward, the gradients are
    unscaled before clipping (the gradient norms equal the fp32 run's to fp16 rounding), and a
    checkpoint carries the scale, so a resume runs step 3 exactly as the uninterrupted run."""
    import shutil

    folder = str(tmp_path)
    fp32 = run_on(2, _tool_history, folder, "f32", [], False)[0]
    half = ["train.param_dtype='float16'", "checkpoint.interval=2"]
    straight = run_on(2, _tool_history, folder, "f16", [*half, f"checkpoint.dir={folder + '/ck'!r}"], True)[0]
    assert [r["loss_scale"] for r in straight] == [2.0**8, 2.0**9, 2.0**10], straight
    # fp16 compute against fp32: relative differences measured 4e-5..4e-4 (loss and norm); gradients
    # left scaled would give norms 256-512x the fp32 ones
    for a, b in zip(straight[:2], fp32[:2]):
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=5e-3) and a["loss"] == pytest.approx(b["loss"], rel=5e-3)
    shutil.copytree(tmp_path / "ck" / "step_000002", tmp_path / "ck2" / "step_000002")
    resumed = run_on(2, _tool_history, folder, "f16r", [*half, f"checkpoint.dir={folder + '/ck2'!r}",
                                                         "checkpoint.resume=True"], True)[0]
    keys = ("step", "loss", "grad_norm", "loss_scale")
    assert [str([r[k] for k in keys]) for r in resumed] == [str([straight[2][k] for k in keys])], (resumed, straight)
