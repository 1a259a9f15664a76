"""Evaluation of a checkpoint: ``python -m shardlib.eval --config FILE --ckpt PATH [--mesh dp=2,tp=2]
[--tasks hellaswag,piqa --include-path TASKS_DIR]``.

Reports the validation loss (nats per token) of a checkpoint written by ``python -m
shardlib.train``, on any mesh: the checkpoint is resharded onto the mesh given (default: the
config's ``parallel.mesh``), and the loss is the mean over ``train.eval_steps`` fixed global
validation batches, the batches the training run evaluated on, so the figure equals the run's
last ``val_loss`` (to fp32 rounding across meshes).

With ``--tasks``, also downstream scores through EleutherAI's ``lm-evaluation-harness``
(``lm-eval``; HellaSwag, PIQA, WinoGrande, TriviaQA, MMLU, RACE, ... or the YAML tasks of
``--include-path``, which may read local JSON files), answered by
:class:`~shardlib.eval.harness.ShardedLM` on a mesh without a pipeline axis.
"""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["open_checkpoint", "validation_loss", "task_manager", "downstream", "main", "entry"]


def _checkpoint_path(ckpt: str) -> str:
    from .. import checkpoint

    path = os.path.expanduser(ckpt)
    if not os.path.exists(os.path.join(path, checkpoint.MARKER)):
        found = checkpoint.latest(path)
        if found is None:
            raise checkpoint.CheckpointError(f"--ckpt {ckpt!r}: not a checkpoint, and no finished checkpoint inside it")
        path = found
    return path


def open_checkpoint(cfg: Any, ckpt: str, log=print):
    """The :class:`~shardlib.train.loop.Run` of ``cfg`` with checkpoint ``ckpt`` loaded (a
    checkpoint folder, or a folder of them: its newest), resharded onto ``parallel.mesh``
    (every rank). The config's own ``checkpoint`` section is ignored: nothing is written.

    Raises:
        CheckpointError: ``ckpt`` is no checkpoint and holds none, or does not fit the model.
        ConfigError: as :func:`shardlib.train.setup`.
    """
    from ..train.loop import setup

    path = _checkpoint_path(ckpt)
    cfg = type(cfg)({**cfg, "checkpoint": {**cfg.checkpoint, "dir": None, "resume": False, "interval": 0}})
    # any global batch: an evaluation continues no data position (the training's, on a mesh
    # whose data size does not divide it, was refused as a resume)
    return setup(cfg, log=log, load=path, verbose=False, continue_data=False)


def validation_loss(run: Any) -> dict[str, Any]:
    """The validation loss of a run from :func:`open_checkpoint` (every rank).

    Returns:
        ``{"val_loss": float (nats/token), "step": the checkpoint's step, "checkpoint": path,
        "mesh": shape, "tokens": held-out tokens evaluated}``.
    """
    from ..train.loop import evaluate

    t = run.cfg.train
    loss = evaluate(run.smodel, run.batches, t.eval_steps, run.device)
    return dict(val_loss=loss, step=run.start, checkpoint=run.resumed_from, mesh=dict(run.mesh.shape),
                tokens=t.eval_steps * t.global_batch * t.seq_len)


def task_manager(tasks: list[str], include_path: str | None = None, include_defaults: bool = True) -> Any:
    """lm-eval's ``TaskManager`` over its built-in tasks (``include_defaults``) and
    ``include_path``'s, after checking that each of ``tasks`` names one (a task, group or tag;
    lm-eval's wildcards allowed): :func:`main` calls it before loading the checkpoint.

    Raises:
        ImportError: lm-eval is not installed.
        ValueError: naming the unknown tasks and the closest known names (lm-eval's own
            KeyError came from one rank's traceback after the checkpoint was loaded and its
            validation loss computed).
    """
    import difflib

    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=include_path, include_defaults=include_defaults or not include_path)
    unknown = [t for t in tasks if not manager.match_tasks([t])]
    if unknown:
        near = list(dict.fromkeys(n for t in unknown for n in difflib.get_close_matches(t, manager.all_tasks, n=3)))
        where = "lm-eval's tasks" + (f" and those of {include_path!r}" if include_path else "")
        if include_path and not include_defaults:
            where = f"the tasks of {include_path!r}"
        raise ValueError(f"unknown lm-eval task{'s' * (len(unknown) > 1)} {', '.join(map(repr, unknown))}: not among "
                         f"{where}" + (f"; close: {', '.join(near)}" if near else "") + ". Fix: a task name of "
                         "`lm_eval --tasks list`, or --include-path DIR with its YAML file")
    return manager


