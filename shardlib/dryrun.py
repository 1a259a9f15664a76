"""Dry run: one training step of a real-size model as one rank of a large mesh, in one process.

    python -m shardlib.dryrun --model llama-70b --mesh dp=128,tp=8 --rank 5
    python -m shardlib.dryrun --hf-config path/to/config.json --mesh pp=8,dp=16,tp=8 --microbatches 32

validates a layout for 1,024 GPUs on a laptop, as torchtitan's ``COMM_MODE=fake_backend`` does
for its own models:

1. ``torch.distributed`` is initialized with torch's fake backend
   (``init_process_group("fake", store=FakeStore(), rank=R, world_size=W)``): every collective
   completes at once and moves nothing, so one process plays rank ``R`` of ``W``;
2. the model is built under ``torch.device("meta")`` (shapes and dtypes, no storage);
3. :func:`shardlib.shard` plans and applies it exactly as on a real rank ``R`` (tensor-parallel
   layers swapped in, ZeRO chunks, this rank's pipeline stage), inside
   :func:`shardlib.lazy.materialize_on` ``("meta")``: chunks, gradients and optimizer state are
   meta tensors of their real sizes;
4. one training step runs on meta inputs: forward, backward (a pipeline's ``forward_backward``)
   and :class:`~shardlib.ZeroOptimizer` (AdamW) ``.step()``;
5. the report: the plan summary, the model-state bytes this rank holds after the step
   (:func:`shardlib.model_state_bytes`: the storages of chunks, gradients and optimizer state)
   against the plan's, and the communication counted per mesh axis and collective kind
   (``mesh.comm``, :mod:`shardlib.mesh.comm`) against the plan's prediction
   (:meth:`shardlib.Plan.comm_per_step`).

Why meta. A fake group performs no arithmetic, so values computed on real tensors would be
wrong anyway, and a 70B step on a CPU is out of reach; on meta tensors every op only propagates
shapes and dtypes, so the forward and backward reach every collective with its real shape (and
count it) in seconds. What a dry run cannot tell: values (the loss is a meta tensor), time on
the real machine, activation memory (meta tensors are not allocated), and a model whose control
flow reads values (``.item()`` on a meta tensor raises: the dry run fails there, naming it; a
mixture of experts routes tokens by value, so Mixtral cannot be dry-run). Hugging Face models
build their causal masks from values, so they run with a causal attention that needs no mask
(:func:`_meta_attention`: the same shapes, and attention moves nothing between ranks).

Models: ``gpt-7b`` (:class:`shardlib.models.GPT` with GPT-3 6.7B shapes: 32 layers, width
4096, 32 heads, vocabulary 50304, sequence 2048), ``llama-7b`` and ``llama-70b`` (Hugging Face
``LlamaForCausalLM`` with LLaMA-2's shapes: 32 layers of width 4096, MLP 11008, 32 heads; 80
layers of width 8192, MLP 28672, 64 heads, 8 key/value heads; vocabulary 32000, sequence
4096), any Hugging Face causal LM config (``--hf-config``; ``dry_run`` also takes a
``GPTConfig`` or a ``transformers`` config object). On a mesh with a ``tp`` axis the family's
preset is used (``gpt_preset``, ``hf_preset``: :mod:`shardlib.models.presets`). The
tensor-parallel verification of ``shard()`` (each unit run sharded and unsharded) is skipped
on meta: there are no values to compare; run it on a small real mesh.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from .errors import ShardingError
from .parallel.schedules import SCHEDULES

__all__ = ["dry_run", "DryRunReport", "MODELS", "build_meta_model", "main"]

MODELS = ("gpt-7b", "llama-7b", "llama-70b")
_LLAMA = {
    "llama-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=32),
    "llama-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                      num_key_value_heads=8),
}
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}


def model_config(model: Any) -> Any:
    """The config a model name stands for (a ``GPTConfig`` or a ``transformers`` config); a config
    object is returned as it is, a path to a ``config.json`` is read.

    Raises:
        ShardingError: an unknown name, or a JSON file without a ``model_type``.
    """
    from .models import GPTConfig

    if not isinstance(model, str):
        return model
    if model == "gpt-7b":
        return GPTConfig(vocab_size=50304, block_size=2048, n_layer=32, n_head=32, n_embd=4096)
    if model in _LLAMA:
        import transformers

        return transformers.LlamaConfig(vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5,
                                        tie_word_embeddings=False, use_cache=False, **_LLAMA[model])
    if model.endswith(".json"):
        import transformers

        with open(model) as f:
            fields = json.load(f)
        if "model_type" not in fields:
            raise ShardingError(f"dry run: {model} has no 'model_type', so no transformers config class can read it; "
                                "give the config.json of a Hugging Face model (it names its model_type)")
        return transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    raise ShardingError(f"dry run: unknown model {model!r}; the built-in ones are {', '.join(MODELS)} (or give "
                        "--hf-config path/to/config.json)")


_META_ATTENTION = "shardlib_meta"


def _meta_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Causal attention in Hugging Face's attention interface, for a model on meta: query
    ``(B, H, T, D)``, key and value ``(B, H_kv, T, D)`` -> ``((B, T, H, D), None)``.

    HF builds its masks from values (``find_packed_sequence_indices`` calls ``.all()``), which
    meta tensors do not have; an attention implementation outside HF's mask registry gets no mask
    (``create_causal_mask`` returns None), and this one is causal by construction. It moves no
    data between ranks, so the collectives are those of the model's own attention."""
    out = F.scaled_dot_product_attention(query, key, value, is_causal=query.shape[2] > 1, scale=scaling,
                                         enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


def build_meta_model(config: Any) -> torch.nn.Module:
    """The model of ``config`` built under ``torch.device("meta")``: shapes, no storage (a
    Hugging Face model with the causal attention of :func:`_meta_attention`, no KV cache)."""
    from .models import GPT, GPTConfig

    with torch.device("meta"):
        if isinstance(config, GPTConfig):
            return GPT(config)
        import transformers

        transformers.AttentionInterface.register(_META_ATTENTION, _meta_attention)
        if hasattr(config, "use_cache"):
            config.use_cache = False
        return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=_META_ATTENTION)


