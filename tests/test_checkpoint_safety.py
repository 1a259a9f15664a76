"""Checkpoint file safety (issue 13, items 1, 6 and 7): save() never deletes or replaces what it
did not write and replaces a checkpoint only with overwrite=True; a failure on one rank while
writing or reading is the same error on every rank at once (nothing waits for the collective
timeout); damaged files are named; export_safetensors validates before gathering."""

import contextlib
import errno
import json
import os
import shutil
import time

import pytest
import torch
import torch.distributed as dist

import shardlib
import shardlib.checkpoint as ckpt
from shardlib.errors import WorkerError
from shardlib.testing import run_on


# A refusal is raised before any communication and an injected failure is exchanged at once: a
# whole test of them (several runs) took 0.01-0.13 s on 2 ranks here (2 shared cores; the pool's
# start, about 11 s, falls in the first test), while a rank left waiting would need the pool's
# collective timeout (120 s). 20 s tells the two apart with a wide margin.
PROMPT_S = 20.0
RUN_TIMEOUT_S = 60  # run_on gives up (and the test fails) instead of waiting for the 120 s timeout


def _tiny(seed=0):
    """A Linear(4, 3) under ZeRO-3 on dp=2 (each rank writes its own data file) and its AdamW."""
    mesh = shardlib.init_mesh({"dp": 2})
    torch.manual_seed(seed)
    smodel = shardlib.shard(torch.nn.Linear(4, 3), mesh, zero_stage=3)
    return smodel, shardlib.ZeroOptimizer(smodel, torch.optim.AdamW, lr=1e-2)


def _raises_on_every_rank(match, fn, *args, **kwargs):
    """Run ``fn`` on 2 ranks; it must raise the same CheckpointError on both, matching ``match``,
    within PROMPT_S seconds. Returns the message."""
    start = time.monotonic()
    with pytest.raises(WorkerError, match=match) as info:
        run_on(2, fn, *args, timeout=RUN_TIMEOUT_S, **kwargs)
    elapsed = time.monotonic() - start
    errors = info.value.errors
    assert sorted(errors) == [0, 1] and {kind for kind, _ in errors.values()} == {"CheckpointError"}, errors
    assert errors[0][1] == errors[1][1], errors  # the same message on every rank
    assert elapsed < PROMPT_S, f"{elapsed:.1f} s: a rank waited for the others"
    return errors[0][1]


def _snapshot(root):
    """Every entry under ``root``: file bytes, link targets, folders."""
    out = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(folder, name)
            rel = os.path.relpath(p, root)
            if os.path.islink(p):
                out[rel] = ("link", os.readlink(p))
            elif os.path.isdir(p):
                out[rel] = ("dir",)
            else:
                with open(p, "rb") as f:
                    out[rel] = ("file", f.read())
    return out


# -- refused saves -----------------------------------------------------------------------------

def _save(path, overwrite=False, seed=0, extra=None):
    smodel, opt = _tiny(seed)
    return ckpt.save(path, smodel, opt, extra=extra, overwrite=overwrite)


def _users_things(root):
    """A user's folder, file, link, and folders that happen to be named like save()'s own."""
    os.makedirs(root / "run" / "sub")
    (root / "run" / "important.txt").write_bytes(b"precious results\n")
    (root / "run" / "sub" / "notes.md").write_text("do not lose\n")
    (root / "file.bin").write_bytes(b"0123456789abc")
    os.symlink(root / "run", root / "link")
    os.makedirs(root / "x.partial")
    (root / "x.partial" / "important.txt").write_text("mine, not a save\n")
    os.makedirs(root / "y.old")
    (root / "y.old" / "important.txt").write_text("mine too\n")
    os.makedirs(root / "bad")  # a folder with a marker that is not save()'s
    (root / "bad" / ckpt.MARKER).write_text("{not json")
    (root / "bad" / "important.txt").write_text("still mine\n")
    os.makedirs(root / "empty")


