"""A Llama-style decoder in plain torch whose attention reads and writes a paged KV arena.

    tokens of all requests, packed [T] ─▶ embed ─▶ N x (RMSNorm ▸ GQA attention ▸ RMSNorm ▸ SwiGLU) ─▶ RMSNorm ▸ lm_head
                                                      │ write K,V of the step's new positions into their blocks,
                                                      ▼ then one attention call for all requests (paged_attention)

Linear layers and attention both run on all requests at once; what each
request reads and writes is in the step's PagedLayout. K is stored after
rotary embedding. Covers the llama, qwen2 and mistral families (q/k/v and
o_proj biases, tied embeddings, RoPE scalings, sliding windows) as
ModelConfig describes them. Parameter names follow HF's layout without the
leading `model.`. Knows nothing of pools, keys, sampling or scheduling.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from prefixpool.model.config import ModelConfig
from prefixpool.engine.paged_attention import PagedLayout, attend, store
from prefixpool.engine.rotary import Rotary, rotate


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return normed.mul_(self.weight)  # a fresh tensor: scaled in place (one 2k x hidden copy less)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.window = config.window(layer)
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, config.num_heads * config.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_kv_heads * config.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_kv_heads * config.head_dim, bias=bias)
        self.o_proj = nn.Linear(config.num_heads * config.head_dim, config.hidden_size, bias=config.o_proj_bias)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], layout: PagedLayout,
                masks: dict[int | None, torch.Tensor | None], kv: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        q = rotate(self.q_proj(x).view(rows, self.num_heads, self.head_dim), *rope)
        k = rotate(self.k_proj(x).view(rows, self.num_kv_heads, self.head_dim), *rope)
        v = self.v_proj(x).view(rows, self.num_kv_heads, self.head_dim)
        layer_kv = kv[:, self.layer]
        store(layer_kv, layout, k, v)
        out = attend(q, k, v, layer_kv, layout, masks[self.window])
        return self.o_proj(out.reshape(rows, -1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # in place: two [rows, intermediate] tensors less
        return self.down_proj(F.silu(self.gate_proj(x), inplace=True).mul_(self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], layout: PagedLayout,
                masks: dict[int | None, torch.Tensor | None], kv: torch.Tensor) -> torch.Tensor:
        # residuals added into the sublayer's fresh output: same sums, no new [rows, hidden] tensor
        x = self.self_attn(self.input_layernorm(x), rope, layout, masks, kv).add_(x)
        return self.mlp(self.post_attention_layernorm(x)).add_(x)


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
        self.rotary = Rotary(config.head_dim, config.rope_theta, config.rope_scaling)
        self._head: tuple[tuple[int, int, torch.dtype], torch.Tensor] | None = None  # see logits()

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, layout: PagedLayout,
                kv: torch.Tensor, logit_rows: torch.Tensor) -> torch.Tensor:
        """Run packed `tokens` through every layer; return fp32 logits of `logit_rows` only."""
        x = self.embed_tokens(tokens)
        rope = self.rotary.cos_sin(positions, x.dtype)
        groups = self.config.num_heads // self.config.num_kv_heads
        windows = {self.config.window(i) for i in range(len(self.layers))}
        masks = {window: layout.mask(window, groups, x.dtype) for window in windows}
        for layer in self.layers:
            x = layer(x, rope, layout, masks, kv)
        return self.logits(self.norm(x[logit_rows])).float()

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """lm_head(x), as x @ a contiguous [hidden, vocab] copy of its weight.

        On this CPU (MKL, one thread) that is about 30% faster than nn.Linear's
        transposed [vocab, hidden] weight at decode batch sizes, where the vocab
        projection is a quarter of a step (measured); it costs a second copy of the
        lm_head weight. The copy is remade when the weight changes (loaded, cast, moved).
        """
        weight = self.lm_head.weight
        version = (weight.data_ptr(), weight._version, weight.dtype)
        if self._head is None or self._head[0] != version:
            self._head = (version, weight.detach().t().contiguous())
        return x @ self._head[1]