def _default_specs(config: Any, model: torch.nn.Module, mesh: dict[str, int]) -> tuple[Any, dict]:
    """The family's tensor-parallel preset when the mesh has a ``tp`` axis of size > 1:
    :func:`~shardlib.models.gpt_preset` for the reference GPT, else
    :func:`~shardlib.models.hf_preset` (read from the Hugging Face model; it refuses a family
    it has no layout for)."""
    from .models import GPTConfig, gpt_preset, hf_preset

    if mesh.get("tp", 1) <= 1:
        return None, {}
    preset = gpt_preset("tp") if isinstance(config, GPTConfig) else hf_preset(model, "tp")
    options = dict(preset.options)
    if mesh.get("pp", 1) > 1:
        options.pop("vocab_parallel_logits", None)  # a pipeline's criterion reads whole logits (refused there)
    return preset.specs, options


@contextlib.contextmanager
def fake_world(world: int, rank: int) -> Iterator[None]:
    """Initialize ``torch.distributed`` with torch's fake backend as ``rank`` of ``world``, and
    destroy it on exit (a dry run after it in the same process makes a world of its own).

    Raises:
        ShardingError: a process group is already initialized (a dry run needs its own).
    """
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise ShardingError(
            f"dry run: torch.distributed is already initialized in this process (backend {dist.get_backend()!r}, world "
            f"size {dist.get_world_size()}); a dry run plays one rank of a fake world of its own. Fix: run it in a fresh "
            "process (python -m shardlib.dryrun ...)")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:  # shardlib's group caches hold the group itself, so a later world cannot alias this one's
        dist.destroy_process_group()


