"""Plan-time rules of tensor parallelism: which layer a spec on a non-data axis makes, and checks.

Meaning of a spec along a tensor axis ``tp`` (DESIGN.md), by the module owning the parameter:

==================================  ===================  ==============================
module, parameter, spec             role                 lowered to
==================================  ===================  ==============================
``Linear.weight [out, in]`` P(tp,)  column               :class:`ColumnParallelLinear`
``Linear.weight`` P(None, tp)       row                  :class:`RowParallelLinear`
``Conv1D.weight [in, out]`` (HF)    column / row          same, transposed storage
``Embedding.weight`` P(tp,)         vocab                :class:`VocabParallelEmbedding`
``Embedding.weight`` P(None, tp)    embed_dim            :class:`ParallelEmbedding`
==================================  ===================  ==============================

Checks, all raising :class:`~shardlib.errors.ShardingError` at plan time: a row layer must
have a column-parallel sibling (its input must arrive split); every other Linear sibling of a
row layer must be column parallel on the same axis (q/k/v, gate/up must agree); attention
heads (and key/value heads under GQA) must divide by the axis size; norm weights are never
split; a bias follows its weight. A column layer with no row sibling is an output layer (the
language-model head): its output is all-gathered, or kept vocabulary-parallel on request
(``vocab_parallel_logits=True``: the local ``(..., V // tp)`` slice, for
:func:`~shardlib.parallel.cross_entropy.vocab_parallel_cross_entropy`, Megatron's
``parallel_output``; a plan with no output layer to keep split is refused).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from torch import nn

from ..errors import ShardingError
from ..plan_items import fused_blocks
from ..spec import PartitionSpec

__all__ = ["TPLayer", "analyze_tensor_parallel", "tensor_split", "sequence_parallel_layout", "split_region_params",
           "is_attention", "head_counts", "region_blocks",
           "with_sum_globs", "split_param_names"]


@dataclass(frozen=True)
class TPLayer:
    """One module lowered to a tensor-parallel layer.

    Attributes:
        path: module path in the model (``"blocks.0.attn.q_proj"``).
        kind: ``"column"``, ``"row"``, ``"vocab"`` or ``"embed_dim"``.
        axis: the tensor mesh axis.
        in_features, out_features: global sizes (embeddings: vocabulary, dim).
        transposed: the weight is stored ``[in, out]`` (Hugging Face ``Conv1D``).
        output_layer: a column layer with no row partner; its output is gathered, unless
        parallel_output: (an output layer under ``vocab_parallel_logits=True``) its output stays
            split over the axis, this rank's ``(..., out_local)`` slice of the vocabulary.
        group: the parent module whose input is shared by this group of column layers.
        fused: the global sizes of the blocks the output concatenates (GPT-2's ``c_attn``:
            q, k, v ``(C, C, C)``; Phi-3's ``qkv_proj`` under GQA ``(H*hd, KV*hd, KV*hd)``), each
            split over the axis separately, so every rank holds whole heads of each; ``()``: one
            block (:func:`shardlib.plan_items.fused_blocks` gives this form).
    """

    path: str
    kind: str
    axis: str
    in_features: int
    out_features: int
    transposed: bool = False
    output_layer: bool = False
    group: str = ""
    fused: tuple[int, ...] = ()
    parallel_output: bool = False


def _is_conv1d(m: nn.Module) -> bool:
    return type(m).__name__ == "Conv1D" and hasattr(m, "nf")


def _is_norm(m: nn.Module) -> bool:
    return "Norm" in type(m).__name__


_HEAD_ATTRS = ("head_dim", "head_size", "num_heads", "n_head", "n_heads", "num_attention_heads", "num_key_value_groups")


def is_attention(m: nn.Module) -> bool:
    """An attention module: its class is named like one, or it holds a head size or count itself.
    (An MLP that keeps a reference to the model config, as HF's ``LlamaMLP`` does, is not.)"""
    name = type(m).__name__.lower()
    return "attention" in name or "attn" in name or any(isinstance(getattr(m, a, None), int) for a in _HEAD_ATTRS)


def _heads(m: nn.Module) -> tuple[int | None, int | None, int | None]:
    """(head_dim, heads, kv_heads) read off an attention module or its config, when present;
    ``(None, None, None)`` for a module that is not attention (:func:`is_attention`)."""
    if not is_attention(m):
        return None, None, None
    cfg = getattr(m, "config", None)

    def first(*names):
        for obj in (m, cfg):
            for name in names:
                value = getattr(obj, name, None) if obj is not None else None
                if isinstance(value, int) and value > 0:
                    return value
        return None

    return (first("head_dim", "head_size", "key_value_proj_dim", "d_kv"), first("num_heads", "n_head", "n_heads", "num_attention_heads"),
            first("num_key_value_heads", "num_kv_heads", "n_kv_head"))


def head_counts(m: nn.Module) -> tuple[int | None, int | None, int | None]:
    """Public name of :func:`_heads` for the lowering: ``(head_dim, heads, kv_heads)``."""
    return _heads(m)


def analyze_tensor_parallel(
    model: nn.Module, specs: dict[str, tuple[PartitionSpec, str]], mesh_shape: dict[str, int], data_axes: tuple[str, ...],
    fused: dict[str, int | tuple[int, ...]] | None = None, vocab_parallel_logits: bool = False,
) -> tuple[dict[str, str], list[TPLayer]]:
    """Decide the tensor-parallel role of every parameter and module; check the structure.

    Args:
        model: the unsharded model.
        specs: ``resolve_specs`` output, ``{canonical name: (spec, source)}``.
        mesh_shape: ``{axis: size}``.
        data_axes: the data axes (specs along them mean ZeRO-3, handled elsewhere).
        fused: ``{glob over module paths: blocks}`` for column layers whose output concatenates
            several projections: a number of equal blocks (``{"*.attn.c_attn": 3}`` for GPT-2) or
            their sizes (``{"*.self_attn.qkv_proj": (64, 16, 16)}`` for Phi-3 with 4 query and 1
            key/value head of 16).
        vocab_parallel_logits: keep the output layers' outputs split (:attr:`TPLayer.parallel_output`).

    Returns:
        ``({param name: role}, [TPLayer])``; roles are ``"column"``, ``"row"``, ``"vocab"``,
        ``"embed_dim"`` or ``"replicated"``. Names include tied aliases.

    Raises:
        ShardingError: as listed in the module docstring.
    """
    canonical = {}
    for name, prm in model.named_parameters(remove_duplicate=False):
        canonical.setdefault(id(prm), name)
    spec_of = {}
    for name, prm in model.named_parameters(remove_duplicate=False):
        spec_of[name] = specs[canonical[id(prm)]]

    def tp_axis(name: str, prm) -> tuple[str | None, int | None]:
        spec, source = spec_of[name]
        found = [(d, a) for d in range(len(spec)) for a in spec.dim_axes(d) if a not in data_axes]
        if not found:
            return None, None
        dims = {d for d, _ in found}
        if len(dims) > 1 or len(found) > 1:
            raise ShardingError(
                f"the spec {spec} ({source}) of {name} (shape {tuple(prm.shape)}) splits it over several tensor axes "
                f"{[a for _, a in found]}; a parameter is split over one non-data axis. Fix: use one axis"
            )
        d, a = found[0]
        if any(x in data_axes for x in spec.dim_axes(d)):
            raise ShardingError(
                f"the spec {spec} ({source}) of {name} mixes the data axis and the tensor axis {a!r} in one dimension; "
                "ZeRO already shards every parameter over the data axes. Fix: drop the data axis from the spec"
            )
        return a, d

    roles: dict[str, str] = {}
    layers: list[TPLayer] = []
    modules = dict(model.named_modules())
    for path, m in modules.items():
        own = [(n, p) for n, p in m._parameters.items() if p is not None]
        if not own:
            continue
        full = {n: (f"{path}.{n}" if path else n) for n, _ in own}
        where = path or "<root>"  # the module, in messages (the root of shard(nn.Linear(...), ...) has no path)
        w = m._parameters.get("weight")
        axis, dim = tp_axis(full["weight"], w) if w is not None else (None, None)
        for n, p in own:
            if n == "weight":
                continue
            a, _ = tp_axis(full[n], p)
            column_weight = axis is not None and dim == (1 if _is_conv1d(m) else 0) and not isinstance(m, nn.Embedding)
            if a is not None and n == "bias" and axis == a and not column_weight:
                raise ShardingError(
                    f"{full[n]} (shape {tuple(p.shape)}) is split over {a!r}, but {where} is row parallel (mesh {mesh_shape}): "
                    "a row layer adds its bias once, after the reduction, so the bias is replicated. Fix: leave the bias "
                    "replicated (P())"
                )
            if a is not None and not (n == "bias" and axis == a):
                raise ShardingError(
                    f"{full[n]} (shape {tuple(p.shape)}) is split over {a!r}, but {type(m).__name__} {where} "
                    f"{'has no weight split over it' if n == 'bias' else 'has no tensor-parallel form for it'}. "
                    "Fix: split the weight (a bias follows its weight), or leave this parameter replicated"
                )
        if axis is None:
            continue
        size = mesh_shape[axis]
        if _is_norm(m):
            raise ShardingError(
                f"{full['weight']} (shape {tuple(w.shape)}) of the norm {where} is split over {axis!r}; norm weights are "
                f"never split (mesh {mesh_shape}). Under sequence_parallel=True norms run on sequence shards with "
                "replicated weights whose gradients are summed over the axis. Fix: leave the norm weight replicated (P())"
            )
        if isinstance(m, nn.Embedding):
            unsupported = [k for k in ("max_norm", "scale_grad_by_freq", "sparse") if getattr(m, k, None)]
            if unsupported:
                raise ShardingError(
                    f"{full['weight']} of the embedding {where} is split over {axis!r}, but the embedding uses {unsupported}, "
                    "which the parallel embeddings do not implement. Fix: leave this embedding replicated"
                )
            kind = "vocab" if dim == 0 else "embed_dim"
            layers.append(TPLayer(path, kind, axis, m.num_embeddings, m.embedding_dim))
        elif isinstance(m, nn.Linear) or _is_conv1d(m):
            transposed = _is_conv1d(m)
            out_dim = 1 if transposed else 0
            kind = "column" if dim == out_dim else "row"
            in_f, out_f = (w.shape[0], w.shape[1]) if transposed else (w.shape[1], w.shape[0])
            given = next((v for pat, v in (fused or {}).items() if fnmatch.fnmatchcase(path, pat)), 1)
            blocks = _fused_blocks(where, given, kind, out_f, axis, size)
            layers.append(TPLayer(path, kind, axis, in_f, out_f, transposed, fused=blocks))
        else:
            raise ShardingError(
                f"{full['weight']} of {type(m).__name__} {where} is split over {axis!r} (spec {spec_of[full['weight']][0]}), "
                "but tensor parallelism lowers only Linear, Conv1D and Embedding weights. Fix: leave it replicated"
            )
        for n in full.values():
            roles[n] = layers[-1].kind

    # Structure: pair rows with columns among siblings; output layers; heads.
    by_parent: dict[str, list[TPLayer]] = {}
    for layer in layers:
        by_parent.setdefault(layer.path.rpartition(".")[0], []).append(layer)
    final: list[TPLayer] = []
    for parent, group in by_parent.items():
        rows = [g for g in group if g.kind == "row"]
        cols = [g for g in group if g.kind == "column"]
        parent_mod = modules[parent]
        if rows:
            if not cols:
                raise ShardingError(
                    f"row-parallel layer {rows[0].path or '<root>'} (split over {rows[0].axis!r}, size {mesh_shape[rows[0].axis]}) has "
                    f"no column-parallel partner in {parent or '<root>'}: its input would arrive whole, not split. Fix: "
                    "split the layer(s) feeding it by output features (P('tp', None) on their weight), or replicate it"
                )
            for name, child in parent_mod.named_children():
                child_path = f"{parent}.{name}" if parent else name
                if (isinstance(child, nn.Linear) or _is_conv1d(child)) and child_path not in {g.path for g in rows}:
                    col = next((g for g in cols if g.path == child_path), None)
                    if col is None or col.axis != rows[0].axis:
                        others = ", ".join(g.path for g in cols if g.axis == rows[0].axis and g.path != child_path)
                        head = (f"in {parent or '<root>'}, {child_path} is not column parallel over {rows[0].axis!r} while "
                                f"{others} {'are' if ',' in others else 'is'}, and {rows[0].path} is row parallel "
                                f"(mesh {mesh_shape}): every Linear of a module holding a row-parallel layer is part "
                                "of its tensor-parallel block, so it must be column parallel on the same axis")
                        pair = [g.path for g in cols + rows if g.axis == rows[0].axis]
                        if isinstance(parent_mod, nn.Sequential):  # its children run one after the other
                            raise ShardingError(
                                f"{head}; a replicated Linear cannot share that module. In an nn.Sequential no two "
                                f"layers read the same input, so {child_path} runs before or after the pair. Fix: move "
                                f"{' ... '.join(pair)} (and what runs between them) into an nn.Sequential of their "
                                f"own, one child of {parent or '<root>'}")
                        raise ShardingError(
                            f"{head}. Fix: if {child_path} reads the same input as {cols[0].path} (q/k/v, gate/up), "
                            f"give {child_path}.weight the same spec as {cols[0].path}.weight; if it runs before or "
                            f"after the pair, move {', '.join(pair[:-1])} and {pair[-1]} into a module of their own"
                        )
            head_dim, heads, kv_heads = _heads(parent_mod)
            n = mesh_shape[rows[0].axis]
            for col in cols:
                for block in col.fused or (col.out_features,):
                    h = block // head_dim if head_dim and block % head_dim == 0 else 0
                    if h % n:
                        what = "key/value heads" if kv_heads and h == kv_heads and kv_heads != heads else "heads"
                        where_h = (f"in its fused block of {block} features (blocks {col.fused}, head_dim {head_dim})"
                                   if col.fused else f"(out_features {col.out_features}, head_dim {head_dim})")
                        raise ShardingError(
                            f"attention {parent}: {col.path} has {h} {what} {where_h}, which do not split over "
                            f"{col.axis!r} of size {n} (mesh {mesh_shape}). Fix: use a tensor axis size dividing {h}, "
                            "or replicate the attention projections"
                        )
        final += [TPLayer(g.path, g.kind, g.axis, g.in_features, g.out_features, g.transposed,
                          output_layer=(g.kind == "column" and not rows), group=parent if rows else "", fused=g.fused,
                          parallel_output=bool(vocab_parallel_logits and g.kind == "column" and not rows))
                  for g in group]
    if vocab_parallel_logits and not any(layer.parallel_output for layer in final):
        raise ShardingError(
            f"vocab_parallel_logits=True keeps the logits of the output layer (a column-parallel Linear with no row-parallel "
            f"partner: the LM head) split over the tensor axis, but {type(model).__name__} has none on the mesh "
            f"{mesh_shape}{' (no layer is tensor parallel)' if not final else ''}. Fix: split the LM head by output "
            "features (P('tp', None) on its weight, or tie it to a vocabulary-parallel embedding), or drop "
            "vocab_parallel_logits")
    return roles, final


def _fused_blocks(where: str, given, kind: str, out_f: int, axis: str, size: int) -> tuple[int, ...]:
    """The block sizes (:attr:`TPLayer.fused`) of a layer a ``fused`` glob matched (``given``: a
    number of equal blocks or their sizes), checked: a column layer, blocks that fill its output,
    each divisible by the axis size."""
    if isinstance(given, (tuple, list)):
        blocks = tuple(int(b) for b in given)
        what = f"blocks {blocks}"
        if sum(blocks) != out_f:
            raise ShardingError(
                f"fused layer {where} ({what}) has out_features {out_f}, but the blocks sum to {sum(blocks)}: they are "
                f"the sizes of the projections its output joins, in order. Fix: give sizes summing to {out_f} (Phi-3's "
                "qkv_proj: (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim))"
            )
    elif int(given) == 1:
        return ()
    else:
        given = int(given)
        blocks, what = (out_f // given,) * given, f"{given} blocks"
    rule = (f"fused layer {where} ({what}, out_features {out_f}) must be column parallel with each block divisible "
            f"by {axis!r} of size {size}")
    if kind != "column":
        raise ShardingError(f"{rule}, but it is {kind} parallel (its weight is split by input features). Fix: split "
                            "its weight by output features (P('tp', None)), or remove it from fused")
    if not isinstance(given, (tuple, list)) and out_f % given:
        raise ShardingError(f"{rule}, but {out_f} features do not make {given} equal blocks. Fix: give the block "
                            "sizes as a tuple, or the right number of blocks")
    bad = sorted({b for b in blocks if b % size})
    if bad:
        raise ShardingError(f"{rule}; block size(s) {bad} are not. Fix: use a tensor axis size dividing every block, "
                            f"or leave {where} replicated")
    return fused_blocks(out_f, blocks)


_WEIGHT_DIM = {("column", False): 0, ("column", True): 1, ("row", False): 1, ("row", True): 0,
               ("vocab", False): 0, ("embed_dim", False): 1}


def tensor_split(tp_layers, names) -> tuple[str | None, int | None, tuple[int, ...]]:
    """(axis, dim, fused block sizes) of the tensor split of a parameter known by ``names`` (its
    canonical name and tied aliases), or ``(None, None, ())`` when it is not split."""
    by_path = {layer.path: layer for layer in tp_layers}
    for n in names:
        path, _, attr = n.rpartition(".")
        layer = by_path.get(path)
        if layer is None:
            continue
        if attr == "weight":
            return layer.axis, _WEIGHT_DIM[(layer.kind, layer.transposed)], layer.fused
        if attr == "bias" and layer.kind == "column":
            return layer.axis, 0, layer.fused
    return None, None, ()


def sequence_parallel_layout(model: nn.Module, tp_layers, entry: str | None, exit_: str | None) -> tuple[str, str, tuple[str, ...]]:
    """(entry module, exit module, parameters whose gradients are summed over the tensor axis).

    Entry default: the module named ``drop`` (GPT-2's dropout after the embedding sum), else the
    first block of the longest ``ModuleList`` holding tensor-parallel layers (the decoder layers:
    LLaMA; not a list of per-head norms inside them), so masks and positions
    are built on the whole sequence before the split. Exit: a module whose output is gathered
    along the sequence (GPT-2's ``ln_f``); default none when a tensor-parallel output layer (the
    LM head) gathers, else the last block. Every replicated parameter of the blocks, the norms
    after them up to the gather, and row-layer biases run on sequence shards, so their gradients
    are partial sums.

    Raises:
        ShardingError: an entry or exit that is not a module; no entry found; an exit inside a block
            before the region's last.
    """
    modules = dict(model.named_modules())
    for label, given in (("sp_entry", entry), ("sp_exit", exit_)):
        if given is not None and given not in modules:
            raise ShardingError(f"{label} {given!r} is not a module of {type(model).__name__}")
    if entry is None:
        in_lists = {f"{n_}.{i}" for n_, m in modules.items() if isinstance(m, nn.ModuleList) for i in range(len(m))}
        drops = [name for name in modules if name.rpartition(".")[2] == "drop"  # GPT-2's, not one inside a block
                 and not any(name.startswith(b + ".") for b in in_lists)]
        lists = block_lists(modules, tp_layers)
        if drops:
            entry = drops[0]
        elif lists:
            entry = f"{max(lists, key=lambda t: t[0])[1]}.0"
        else:
            raise ShardingError(
                "sequence_parallel=True needs an entry into the sequence-parallel region: a module named 'drop' after "
                f"the embeddings or a ModuleList of blocks; {type(model).__name__} has neither. Fix: pass sp_entry='<path>'"
            )
    row_biases = {f"{layer.path}.bias" for layer in tp_layers if layer.kind == "row"}
    split = split_param_names(tp_layers)
    blocks = region_blocks(modules, entry, tp_layers)
    if exit_ is None and blocks and not any(layer.output_layer for layer in tp_layers):
        exit_ = blocks[-1]  # nothing gathers the sequence later (a replicated LM head): the last block does
    inner = [b for b in blocks[:-1] if exit_ is not None and (exit_ == b or exit_.startswith(b + "."))]
    if inner:
        raise ShardingError(
            f"sp_exit {exit_!r} is inside the sequence-parallel region's block {inner[0]!r}, before its last block "
            f"{blocks[-1]!r}: the blocks after it would get the whole sequence while their layers expect sequence "
            f"shards. Fix: sp_exit={blocks[-1]!r} (or the final norm after it), or leave sp_exit unset")
    container = blocks[0].rpartition(".")[0].rpartition(".")[0] if blocks else None  # the blocks' list's parent
    names = []
    for mname, module in model.named_modules():
        in_block = any(mname == b or mname.startswith(b + ".") for b in blocks)
        # a norm outside the blocks runs on sequence shards if it follows them, before the gather
        # (the output layer's, with no exit; or the exit's own output, GPT-2's ln_f): the final
        # norm next to the block list (LLaMA's model.norm, OPT's decoder.final_layer_norm, which
        # OPT registers before its layers); a norm of the embeddings (BLOOM's) runs before them
        final_norm = (container is not None and mname.rpartition(".")[0] == container
                      and "emb" not in mname.rpartition(".")[2])
        loose_norm = ("Norm" in type(module).__name__ and not in_block
                      and (mname == exit_ or (exit_ is None and final_norm)))
        for pname, prm in module.named_parameters(prefix=mname, recurse=False):
            if prm.requires_grad and pname not in split and (in_block or loose_norm or pname in row_biases):
                names.append(pname)
    return entry, exit_ or "", tuple(dict.fromkeys(names))


def split_param_names(tp_layers) -> set[str]:
    """Names of the parameters split over the tensor axis (column/row weights, column biases)."""
    out = set()
    for layer in tp_layers:
        out.add(f"{layer.path}.weight" if layer.path else "weight")
        if layer.kind == "column":
            out.add(f"{layer.path}.bias" if layer.path else "bias")
    return out


def block_lists(modules: dict, tp_layers) -> list[tuple[int, str]]:
    """``(length, path)`` of the ``ModuleList`` s whose entries hold tensor-parallel layers: the
    blocks (not a list of per-head norms inside them, StableLM's ``q_layernorm.norms``, which can
    be longer)."""
    return [(len(m), name) for name, m in modules.items() if isinstance(m, nn.ModuleList) and len(m)
            and any(layer.path.startswith(f"{name}.") for layer in tp_layers)]


def region_blocks(modules: dict, entry: str, tp_layers) -> list[str]:
    """The blocks that run inside the sequence-parallel region: the entry block and those after
    it in its ``ModuleList`` (LLaMA's ``model.layers.0`` onward), or, for an entry that is not a
    block (GPT-2's ``drop``), every block of the longest list of blocks (:func:`block_lists`)."""
    parent, _, idx = entry.rpartition(".")
    if idx.isdigit() and isinstance(modules.get(parent), nn.ModuleList):
        return [f"{parent}.{i}" for i in range(int(idx), len(modules[parent]))]
    lists = block_lists(modules, tp_layers)
    if not lists:
        return []
    name = max(lists, key=lambda t: t[0])[1]
    return [f"{name}.{i}" for i in range(len(modules[name]))]


def split_region_params(model: nn.Module, tp_layers) -> tuple[str, ...]:
    """Replicated parameters used on feature-split activations without sequence parallelism.

    Inside an attention or MLP module whose projections are column/row parallel, a module that is
    not itself a parallel layer (Qwen3's per-head ``q_norm``/``k_norm``) runs on this rank's
    heads only, so each rank's gradient of its replicated weight is a partial sum over heads:
    it is summed over the tensor axis (HF's tp plan calls this "replicated_with_grad_allreduce").
    Row-layer biases are added once after the reduction, so their gradients are whole already.
    A group whose parent is a block of a ``ModuleList`` (MLP projections directly in OPT's decoder
    layer) is not searched: the parent's other modules run before the split. Nor is a module the
    parent registers before the group's first column layer (a pre-norm feed-forward block: norm,
    column, row), taken to run on the replicated input; Qwen3 registers its per-head norms after
    the projections. ``shard(verify=True)`` checks every case on the real modules.
    """
    modules = dict(model.named_modules())
    order = {name: i for i, name in enumerate(modules)}  # registration order (named_modules walks it)
    in_lists = {f"{name}.{i}" for name, m in modules.items() if isinstance(m, nn.ModuleList) for i in range(len(m))}
    split = split_param_names(tp_layers) | {f"{layer.path}.bias" for layer in tp_layers if layer.kind == "row"}
    parents = {layer.group for layer in tp_layers if layer.group and layer.group not in in_lists}
    names = []
    for parent in sorted(parents):
        first = min((order[layer.path] for layer in tp_layers if layer.group == parent and layer.kind == "column"),
                    default=len(order))
        for pname, prm in modules[parent].named_parameters(prefix=parent):
            owner = pname.rpartition(".")[0]
            if prm.requires_grad and pname not in split and not (owner != parent and order[owner] < first):
                names.append(pname)
    return tuple(dict.fromkeys(names))


def with_sum_globs(model: nn.Module, names: tuple[str, ...], globs, tp_layers) -> tuple[str, ...]:
    """``names`` plus the replicated parameters matching a ``tp_sum_grads`` glob (their gradients
    are summed over the tensor axis: used on split activations).

    Raises:
        ShardingError: a glob that matches no parameter; one matching a parameter split over the
            tensor axis (its gradient is a slice, not a partial sum).
    """
    if not globs:
        return names
    split = split_param_names(tp_layers)
    out = list(names)
    for pattern in globs:
        hits = [n for n, p in model.named_parameters() if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise ShardingError(f"tp_sum_grads pattern {pattern!r} matches no parameter of {type(model).__name__}")
        bad = [n for n in hits if n in split]
        if bad:
            raise ShardingError(f"tp_sum_grads pattern {pattern!r} matches {bad[0]}, which is split over the tensor axis: "
                                "only replicated parameters have partial-sum gradients. Fix: a narrower pattern")
        out += hits
    return tuple(dict.fromkeys(out))


