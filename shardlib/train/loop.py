"""The training loop of ``python -m shardlib.train``: one config in, a trained sharded model,
its checkpoints and its metrics out.

Each optimizer step draws the global batch ``(train.global_batch, train.seq_len)`` (the same on
every rank and mesh, :class:`~shardlib.train.batches.Batches`), keeps this rank's rows, runs
forward and backward (``train.grad_accum`` slices, all but the last under ``no_sync()``; on a
pipeline mesh one ``forward_backward`` over ``parallel.microbatches``), clips to
``optim.grad_clip`` and steps AdamW at the scheduled learning rate. With
``train.param_dtype="float16"`` the loss is scaled dynamically (:class:`~shardlib.GradScaler`,
as Megatron's ``--fp16``): a step with an inf/NaN gradient anywhere is skipped on every rank.
The loss reported is the mean over the global batch, so a config gives the same curve on any
mesh, to fp32 rounding.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import Config, ConfigError
from ..random import MicrobatchDropout
from .batches import Batches, open_data
from .build import PEAK_TFLOPS, build_model, check_run, dims, flops_per_token, is_hf, pipeline_keys_unused, sharding
from .checkpoints import Checkpoints
from .metrics import MetricsLog, peak_memory_mb
from .schedule import learning_rate

__all__ = ["Run", "train", "lm_criterion", "step_loss", "global_mean", "evaluate", "setup"]


def lm_criterion(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of logits ``(B, T, V)`` against targets ``(B, T)`` (nats)."""
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def _local(batch: torch.Tensor, smodel: Any, device: torch.device) -> torch.Tensor:
    """This rank's rows of a global ``(B, T)`` batch: local ``(B / data ranks, T)``."""
    import shardlib

    return shardlib.distribute(batch, smodel.mesh, smodel.batch_spec).to(device)


def step_loss(smodel: Any, x: torch.Tensor, y: torch.Tensor, backward: bool, accum: int = 1,
              scaler: Any = None) -> torch.Tensor:
    """This rank's mean loss on its rows ``x``, ``y`` (local ``(b, T)``), with backward if asked.

    Off a pipeline, ``accum`` slices of ``b / accum`` rows run one after the other, all but the
    last backward inside ``smodel.no_sync()``, each loss scaled by ``1 / accum`` (the gradient
    of the mean over the ``b`` rows). On a pipeline the schedule runs its microbatches and the
    last stage's loss is shared with every stage (``accum`` must be 1). ``scaler``: a
    :class:`~shardlib.GradScaler` whose scale multiplies what backward starts from (fp16); the
    loss returned is unscaled.
    """
    import shardlib

    if isinstance(smodel, shardlib.PipelineModule):
        run = smodel.forward_backward if backward else smodel.evaluate
        scaled = backward and scaler is not None
        criterion = (lambda logits, t: scaler.scale(lm_criterion(logits, t))) if scaled else lm_criterion
        losses, _ = run(x, criterion=criterion, labels=(y,))
        loss = torch.stack(losses).mean() if losses is not None else torch.zeros((), device=x.device)
        if scaled:
            loss = loss / scaler.get_scale()  # a power of two by default: exact
        return shardlib.all_reduce(loss, smodel.pp_axis)  # zero on every stage but the last
    total = torch.zeros((), device=x.device)
    hf = is_hf(smodel)
    # dropout: each slice draws its rows of the whole batch's masks (the curve does not depend on accum)
    drops = MicrobatchDropout(smodel.module, accum) if accum > 1 else None
    for i, (xs, ys) in enumerate(zip(x.chunk(accum), y.chunk(accum))):
        sync = i == accum - 1 or not backward
        with contextlib.nullcontext() if sync else smodel.no_sync(), \
                drops.forward(i) if drops else contextlib.nullcontext():
            # a Hugging Face model: its logits (gathered over tp by its output layer) into our criterion
            loss = lm_criterion(smodel(input_ids=xs).logits, ys) if hf else smodel(xs, ys)[1]
            if backward:
                (loss / accum if scaler is None else scaler.scale(loss / accum)).backward()
        total = total + loss.detach() / accum
    return total