@dataclasses.dataclass
class DryRunReport:
    """What one dry run measured on its rank, with the plan's figures beside it.

    Attributes:
        model: the model's class name; ``n_params`` its parameters (the whole model).
        mesh, rank, coords: the mesh shape, the rank played and its coordinates.
        settings: zero stage, dtype, batch, sequence, microbatches, schedule.
        tokens: tokens of one microbatch on this rank (local batch / microbatches x sequence).
        plan_summary: the plan in a few lines.
        state_measured, state_planned: model-state bytes on this rank after the step
            (``params``, ``grads``, ``optimizer``, ``total``).
        comm_measured, comm_planned: ``{(axis, kind): (calls, bytes per rank)}`` of the step.
        seconds: wall seconds of ``build``, ``shard``, ``step``, and ``cpu`` (process CPU of all).
    """

    model: str
    n_params: int
    mesh: dict[str, int]
    rank: int
    coords: dict[str, int]
    settings: dict[str, Any]
    tokens: int
    plan_summary: str
    state_measured: dict[str, int]
    state_planned: dict[str, int]
    comm_measured: dict[tuple[str, str], tuple[int, float]]
    comm_planned: dict[tuple[str, str], tuple[int, float]]
    seconds: dict[str, float]

    def mismatches(self) -> list[str]:
        """Where the measurement differs from the plan, one line each (empty: they agree)."""
        out = [f"state {k}: measured {self.state_measured[k]:,} B, planned {self.state_planned[k]:,} B"
               for k in self.state_planned if self.state_measured.get(k) != self.state_planned[k]]
        for key in sorted(set(self.comm_measured) | set(self.comm_planned)):
            (mc, mb), (pc, pb) = self.comm_measured.get(key, (0, 0.0)), self.comm_planned.get(key, (0, 0.0))
            if mc != pc or not math.isclose(mb, pb, rel_tol=1e-9, abs_tol=1e-6):
                out.append(f"{key[0]} {key[1]}: measured {mc} calls {mb:,.0f} B, planned {pc} calls {pb:,.0f} B")
        return out

    def format(self) -> str:
        """The report as text (what ``python -m shardlib.dryrun`` prints)."""
        world = math.prod(self.mesh.values())
        s = self.settings
        coords = " ".join(f"{a}={i}" for a, i in self.coords.items())
        lines = [
            f"shardlib dry run: {self.model} ({self.n_params:,} parameters) as rank {self.rank} of {self.mesh} "
            f"({world:,} ranks; coordinates {coords}) on torch's fake process group, tensors on meta",
            f"  zero_stage {s['zero_stage']}, param_dtype {s['dtype']}, local batch {s['batch']} x sequence {s['seq']}"
            + (f", {s['microbatches']} microbatches ({s['schedule']})" if s.get("microbatches") else "")
            + f"; {self.tokens:,} tokens per microbatch on this rank",
            "plan:",
            *("  " + line for line in self.plan_summary.splitlines()),
            "model state on this rank after the step (bytes):      measured          planned",
        ]
        for k in ("params", "grads", "optimizer", "total"):
            lines.append(f"  {k:<10} {self.state_measured[k]:>40,} {self.state_planned[k]:>16,}")
        lines.append("communication in the step (per rank, logical ring bytes): measured calls, bytes | planned calls, bytes")
        for key in sorted(set(self.comm_measured) | set(self.comm_planned)):
            (mc, mb), (pc, pb) = self.comm_measured.get(key, (0, 0.0)), self.comm_planned.get(key, (0, 0.0))
            lines.append(f"  {key[0]:<8} {key[1]:<15} {mc:>6} {mb:>20,.0f} | {pc:>6} {pb:>20,.0f}")
        total_m = sum(b for _, b in self.comm_measured.values())
        total_p = sum(b for _, b in self.comm_planned.values())
        lines.append(f"  {'total':<24} {total_m:>27,.0f} | {total_p:>27,.0f}")
        t = self.seconds
        lines.append(f"time: build {t['build']:.1f} s, shard {t['shard']:.1f} s, step {t['step']:.1f} s "
                     f"(wall); {t['cpu']:.1f} s of CPU")
        bad = self.mismatches()
        lines.append("verdict: the measured state and communication equal the plan" if not bad else
                     "verdict: MEASURED DIFFERS FROM THE PLAN:\n" + "\n".join("  " + b for b in bad))
        return "\n".join(lines)

    def to_json(self) -> dict:
        """The report as JSON-ready data (comm keys as ``"axis/kind"``)."""
        out = dataclasses.asdict(self)
        for k in ("comm_measured", "comm_planned"):
            out[k] = {f"{a}/{kind}": list(v) for (a, kind), v in getattr(self, k).items()}
        out["mismatches"] = self.mismatches()
        return out


def _plan_summary(plan: Any, tokens: int) -> str:
    """A few lines: strategies by count and the per-rank totals (a pipeline: its own summary)."""
    if hasattr(plan, "summary"):
        return plan.summary(tokens)
    counts: dict[str, int] = {}
    for p in plan.params:
        counts[p.strategy] = counts.get(p.strategy, 0) + 1
    kinds = ", ".join(f"{k} x{n}" for k, n in sorted(counts.items()))
    return (f"{len(plan.params)} parameters: {kinds}; {len(plan.chunks)} ZeRO chunks over {plan.data_axes or '()'} "
            f"(N={plan.data_size}); {len(plan.tp_layers)} tensor-parallel layers"
            + ("; sequence parallel" if plan.sequence_parallel else ""))


