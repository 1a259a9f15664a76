"""From a checked :class:`~shardlib.config.Config` to the pieces of a run: the mesh shape, the
model (the same initial weights on every rank), its specs and plan options, and its FLOPs.

:func:`check_run` refuses what the config's sections cannot say one key at a time (a mesh that
is not the world size, a batch the data ranks do not divide, sequences longer than the model's
positions), on every rank before any process group exists, each naming the keys involved.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..config import Config, ConfigError
from ..options import DATA_AXIS_NAMES
from .schedule import DECAYS

__all__ = ["mesh_shape", "data_size", "build_model", "sharding", "flops_per_token", "check_run", "PEAK_TFLOPS"]

# dense bf16 tensor-core peaks (TFLOP/s per device, from the vendors' data sheets), for the MFU
PEAK_TFLOPS = {"H200": 989.5, "H100": 989.5, "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "V100": 125.0}


def mesh_shape(cfg: Config, world_size: int) -> dict[str, int]:
    """``parallel.mesh`` with one axis of size -1 (if any) grown to the rest of ``world_size``
    (torchtitan's ``-1`` degree): ``{"dp": -1}`` is data parallel over every rank.

    Raises:
        ConfigError: a size that is not a positive int (or one -1), or a product that is not
            ``world_size``.
    """
    shape = dict(cfg.parallel.mesh)
    if not shape:
        raise ConfigError("config key 'parallel.mesh' is empty; give the axes, e.g. {'dp': -1} (every rank)")
    free = [a for a, n in shape.items() if n == -1]
    bad = {a: n for a, n in shape.items() if isinstance(n, bool) or not isinstance(n, int) or (n < 1 and n != -1)}
    if bad or len(free) > 1:
        raise ConfigError(f"config key 'parallel.mesh' is {shape}: each axis size must be a positive int, and one "
                          f"axis may be -1 (the rest of the world size)")
    fixed = math.prod(n for n in shape.values() if n != -1)
    if free:
        if world_size % fixed:
            raise ConfigError(f"config key 'parallel.mesh' is {shape}: the world size {world_size} is not divisible "
                              f"by the fixed axes' product {fixed}")
        shape[free[0]] = world_size // fixed
    if math.prod(shape.values()) != world_size:
        raise ConfigError(f"config key 'parallel.mesh' is {shape} ({math.prod(shape.values())} ranks), but this run "
                          f"has {world_size} (WORLD_SIZE). Fix: launch {math.prod(shape.values())} processes "
                          f"(torchrun --nproc-per-node ...), or --set parallel.mesh=... with -1 on one axis")
    return shape


def _data_axes(cfg: Config, shape: dict[str, int]) -> tuple[str, ...]:
    axes = cfg.parallel.data_axes
    return tuple(axes) if axes is not None else tuple(a for a in shape if a in DATA_AXIS_NAMES)


def data_size(cfg: Config, shape: dict[str, int]) -> int:
    """The number of ranks the global batch is split over (the product of the data axes)."""
    return math.prod(shape[a] for a in _data_axes(cfg, shape) if a in shape)


def _model_fields(cfg: Config) -> dict[str, Any]:
    return {k: v for k, v in cfg.model.items() if k != "builder"}


def build_model(cfg: Config) -> nn.Module:
    """The config's model, seeded with ``train.seed`` (the same weights on every rank), on the
    default device (a ``torch.device("meta")`` context builds it without memory).

    Raises:
        ConfigError: an unknown builder.
    """
    from ..models import GPT, GPTConfig, Llama, LlamaConfig, PaLMConfig

    torch.manual_seed(cfg.train.seed)
    fields = _model_fields(cfg)
    if cfg.model.builder == "gpt":
        return GPT(GPTConfig(**fields))
    if cfg.model.builder == "llama":
        return Llama(LlamaConfig(**fields))
    if cfg.model.builder == "palm":
        return Llama(PaLMConfig(**fields))
    if cfg.model.builder == "hf":
        from ..models.hf_build import hf_model, hf_pretrained

        if fields["pretrained"]:
            return hf_pretrained(fields["pretrained"])
        return hf_model(fields["family"], fields["hidden"], fields["layers"], fields["heads"], fields["block_size"],
                        fields["vocab_size"], fields["n_kv_heads"], fields["dropout"])
    raise ConfigError(f"config key 'model.builder' is {cfg.model.builder!r}; the builders are: gpt, llama, palm, hf")


def is_hf(model: nn.Module) -> bool:
    """Whether ``model`` (or the module a sharded model wraps) is a ``transformers`` model: it is
    called as ``model(input_ids=x).logits``, the others as ``model(x, y) -> (logits, loss)``."""
    model = getattr(model, "module", model)
    return type(model).__module__.startswith("transformers.")


def dims(model: nn.Module) -> tuple[int, int, int, int]:
    """``(layers, width, positions, vocabulary)`` of a built model (ours or a Hugging Face one)."""
    c = getattr(model, "module", model).config
    get = lambda *names: next(getattr(c, n) for n in names if getattr(c, n, None) is not None)  # noqa: E731
    return (get("n_layer", "num_hidden_layers"), get("n_embd", "hidden_size"),
            get("block_size", "max_position_embeddings", "n_positions"), get("vocab_size"))


def sharding(cfg: Config, shape: dict[str, int], model: nn.Module | None = None) -> tuple[dict, dict[str, Any]]:
    """``(specs, options)`` for :func:`shardlib.plan`: the builder's tensor-parallel preset when
    the mesh has a ``tp`` axis (for ``hf``, :func:`shardlib.models.hf_preset` of ``model``), and
    the ``parallel`` section's options (pipeline ones on a ``pp`` axis of size > 1)."""
    from ..models import gpt_preset, hf_preset, llama_tp_specs

    p = cfg.parallel
    options: dict[str, Any] = dict(zero_stage=p.zero_stage, sequence_parallel=p.sequence_parallel,
                                   dropout_seed=cfg.train.seed, optimizer_offload=p.optimizer_offload)
    for key in ("data_axes", "activation_checkpointing", "offload_ratio"):
        if p[key] is not None:
            options[key] = tuple(p[key]) if key == "data_axes" else p[key]
    if p.offload_param_frac:
        options["offload_param_frac"] = p.offload_param_frac
    if cfg.train.param_dtype is not None:
        options["param_dtype"] = getattr(torch, cfg.train.param_dtype)
    pipelined = shape.get("pp", 1) > 1
    if pipelined:
        options.update(schedule=p.schedule or "1f1b", microbatches=p.microbatches)
        if p.virtual_stages is not None:  # None: the schedule's own (2 for interleaved_1f1b and the V schedules)
            options["virtual_stages"] = p.virtual_stages
    specs: dict = {}
    if shape.get("tp", 1) > 1 and cfg.model.builder == "hf":
        if model is None:
            raise ValueError("sharding: the hf builder's specs are read from the model; pass model=")
        preset = hf_preset(model, "tp")
        specs = preset.specs
        options.update(preset.options)
    elif shape.get("tp", 1) > 1:
        if cfg.model.builder == "gpt":
            specs = gpt_preset("tp").specs
        else:
            specs = llama_tp_specs("tp")
        if not pipelined:  # vocabulary-parallel logits into the loss; a pipeline's criterion reads whole logits
            options["vocab_parallel_logits"] = True
    return specs, options


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Training FLOPs per token of a GPT-style model: ``6 N + 12 L h T`` (PaLM, arXiv 2204.02311,
    appendix B), ``N`` the parameters of every matmul (the embedding counts once, as the output
    layer it also is; an untied input table is a lookup, left out), ``L`` layers, ``h`` the width, ``T`` the sequence length (the attention
    scores and their product with the values, forward and backward)."""
    layers, width, _, _ = dims(model)
    if hasattr(model, "num_params"):
        n = model.num_params(non_embedding=True)  # less the position table and an untied input table: lookups
    else:  # a Hugging Face model: every parameter (a tied one once), less an untied input embedding
        n = sum(p.numel() for p in model.parameters())
        inp, out = model.get_input_embeddings(), model.get_output_embeddings()
        if out is None or out.weight is not inp.weight:
            n -= inp.weight.numel()
    return 6.0 * n + 12.0 * layers * width * seq_len


def _check_hf(cfg: Config, shape: dict[str, int]) -> None:
    """The hf builder's keys against the mesh (a ``pretrained`` model's sizes are its own)."""
    from ..models.hf import HF_PIPELINE_FAMILIES
    from ..models.hf_build import FAMILIES, GQA, kv_heads

    m, tp, pp = cfg.model, shape.get("tp", 1), shape.get("pp", 1)
    if pp > 1 and cfg.parallel.sequence_parallel:
        raise ConfigError(f"config key 'parallel.sequence_parallel' with pp={pp} and model.builder='hf': a Hugging "
                          f"Face model's pipeline layers build masks and rotary positions from each decoder layer's "
                          f"input, which under sequence parallelism is a sequence shard. Fix: "
                          f"--set parallel.sequence_parallel=False, or a mesh without pp")
    if m.pretrained:
        return
    if m.family not in FAMILIES:
        raise ConfigError(f"config key 'model.family' is {m.family!r}; the families are: {', '.join(FAMILIES)}")
    if m.hidden % m.heads:
        raise ConfigError(f"config keys 'model.hidden' ({m.hidden}) and 'model.heads' ({m.heads}): hidden must be "
                          f"divisible by heads")
    if cfg.train.seq_len > m.block_size:
        raise ConfigError(f"config key 'train.seq_len' ({cfg.train.seq_len}) is longer than 'model.block_size' "
                          f"({m.block_size}), the positions the model has")
    kv = (m.n_kv_heads or kv_heads(m.family, m.heads)) if m.family in GQA else m.heads
    if m.heads % kv or kv % tp:
        raise ConfigError(f"config keys 'model.heads' ({m.heads}) and 'model.n_kv_heads' give {m.family} {kv} key/value "
                          f"heads: they must divide heads, and the tp axis ({tp}) must divide them (each tp rank holds "
                          f"whole heads)")
    if pp > 1 and m.family not in HF_PIPELINE_FAMILIES:
        raise ConfigError(f"config key 'model.family' is {m.family!r} on a pipeline mesh {shape}: shardlib has no "
                          f"pipeline layers for it (it has them for {', '.join(sorted(HF_PIPELINE_FAMILIES))})")


def pipeline_keys_unused(cfg: Config, shape: dict[str, int]) -> list[str]:
    """``["parallel.microbatches=2", ...]``: the pipeline keys set to other than their default on a
    mesh without a ``pp`` axis of size > 1, where :func:`sharding` does not pass them (a config
    serves every mesh; the training tool logs them)."""
    if shape.get("pp", 1) > 1:
        return []
    p = cfg.parallel
    return [f"parallel.{k}={p[k]!r}" for k, off in (("schedule", None), ("microbatches", 1), ("virtual_stages", None))
            if p[k] != off]


def check_run(cfg: Config, world_size: int) -> dict[str, int]:
    """The mesh shape of ``cfg`` on ``world_size`` ranks, after the checks that involve several
    keys (every rank raises the same, before any communication).

    Raises:
        ConfigError: naming the keys: a mesh not of the world size; ``train.global_batch`` not
            divisible by the data ranks times ``train.grad_accum`` (times ``parallel.microbatches``
            on a pipeline); ``train.grad_accum > 1`` on a pipeline (raise the microbatches
            instead); ``train.seq_len`` above ``model.block_size``; ``model.n_embd`` not divisible
            by ``model.n_head``; a non-positive step count, interval or learning rate; an unknown
            ``optim.decay`` or ``optim.name``; ``train.param_dtype`` not a float dtype name.
    """
    t, o, m = cfg.train, cfg.optim, cfg.model
    for key, low in (("steps", 1), ("global_batch", 1), ("seq_len", 1), ("grad_accum", 1), ("log_interval", 1),
                     ("eval_interval", 0), ("eval_steps", 1)):
        if t[key] < low:
            raise ConfigError(f"config key 'train.{key}' must be >= {low}, got {t[key]}")
    if cfg.checkpoint.interval < 0 or cfg.checkpoint.keep_last < 0:
        raise ConfigError(f"config keys 'checkpoint.interval' and 'checkpoint.keep_last' must be >= 0 (0: only at "
                          f"the end / keep all), got {cfg.checkpoint.interval} and {cfg.checkpoint.keep_last}")
    if o.name != "adamw":
        raise ConfigError(f"config key 'optim.name' is {o.name!r}; the optimizers are: adamw")
    if o.decay not in DECAYS:
        raise ConfigError(f"config key 'optim.decay' is {o.decay!r}; the decays are: {', '.join(DECAYS)}")
    if not o.lr > 0 or o.min_lr < 0 or o.min_lr > o.lr:
        raise ConfigError(f"config keys 'optim.lr' and 'optim.min_lr' must satisfy 0 <= min_lr <= lr and lr > 0, got "
                          f"lr={o.lr}, min_lr={o.min_lr}")
    betas = tuple(o.betas)
    if len(betas) != 2 or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in betas):
        raise ConfigError(f"config key 'optim.betas' must be two numbers in [0, 1) (AdamW's beta1, beta2), got "
                          f"{o.betas!r}")
    if o.warmup_steps < 0:  # longer than the run is allowed: the rate then never reaches optim.lr
        raise ConfigError(f"config key 'optim.warmup_steps' must be >= 0, got {o.warmup_steps}")
    if o.grad_clip is not None and not o.grad_clip > 0:
        raise ConfigError(f"config key 'optim.grad_clip' must be > 0, or None for no clipping, got {o.grad_clip}")
    if t.peak_tflops is not None and not t.peak_tflops > 0:  # (it logged a negative MFU)
        raise ConfigError(f"config key 'train.peak_tflops' must be > 0 (the device's peak, TFLOP/s, for MFU), or None "
                          f"for the device's own figure, got {t.peak_tflops}")
    if t.param_dtype is not None and t.param_dtype not in ("bfloat16", "float16", "float32"):
        raise ConfigError(f"config key 'train.param_dtype' must be 'bfloat16', 'float16', 'float32' or None, got "
                          f"{t.param_dtype!r}")
    if cfg.data.tokenizer == "bpe" and cfg.data.vocab_size > m.get("vocab_size", cfg.data.vocab_size):
        raise ConfigError(f"config key 'model.vocab_size' ({m.vocab_size}) is below 'data.vocab_size' "
                          f"({cfg.data.vocab_size}), the BPE vocabulary. Fix: --set model.vocab_size={cfg.data.vocab_size}")
    shape = mesh_shape(cfg, world_size)
    tp, pp = shape.get("tp", 1), shape.get("pp", 1)
    if m.builder == "hf":
        _check_hf(cfg, shape)
    else:
        if m.n_embd % m.n_head:
            raise ConfigError(f"config keys 'model.n_embd' ({m.n_embd}) and 'model.n_head' ({m.n_head}): n_embd must "
                              f"be divisible by n_head")
        if t.seq_len > m.block_size:
            raise ConfigError(f"config key 'train.seq_len' ({t.seq_len}) is longer than 'model.block_size' "
                              f"({m.block_size}), the positions the model has")
    if m.builder in ("llama", "palm"):
        if m.n_head % m.n_kv_head or (m.n_embd // m.n_head) % 2:
            raise ConfigError(f"config keys 'model.n_head' ({m.n_head}) and 'model.n_kv_head' ({m.n_kv_head}): n_head must "
                              f"be divisible by n_kv_head, and the head size n_embd / n_head even (rotary pairs)")
        if m.n_kv_head % tp:
            raise ConfigError(f"config key 'model.n_kv_head' ({m.n_kv_head}) is not divisible by the tp axis ({tp}): "
                              f"each tensor-parallel rank holds whole key/value heads (multi-query attention, one "
                              f"head, cannot be split). Fix: --set model.n_kv_head={tp * max(1, m.n_kv_head // tp)} or "
                              f"a smaller tp")
    if tp > 1 and m.builder != "hf" and m.n_head % tp:
        raise ConfigError(f"config key 'model.n_head' ({m.n_head}) is not divisible by the tp axis ({tp})")
    ranks = data_size(cfg, shape)
    pipelined = pp > 1
    if pipelined and t.grad_accum > 1:
        raise ConfigError(f"config key 'train.grad_accum' is {t.grad_accum} on a pipeline mesh {shape}: a pipeline "
                          f"step already accumulates over its microbatches. Fix: --set train.grad_accum=1 "
                          f"--set parallel.microbatches={cfg.parallel.microbatches * t.grad_accum}")
    split = ranks * t.grad_accum * (cfg.parallel.microbatches if pipelined else 1)
    if t.global_batch % split:
        parts = f"{ranks} data rank(s) x train.grad_accum={t.grad_accum}"
        if pipelined:
            parts += f" x parallel.microbatches={cfg.parallel.microbatches}"
        raise ConfigError(f"config key 'train.global_batch' ({t.global_batch}) must be divisible by {parts} = {split} "
                          f"(mesh {shape}): every rank trains on an equal share of each step's batch")
    return shape