def global_mean(loss: torch.Tensor, smodel: Any) -> float:
    """A per-rank mean loss averaged over the data axes: the mean over the global batch."""
    import shardlib

    loss = loss.detach()
    return (shardlib.all_reduce(loss, smodel.data_axes, op="avg") if smodel.data_axes else loss).item()


@torch.no_grad()
def evaluate(smodel: Any, batches: Batches, steps: int, device: torch.device) -> float:
    """The validation loss (nats per token): the mean over ``steps`` fixed global batches."""
    smodel.eval()
    total = 0.0
    for i in range(steps):
        x, y = batches.val(i)
        total += global_mean(step_loss(smodel, _local(x, smodel, device), _local(y, smodel, device), False), smodel)
    smodel.train()
    return total / steps


@dataclass
class Run:
    """A run set up from a config: the mesh, the sharded model and its optimizer, the data, the
    checkpoints. Built by :func:`setup` on every rank."""

    cfg: Config
    mesh: Any
    smodel: Any
    optimizer: Any
    batches: Batches
    checkpoints: Checkpoints
    device: torch.device
    flops_per_token: float
    start: int = 0  # optimizer steps done (from a resumed checkpoint)
    resumed_from: str | None = None
    resumed_record: dict | None = None  # the checkpoint's step, loss and lr (a resume checks metrics.jsonl by it)
    scaler: Any = None  # a GradScaler, enabled for train.param_dtype="float16" (as Megatron's --fp16)
    history: list = field(default_factory=list)

    @property
    def is_main(self) -> bool:
        return self.mesh.rank == 0

    def set_lr(self, step: int) -> float:
        o = self.cfg.optim
        lr = learning_rate(step, o.lr, self.cfg.train.steps, o.warmup_steps, o.decay, o.min_lr)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def save(self, step: int, record: dict | None = None) -> str:
        extra = dict(step=step, data=self.batches.state_dict(), config=self.cfg.to_dict())
        if record is not None:  # its metrics line: a resume tells this run's metrics.jsonl by it
            extra["record"] = {k: record[k] for k in ("step", "loss", "lr")}
        if self.scaler.is_enabled():
            extra["grad_scaler"] = self.scaler.state_dict()
        return self.checkpoints.save(step, self.smodel, self.optimizer, extra, self.is_main)


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def setup(cfg: Config, world_size: int | None = None, log=print, load: str | None = None, verbose: bool = True,
          continue_data: bool = True) -> Run:
    """Check ``cfg``, make the mesh, build, plan and shard the model, make the optimizer, and
    load a checkpoint (every rank; under ``torchrun``).

    Args:
        cfg: the checked config.
        world_size: the number of ranks (default: ``WORLD_SIZE``, else 1).
        log: where rank 0's lines go.
        load: a checkpoint to load (model and optimizer, resharded onto this mesh); None: the
            newest one in ``checkpoint.dir`` when ``checkpoint.resume``, else none.
        verbose: print the corpus, the model and the plan (rank 0).
        continue_data: take the checkpoint's data position (refusing another seed, global batch
            or sequence length); False for an evaluation, which trains on no further batch.

    Raises:
        ConfigError: what :func:`~shardlib.train.build.check_run` and
            :class:`~shardlib.train.checkpoints.Checkpoints` refuse, before any communication.
        ShardingError: a plan the model cannot take (from :func:`shardlib.plan`).
        CheckpointError: a checkpoint that does not fit the model.
    """
    import shardlib
    from .. import checkpoint

    if world_size is None:
        import torch.distributed as dist

        world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    shape = check_run(cfg, world_size)
    checkpoints = Checkpoints(cfg.checkpoint, cfg.train.steps)
    corpus = open_data(cfg.data, log=log)  # before the mesh: a bad path fails alike everywhere
    for split in ("train", "val"):  # at start, not at the first evaluation after hours of training
        n = len(corpus.split(split))
        if n <= cfg.train.seq_len:
            keys = "data.val_fraction / data.val_files" if split == "val" else "data.files"
            raise ConfigError(f"the {split} split of {corpus.source} has {n:,} tokens, too few for windows of "
                              f"train.seq_len={cfg.train.seq_len} (+1 target). Fix: a shorter train.seq_len, or more "
                              f"{split} text ({keys})")
    mesh = shardlib.init_mesh(shape)
    device = _device()
    model = build_model(cfg)
    vocab = dims(model)[3]
    if vocab < corpus.vocab_size:
        raise ConfigError(f"config key 'model.vocab_size' ({vocab}) is below the tokenizer's vocabulary "
                          f"({corpus.vocab_size})")
    if cfg.train.seq_len > dims(model)[2]:  # a pretrained model's own positions
        raise ConfigError(f"config key 'train.seq_len' ({cfg.train.seq_len}) is longer than the model's "
                          f"{dims(model)[2]} positions")
    fpt = flops_per_token(model, cfg.train.seq_len)
    model = model.to(device)
    specs, options = sharding(cfg, shape, model)
    plan = shardlib.plan(model, mesh, specs, **options)
    if mesh.rank == 0 and verbose:
        log(str(corpus))
        log(f"model: {sum(p.numel() for p in model.parameters()):,} parameters ({type(model).__name__}), mesh {shape}, "
            f"ZeRO stage {cfg.parallel.zero_stage}")
        unused = pipeline_keys_unused(cfg, shape)
        if unused:  # one config serves every mesh (a pp mesh reads them): say so, do not refuse
            log(f"parallel: {', '.join(unused)} apply to a mesh with a 'pp' axis; not used on {shape}")
        rows = cfg.train.global_batch // plan.data_size
        pipelined = shape.get("pp", 1) > 1
        per_pass = rows // (cfg.parallel.microbatches if pipelined else cfg.train.grad_accum)
        # (a pipeline's stage plans count its microbatches themselves)
        log(plan.explain(tokens=per_pass * cfg.train.seq_len) if pipelined else
            plan.explain(tokens=per_pass * cfg.train.seq_len, micro_steps=cfg.train.grad_accum))
    smodel = plan.apply(model)
    o = cfg.optim
    optimizer = shardlib.ZeroOptimizer(smodel, torch.optim.AdamW, max_grad_norm=o.grad_clip or math.inf, lr=o.lr,
                                       weight_decay=o.weight_decay, betas=tuple(o.betas))
    batches = Batches(corpus, cfg.train.global_batch, cfg.train.seq_len, cfg.train.seed)
    run = Run(cfg, mesh, smodel, optimizer, batches, checkpoints, device, fpt)
    # fp16's range needs the loss scaled (bf16's does not); disabled, every call passes through
    run.scaler = shardlib.GradScaler(enabled=cfg.train.param_dtype == "float16")
    if checkpoints.dir and mesh.size() > 1:  # node-local disks: refused now, not at the first save
        from ..checkpoint._shared import check_shared_folder

        check_shared_folder(checkpoints.dir, mesh, "config key 'checkpoint.dir'")
    path = load if load is not None else checkpoints.latest(mesh)  # one branch on every rank
    if path is not None:
        extra = checkpoint.load(path, smodel, optimizer)  # any mesh / ZeRO stage: resharded on load
        run.start, run.resumed_from, run.resumed_record = int(extra["step"]), path, extra.get("record")
        batches.check_tokens(extra.get("data") or {}, (extra.get("config") or {}).get("data"))
        if extra.get("grad_scaler"):
            run.scaler.load_state_dict(extra["grad_scaler"])
        if continue_data:
            batches.load_state_dict(extra["data"])
        wanted = dict(betas=tuple(o.betas), weight_decay=o.weight_decay)  # the config's win over the checkpoint's
        changed = {}
        for group in optimizer.param_groups:
            for key, value in wanted.items():
                saved = tuple(group[key]) if key == "betas" else group[key]
                if saved != value:
                    changed[key] = (saved, value)
                group[key] = value
        if run.is_main and changed:
            log("optim: " + ", ".join(f"{k} {a} in the checkpoint, {b} from the config (used)"
                                      for k, (a, b) in changed.items()))
        if run.is_main:
            log(f"{'loaded' if load is not None else 'resumed from'} {path} at step {run.start}")
    elif cfg.checkpoint.resume and run.is_main:
        log(f"checkpoint.resume: no checkpoint in {cfg.checkpoint.dir!r} yet; starting at step 0")
    return run