def _pipeline_comm(pplan: Any, index: int, tokens: int) -> dict[tuple[str, str], tuple[int, float]]:
    """Predicted point-to-point and tied-gradient traffic of pp rank ``index`` in one step: its
    boundary sends (``transfers_per_step`` of ``boundary_bytes``) and one all-reduce over the
    pipeline axis per tied tensor (its local gradient, in the reduction dtype)."""
    from .mesh.comm import ring_bytes

    out: dict[tuple[str, str], tuple[int, float]] = {}
    sends = pplan.transfers_per_step(index)
    if sends:
        out[(pplan.pp_axis, "send")] = (sends, float(sends * pplan.boundary_bytes(tokens)))
    whole = pplan.whole
    calls, total = 0, 0.0
    for names, _ in pplan.tied:
        p = whole.param(names[0])
        itemsize = (whole.reduce_dtype or p.dtype).itemsize
        calls += 1
        total += float(ring_bytes("all_reduce", math.prod(whole.local_shape(p)) * itemsize, pplan.p))
    if calls:
        out[(pplan.pp_axis, "all_reduce")] = (calls, total)
    return out


def _lm_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of a causal LM's output (HF's ``.logits``, a ``(logits, ...)``
    tuple, or the logits ``(B, T, V)``) against ``targets`` ``(B, T)``."""
    logits = output.logits if hasattr(output, "logits") else output[0] if isinstance(output, tuple) else output
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _forward_backward(smodel: Any, config: Any, x: torch.Tensor) -> None:
    """One step's forwards and backwards on the meta batch ``x`` ``(B, T)`` (its own labels):
    a pipeline's ``forward_backward``, the reference GPT's own loss, or :func:`_lm_loss`."""
    from .models import GPTConfig

    if hasattr(smodel, "forward_backward"):
        smodel.forward_backward(x, criterion=_lm_loss, labels=(x,))
    elif isinstance(config, GPTConfig):
        smodel(x, x)[1].backward()
    else:
        _lm_loss(smodel(input_ids=x), x).backward()


def dry_run(model: Any = "gpt-7b", mesh: dict[str, int] | None = None, rank: int = 0, *, zero_stage: int = 3,
            dtype: str = "bf16", seq: int | None = None, batch: int | None = None, microbatches: int | None = None,
            schedule: str | None = None, specs: Any = None, **options: Any) -> DryRunReport:
    """Shard ``model`` on a fake group as ``rank`` of ``mesh`` and run one training step on meta.

    See the module doc for what runs. Must be called where ``torch.distributed`` is not
    initialized (it makes, and afterwards destroys, a fake world of its own).

    Args:
        model: ``"gpt-7b"``, ``"llama-7b"``, ``"llama-70b"``, a path to a Hugging Face
            ``config.json``, a :class:`~shardlib.models.GPTConfig` or a ``transformers`` config.
        mesh: ``{axis: size}`` (default ``{"dp": 8}``); the world is the product of the sizes.
        rank: the global rank played, in ``[0, world)``.
        zero_stage: ZeRO stage over the data axes (0-3).
        dtype: ``"bf16"`` / ``"fp16"`` (mixed precision: ``param_dtype``, fp32 masters) or ``"fp32"``.
        seq: sequence length (default: the model's block size / ``max_position_embeddings``).
        batch: sequences per data rank in the step (default: ``microbatches``, else 1).
        microbatches, schedule: pipeline options (a mesh with a ``pp`` axis).
        specs: PartitionSpec rules (default: the family's preset on a ``tp`` axis, and its
            options; ``specs`` given: no preset options either).
        **options: further :func:`~shardlib.plan` options (``sequence_parallel=True``, ...).

    Returns:
        A :class:`DryRunReport`.

    Raises:
        ShardingError: an unknown model, a process group already initialized, a dtype not in
            bf16/fp16/fp32, and every check of :func:`~shardlib.plan` (before the step).

    Example:
        >>> from shardlib.models import GPTConfig
        >>> r = dry_run(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32), {"dp": 256}, rank=3)
        >>> r.mismatches(), r.state_measured == r.state_planned
        ([], True)
    """
    import shardlib

    from .lazy import materialize_on

    mesh = dict(mesh or {"dp": 8})
    if dtype not in _DTYPES:
        raise ShardingError(f"dry run: dtype {dtype!r} is not one of {', '.join(_DTYPES)}")
    config = model_config(model)
    seq = seq or getattr(config, "block_size", None) or config.max_position_embeddings
    batch = batch or microbatches or 1
    pp = {k: v for k, v in (("microbatches", microbatches), ("schedule", schedule)) if v is not None}
    param_dtype = _DTYPES[dtype]
    if param_dtype is not None:
        options.setdefault("param_dtype", param_dtype)
    cpu0 = time.process_time()
    with fake_world(math.prod(mesh.values()), rank):
        t0 = time.perf_counter()
        net = build_meta_model(config)
        n_params = sum(p.numel() for p in net.parameters())
        name = type(net).__name__
        if specs is None:
            specs, preset_options = _default_specs(config, net, mesh)
            options = {**preset_options, **options}
        t1 = time.perf_counter()
        fmesh = shardlib.init_mesh(mesh)
        fmesh.device = torch.device("meta")  # every tensor of the step is on meta, and so is what it communicates
        with materialize_on("meta"):
            smodel = shardlib.shard(net, fmesh, specs, zero_stage=zero_stage, **pp, **options)
        t2 = time.perf_counter()
        opt = shardlib.ZeroOptimizer(smodel, torch.optim.AdamW, lr=1e-4)
        fmesh.comm.reset()  # the step's communication only (shard() may broadcast buffers)
        _forward_backward(smodel, config, torch.zeros(batch, seq, dtype=torch.long, device="meta"))
        opt.step()
        is_pipeline = hasattr(smodel, "forward_backward")
        m = smodel.pipeline_plan.m if is_pipeline else 1
        t3 = time.perf_counter()
        tokens = batch // m * seq
        plan = smodel.plan
        state = shardlib.model_state_bytes(smodel, opt)
        planned_state = {"params": plan.param_bytes, "grads": plan.grad_bytes, "optimizer": plan.optimizer_bytes,
                         "total": plan.model_state_bytes}
        comm_planned = dict(plan.comm_per_step(micro_steps=m, tokens=tokens))
        if is_pipeline:
            comm_planned.update(_pipeline_comm(smodel.pipeline_plan, fmesh.index(smodel.pp_axis), tokens))
        summary_plan = smodel.pipeline_plan if is_pipeline else plan
        report = DryRunReport(
            model=name, n_params=n_params, mesh=mesh, rank=rank, coords=fmesh.coords(),
            settings={"zero_stage": zero_stage, "dtype": dtype, "batch": batch, "seq": seq,
                      "microbatches": m if is_pipeline else None, "schedule": smodel.schedule if is_pipeline else None},
            tokens=tokens, plan_summary=_plan_summary(summary_plan, tokens), state_measured=dict(state),
            state_planned=planned_state, comm_measured=fmesh.comm.table(), comm_planned=comm_planned,
            seconds={"build": t1 - t0, "shard": t2 - t1, "step": t3 - t2, "cpu": time.process_time() - cpu0},
        )
    return report


def main(argv: list[str] | None = None) -> int:
    """``python -m shardlib.dryrun``: parse the options, run :func:`dry_run`, print the report."""
    from .cli import ArgumentParser, mesh_shape, nonnegative_int, positive_int

    ap = ArgumentParser(prog="python -m shardlib.dryrun", description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model", choices=MODELS, default="gpt-7b", help="a built-in model (default: %(default)s)")
    src.add_argument("--hf-config", help="a Hugging Face causal LM's config.json")
    ap.add_argument("--mesh", type=mesh_shape, default={"dp": 8}, help="axis=size,... outer to inner, e.g. pp=8,dp=16,tp=8 "
                    "(default: dp=8)")
    ap.add_argument("--world", type=positive_int, help="the world size, checked against the mesh (default: its product)")
    ap.add_argument("--rank", type=nonnegative_int, default=0)
    ap.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=3)
    ap.add_argument("--dtype", choices=tuple(_DTYPES), default="bf16", help="compute dtype; bf16/fp16 keep fp32 masters "
                    "(default: %(default)s)")
    ap.add_argument("--seq", type=positive_int, help="sequence length (default: the model's)")
    ap.add_argument("--batch", type=positive_int, help="sequences per data rank (default: --microbatches, else 1)")
    ap.add_argument("--microbatches", type=positive_int, help="pipeline microbatches (a mesh with pp)")
    ap.add_argument("--schedule", choices=sorted(SCHEDULES), help="pipeline schedule (a mesh with pp)")
    ap.add_argument("--sequence-parallel", action="store_true", help="Megatron sequence parallelism on tp")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)
    world = math.prod(args.mesh.values())
    if args.world is not None and args.world != world:
        ap.error(f"--world {args.world} but the mesh {args.mesh} has {world} ranks")
    if args.rank >= world:
        ap.error(f"--rank {args.rank} is outside the mesh {args.mesh} of {world} ranks")
    extra = {"sequence_parallel": True} if args.sequence_parallel else {}
    report = dry_run(args.hf_config or args.model, args.mesh, args.rank, zero_stage=args.zero_stage, dtype=args.dtype,
                     seq=args.seq, batch=args.batch, microbatches=args.microbatches, schedule=args.schedule, **extra)
    print(json.dumps(report.to_json(), indent=1) if args.json else report.format())
    return 0


if __name__ == "__main__":
    from .cli import main_guard

    raise SystemExit(main_guard(main, prog="python -m shardlib.dryrun"))
