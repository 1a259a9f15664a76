"""Tiny random configs of fourteen unmodified Hugging Face architectures (transformers 5.x), for
equivalence tests under any layout: ``FAMILIES[name] = (make_model, make_batch, loss_fn)``.

- ``make_model()`` builds the model from the current torch seed (a module-level function, so
  the worker pool receives it by reference).
- ``make_batch(rows)`` returns the global batch as a tuple ``(*inputs, target)``, the same on
  every call; the model is called ``model(*inputs)`` and scored ``loss_fn(output, target)``
  (the calling convention of :func:`shardlib.testing.assert_equivalent`). ``rows`` must be a
  multiple of the number of data ranks; every row weighs the same in the loss, so the mean of
  per-rank losses is the global loss (DDP semantics).

Every config: 2 layers, 4 attention heads (2 key/value heads where the family has GQA), hidden
16 or 32, vocab 37, 8 tokens per row, dropout 0, ``use_cache=False``, eager attention (and eager
MoE experts), so the arithmetic is plain torch ops that a sharded run can reproduce. Head
counts, key/value heads, intermediate sizes and expert counts are even, so tp=2 splits whole
heads; the vocab (37) is odd on purpose, to exercise an uneven vocab split.

``with_attention(make_model, "sdpa")`` builds the same model with another attention
implementation (HF 5.x's default is sdpa; Gemma2 supports only eager): a layout can behave
differently there (OPT's attention under tensor parallelism crashes in eager, where the mask has
the global sequence length, and runs silently wrong in sdpa, which builds no mask).

No tests here: tests/test_hf_zoo.py holds them.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import transformers

VOCAB = 37
SEQ = 8  # tokens per row the model sees (decoder side for T5)
MAX_POS = 16
COMMON = {"use_cache": False, "attn_implementation": "eager"}  # tie_word_embeddings: each family's default
TOKENS = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}  # defaults (32000, 50256) lie outside the vocab


def lm_loss(output, targets):
    """Next-token cross entropy, mean over every position: ``logits (batch, seq, vocab)``,
    ``targets (batch, seq)``."""
    return F.cross_entropy(output.logits.flatten(0, 1).float(), targets.flatten())


def masked_lm_loss(output, labels):
    """Cross entropy over the masked positions (``labels`` is -100 elsewhere); every row masks
    the same number of positions, so per-rank means average to the global mean."""
    return F.cross_entropy(output.logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)


def _tokens(rows, cols, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (rows, cols), generator=g)  # 0 is pad/bos/eos: kept out of the data


def causal_batch(rows):
    """``(input_ids (rows, SEQ), targets (rows, SEQ))``: targets are the inputs shifted by one."""
    x = _tokens(rows, SEQ + 1)
    return x[:, :-1], x[:, 1:]


MASK_ID = VOCAB - 1  # BERT's [MASK] token in the tiny vocab
MASKED_PER_ROW = 2


def masked_batch(rows):
    """``(input_ids (rows, SEQ), labels (rows, SEQ))`` for masked LM: ``MASKED_PER_ROW`` positions
    per row (chosen by a fixed generator) are replaced by ``MASK_ID`` and labelled with the
    original token; the others are labelled -100."""
    x = _tokens(rows, SEQ) % MASK_ID  # ids 0..MASK_ID-1: the data never holds the mask token
    g = torch.Generator().manual_seed(1)
    where = torch.stack([torch.randperm(SEQ, generator=g)[:MASKED_PER_ROW] for _ in range(rows)])
    mask = torch.zeros(rows, SEQ, dtype=torch.bool).scatter_(1, where, True)
    labels = torch.where(mask, x, torch.full_like(x, -100))
    return torch.where(mask, torch.full_like(x, MASK_ID), x), labels


def seq2seq_batch(rows):
    """``(input_ids (rows, SEQ), attention_mask (rows, SEQ), decoder_input_ids (rows, SEQ),
    labels (rows, SEQ))``: the decoder input is the labels shifted right behind T5's decoder
    start token (the pad id, 0); the mask is all ones (a tensor, as the batch must be)."""
    src = _tokens(rows, SEQ, seed=2)
    labels = _tokens(rows, SEQ, seed=3)
    start = torch.zeros(rows, 1, dtype=labels.dtype)
    return src, torch.ones_like(src), torch.cat([start, labels[:, :-1]], dim=1), labels


def _no_grad_key_bias(model, biases):
    """Freeze key biases whose gradient is zero in exact arithmetic: with no rotation between the
    projection and the scores, a key bias adds ``q_i . b`` to every score of row ``i``, and softmax
    is shift invariant. AdamW turns the rounding noise of such a gradient (which differs with the
    order of the data-parallel sum) into run-dependent updates of up to ``lr``: trained, OPT's and
    BERT's key biases ended ZeRO-3 dp=2 at 0.75 and 1.2 relative error (inside the harness's noise
    band, so it passed, but every other parameter of those models stays within 1.3e-6). Phi's and
    GPT-NeoX's key biases are partly rotated (partial rotary), so they learn and stay trained;
    their unrotated part is noise: 2.5e-6 and 4.4e-6 absolute at lr 1e-3 after 3 steps (measured)."""
    for bias in biases:
        bias.requires_grad_(False)
    return model


def make_gpt2():
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=4, n_positions=MAX_POS, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, **COMMON, **TOKENS,
    )
    model = transformers.GPT2LMHeadModel(cfg)
    return _no_grad_key_bias(model, [b.attn.c_attn.bias for b in model.transformer.h])  # holds q, k and v biases


def _llama_like(config_cls, **extra):
    base = dict(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=MAX_POS, **COMMON, **TOKENS,
    )
    base.update(extra)
    return config_cls(**base)


def make_llama():
    return transformers.LlamaForCausalLM(_llama_like(transformers.LlamaConfig))


def make_mistral():
    return transformers.MistralForCausalLM(_llama_like(transformers.MistralConfig, sliding_window=None))


def make_qwen2():
    # q/k/v biases (hard-wired in Qwen2Attention): rotary embeddings come after, so the key bias learns
    return transformers.Qwen2ForCausalLM(_llama_like(transformers.Qwen2Config))


def make_qwen3():
    # head_dim defaults to 128 in Qwen3Config; q_norm and k_norm are RMSNorms over head_dim
    return transformers.Qwen3ForCausalLM(_llama_like(transformers.Qwen3Config, head_dim=4))


def make_gemma():
    # head_dim (default 256) set; tied embeddings; GemmaTextScaledWordEmbedding multiplies by sqrt(hidden)
    return transformers.GemmaForCausalLM(_llama_like(transformers.GemmaConfig, head_dim=4))


def make_gemma2():
    # attention logit softcapping (eager only), final logit softcapping and alternating sliding
    # windows (4096, wider than the sequence) kept at their defaults; the scores scale by query_pre_attn_scalar
    return transformers.Gemma2ForCausalLM(_llama_like(transformers.Gemma2Config, head_dim=4, query_pre_attn_scalar=4))


def make_mixtral():
    # 4 experts of which 2 per token; experts as 3-D Parameters (HF 5.x), run by the eager loop
    cfg = _llama_like(transformers.MixtralConfig, num_local_experts=4, num_experts_per_tok=2,
                      router_jitter_noise=0.0, experts_implementation="eager")
    return transformers.MixtralForCausalLM(cfg)


def make_phi():
    # partial rotary (factor 0.5: 4 of 8 head dims rotate), q/k/v biases, parallel attention + MLP
    cfg = transformers.PhiConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=MAX_POS, resid_pdrop=0.0, embd_pdrop=0.0,
        attention_dropout=0.0, **COMMON, **TOKENS,
    )
    return transformers.PhiForCausalLM(cfg)


def make_phi3():
    # fused qkv_proj [(4 + 2 + 2) * head_dim, hidden] and gate_up_proj [2 * intermediate, hidden]
    cfg = transformers.Phi3Config(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=MAX_POS, original_max_position_embeddings=MAX_POS,
        resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0, **COMMON, **TOKENS,
    )
    return transformers.Phi3ForCausalLM(cfg)


def make_gpt_neox():
    # hidden 32 (head_dim 8) so that rotary_pct 0.25 rotates 2 dims, not 1; query_key_value fused
    # per head ([h0 q,k,v | h1 q,k,v | ...]); parallel residual
    cfg = transformers.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=MAX_POS, hidden_dropout=0.0, attention_dropout=0.0, **COMMON, **TOKENS,
    )
    return transformers.GPTNeoXForCausalLM(cfg)


def make_opt():
    # learned positions with an offset of 2 (embed_positions has MAX_POS + 2 rows); embeddings tied
    cfg = transformers.OPTConfig(
        vocab_size=VOCAB, hidden_size=16, ffn_dim=24, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=MAX_POS, dropout=0.0, attention_dropout=0.0, layerdrop=0.0,
        **COMMON, **{**TOKENS, "pad_token_id": 1},
    )
    model = transformers.OPTForCausalLM(cfg)
    return _no_grad_key_bias(model, [layer.self_attn.k_proj.bias for layer in model.model.decoder.layers])


def make_bert():
    # masked LM; absolute positions, token types (all 0), decoder tied to the word embeddings
    cfg = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=MAX_POS, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        **COMMON, pad_token_id=0,
    )
    model = transformers.BertForMaskedLM(cfg)
    layers = model.bert.encoder.layer
    return _no_grad_key_bias(model, [layer.attention.self.key.bias for layer in layers])


def make_t5():
    # encoder-decoder, relative position bias in the first layer of each stack, shared embeddings
    # (T5Config always ties them), no biases, decoder output scaled by d_model ** -0.5 before lm_head
    cfg = transformers.T5Config(
        vocab_size=VOCAB, d_model=16, d_kv=4, d_ff=24, num_layers=2, num_decoder_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=MAX_POS, dropout_rate=0.0,
        use_cache=False, attn_implementation="eager", pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )
    return transformers.T5ForConditionalGeneration(cfg)


def _with_attention(make_model, implementation):
    model = make_model()
    model.set_attn_implementation(implementation)
    return model


def with_attention(make_model, implementation):
    """A picklable maker: ``make_model()`` switched to ``implementation`` (``"sdpa"``, ``"eager"``).

    Raises:
        ValueError: (from transformers, when called) the family does not support it.
    """
    return functools.partial(_with_attention, make_model, implementation)


FAMILIES = {
    "gpt2": (make_gpt2, causal_batch, lm_loss),
    "llama": (make_llama, causal_batch, lm_loss),
    "mistral": (make_mistral, causal_batch, lm_loss),
    "qwen2": (make_qwen2, causal_batch, lm_loss),
    "qwen3": (make_qwen3, causal_batch, lm_loss),
    "gemma": (make_gemma, causal_batch, lm_loss),
    "gemma2": (make_gemma2, causal_batch, lm_loss),
    "mixtral": (make_mixtral, causal_batch, lm_loss),
    "phi": (make_phi, causal_batch, lm_loss),
    "phi3": (make_phi3, causal_batch, lm_loss),
    "gpt_neox": (make_gpt_neox, causal_batch, lm_loss),
    "opt": (make_opt, causal_batch, lm_loss),
    "bert": (make_bert, masked_batch, masked_lm_loss),
    "t5": (make_t5, seq2seq_batch, lm_loss),
}