def _peak_flops(cfg: Config, device: torch.device) -> float | None:
    if cfg.train.peak_tflops is not None:
        return cfg.train.peak_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tflops in PEAK_TFLOPS.items():
            if key in name:
                return tflops * 1e12
    return None


def _out_dir(cfg: Config, config_path: str | None) -> str:
    """``train.out_dir``, else a new ``runs/<config stem>-<date-time>[-k]`` (only rank 0 writes there).

    Raises:
        ConfigError: ``train.out_dir`` holds a ``metrics.jsonl`` and this run does not resume
            from a checkpoint (checked on every rank, before any communication: the file is
            another run's, and is not replaced).
    """
    from ..checkpoint._files import check_parent

    if cfg.train.out_dir is not None:
        if not cfg.train.out_dir.strip():  # (no metrics.jsonl was written, and nothing said so)
            raise ConfigError(f"config key 'train.out_dir' is {cfg.train.out_dir!r}: a folder, or None for a new "
                              "runs/<config>-<date-time>")
        out = os.path.expanduser(cfg.train.out_dir)
        if os.path.lexists(out) and not os.path.isdir(out):
            raise ConfigError(f"config key 'train.out_dir' is {out!r}, which is not a folder")
        try:
            check_parent(os.path.join(out, "metrics.jsonl"), "config key 'train.out_dir'")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        metrics = os.path.join(out, "metrics.jsonl")
        from .. import checkpoint

        resumes = cfg.checkpoint.resume and cfg.checkpoint.dir and checkpoint.latest(os.path.expanduser(cfg.checkpoint.dir))
        if os.path.exists(metrics) and not resumes:
            raise ConfigError(f"config key 'train.out_dir' is {out!r}, which already holds metrics.jsonl (an earlier "
                              f"run's); this run does not replace it. Fix: --set train.out_dir=ANOTHER_FOLDER (or None: "
                              f"a new runs/<config>-<date-time>), or resume that run from its checkpoints")
        return out
    stem = os.path.splitext(os.path.basename(config_path))[0] if config_path else "run"
    base = os.path.join("runs", f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}")
    out, k = base, 1
    if int(os.environ.get("RANK", "0")) != 0:  # only rank 0 writes there
        return out
    while True:  # made here, so two runs started in the same second get two folders
        try:
            os.makedirs(out)
            return out
        except FileExistsError:
            k += 1
            out = f"{base}-{k}"


