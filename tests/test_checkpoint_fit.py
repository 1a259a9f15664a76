"""checkpoint.load checks the checkpoint against the whole model (issue 12): entries no rank
of the loading model holds and entries it lacks are refused, naming them, unless
``strict=False``; a pipeline stage's missing entries are held by another stage."""

import functools
import re

import pytest
import torch

import shardlib
import shardlib.checkpoint as ckpt
from shardlib.errors import WorkerError
from shardlib.models import GPT, GPTConfig
from shardlib.testing import run_on
from test_checkpoint import _read_whole, _round_trip, _save_side, _shard, _step

pytestmark = pytest.mark.multiprocess


def _load_layers(path, path2, kind, shape, strict):
    """Load ``path`` into a fresh ``kind`` model on ``shape`` (ZeRO-3); return the error message,
    or the values before and after the load, and save at once to ``path2``."""
    smodel, opt = _shard(kind, 7, shape, 3, 400)
    before = shardlib.full_state_dict(smodel)
    try:
        extra = ckpt.load(path, smodel, opt) if strict else ckpt.load(path, smodel, opt, strict=False)
    except ckpt.CheckpointError as exc:  # raised on each rank before any communication
        return str(exc)
    ckpt.save(path2, smodel, opt)
    return extra, before, shardlib.full_state_dict(smodel), _step(smodel, opt, kind, 2)


def _block(name, first):
    """Whether ``name`` is in a block numbered ``first`` or more."""
    return name.startswith("blocks.") and int(name.split(".")[1]) >= first


def _check_common_part(tmp_path, p1, p2, saved, loaded):
    """After ``strict=False`` between GPTs of 2 and 4 blocks: every name both have (blocks 0-1,
    embeddings, head) holds the saved value, weights and AdamW state; the loading model's own
    blocks 2-3, if any, keep their values and their optimizer state starts from zero."""
    extra, before, after, _ = loaded
    assert extra == {"step": 2}
    for name, value in after.items():
        assert torch.equal(value, before[name] if _block(name, 2) else saved[name]), name
    one, two = _read_whole(p1, tmp_path), _read_whole(p2, tmp_path)
    common = [k for k in one if not _block(k.split(".", 1)[1], 2)]
    assert any(k.endswith(".exp_avg_sq") for k in common)
    for key in common:
        assert torch.equal(one[key], two[key]), key
    for key in two:
        if _block(key.split(".", 1)[1], 2) and key.startswith("optim.") and two[key].dim():
            assert not two[key].any(), key


def test_bigger_model_into_smaller_is_refused_unless_not_strict(tmp_path):
    """A 4-block GPT's checkpoint into a 2-block one: refused on every rank, naming the 32
    entries no rank holds (blocks 2 and 3); ``strict=False`` loads the 2 common blocks, the
    embeddings and the head, with their AdamW state."""
    p1, p2 = str(tmp_path / "big"), str(tmp_path / "again")
    saved, _ = run_on(2, _save_side, p1, "layers4", {"dp": 2}, 3, 400)[0]
    n = sum(_block(name, 2) for name in saved)
    assert n == 32
    for message in run_on(2, _load_layers, p1, p2, "layers2", {"dp": 2}, True):
        assert isinstance(message, str), "loaded silently"
        assert message.startswith(f"checkpoint {p1!r} does not fit GPT: {n} of its entries are in no rank's part "
                                  "of the model: blocks.2."), message
        named = r"(blocks\.[23]\.[\w.]+ \([\d, ]+\), ){5}"  # five names with shapes, then the count
        assert re.search(named + rf"\.\.\. {n - 5} more \(with their optimizer state\)\. Fix: ", message), message
        assert "or pass strict=False to load only the entries both have" in message
    with pytest.raises(WorkerError, match=r"32 of its entries are in no rank's part of the model: blocks\.2\."):
        run_on(2, _strict_load, p1, "layers2")  # the error itself, as a user sees it
    loaded = run_on(2, _load_layers, p1, p2, "layers2", {"dp": 2}, False)
    _check_common_part(tmp_path, p1, p2, saved, loaded[0])
    assert loaded[0][3] == loaded[1][3]  # the next step runs, the same loss on every rank


def _strict_load(path, kind):
    smodel, opt = _shard(kind, 7, {"dp": 2}, 3, 400)
    ckpt.load(path, smodel, opt)


def test_smaller_model_into_bigger_is_refused_unless_not_strict(tmp_path):
    """A 2-block GPT's checkpoint into a 4-block one: refused (blocks 2 and 3 missing);
    ``strict=False`` loads the common part and leaves blocks 2 and 3 as initialized."""
    p1, p2 = str(tmp_path / "small"), str(tmp_path / "again")
    saved, _ = run_on(2, _save_side, p1, "layers2", {"dp": 2}, 3, 400)[0]
    for message in run_on(2, _load_layers, p1, p2, "layers4", {"dp": 2}, True):
        assert isinstance(message, str)
        assert "32 of the model's entries are not in the checkpoint: blocks.2.ln_1.weight (16,), " in message
        assert ", ... 27 more. Fix: build the model the checkpoint was saved from" in message  # 5 shown
    loaded = run_on(2, _load_layers, p1, p2, "layers4", {"dp": 2}, False)
    _check_common_part(tmp_path, p1, p2, saved, loaded[0])