REFUSED = {
    "run": r"'[^']*/run' is a folder that is not a shardlib checkpoint \(it has no shardlib_checkpoint\.json; it "
           r"holds important\.txt, sub/\); save\(\) writes a checkpoint folder there and never replaces what it did not "
           r"write\. Fix: choose another path, or move it away",
    "file.bin": r"'[^']*/file\.bin' is a file \(13 bytes\); save\(\) writes a checkpoint folder there",
    "link": r"'[^']*/link' is a symbolic link to '[^']*/run'; save\(\) writes a checkpoint folder there",
    "x": r"'[^']*/x\.partial' is a folder that is not a shardlib checkpoint \(it has no shardlib_checkpoint\.json; it "
         r"holds important\.txt\); save\(\) writes its unfinished saves there and removes only folders it made \(they "
         r"hold \.shardlib_partial\.json\)\. Fix: move it away, or choose another path",
    "y": r"'[^']*/y\.old' is a folder that is not a shardlib checkpoint .*; save\(\) moves the checkpoint it replaces "
         r"there and removes only checkpoints",
    "bad": r"'[^']*/bad' is a folder whose shardlib_checkpoint\.json cannot be read \(JSONDecodeError: ",
    "empty": r"'[^']*/empty' is a folder that is not a shardlib checkpoint \(it has no shardlib_checkpoint\.json; it is "
             r"empty\)",
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_saves_keep_the_users_files_byte_for_byte(tmp_path, name):
    """Refused on every rank before anything is written, with overwrite=True too (it replaces only
    checkpoints); nothing under tmp_path changes. The old save() deleted run/ and its
    important.txt, moved file.bin to file.bin.old, and deleted x.partial/."""
    _users_things(tmp_path)
    before = _snapshot(tmp_path)
    for overwrite in (False, True):
        message = _raises_on_every_rank(REFUSED[name], _save, str(tmp_path / name), overwrite)
        assert message.startswith(f"checkpoint.save('{tmp_path / name}'): "), message
    assert _snapshot(tmp_path) == before


# -- overwrite ---------------------------------------------------------------------------------

def _load(path, seed=5, optimizer=True):
    """Load ``path`` into a fresh model (other initial values); ``(extra, full state dict)``."""
    smodel, opt = _tiny(seed)
    extra = ckpt.load(path, smodel, opt if optimizer else None)
    return extra, shardlib.full_state_dict(smodel)


@pytest.mark.multiprocess
def test_overwrite_true_replaces_a_checkpoint_and_the_result_loads(tmp_path):
    path = str(tmp_path / "step_1")
    run_on(2, _save, path, extra={"run": 1}, timeout=RUN_TIMEOUT_S)
    _raises_on_every_rank(r"checkpoint\.save\('[^']*/step_1'\): '[^']*/step_1' already holds a finished shardlib "
                          r"checkpoint; save\(\) replaces one only when asked\. Fix: pass overwrite=True to replace it, "
                          r"or choose another path", _save, path, extra={"run": 2})
    assert run_on(2, _load, path, timeout=RUN_TIMEOUT_S)[0][0] == {"run": 1}  # the refused save changed nothing
    run_on(2, _save, path, True, 1, {"run": 2}, timeout=RUN_TIMEOUT_S)  # other values (seed 1), overwrite=True
    saved = run_on(2, _full, 1, timeout=RUN_TIMEOUT_S)[0]
    for extra, loaded in run_on(2, _load, path, timeout=RUN_TIMEOUT_S):
        assert extra == {"run": 2}
        assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
    assert sorted(os.listdir(tmp_path)) == ["step_1"]  # no step_1.old or step_1.partial left


def _full(seed):
    return shardlib.full_state_dict(_tiny(seed)[0])


@pytest.mark.multiprocess
def test_overwrite_keeps_the_users_files_inside_a_checkpoint(tmp_path):
    """overwrite=True replaces a checkpoint, not a NOTES.txt the user put into its folder (found
    by a new-user review: it was deleted with the old checkpoint)."""
    path = str(tmp_path / "step_1")
    run_on(2, _save, path, extra={"run": 1}, timeout=RUN_TIMEOUT_S)
    with open(os.path.join(path, "NOTES.txt"), "w") as f:
        f.write("what this run was\n")
    before = _snapshot(tmp_path)
    _raises_on_every_rank(r"checkpoint\.save\('[^']*/step_1'\): the checkpoint '[^']*/step_1' also holds NOTES\.txt, "
                          r"which save\(\) did not write; replacing the checkpoint would delete them\. Fix: move them",
                          _save, path, True, 1, {"run": 2})
    assert _snapshot(tmp_path) == before


# -- failures on one rank: an error on every rank, at once --------------------------------------

@pytest.mark.multiprocess
def test_a_parent_that_is_a_file_is_refused_on_every_rank_at_once(tmp_path):
    """The old save() raised on rank 0 only (its mkdir), leaving rank 1 in a barrier."""
    (tmp_path / "notes.txt").write_text("a file\n")
    before = _snapshot(tmp_path)
    _raises_on_every_rank(r"checkpoint\.save\('[^']*/notes\.txt/ckpt'\): cannot write '[^']*/notes\.txt/ckpt': its "
                          r"parent '[^']*/notes\.txt' is a file \(7 bytes\), not a folder\. Fix: choose a path inside "
                          r"a folder", _save, str(tmp_path / "notes.txt" / "ckpt"))
    _raises_on_every_rank(r"its parent '[^']*/notes\.txt' is a file", _save, str(tmp_path / "notes.txt" / "a" / "b"))
    assert _snapshot(tmp_path) == before


def _each_rank_its_own(root, op):
    """Each rank computes its own folder: a timestamp a second apart (save), its own idea of the
    newest checkpoint (load)."""
    smodel, opt = _tiny()
    rank = torch.distributed.get_rank()
    if op == "save":
        return ckpt.save(f"{root}/run-12000{rank}", smodel, opt)
    return ckpt.load(f"{root}/step_{rank + 1}", smodel, opt)


@pytest.mark.multiprocess
def test_ranks_naming_different_folders_are_refused_on_every_rank(tmp_path):
    """Found by a new user: save() to a folder per rank reported success with a checkpoint marked
    complete but missing rank 1's data file (rank 1's was left in an orphaned .partial), and
    load() of a different checkpoint per rank gave a model mixed from both, silently."""
    before = _snapshot(tmp_path)
    _raises_on_every_rank(r"checkpoint\.save: the ranks name different folders \(rank 0: '[^']*/run-120000', rank 1: "
                          r"'[^']*/run-120001'\): .* Nothing was written", _each_rank_its_own, str(tmp_path), "save")
    assert _snapshot(tmp_path) == before
    for step in (1, 2):
        run_on(2, _save, str(tmp_path / f"step_{step}"), seed=step)
    _raises_on_every_rank(r"checkpoint\.load: the ranks name different folders \(rank 0: '[^']*/step_1', rank 1: "
                          r"'[^']*/step_2'\)", _each_rank_its_own, str(tmp_path), "load")


def _on_own_disks(root, op, shared=None):
    """Each rank's "node" has its own disk at the same path, as on a cluster without a shared file
    system: ``/proc/self/cwd`` is each process's working directory, so one path string names a
    different folder on each rank (a bind mount per node, without root). ``shared``: every rank on
    that node's disk instead."""
    smodel, opt = _tiny()
    rank, cwd = torch.distributed.get_rank(), os.getcwd()
    disk = f"{root}/node{rank if shared is None else shared}"
    os.makedirs(disk, exist_ok=True)
    os.chdir(disk)
    try:
        if op == "save":
            return ckpt.save("/proc/self/cwd/ck", smodel, opt)
        if op == "latest":  # the training tool's resume: which checkpoint is newest
            return ckpt.latest("/proc/self/cwd", smodel.mesh)
        if op == "probe":  # the training tool at start, before its first save
            from shardlib.checkpoint._shared import check_shared_folder

            return check_shared_folder("/proc/self/cwd/run", smodel.mesh, "config key 'checkpoint.dir'")
        return ckpt.load("/proc/self/cwd/ck", smodel, opt)
    finally:
        os.chdir(cwd)


@pytest.mark.multiprocess
@pytest.mark.skipif(not os.path.isdir("/proc/self/cwd"), reason="needs Linux's /proc/self/cwd to give ranks own disks")
def test_ranks_without_a_shared_file_system_are_refused_on_every_rank(tmp_path):
    """Found by a new user on two torchrun nodes, each with its own disk at the checkpoint path:
    every save reported success and node 0's folder was marked finished without node 1's data
    files (those stayed in node 1's .partial); every load of the run failed. A resume where only
    node 0 saw the checkpoint sent the ranks separate ways until the watchdog."""
    _raises_on_every_rank(r"checkpoint\.save: not every rank sees the folder rank 0 made, '/proc/self/cwd/ck\.partial' "
                          r"\(rank 1: no folder made by rank 0 \(FileNotFoundError.*each would write its part to its own "
                          r"disk\. A checkpoint folder must be on a file system every rank shares", _on_own_disks,
                          str(tmp_path), "save")
    assert not os.path.exists(tmp_path / "node0" / "ck") and not os.path.exists(tmp_path / "node1" / "ck")
    run_on(2, _on_own_disks, str(tmp_path), "save", 0, timeout=RUN_TIMEOUT_S)  # a checkpoint on node 0's disk
    assert os.path.isdir(tmp_path / "node0" / "ck")
    # node 1 sees none: its own check fails before any communication, and rank 0's wait names it
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        run_on(2, _on_own_disks, str(tmp_path), "load", timeout=RUN_TIMEOUT_S)
    assert time.monotonic() - start < PROMPT_S
    assert info.value.errors[1][0] == "CheckpointError", info.value.errors
    assert "checkpoint '/proc/self/cwd/ck' does not exist (no such folder)" in info.value.errors[1][1]
    # node 1 holds a checkpoint of another save at the same path: both pass their own checks, then
    # the ranks compare before reading (a model mixed from two checkpoints, silently, before)
    other = tmp_path / "other"
    run_on(2, _on_own_disks, str(other), "save", 0, timeout=RUN_TIMEOUT_S)
    run_on(2, _on_own_disks, str(other), "save", 1, timeout=RUN_TIMEOUT_S)
    _raises_on_every_rank(r"checkpoint\.load\('/proc/self/cwd/ck'\): the ranks see different checkpoints there \(rank "
                          r"0: a checkpoint saved at [0-9.]+; rank 1: a checkpoint saved at [0-9.]+\).*Nothing was read",
                          _on_own_disks, str(other), "load")
    _raises_on_every_rank(r"checkpoint\.latest: the ranks found different newest checkpoints \(rank 0: "
                          r"'/proc/self/cwd/ck' in '/proc/self/cwd'; rank 1: none in '/proc/self/cwd'\), so a resume "
                          r"would load on some ranks and start afresh on others", _on_own_disks, str(tmp_path), "latest")
    _raises_on_every_rank(r"config key 'checkpoint\.dir' '/proc/self/cwd/run': not every rank sees the file rank 0 "
                          r"wrote there \(rank 1: no file \(FileNotFoundError", _on_own_disks, str(tmp_path), "probe")
    assert os.listdir(tmp_path / "node0" / "run") == []  # the probe file is removed


def _save_unwritable(path):
    original = os.access
    os.access = lambda p, mode: False if os.path.abspath(p) == os.path.dirname(path) else original(p, mode)
    try:  # root may write anywhere, so the permission is simulated
        return _save(path)
    finally:
        os.access = original


@pytest.mark.multiprocess
def test_a_parent_that_is_not_writable_is_refused_on_every_rank(tmp_path):
    _raises_on_every_rank(r"cannot write '[^']*/ckpt': the folder '[^']*' is not writable by this process\. Fix: "
                          r"choose a path in a folder you can write", _save_unwritable, str(tmp_path / "ckpt"))
    assert os.listdir(tmp_path) == []


@contextlib.contextmanager
def _patched(obj, name, replacement):
    original = getattr(obj, name)
    setattr(obj, name, replacement(original))
    try:
        yield
    finally:
        setattr(obj, name, original)  # the pool's processes run the next tests


def _failing(where):
    """A patch that fails the save on one rank at ``where``."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    rank = dist.get_rank()

    def raise_if(test, exc):
        def wrap(original):
            def patched(*args, **kwargs):
                if test(*args):
                    raise exc
                return original(*args, **kwargs)
            return patched
        return wrap

    disk_full = OSError(errno.ENOSPC, "No space left on device (injected)")
    if where == "mkdir" and rank == 0:
        return _patched(os, "makedirs", raise_if(lambda p, *a: str(p).endswith(".partial"), disk_full))
    if where == "write" and rank == 1:
        return _patched(FileSystemWriter, "write_data", raise_if(lambda *a: True, RuntimeError("disk on fire")))
    if where == "marker" and rank == 0:
        return _patched(os, "replace", raise_if(lambda src, dst, *a: str(dst).endswith(ckpt.MARKER), disk_full))
    if where == "rename" and rank == 0:
        return _patched(os, "rename", raise_if(lambda src, dst, *a: str(src).endswith(".partial"), disk_full))
    return contextlib.nullcontext()


def _save_failing(path, where, overwrite=False):
    with _failing(where):
        return _save(path, overwrite=overwrite, seed=1, extra={"run": 2})


FAILURES = {
    "mkdir": r"failed making the folder on rank 0: OSError: \[Errno 28\] No space left on device \(injected\)\. "
             r"'[^']*/ckpt' is as it was",
    "write": r"failed writing the data files on rank 1: RuntimeError: disk on fire\. '[^']*/ckpt' is as it was; the "
             r"unfinished save is in '[^']*/ckpt\.partial' \(the next save to '[^']*/ckpt' removes it\)",
    "marker": r"failed finishing on rank 0: OSError: \[Errno 28\] No space left on device \(injected\)\. The new "
              r"checkpoint is in '[^']*/ckpt\.partial' or '[^']*/ckpt'",
    "rename": r"failed finishing on rank 0: OSError: \[Errno 28\] No space left",
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("where", sorted(FAILURES))
def test_a_failure_on_one_rank_while_writing_is_an_error_on_every_rank(tmp_path, where):
    """Injected on one rank: rank 0's mkdir, rank 1's DCP write, rank 0's marker, rank 0's final
    rename. Every rank raises the same error at once (the old save() left rank 1 in its barrier
    for a mkdir failure, and let DCP's CheckpointException, a BaseException, escape), the previous
    checkpoint stays loadable, and a second save (overwrite=True) replaces it."""
    path = str(tmp_path / "ckpt")
    run_on(2, _save, path, extra={"run": 1}, timeout=RUN_TIMEOUT_S)
    _raises_on_every_rank(FAILURES[where], _save_failing, path, where, True)
    assert run_on(2, _load, path, timeout=RUN_TIMEOUT_S)[0][0] == {"run": 1}  # as it was
    run_on(2, _save_failing, path, "none", True, timeout=RUN_TIMEOUT_S)
    assert run_on(2, _load, path, timeout=RUN_TIMEOUT_S)[0][0] == {"run": 2}
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def _raw_dcp_save(path):
    """DCP itself, with rank 1's write failing: what save() relies on (and turns into one error)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    with _failing("write"):
        try:
            dcp.save({"x": torch.zeros(3)}, storage_writer=dcp.FileSystemWriter(path))
        except CheckpointException as exc:  # a BaseException, raised on every rank
            return sorted(exc.failures), type(exc.failures[1][0]).__name__
    return None


@pytest.mark.multiprocess
def test_dcp_raises_a_one_rank_write_failure_on_every_rank(tmp_path):
    """A canary for torch upgrades: DCP gathers the failure of rank 1's write_data to every rank
    as a CheckpointException (a BaseException, not an Exception) naming rank 1."""
    assert run_on(2, _raw_dcp_save, str(tmp_path / "raw"), timeout=RUN_TIMEOUT_S) == [([1], "RuntimeError")] * 2


# -- damaged checkpoints: the file named, on every rank ---------------------------------------

def _damage(path, name, how):
    target = os.path.join(path, name)
    if how == "truncate":
        with open(target, "r+b") as f:
            f.truncate(os.path.getsize(target) // 2)
    else:
        with open(target, "wb") as f:
            f.write(b"\x00garbage, not what save() wrote\n")


DAMAGED = {  # file: (damage, message); rank 1 alone reads __1_0.distcp (rank 0 reads __0_0 only)
    ckpt.MARKER: ("overwrite", r"checkpoint '[^']*/ckpt' is damaged: its file 'shardlib_checkpoint\.json' \(written by "
                               r"save\(\) when the checkpoint was finished\) cannot be read \(JSONDecodeError: .*\)\. "
                               r"Load an earlier checkpoint"),
    ".metadata": ("overwrite", r"checkpoint '[^']*/ckpt' is damaged: its file '\.metadata' \(DCP's index of the saved "
                               r"tensors\) cannot be read \(UnpicklingError: .*\)\. Load an earlier checkpoint"),
    "__0_0.distcp": ("truncate", r"checkpoint '[^']*/ckpt' cannot be read: ranks 0, 1: its data file '__0_0\.distcp' "
                                 r"cannot be read \(.*\)\. It may be damaged, and the model and optimizer partly "
                                 r"loaded: load an earlier checkpoint"),
    "__1_0.distcp": ("overwrite", r"checkpoint '[^']*/ckpt' cannot be read: rank 1: its data file '__1_0\.distcp' "
                                  r"cannot be read \(.*\)\. It may be damaged"),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(DAMAGED))
def test_a_damaged_file_is_named_on_every_rank(tmp_path, name):
    """The old load() raised JSONDecodeError, UnpicklingError, or DCP's CheckpointException (a
    BaseException naming neither file nor checkpoint)."""
    path = str(tmp_path / "ckpt")
    run_on(2, _save, path, timeout=RUN_TIMEOUT_S)
    how, message = DAMAGED[name]
    _damage(path, name, how)
    _raises_on_every_rank(message, _load, path)


@pytest.mark.multiprocess
def test_loading_a_file_says_it_is_a_file(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"not a folder")
    _raises_on_every_rank(r"checkpoint '[^']*/model\.safetensors' is a file, not a checkpoint folder: pass the folder "
                          r"save\(\) wrote \(it holds shardlib_checkpoint\.json and \.metadata\)", _load,
                          str(tmp_path / "model.safetensors"))


@pytest.mark.multiprocess
def test_latest_skips_a_damaged_marker_with_a_warning(tmp_path):
    """The newest checkpoint's marker is damaged: latest() warns, naming it, and returns the
    newest readable one (the old latest() raised JSONDecodeError)."""
    run_on(2, _save, str(tmp_path / "step_1"), timeout=RUN_TIMEOUT_S)
    shutil.copytree(tmp_path / "step_1", tmp_path / "step_2")
    info = json.loads((tmp_path / "step_1" / ckpt.MARKER).read_text())
    (tmp_path / "step_2" / ckpt.MARKER).write_text(json.dumps(dict(info, time=info["time"] + 10)))
    assert ckpt.latest(tmp_path) == str(tmp_path / "step_2")
    (tmp_path / "step_2" / ckpt.MARKER).write_text('{"format": 1, "time": ')  # cut off mid-write
    with pytest.warns(UserWarning, match=r"checkpoint\.latest\('[^']*'\) skips 'step_2': checkpoint '[^']*/step_2' is "
                                         r"damaged: its file 'shardlib_checkpoint\.json' .* cannot be read "
                                         r"\(JSONDecodeError: "):
        assert ckpt.latest(tmp_path) == str(tmp_path / "step_1")


# -- export_safetensors ------------------------------------------------------------------------

def _export(path, overwrite=False, fail=False):
    smodel = _tiny(3)[0]
    if fail and dist.get_rank() == 0:
        import safetensors.torch

        def half_then_fail(original):
            def patched(tensors, filename, metadata=None):
                with open(filename, "wb") as f:
                    f.write(b"half a file")
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
            return patched

        with _patched(safetensors.torch, "save_file", half_then_fail):
            return ckpt.export_safetensors(path, smodel, overwrite=overwrite)
    return ckpt.export_safetensors(path, smodel, overwrite=overwrite), shardlib.full_state_dict(smodel)


@pytest.mark.multiprocess
def test_export_safetensors_refusals_on_every_rank(tmp_path):
    """A folder, a parent that is a file, an existing file: refused on every rank before the
    gather, nothing changed (the old export raised on rank 0 only, after the gather, and left
    ``<path>.tmp``; it replaced an existing file silently)."""
    os.makedirs(tmp_path / "out")
    (tmp_path / "notes.txt").write_text("a file\n")
    (tmp_path / "model.safetensors").write_bytes(b"an earlier export")
    before = _snapshot(tmp_path)
    _raises_on_every_rank(r"checkpoint\.export_safetensors\('[^']*/out'\): '[^']*/out' is a folder; the export is one "
                          r"file\. Fix: name a file, such as '[^']*/out/model\.safetensors'", _export, str(tmp_path / "out"))
    _raises_on_every_rank(r"cannot write '[^']*/notes\.txt/model\.safetensors': its parent '[^']*/notes\.txt' is a file",
                          _export, str(tmp_path / "notes.txt" / "model.safetensors"))
    _raises_on_every_rank(r"'[^']*/model\.safetensors' already exists; export_safetensors replaces a file only when "
                          r"asked\. Fix: pass overwrite=True to replace it, or choose another path", _export,
                          str(tmp_path / "model.safetensors"))
    assert _snapshot(tmp_path) == before


@pytest.mark.multiprocess
def test_export_safetensors_overwrite_and_a_failed_write(tmp_path):
    """overwrite=True replaces the file, whose name's ``.tmp`` sibling (the user's) survives; a
    write failing on rank 0 is an error on every rank and leaves no temporary file."""
    from safetensors.torch import load_file

    path = tmp_path / "model.safetensors"
    path.write_bytes(b"an earlier export")
    (tmp_path / "model.safetensors.tmp").write_bytes(b"the user's own file")  # the old export's temporary name
    results = run_on(2, _export, str(path), True, timeout=RUN_TIMEOUT_S)
    assert [r[0] for r in results] == [str(path), None]
    exported = load_file(path)
    assert exported.keys() == results[0][1].keys() and all(torch.equal(exported[k], results[0][1][k]) for k in exported)
    before = _snapshot(tmp_path)
    assert before["model.safetensors.tmp"] == ("file", b"the user's own file")
    _raises_on_every_rank(r"checkpoint\.export_safetensors\('[^']*/model\.safetensors'\) failed on rank 0: OSError: "
                          r"\[Errno 28\] No space left on device \(injected\); no file was left behind and "
                          r"'[^']*/model\.safetensors' is as it was", _export, str(path), True, True)
    assert _snapshot(tmp_path) == before


# -- train_gpt.py: an older run's --ckpt-dir --------------------------------------------------

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _older_run(folder):
    """A --ckpt-dir as an older run left it: a checkpoint (its marker is what is looked at) and
    a file of the user's."""
    os.makedirs(folder / "step_000002")
    (folder / "step_000002" / ckpt.MARKER).write_text('{"format": 1, "time": 0}')
    (folder / "important.txt").write_text("results\n")


def test_train_gpt_refuses_an_older_runs_ckpt_dir_at_start(tmp_path):
    """Exit status 2 with one line naming the folder, what it holds and both flags, before any
    training; the folder is unchanged (the old script trained and replaced step_000002, leaving a
    folder that mixed two runs)."""
    import subprocess
    import sys

    folder = tmp_path / "ckpt"
    _older_run(folder)
    before = _snapshot(folder)
    cmd = [sys.executable, os.path.join(ROOT, "examples", "train_gpt.py"), "--mesh", "dp=1", "--steps", "2",
           "--batch-size", "2", "--block-size", "8", "--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--sample",
           "0", "--eval-batches", "1", "--ckpt-dir", str(folder), "--save-every", "2"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SHARDLIB_TRACEBACK")}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=dict(env, OMP_NUM_THREADS="1"),
                         cwd=tmp_path)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stdout == "" and len(out.stderr.splitlines()) == 1, out.stderr  # nothing started
    assert out.stderr.startswith(f"train_gpt.py: error: --ckpt-dir {folder} already holds checkpoints step_000002 "
                                 f"and other entries important.txt (from an earlier run?)"), out.stderr
    assert f"Fix: --resume {folder} to continue that run, --overwrite-ckpt to save there anyway" in out.stderr
    assert _snapshot(folder) == before


def _train_gpt_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_gpt", os.path.join(ROOT, "examples", "train_gpt.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_gpt_output_checks(tmp_path):
    """What check_outputs() allows: a new or empty --ckpt-dir, --resume into it (the folder or one
    of its checkpoints; not another folder), --overwrite-ckpt, --eval-only (it saves nothing);
    and what it refuses: an existing --export-safetensors file or a folder there."""
    train_gpt = _train_gpt_module()
    folder = tmp_path / "ckpt"
    _older_run(folder)
    os.makedirs(tmp_path / "empty")
    (tmp_path / "model.safetensors").write_bytes(b"an earlier export")

    def check(*argv):
        train_gpt.check_outputs(train_gpt.parse_args(list(argv)))

    for argv in ((), ("--ckpt-dir", str(tmp_path / "new")), ("--ckpt-dir", str(tmp_path / "empty")),
                 ("--ckpt-dir", str(folder), "--resume", str(folder)),
                 ("--ckpt-dir", str(folder), "--resume", str(folder / "step_000002")),
                 ("--ckpt-dir", str(folder), "--overwrite-ckpt"), ("--ckpt-dir", str(folder), "--eval-only", "--resume", str(tmp_path / "elsewhere")),
                 ("--export-safetensors", str(tmp_path / "model.safetensors"), "--overwrite-ckpt")):
        check(*argv)  # allowed: no SystemExit
    with pytest.raises(SystemExit, match=r"--ckpt-dir [^ ]*/ckpt already holds checkpoints step_000002 and other "
                                         r"entries important\.txt \(from an earlier run\?\)"):
        check("--ckpt-dir", str(folder), "--resume", str(tmp_path / "empty"))
    with pytest.raises(SystemExit, match=r"--ckpt-dir [^ ]*/important\.txt: it is a file, not a folder"):
        check("--ckpt-dir", str(folder / "important.txt"))
    with pytest.raises(SystemExit, match=r"--export-safetensors [^ ]*/model\.safetensors: the file already exists\. "
                                         r"Fix: --overwrite-ckpt to replace it, or another file name"):
        check("--export-safetensors", str(tmp_path / "model.safetensors"))
    with pytest.raises(SystemExit, match=r"--export-safetensors [^ ]*/empty: it is a folder; name the file to write"):
        check("--export-safetensors", str(tmp_path / "empty"), "--overwrite-ckpt")
    args = train_gpt.parse_args(["--ckpt-dir", str(folder), "--resume", str(folder / "step_000002")])
    assert train_gpt.resumes_into(args) and not train_gpt.resumes_into(train_gpt.parse_args(["--ckpt-dir", str(folder)]))


def _probe_shared(root):
    from shardlib.checkpoint._shared import check_shared_folder

    smodel, _ = _tiny()
    check_shared_folder(f"{root}/ckpts", smodel.mesh)
    return sorted(os.listdir(f"{root}/ckpts"))


@pytest.mark.multiprocess
def test_the_shared_folder_probe_passes_on_one_file_system_and_leaves_nothing(tmp_path):
    # rank 0 removes its probe before it returns (rank 1 may list the folder before that)
    assert run_on(2, _probe_shared, str(tmp_path), timeout=RUN_TIMEOUT_S)[0] == []