def _check_metrics_of_this_run(out_dir: str, run: Run) -> None:
    """A resumed run appends to ``out_dir/metrics.jsonl`` and drops its records after the
    checkpoint's step (the run repeats those steps): only where the file is that run's. Found by a
    new user: run B resumed from its own checkpoints with ``train.out_dir`` at run A's folder cut
    A's records after B's step. The file is this run's when its record of the checkpoint's step
    has the checkpoint's loss and learning rate (saved with it); a file with no record of that
    step (a run killed between a save and its line) is this run's when nothing follows.

    Raises:
        ConfigError: the file holds records after the checkpoint's step and its record of that
            step is missing or another (or the checkpoint, older, saved none to compare).
    """
    path = os.path.join(out_dir, "metrics.jsonl")
    if not run.resumed_from or not os.path.exists(path):
        return
    at, later = None, 0
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:  # a line cut short by a kill: MetricsLog drops it
                continue
            if isinstance(rec, dict) and isinstance(rec.get("step"), int):
                if rec["step"] == run.start:
                    at = rec
                later += rec["step"] > run.start
    mine = run.resumed_record
    if at is not None and mine is not None:
        if at.get("loss") == mine["loss"] and at.get("lr") == mine["lr"]:
            return
        why = f"its step {run.start} has loss {at.get('loss')}, the checkpoint's {mine['loss']}"
    elif not later:
        return  # nothing after the checkpoint's step: nothing is dropped
    else:
        why = (f"it has no record of step {run.start}" if at is None else
               f"the checkpoint saved no metrics line to compare with its step {run.start}")
    raise ConfigError(
        f"config key 'train.out_dir' is {out_dir!r}, whose metrics.jsonl does not look like the metrics of the run "
        f"resumed from {run.resumed_from} ({why}): the resume would drop its {later} record(s) after step "
        f"{run.start}. Fix: --set train.out_dir=ANOTHER_FOLDER (or None: a new runs/<config>-<date-time>), or "
        f"resume the run that wrote it from its own checkpoint.dir")


