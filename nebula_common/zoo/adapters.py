"""ABNet (the paper's Scenario II, the built-in `abnet` job) as torch modules: LMs, adapters, decoding.

The encoder side (cluster S) is a pre-LN transformer pre-trained as a masked LM;
the decoder side (cluster T) a causal LM. Fine-tuning freezes both and trains only:

* encoder adapters (layer norm + two feed-forward layers with a non-linearity,
  residual) after *each sub-layer* of every encoder block: ``H = AENC(PLM-S(H))``;
* decoder adapters (multi-head cross-attention over the encoder states, a
  feed-forward layer, layer norms and residuals) after every decoder block:
  ``H = ADEC(PLM-T(H), H_E, H_E)``.

Adapters start as the identity (their last projection is zero-initialised), so
fine-tuning starts exactly from the pre-trained models' behaviour. Why padding
travels as zero rows: cluster T never sees Spanish token ids, so the encoder
zeroes the states of padding positions and T masks the rows that are exactly
zero; every codec Nebula ships keeps zero exact (fp16, symmetric int8).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from nebula_common.zoo.text_data import BOS, EOS, MASK, PAD, UNK


def _check_dims(d_model: int, n_heads: int) -> None:
    if d_model < 8 or n_heads < 1 or d_model % n_heads:
        raise ValueError(f"d_model {d_model} must be >= 8 and a multiple of n_heads {n_heads}")


class Block(nn.Module):
    """Pre-LN transformer block whose two sub-layers can be run separately (adapters go between them)."""

    def __init__(self, d_model: int, n_heads: int, causal: bool) -> None:
        super().__init__()
        self.causal = causal
        self.norm_attn = nn.LayerNorm(d_model)
        self.attn = nn.MultiheadAttention(d_model, n_heads, dropout=0.0, batch_first=True)
        self.norm_ff = nn.LayerNorm(d_model)
        self.ff = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def attention(self, h: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        x = self.norm_attn(h)
        causal = None
        if self.causal:
            size = h.shape[1]
            causal = torch.triu(torch.ones(size, size, dtype=torch.bool, device=h.device), diagonal=1)
        out, _ = self.attn(x, x, x, key_padding_mask=padding, attn_mask=causal, need_weights=False)
        return h + out

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.ff(self.norm_ff(h))

    def forward(self, h: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        return self.feed_forward(self.attention(h, padding))


class LanguageModel(nn.Module):
    """Embeddings + blocks + final norm + vocabulary head: the encoder (MLM) or the decoder (causal LM)."""

    def __init__(
        self, vocab: int, length: int, d_model: int, n_heads: int, n_layers: int, causal: bool
    ) -> None:
        super().__init__()
        _check_dims(d_model, n_heads)
        self.causal = causal
        self.embed = nn.Embedding(vocab, d_model, padding_idx=PAD)
        self.position = nn.Parameter(torch.randn(length, d_model) * 0.02)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, causal) for _ in range(n_layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        self.scale = math.sqrt(d_model)

    def embed_ids(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.shape[1] > self.position.shape[0]:
            raise ValueError(f"sequence length {ids.shape[1]} exceeds the model's {self.position.shape[0]}")
        return self.embed(ids) * self.scale + self.position[: ids.shape[1]]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits per position (pre-training)."""
        padding = ids == PAD
        h = self.embed_ids(ids)
        for block in self.blocks:
            h = block(h, padding)
        return self.head(self.norm(h))


def rms(x: torch.Tensor) -> torch.Tensor:
    """Root mean square over the last dimension (kept): a position's magnitude in the residual stream."""
    return x.pow(2).mean(dim=-1, keepdim=True).sqrt()


