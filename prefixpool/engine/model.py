"""A Llama-style decoder in plain torch whose attention reads and writes a paged KV arena.

    tokens of all requests, packed [T] ─▶ embed ─▶ N x (RMSNorm ▸ GQA attention ▸ RMSNorm ▸ SwiGLU) ─▶ RMSNorm ▸ lm_head
                                                      │ write K,V of the step's new positions into their blocks,
                                                      ▼ then one attention call for all requests (paged_attention)

Linear layers and attention both run on all requests at once, in the shapes
the step's kernels choose (prefixpool/engine/kernels.py: the whole step per
call, or fixed tiles in the batch-invariant mode); what each request reads
and writes is in the step's PagedLayout. K is stored after
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
from prefixpool.engine.kernels import STANDARD, Kernels, StepAttention
from prefixpool.engine.paged_attention import PagedLayout, store
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

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q [rows, heads, dim], k and v [rows, kv_heads, dim] of normed x, q and k rotated: per token."""
        rows = x.shape[0]
        q = rotate(self.q_proj(x).view(rows, self.num_heads, self.head_dim), cos, sin)
        k = rotate(self.k_proj(x).view(rows, self.num_kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(rows, self.num_kv_heads, self.head_dim)
        return q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PagedLayout,
               attention: StepAttention, kv: torch.Tensor) -> torch.Tensor:
        """Store this step's K,V in the arena, then every query against its context: [rows, heads * dim]."""
        layer_kv = kv[:, self.layer]
        store(layer_kv, layout, k, v)
        return attention.attend(q, k, v, layer_kv, self.window).reshape(q.shape[0], -1)


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
                attention: StepAttention, kv: torch.Tensor, kernels: Kernels) -> torch.Tensor:
        q, k, v = kernels.rows(self._project, x, *rope)
        return kernels.rows(self._finish, self.self_attn.attend(q, k, v, layout, attention, kv), x)

    def _project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.self_attn.project(self.input_layernorm(x), cos, sin)

    def _finish(self, attended: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # residuals added into the sublayer's fresh output: same sums, no new [rows, hidden] tensor
        x = self.self_attn.o_proj(attended).add_(x)
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
                kv: torch.Tensor, logit_rows: torch.Tensor, kernels: Kernels = STANDARD) -> torch.Tensor:
        """Run packed `tokens` through every layer; return fp32 logits of `logit_rows` only.

        `kernels` decide the shapes the work runs in (prefixpool/engine/kernels.py): the
        standard ones, or the batch-invariant ones whose results do not depend on the batch.
        """
        x = self.embed_tokens(tokens)
        rope = kernels.rows(lambda p: self.rotary.cos_sin(p, x.dtype), positions)
        groups = self.config.num_heads // self.config.num_kv_heads
        windows = {self.config.window(i) for i in range(len(self.layers))}
        attention = kernels.attention(layout, windows, groups, x.dtype, block_size=kv.shape[3])
        for layer in self.layers:
            x = layer(x, rope, layout, attention, kv, kernels)
        return kernels.rows(lambda h: self.logits(self.norm(h)), x[logit_rows]).float()

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