def train(cfg: Config, config_path: str | None = None, log=print) -> dict[str, Any]:
    """Run the training a config describes (every rank, under ``torchrun``).

    Args:
        cfg: from :func:`shardlib.config.load_config`.
        config_path: the config's file, for the default ``train.out_dir``
            (``runs/<file stem>-<date-time>``, a new folder each run).
        log: where rank 0's lines go.

    Returns:
        On every rank: ``{"history": [records], "val_loss": final validation loss, "out_dir": ...,
        "start": first step run, "checkpoints": [paths saved]}``; a record is one step's metrics
        (:mod:`shardlib.train.metrics`).

    Raises:
        ConfigError, ShardingError, CheckpointError: as :func:`setup`; ConfigError also for a
            ``train.out_dir`` holding another run's metrics.
    """
    out_dir = _out_dir(cfg, config_path)  # every rank, before any communication
    run = setup(cfg, log=log)
    _check_metrics_of_this_run(out_dir, run)  # every rank: each reads the same file and checkpoint
    t = cfg.train
    world = math.prod(run.mesh.shape.values())
    peak = _peak_flops(cfg, run.device)
    metrics = MetricsLog(out_dir, t.steps, t.log_interval, run.is_main, t.tensorboard,
                         resume_from=run.start if run.resumed_from else None)
    tokens = t.global_batch * t.seq_len
    saved, val_loss = [], None
    accum = t.grad_accum
    try:
        for step in range(run.start, t.steps):
            t0 = time.perf_counter()
            lr = run.set_lr(step)
            x, y = next(run.batches)
            loss = step_loss(run.smodel, _local(x, run.smodel, run.device), _local(y, run.smodel, run.device),
                             True, accum, run.scaler)
            scale = run.scaler.get_scale() if run.scaler.is_enabled() else None
            run.scaler.step(run.optimizer)  # a step with an inf/NaN gradient anywhere is skipped on every rank
            run.scaler.update()
            run.optimizer.zero_grad()
            loss = global_mean(loss, run.smodel)
            dt = time.perf_counter() - t0
            norm = run.optimizer.last_grad_norm
            record = dict(step=step + 1, loss=loss, lr=lr, grad_norm=None if norm is None else float(norm),
                          tokens_per_s=tokens / dt, mfu=None if peak is None else tokens / dt * run.flops_per_token /
                          (world * peak), peak_mem_mb=peak_memory_mb(run.device), val_loss=None)
            if scale is not None:
                record["loss_scale"] = scale  # the scale this step's backward ran at (halved after a skip)
            if run.checkpoints.due(step + 1):  # before the evaluation: a failing one loses no training
                saved.append(run.save(step + 1, record))
                metrics.write(f"step {step + 1}: checkpoint {saved[-1]}")
            if (t.eval_interval and (step + 1) % t.eval_interval == 0) or step + 1 == t.steps:
                val_loss = record["val_loss"] = evaluate(run.smodel, run.batches, t.eval_steps, run.device)
            metrics.log(record)
            run.history.append(record)
        if run.start >= t.steps:
            val_loss = evaluate(run.smodel, run.batches, t.eval_steps, run.device)
            metrics.write(f"the checkpoint is at step {run.start} of train.steps={t.steps}: nothing to train; "
                          f"val loss {val_loss:.4f}")
    finally:
        metrics.close()
    if run.is_main:
        vocab = run.batches.corpus.vocab_size
        log(f"final val loss {val_loss:.4f} nats/token after {max(t.steps, run.start)} steps (a uniform guess over "
            f"{vocab} tokens: {math.log(vocab):.4f})" + (f"; metrics: {metrics.path}" if metrics.path else ""))
    return dict(history=run.history, val_loss=val_loss, out_dir=out_dir, start=run.start, checkpoints=saved)
