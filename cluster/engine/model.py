"""A Llama-style decoder in plain torch whose attention reads and writes a paged KV arena.

    tokens of all spans, packed [T] ─▶ embed ─▶ N x (RMSNorm ▸ GQA attention ▸ RMSNorm ▸ SwiGLU) ─▶ RMSNorm ▸ lm_head
                                                      │ per span: write K,V of its new positions into its blocks,
                                                      ▼ then attend over positions [0, end) read back from the blocks

A span is one request's slice of a step: positions [start, end) of its
sequence, its block table, and from which position its K,V must be stored
(positions below `store_from` are already in the arena). Linear layers run
on all spans' tokens at once; attention runs span by span. K is stored after
rotary embedding. Parameter names follow HF's Llama / Qwen2 layout without
the leading `model.`. Knows nothing of pools, keys, sampling or scheduling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from cluster.engine.model_config import ModelConfig


@dataclass(frozen=True, slots=True)
class Span:
    offset: int              # first row of this span in the packed tokens
    start: int               # sequence position of that row
    end: int                 # one past the last position computed
    store_from: int          # positions >= store_from get their K,V written
    block_ids: torch.Tensor  # int64 on the arena's device, covering positions [0, end)

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Rotary(nn.Module):
    """Rotary embeddings in HF's rotate-half layout.

    The tables are plain fp32 attributes, not buffers, so casting the model to
    bf16 (or building it on the meta device) leaves them exact; they follow
    the input to its device on first use.
    """

    def __init__(self, head_dim: int, max_position: int, theta: float) -> None:
        super().__init__()
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim
        angles = torch.outer(torch.arange(max_position, dtype=torch.float64, device="cpu"), 1.0 / theta**exponents)
        angles = torch.cat([angles, angles], dim=-1)
        self.cos, self.sin = angles.cos().float(), angles.sin().float()

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.cos.device != positions.device:
            self.cos, self.sin = self.cos.to(positions.device), self.sin.to(positions.device)
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        x32 = x.float()
        half = x32.shape[-1] // 2
        rotated = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)
        return (x32 * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, config.num_heads * config.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_kv_heads * config.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_kv_heads * config.head_dim, bias=bias)
        self.o_proj = nn.Linear(config.num_heads * config.head_dim, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary,
                spans: list[Span], kv: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        q = rotary(self.q_proj(x).view(rows, self.num_heads, self.head_dim), positions)
        k = rotary(self.k_proj(x).view(rows, self.num_kv_heads, self.head_dim), positions)
        v = self.v_proj(x).view(rows, self.num_kv_heads, self.head_dim)
        out = torch.empty_like(q)
        for span in spans:
            self._store(span, k, v, kv)
            rows_of = slice(span.offset, span.offset + span.num_tokens)
            out[rows_of] = self._attend(span, q[rows_of], kv)
        return self.o_proj(out.view(rows, -1))

    def _store(self, span: Span, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor) -> None:
        first = max(span.start, span.store_from)
        if first >= span.end:
            return
        block_size = kv.shape[3]
        positions = torch.arange(first, span.end, device=kv.device)
        blocks, slots = span.block_ids[positions // block_size], positions % block_size
        rows = slice(span.offset + first - span.start, span.offset + span.num_tokens)
        kv[blocks, self.layer, 0, slots] = k[rows]
        kv[blocks, self.layer, 1, slots] = v[rows]

    def _attend(self, span: Span, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """q [n, heads, dim] at positions [start, end) against K,V of positions [0, end)."""
        layer_kv = kv[span.block_ids, self.layer]                  # [blocks, 2, block_size, kv_heads, dim]
        keys = layer_kv[:, 0].flatten(0, 1)[: span.end].transpose(0, 1)
        values = layer_kv[:, 1].flatten(0, 1)[: span.end].transpose(0, 1)
        query = q.transpose(0, 1)
        if span.start == 0:
            out = F.scaled_dot_product_attention(query, keys, values, is_causal=True, enable_gqa=True)
        else:
            query_pos = torch.arange(span.start, span.end, device=kv.device).unsqueeze(1)
            mask = torch.arange(span.end, device=kv.device).unsqueeze(0) <= query_pos
            out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, enable_gqa=True)
        return out.transpose(0, 1)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary,
                spans: list[Span], kv: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, rotary, spans, kv)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = Rotary(config.head_dim, config.max_position, config.rope_theta)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, spans: list[Span],
                kv: torch.Tensor, logit_rows: torch.Tensor) -> torch.Tensor:
        """Run packed `tokens` through every layer; return fp32 logits of `logit_rows` only."""
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x, positions, self.rotary, spans, kv)
        return self.lm_head(self.norm(x[logit_rows])).float()
