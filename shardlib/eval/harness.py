"""An EleutherAI ``lm-evaluation-harness`` (``lm-eval``) model for a sharded causal LM.

:class:`ShardedLM` is an ``lm_eval.api.model.TemplateLM``: the harness hands it requests and it
answers them with the sharded model, on any mesh without a pipeline axis. Every rank receives the
same requests in the same order (lm-eval's "tensor-parallel launcher" mode: each rank reports
``rank == 0``), runs the same batches, each one whole on every rank (tensor parallel ranks need
identical inputs; data ranks simply repeat the work), and gets the same scores.

- ``loglikelihood``: the sum of ``log p(continuation token | prefix)`` over the continuation, and
  whether greedy decoding would produce it (lm-eval's contract); contexts longer than the model's
  positions are cut from the left, as lm-eval's Hugging Face model does. A continuation longer
  than ``max_length`` by itself is scored on its last ``max_length`` tokens only, with a
  ``UserWarning`` naming the tokens left out (its first tokens would have no context to fit).
- ``loglikelihood_rolling``: the whole text's log-likelihood in disjoint windows of the model's
  length (``lm_eval.utils.get_rolling_token_windows``), the first conditioned on the
  end-of-text token.
- ``generate_until``: greedy decoding, stopped at any of the request's ``until`` strings or after
  ``max_gen_toks`` tokens.

Batches are sorted by length (longest first) and padded on the right, which a causal model
never attends to; the scores come back in the requests' order.

Tokenizers: ``"bytes"`` (ids are UTF-8 bytes; the end-of-text token is the newline byte) or a
``tokenizers.Tokenizer`` (its ``<|endoftext|>`` id, else 0).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["ShardedLM", "ByteCodec", "TokenizerCodec", "codec_for"]

try:
    from lm_eval.api.model import TemplateLM as _Base
except ImportError:  # the adapter needs lm-eval; the codecs do not
    _Base = object


class ByteCodec:
    """UTF-8 bytes as token ids (vocabulary 256); end of text: the newline byte (10)."""

    eot_id = 10
    stops_at_eot = False  # a newline is text, not the end of it

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class TokenizerCodec:
    """A ``tokenizers.Tokenizer``; end of text: its ``<|endoftext|>`` id, else 0."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        eot = tokenizer.token_to_id("<|endoftext|>")
        self.eot_id = 0 if eot is None else eot
        self.stops_at_eot = True

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


def codec_for(corpus: Any) -> ByteCodec | TokenizerCodec:
    """The codec of a training tool corpus: bytes for a ByteCorpus, its tokenizer for a TokenCorpus."""
    return TokenizerCodec(corpus.tokenizer()) if hasattr(corpus, "tokenizer") else ByteCodec()