def test_dp2_to_pp2(tmp_path):
    """A checkpoint without a pipeline loads strictly into two pipeline stages (each stage holds
    half the entries; the whole model claims them all); the other way: ``test_pp2_dp2_to_dp4``."""
    _round_trip(tmp_path, "gpt", ({"dp": 2}, 3, 400), ({"pp": 2}, 1, 400))


def test_pipeline_checks_the_whole_model(tmp_path):
    """Two stages of a 2-block GPT refuse a 4-block checkpoint, and two stages of a 4-block GPT
    a 2-block one, with the same message on both ranks (a stage that holds every entry it
    needs still refuses: the check is over the whole model, before any communication)."""
    big, small, unused = (str(tmp_path / name) for name in ("big", "small", "unused"))
    run_on(2, _save_side, big, "layers4", {"dp": 2}, 3, 400)
    run_on(2, _save_side, small, "layers2", {"dp": 2}, 3, 400)
    fewer = run_on(2, _load_layers, big, unused, "layers2", {"pp": 2}, True)
    assert isinstance(fewer[0], str) and fewer[0] == fewer[1]
    assert "32 of its entries are in no rank's part of the model: blocks.2.ln_1.weight (16,)" in fewer[0]
    more = run_on(2, _load_layers, small, unused, "layers4", {"pp": 2}, True)
    assert isinstance(more[0], str) and more[0] == more[1]
    assert "32 of the model's entries are not in the checkpoint: blocks.2.ln_1.weight (16,)" in more[0]
    assert more[0].startswith(f"checkpoint {small!r} does not fit GPT: ")  # the model's name, not Stage


# -- exact resume ----------------------------------------------------------------------------------


class _Wrapped(torch.nn.Module):
    """The reference GPT one level down (``model.wte.weight``), as a user's wrapper holds it."""

    def __init__(self, tie=True):
        super().__init__()
        torch.manual_seed(3)
        self.model = GPT(GPTConfig(vocab_size=37, block_size=8, n_layer=2, n_head=2, n_embd=16, tie_embeddings=tie))

    def forward(self, x, y):
        return self.model(x, y)


def _untied(tie):
    torch.manual_seed(5)
    return GPT(GPTConfig(vocab_size=37, block_size=8, n_layer=2, n_head=2, n_embd=16, tie_embeddings=tie))


def _save_model(path, make):
    smodel = shardlib.shard(make(), shardlib.init_mesh({"dp": 2}), zero_stage=3)
    ckpt.save(path, smodel)
    return shardlib.full_state_dict(smodel)


def _try_load(path, make, strict):
    import warnings

    smodel = shardlib.shard(make(), shardlib.init_mesh({"dp": 2}), zero_stage=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            ckpt.load(path, smodel, strict=strict)
        except ckpt.CheckpointError as exc:
            return "error", str(exc), [str(w.message) for w in caught]
    return "loaded", shardlib.full_state_dict(smodel), [str(w.message) for w in caught]


def test_an_untied_checkpoint_into_a_tied_model_is_refused(tmp_path):
    """Regression (review): an untied GPT's checkpoint (``wte`` and ``lm_head`` apart) loaded
    into a tied GPT kept ``wte`` and dropped the saved ``lm_head`` without a word. Strict: refused,
    naming both; ``strict=False``: loads ``wte`` into the tied tensor and warns what it drops."""
    path = str(tmp_path / "untied")
    saved = run_on(2, _save_model, path, functools.partial(_untied, False))[0]
    assert not torch.equal(saved["wte.weight"], saved["lm_head.weight"])
    for kind, message, _ in run_on(2, _try_load, path, functools.partial(_untied, True), True):
        assert kind == "error"
        assert ("wte.weight = lm_head.weight is one tied parameter here, but the checkpoint holds wte.weight and "
                "lm_head.weight as separate tensors (an untied model's): loading would keep wte.weight and drop "
                "lm_head.weight") in message and "pass strict=False" in message
    results = run_on(2, _try_load, path, functools.partial(_untied, True), False)
    kind, full, warned = results[0]
    assert kind == "loaded" and torch.equal(full["wte.weight"], saved["wte.weight"])
    assert len(warned) == 1 and "skips: wte.weight = lm_head.weight is one tied parameter here" in warned[0]
    assert results[1][2] == []  # warned once, by rank 0


def test_a_wrapped_model_names_the_prefix_and_strict_false_refuses_to_load_nothing(tmp_path):
    """Regression (review): a checkpoint of ``GPT`` loaded into a wrapper holding it as ``model``
    listed 8 missing names with the reason last; the message now starts with the prefix. With
    ``strict=False`` nothing would load: refused too, instead of returning as if loaded."""
    path = str(tmp_path / "plain")
    run_on(2, _save_model, path, functools.partial(_untied, True))
    for kind, message, _ in run_on(2, _try_load, path, _Wrapped, True):
        assert kind == "error"
        assert message.startswith(f"checkpoint {path!r} does not fit _Wrapped: this model's names are the checkpoint's "
                                  "with the prefix 'model.' (it needs 'model."), message
    for kind, message, _ in run_on(2, _try_load, path, _Wrapped, False):
        assert kind == "error" and "none of its entries has a name of _Wrapped, so even with strict=False" in message
