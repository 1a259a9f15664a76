"""Each pipeline stage's share of the whole model's tensor-parallel layout: the layout
:func:`~shardlib.pipeline_plan.plan_pipeline` plans on the whole model (and ``shard(verify=True)``
proves) is the one every stage runs."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import ShardingError
from .parallel.pipeline import Stage

if TYPE_CHECKING:
    from .plan import Plan


def check_stage_layout(whole: "Plan", stage_plan: "Plan", stage: Stage, r: int) -> None:
    """A stage runs the tensor-parallel layers the whole model's plan (the one ``shard(verify=True)``
    proves) gives its modules, nothing planned apart on the stage's own containers.

    Raises:
        ShardingError: a layer planned otherwise on the stage (a defect of the planner: refused
            rather than run unverified)."""
    held = {path for paths in stage.chunk_paths for path in paths}

    def inside(path: str) -> bool:
        return any(path == root or path.startswith(root + ".") for root in held)

    want = {layer for layer in whole.tp_layers if inside(layer.path)}
    got = set(stage_plan.tp_layers)
    if want != got:
        diff = sorted(want ^ got, key=lambda layer: layer.path)[0]
        raise ShardingError(
            f"pp rank {r}: the stage's tensor-parallel layout differs from the whole model's, which is the one verified "
            f"(first difference: {diff.path}, {'only the whole model' if diff in want else 'only the stage'} plans it as "
            f"{diff}). This is a shardlib defect: please report it with the model; refused rather than run unverified")


def sequence_parallel_per_rank(whole: "Plan", modules: list[Stage], mesh: Any, axis: str, at: dict) -> list[dict]:
    """Each pp rank's share of the whole model's sequence-parallel layout, checked exact.

    Returns, per pp rank, the plan fields: ``sp_entry`` (the whole model's on the first stage's
    rank, else None: the stage's input arrives as the sequence shard) and ``sp_exit`` (on the
    last stage's rank); each stage's ``sp_grad_params`` are the whole model's it holds, planned
    with the stage (``_sum_grads`` in :func:`~shardlib.pipeline_plan.plan_pipeline`).
    """
    p = len(modules)
    n_stages = p * len(modules[0].chunk_paths)
    mesh_shape = dict(mesh.shape)

    def stage_of(path: str) -> int | None:
        for s in range(n_stages):
            if any(path == root or path.startswith(root + ".") for root in modules[at[s][0]].chunk_paths[at[s][1]]):
                return s
        return None

    def where(s: int | None) -> str:
        return "in no stage" if s is None else f"on stage {s} (layers {modules[at[s][0]].chunk_layers[at[s][1]]})"

    given = f"sequence_parallel=True on the pipeline mesh {mesh_shape} ({n_stages} stages over {axis!r})"
    entry = stage_of(whole.sp_entry)
    if entry != 0:
        raise ShardingError(
            f"{given}: the sequence-parallel entry {whole.sp_entry!r} is {where(entry)}, not on stage 0; the stages "
            "before it would run norms and dropouts as if on sequence shards. Fix: sp_entry= a module of the first stage "
            f"({modules[0].chunk_layers[0]}), or split_points= that put {whole.sp_entry!r} in stage 0"
        )
    outputs = [layer.path for layer in whole.tp_layers if layer.output_layer] + ([whole.sp_exit] if whole.sp_exit else [])
    if not outputs:
        raise ShardingError(
            f"{given}: nothing gathers the sequence at the end (no column-parallel output layer and no sp_exit), so the last "
            "stage would return a sequence shard to the loss. Fix: split the LM head (e.g. models.gpt_preset(), whose "
            "vocabulary-parallel wte is tied to lm_head), or pass sp_exit='<the final norm>' (e.g. 'ln_f')"
        )
    for path in outputs:
        s = stage_of(path)
        if s != n_stages - 1:
            raise ShardingError(
                f"{given}: {path!r} gathers the sequence but is {where(s)}, not on the last stage {n_stages - 1}; the "
                "stages after it would receive full sequences where shards are expected. Fix: "
                f"split_points= that keep {path!r} in the last stage, or leave sp_exit unset"
            )
    tp_ranks = {at[s][0] for s in map(stage_of, (layer.path for layer in whole.tp_layers)) if s is not None}
    for r in range(p):
        if r not in tp_ranks:
            held = [name for layers in modules[r].chunk_layers for name in layers]
            raise ShardingError(
                f"{given}: pp rank {r} holds layers {held} with no tensor-parallel layer, so nothing there splits, "
                f"gathers or sums over {whole.tp_layers[0].axis!r}. Fix: split_points= that give every stage a block, or "
                "split its embedding (P('tp', None) on wte.weight, as models.gpt_preset() does)"
            )
    return [dict(sequence_parallel=True, sp_entry=whole.sp_entry if r == at[0][0] else None,
                 sp_exit=whole.sp_exit if r == at[n_stages - 1][0] else "") for r in range(p)]
