"""checkpoint.load checks the checkpoint against the whole model (issue 12): entries no rank
of the loading model holds and entries it lacks are refused, naming them, unless
``strict=False``; a pipeline stage's missing entries are held by another stage."""

import re

import pytest
import torch

import shardlib
import shardlib.checkpoint as ckpt
from shardlib.errors import WorkerError
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
        assert "parameter blocks.2.ln_1.weight (16,) is not in the checkpoint" in message
        assert "; ... 24 more. Fix: build the model the checkpoint was saved from" in message  # 32 missing, 8 shown
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
    assert "parameter blocks.2.ln_1.weight (16,) is not in the checkpoint" in more[0]


# -- exact resume ----------------------------------------------------------------------------------