class Adapter(nn.Module):
    """ABNet encoder adapter: LayerNorm -> Linear -> ReLU -> Linear, residual; the identity at init."""

    def __init__(self, d_model: int, bottleneck: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.down = nn.Linear(d_model, bottleneck)
        self.up = nn.Linear(bottleneck, d_model)
        nn.init.zeros_(self.up.weight)
        nn.init.zeros_(self.up.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.up(torch.relu(self.down(self.norm(h))))


class CrossAdapter(nn.Module):
    """ABNet decoder adapter: cross-attention to the encoder states, then feed-forward; identity at init."""

    def __init__(self, d_model: int, n_heads: int, bottleneck: int) -> None:
        super().__init__()
        self.norm_query = nn.LayerNorm(d_model)
        self.cross = nn.MultiheadAttention(d_model, n_heads, dropout=0.0, batch_first=True)
        self.norm_ff = nn.LayerNorm(d_model)
        self.ff = Adapter(d_model, bottleneck)
        self.gate = nn.Parameter(torch.zeros(()))  # the source's share of the stream, from zero

    def forward(self, h: torch.Tensor, memory: torch.Tensor, memory_padding: torch.Tensor) -> torch.Tensor:
        context, _ = self.cross(
            self.norm_query(h), memory, memory, key_padding_mask=memory_padding, need_weights=False
        )
        # The gate is the source's share of the stream: the context is rescaled to the stream's RMS at
        # each position. Added as it comes out of attention (RMS ~0.1 against the frozen LM's ~8, its
        # embeddings x sqrt(d)), the source stayed ~1% of the stream for hundreds of steps while the
        # gate grew by ~lr a step, and the decoder kept continuing its own LM (BLEU < 1).
        context = context * (rms(h.detach()) / (rms(context) + 1e-6))
        return self.ff(h + self.gate * context)


def freeze(module: nn.Module) -> nn.Module:
    """Pre-trained weights stay exactly as loaded: no gradient, and the optimizer never sees them."""
    for parameter in module.parameters():
        parameter.requires_grad_(False)
    return module


def load_pretrained(model: LanguageModel, path: str | None) -> LanguageModel:
    """Load a pre-training checkpoint (a plain state dict) into ``model``; refuse any key mismatch."""
    if path:
        try:
            state = torch.load(path, weights_only=True, map_location="cpu")
        except FileNotFoundError as exc:
            raise ValueError(f"pretrained checkpoint {path} does not exist in this cluster") from exc
        try:
            missing, unexpected = model.load_state_dict(state, strict=False)
        except RuntimeError as exc:
            first = str(exc).splitlines()[1].strip() if "\n" in str(exc) else str(exc)
            raise ValueError(f"pretrained checkpoint {path} does not fit the model: {first}") from exc
        if missing or unexpected:
            raise ValueError(
                f"pretrained checkpoint {path} does not fit the model: missing {sorted(missing)[:4]}, "
                f"unexpected {sorted(unexpected)[:4]} (same d_model/n_layers/vocab as the pre-training job?)"
            )
    return model


def language_model_like(state: dict[str, torch.Tensor], n_heads: int, causal: bool) -> LanguageModel:
    """An empty ``LanguageModel`` of the shape an adapter stage's state dict holds (its ``plm.*`` weights).

    The vocabulary, width, length and depth are read from the weights, so a stage that loads a saved
    model needs only the head count, which no weight's shape gives away.
    """
    vocab, d_model = state["plm.embed.weight"].shape
    length = state["plm.position"].shape[0]
    layers = len({key.split(".")[2] for key in state if key.startswith("plm.blocks.")})
    return LanguageModel(vocab, length, d_model, n_heads, layers, causal=causal)


class AdapterTransformerEncoder(nn.Module):
    """Cluster S: the frozen pre-trained encoder with a trainable adapter after each sub-layer."""

    def __init__(self, plm: LanguageModel, bottleneck: int) -> None:
        super().__init__()
        if plm.causal:
            raise ValueError("the ABNet encoder needs a bidirectional (masked) language model")
        self.plm = freeze(plm)
        d_model = plm.embed.embedding_dim
        self.attn_adapters = nn.ModuleList(Adapter(d_model, bottleneck) for _ in plm.blocks)
        self.ff_adapters = nn.ModuleList(Adapter(d_model, bottleneck) for _ in plm.blocks)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Encoder states to send to T; padding rows are exactly zero (T masks them)."""
        padding = ids == PAD
        h = self.plm.embed_ids(ids)
        for block, after_attn, after_ff in zip(
            self.plm.blocks, self.attn_adapters, self.ff_adapters, strict=True
        ):
            h = after_attn(block.attention(h, padding))
            h = after_ff(block.feed_forward(h))
        return self.plm.norm(h) * (~padding).unsqueeze(-1)


def memory_padding(memory: torch.Tensor) -> torch.Tensor:
    """Padding positions of received encoder states: the rows S zeroed."""
    padding = memory.detach().abs().amax(dim=-1) == 0
    padding[:, 0] = False  # never mask a whole row (an empty source still has its EOS state)
    return padding


NO_REPEAT_NGRAM = 3
"""Greedy decoding's default repetition guard: no 3-gram twice in one output (the product's and Table 5's)."""


def repeated_ngram_mask(ids: torch.Tensor, n: int, vocab: int) -> torch.Tensor:
    """``[batch, vocab]``: True for each next token that would complete an ``n``-gram already in ``ids``.

    ``ids`` is ``[batch, length]``, the tokens emitted so far. For each earlier position whose
    ``n - 1`` tokens equal the row's last ``n - 1``, the token that followed them is banned.
    """
    mask = torch.zeros(ids.shape[0], vocab, dtype=torch.bool)
    if ids.shape[1] < n:
        return mask
    windows = ids.unfold(1, n, 1)  # [batch, positions, n]
    if n > 1:
        seen = (windows[:, :, :-1] == ids[:, None, ids.shape[1] - n + 1 :]).all(dim=-1)
    else:
        seen = torch.ones(windows.shape[:2], dtype=torch.bool)
    hits = torch.zeros(ids.shape[0], vocab)
    hits.scatter_add_(1, windows[:, :, -1], seen.float())
    return hits > 0


class TranslationDecoding:
    """Loss and greedy decoding of a decoder stage, given ``self(ids, memory) -> logits``.

    Shared by the decoder built from code (AdapterTransformerDecoder) and the one started from a
    Hugging Face-format directory (hf_adapters.PretrainedAdapterDecoder): both are scored the same.
    """

    def loss(self, memory: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Teacher-forced cross-entropy of the next English token given the Spanish encoder states."""
        if memory.shape[0] != target.shape[0]:
            raise ValueError(f"{memory.shape[0]} encoder states arrived for {target.shape[0]} targets")
        logits = self(target[:, :-1], memory)
        return nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), target[:, 1:].reshape(-1), ignore_index=PAD
        )

    @torch.no_grad()
    def greedy(
        self,
        memory: torch.Tensor,
        max_length: int,
        *,
        ban_unknown: bool = False,
        no_repeat_ngram: int = NO_REPEAT_NGRAM,
    ) -> torch.Tensor:
        """Greedy decoding: ids (BOS first) of the most likely next token until EOS or ``max_length``.

        ``ban_unknown``: never emit UNK (it is dropped from the text, so it can never match a reference
        word; the next most likely token might) -- what the Table 5 benchmark scores.
        ``no_repeat_ngram``: the repetition guard -- never emit a token that would repeat an n-gram
        of this length already in the row's output (1: no token twice; 0: no guard), so a decoder
        that falls back on its LM cannot loop ("the use of the use of ...").
        """
        if no_repeat_ngram < 0:
            raise ValueError(f"no_repeat_ngram must be >= 0, got {no_repeat_ngram}")
        ids = torch.full((memory.shape[0], 1), BOS, dtype=torch.long)
        finished = torch.zeros(memory.shape[0], dtype=torch.bool)
        banned = [PAD, BOS, MASK, UNK] if ban_unknown else [PAD, BOS, MASK]
        for _ in range(max_length - 1):
            logits = self(ids, memory)[:, -1]
            logits[:, banned] = float("-inf")
            if no_repeat_ngram:
                logits[repeated_ngram_mask(ids[:, 1:], no_repeat_ngram, logits.shape[-1])] = float("-inf")
            token = logits.argmax(dim=-1).masked_fill(finished, PAD)
            ids = torch.cat([ids, token.unsqueeze(1)], dim=1)
            finished |= token == EOS
            if bool(finished.all()):
                break
        return ids


class AdapterTransformerDecoder(TranslationDecoding, nn.Module):
    """Cluster T: the frozen pre-trained causal LM with a trainable cross-attention adapter per block."""

    def __init__(self, plm: LanguageModel, n_heads: int, bottleneck: int) -> None:
        super().__init__()
        if not plm.causal:
            raise ValueError("the ABNet decoder needs a causal language model")
        self.plm = freeze(plm)
        d_model = plm.embed.embedding_dim
        self.adapters = nn.ModuleList(CrossAdapter(d_model, n_heads, bottleneck) for _ in plm.blocks)

    def forward(self, ids: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        padding = ids == PAD
        source_padding = memory_padding(memory)
        h = self.plm.embed_ids(ids)
        for block, adapter in zip(self.plm.blocks, self.adapters, strict=True):
            h = adapter(block(h, padding), memory, source_padding)
        return self.plm.head(self.plm.norm(h))


def mlm_loss(model: LanguageModel, ids: torch.Tensor, mask_prob: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked-LM loss on ``ids`` (BERT-style [MASK] only) and each example's loss (detached).

    The mask positions come from a random stream seeded by the batch's content,
    so re-running a step draws the same masks.
    """
    rng = torch.Generator().manual_seed(int((ids * torch.arange(1, ids.numel() + 1).view_as(ids)).sum()))
    real = (ids != PAD) & (ids != EOS)
    masked = (torch.rand(ids.shape, generator=rng) < mask_prob) & real
    masked[:, 0] |= ~masked.any(dim=1)  # at least one masked token per row
    logits = model(ids.masked_fill(masked, MASK))
    per_token = nn.functional.cross_entropy(logits.transpose(1, 2), ids, reduction="none") * masked
    per_example = per_token.sum(dim=1) / masked.sum(dim=1).clamp(min=1)
    return per_token.sum() / masked.sum(), per_example.detach()


def lm_loss(model: LanguageModel, ids: torch.Tensor) -> torch.Tensor:
    """Causal LM loss: each next token given the ones before it."""
    logits = model(ids[:, :-1])
    return nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), ignore_index=PAD
    )