def downstream(run: Any, tasks: list[str], include_path: str | None = None, limit: int | None = None,
               num_fewshot: int | None = None, batch_size: int = 8,
               include_defaults: bool = True, manager: Any = None) -> dict[str, dict[str, float]]:
    """lm-eval scores of a run from :func:`open_checkpoint` on ``tasks`` (every rank; the same on each).

    Args:
        run: the loaded checkpoint.
        tasks: lm-eval task names.
        include_path: a folder of extra YAML task definitions (lm-eval's ``--include_path``).
        limit: at most this many documents per task.
        num_fewshot: few-shot examples per prompt (lm-eval's default per task when None).
        batch_size: sequences per forward.
        include_defaults: also index lm-eval's built-in tasks (False: only ``include_path``'s,
            which skips indexing the thousands of built-in YAML files).
        manager: a :func:`task_manager` already made (else one is, checking ``tasks``).

    Returns:
        ``{task: {metric: value}}`` (lm-eval's metric names, e.g. ``"acc,none"``).

    Raises:
        ImportError: lm-eval is not installed. ValueError: a pipeline mesh, an unknown task.
    """
    import lm_eval

    import shardlib

    from ..train.build import dims
    from .harness import ShardedLM, codec_for

    if isinstance(run.smodel, shardlib.PipelineModule):
        raise ValueError(f"shardlib.eval --tasks on the pipeline mesh {dict(run.mesh.shape)}: lm-eval scores need the "
                         f"whole model's logits on every rank. Fix: --mesh without pp (the checkpoint reshards), "
                         f"e.g. --mesh dp=1,tp={run.mesh.shape.get('tp', 1)}")
    lm = ShardedLM(run.smodel, codec_for(run.batches.corpus), max_length=dims(run.smodel)[2], batch_size=batch_size)
    manager = manager or task_manager(list(tasks), include_path, include_defaults)
    # lm-eval's wildcards expanded as its own CLI does (simple_evaluate takes names only: KeyError)
    names = list(dict.fromkeys(n for t in tasks for n in manager.match_tasks([t])))
    out = lm_eval.simple_evaluate(model=lm, tasks=names, task_manager=manager, limit=limit,
                                  num_fewshot=num_fewshot, log_samples=False, bootstrap_iters=0)
    scores = None if out is None else {  # lm-eval reports on the process with LOCAL_RANK 0 only
        task: {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        for task, metrics in out["results"].items()}
    return _from_rank0(run.mesh, scores)


def _from_rank0(mesh: Any, obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (an object broadcast, under the watchdog)."""
    import torch.distributed as dist

    from ..checkpoint._files import watched

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    watched(mesh, "broadcast_object_list", "shardlib.eval: rank 0's lm-eval scores",
            lambda: dist.broadcast_object_list(box, src=0))
    return box[0]


def main(argv: list[str] | None = None) -> int:
    """Parse ``--config``, ``--ckpt``, ``--mesh``, ``--set``/``--section.key=value``, ``--tasks``
    (with ``--include-path``, ``--limit``, ``--num-fewshot``, ``--batch-size``) and ``--json
    FILE``; print the validation loss (and the task scores) on rank 0."""
    from ..cli import ArgumentParser, mesh_shape_rest, positive_int
    from ..config import load_config
    from ..train import parse_args as train_args

    p = ArgumentParser(prog="shardlib.eval", description=__doc__)
    p.add_argument("--ckpt", required=True, metavar="PATH", help="a checkpoint, or a folder of them (its newest)")
    p.add_argument("--mesh", type=mesh_shape_rest, default=None, help="evaluate on this mesh, e.g. dp=2,tp=2 or "
                   "dp=-1,tp=2 (-1: the rest of the ranks; default: the config's parallel.mesh)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the result here (rank 0)")
    p.add_argument("--tasks", default=None, help="comma-separated lm-eval tasks (e.g. hellaswag,piqa,winogrande)")
    p.add_argument("--include-path", default=None, metavar="DIR", help="a folder of extra lm-eval YAML tasks")
    p.add_argument("--only-included", action="store_true", help="index only the --include-path tasks, not "
                   "lm-eval's built-in ones (faster)")
    p.add_argument("--limit", type=positive_int, default=None, help="at most this many documents per task")
    p.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples per prompt")
    p.add_argument("--batch-size", type=positive_int, default=8, help="sequences per forward in the lm-eval tasks")
    args, rest = p.parse_known_args(argv)
    if args.json and os.path.lexists(args.json):
        p.error(f"--json {args.json}: the file already exists; this tool does not replace it (name another file)")
    targs, overrides = train_args(rest)
    if args.mesh:
        overrides.append(f"parallel.mesh={dict(args.mesh)!r}")
    cfg = load_config(targs.config, overrides)
    tasks = [t.strip() for t in (args.tasks or "").split(",") if t.strip()]  # "a, b" as "a,b"
    manager = None
    if tasks:  # before the checkpoint is loaded: a misspelled task ended the run after its validation loss
        try:
            manager = task_manager(tasks, args.include_path, include_defaults=not args.only_included)
        except (ImportError, ValueError) as exc:
            p.error(f"--tasks: {exc}")
    run = open_checkpoint(cfg, args.ckpt)
    out = validation_loss(run)
    main_rank = run.is_main
    if main_rank:
        print(f"val loss {out['val_loss']:.4f} nats/token of {out['checkpoint']} (step {out['step']}) on mesh "
              f"{out['mesh']}, {out['tokens']:,} held-out tokens")
    if tasks:
        out["tasks"] = downstream(run, tasks, args.include_path, args.limit, args.num_fewshot, args.batch_size,
                                  include_defaults=not args.only_included, manager=manager)
        if main_rank:
            for task, metrics in out["tasks"].items():
                print(f"{task}: " + ", ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items())))
    if main_rank and args.json:
        with open(args.json, "x") as f:
            json.dump(out, f, indent=1)
    return 0


def entry() -> int:
    """``python -m shardlib.eval``: :func:`main` under :func:`shardlib.cli.main_guard`."""
    from ..cli import main_guard

    return main_guard(main, prog="shardlib.eval")