class ShardedLM(_Base):
    """An ``lm_eval`` model answering with ``smodel``, a sharded causal LM (every rank).

    Args:
        smodel: a :class:`~shardlib.ShardedModule` whose call ``smodel(idx)`` returns the logits
            ``(B, L, V)`` whole on every rank (or ``(logits, loss)``), with ``smodel.mesh``, e.g. a sharded
            :class:`shardlib.models.GPT` (vocabulary-parallel logits are gathered without targets).
        codec: :class:`ByteCodec` or :class:`TokenizerCodec`.
        max_length: the longest input, in tokens (the model's positions, e.g. ``block_size``).
        batch_size: sequences per forward.
        max_gen_toks: the default limit of ``generate_until``.

    Raises:
        ImportError: ``lm-eval`` is not installed (``pip install lm-eval``).
        ValueError: ``smodel`` runs a pipeline (evaluate on a mesh without ``pp``: checkpoints
            reshard onto any mesh), or a non-positive ``max_length`` / ``batch_size``.
    """

    def __init__(self, smodel: Any, codec: Any, max_length: int, batch_size: int = 8, max_gen_toks: int = 32):
        if _Base is object:
            raise ImportError("shardlib.eval.harness.ShardedLM needs lm-eval: pip install lm-eval")
        import shardlib

        if isinstance(smodel, shardlib.PipelineModule):
            raise ValueError("ShardedLM: the model runs a pipeline; evaluate the checkpoint on a mesh without a pp "
                             "axis (it reshards on load), e.g. python -m shardlib.eval --mesh dp=2,tp=2")
        if max_length < 1 or batch_size < 1:
            raise ValueError(f"ShardedLM: max_length and batch_size must be >= 1, got {max_length} and {batch_size}")
        super().__init__()
        self.smodel, self.codec = smodel, codec
        self.max_length, self.batch_size, self.max_gen_toks = max_length, batch_size, max_gen_toks
        self._tp = smodel.mesh.shape.get("tp", 1)
        self._dev = smodel.mesh.device

    # -- lm-eval's interface ------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.codec.eot_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return self.codec.encode(string)

    def tok_decode(self, tokens: list[int], **kwargs: Any) -> str:
        return self.codec.decode(list(tokens))

    @torch.no_grad()
    def _logprobs(self, rows: list[list[int]]) -> list[torch.Tensor]:
        """Log-softmax ``(len(row), V)`` of each row (one batch: at most ``batch_size`` rows), on the
        model's device: callers pick the few positions they need there (a copy of the whole
        ``(B, T, V)`` to the host was 1.6 GB a batch at 8 x 1024 x 50304)."""
        length = max(len(r) for r in rows)
        if self._tp > 1:  # sequence parallelism splits the sequence over tp
            length = -(-length // self._tp) * self._tp
        length = min(length, self.max_length)
        x = torch.zeros(len(rows), length, dtype=torch.long)
        for i, r in enumerate(rows):
            x[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        was = self.smodel.training
        self.smodel.eval()
        out = self.smodel(x.to(self._dev))
        self.smodel.train(was)
        logits = out[0] if isinstance(out, tuple) else getattr(out, "logits", out)  # ours, or a Hugging Face output
        logp = F.log_softmax(logits.float(), dim=-1)
        return [logp[i, :len(r)] for i, r in enumerate(rows)]

    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """``(sum of log p(continuation), greedy)`` for ``(context, continuation)`` id lists."""
        order = sorted(range(len(pairs)), key=lambda i: -(len(pairs[i][0]) + len(pairs[i][1])))
        out: list[tuple[float, bool] | None] = [None] * len(pairs)
        for start in range(0, len(order), self.batch_size):
            idx = order[start:start + self.batch_size]
            rows, conts = [], []
            for i in idx:
                ctx, cont = pairs[i]
                if not cont:
                    raise ValueError("ShardedLM: a continuation of no tokens has no log-likelihood to score")
                whole = (ctx + cont)[-(self.max_length + 1):]  # cut the context from the left
                rows.append(whole[:-1])
                if len(cont) >= len(whole):
                    warnings.warn(f"ShardedLM: a continuation of {len(cont)} tokens is longer than max_length "
                                  f"({self.max_length}): only its last {len(whole) - 1} tokens are scored", stacklevel=2)
                    cont = cont[-len(whole) + 1:]
                conts.append(cont)
            for i, row, cont, lp in zip(idx, rows, conts, self._logprobs(rows)):
                tail = lp[len(row) - len(cont):]  # the positions that predict the continuation
                target = torch.tensor(cont, dtype=torch.long, device=tail.device)
                total = tail.gather(1, target[:, None]).sum().item()
                out[i] = (total, bool((tail.argmax(-1) == target).all()))
        return out  # type: ignore[return-value]

    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        results = self._score([(list(ctx), list(cont)) for _, ctx, cont in requests])
        for (key, _, _), res in zip(requests, results):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, res)
        return results

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        out = []
        for req in requests:
            (text,) = req.args
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                self.tok_encode(text), self.eot_token_id, self.max_length, 1)]
            total = sum(score for score, _ in self._score([(list(a), list(b)) for a, b in windows]))
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            out.append(total)
        return out

    @torch.no_grad()
    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        out = []
        for req in requests:
            context, kwargs = req.args
            kwargs = dict(kwargs or {})
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            limit = int(kwargs.get("max_gen_toks", self.max_gen_toks))
            ids = self.tok_encode(context) or [self.eot_token_id]
            new: list[int] = []
            text = ""
            for _ in range(limit):
                row = (ids + new)[-self.max_length:]
                nxt = int(self._logprobs([row])[0][-1].argmax())
                if nxt == self.eot_token_id and self.codec.stops_at_eot:
                    break
                new.append(nxt)
                text = self.tok_decode(new)
                if any(u in text for u in until):
                    break
            for u in until:
                text = text.split(u)[0]
            self.cache_hook.add_partial("generate_until", (context, req.args[1]), text)
            out.append(text)
        return out
