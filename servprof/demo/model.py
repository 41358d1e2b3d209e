"""A Llama-shaped decoder-only transformer with a slot-based KV cache.

Seeded random weights: the kernels and their cost are what the demo needs, not
the words. The KV cache is one tensor per layer shaped
[slots, kv_heads, context, head_dim]; a request owns one slot while it runs.
A decode step takes the active slots (any subset, each at its own length) and
runs every projection, MLP and LM-head GEMM once for the whole batch, with a
padding mask in attention, which is what batched decode looks like on a real
server and what the bandwidth detector looks at.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

# scaled_dot_product_attention takes enable_gqa from torch 2.5 on.
_SDPA_HAS_GQA = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5)


@dataclass(frozen=True)
class ModelConfig:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    # Llama-3 rope scaling as (factor, low_freq_factor, high_freq_factor, original context); None = plain.
    rope_scaling: tuple[float, float, float, int] | None = None

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


# Named sizes. The vocabulary is the model's own (LM-head width); logits past the
# tokenizer's vocabulary are masked when sampling, so the GEMM keeps its real shape.
SIZES: dict[str, ModelConfig] = {
    "tiny": ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=192, vocab_size=4096),
    "small": ModelConfig(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=1536, vocab_size=32768),
    # Llama-3.2-1B-like shapes (its real vocabulary is 128256; 32768 keeps it ~1.1B).
    "1b": ModelConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, vocab_size=32768),
}


def model_config(size: str, min_vocab: int = 0) -> ModelConfig:
    if size not in SIZES:
        raise ValueError(f"unknown model size {size!r}; choose one of {', '.join(SIZES)}")
    config = SIZES[size]
    if config.vocab_size < min_vocab:
        config = replace(config, vocab_size=-(-min_vocab // 64) * 64)
    return config


def count_parameters(config: ModelConfig) -> int:
    attn = config.dim * config.head_dim * (2 * config.n_heads + 2 * config.n_kv_heads)
    mlp = 3 * config.dim * config.ffn_dim
    per_layer = attn + mlp + 2 * config.dim
    return config.n_layers * per_layer + 2 * config.vocab_size * config.dim + config.dim


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


def rotary_tables(
    config: ModelConfig, context: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    half = config.head_dim // 2
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(half, device=device, dtype=torch.float32) / half))
    if config.rope_scaling is not None:
        inv_freq = _llama3_scaled(inv_freq, *config.rope_scaling)
    angles = torch.outer(torch.arange(context, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def _llama3_scaled(
    inv_freq: torch.Tensor,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_context: int,
) -> torch.Tensor:
    # Llama 3.1+ stretches long wavelengths by `factor`, keeps short ones, and blends between.
    wavelength = 2 * math.pi / inv_freq
    low_freq_wavelength = original_context / low_freq_factor
    high_freq_wavelength = original_context / high_freq_factor
    scaled = torch.where(wavelength > low_freq_wavelength, inv_freq / factor, inv_freq)
    smooth = (original_context / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= high_freq_wavelength) & (wavelength <= low_freq_wavelength)
    return torch.where(medium, blended, scaled)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [batch, heads, seq, head_dim]; cos/sin: [batch, 1, seq, head_dim/2]."""
    first, second = x.float().chunk(2, dim=-1)
    rotated = torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)
    return rotated.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * config.head_dim, bias=False)
        self.wkv = nn.Linear(config.dim, 2 * config.n_kv_heads * config.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, step: ForwardStep, layer: int) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)
        kv = self.wkv(x).view(batch, seq, 2, self.n_kv_heads, self.head_dim)
        k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
        q, k = apply_rotary(q, step.cos, step.sin), apply_rotary(k, step.cos, step.sin)
        keys, values = step.cache.write_and_read(layer, step.view, k, v)
        attn_mask = step.attn_mask
        gqa: dict[str, bool] = {}
        groups = self.n_heads // self.n_kv_heads
        if groups > 1 and _SDPA_HAS_GQA:
            gqa["enable_gqa"] = True  # the kernel shares each KV head across its query heads
        elif groups > 1:  # torch < 2.5: copy the KV heads instead
            keys = keys.repeat_interleave(groups, dim=1)
            values = values.repeat_interleave(groups, dim=1)
        if attn_mask is None:  # prefill of one request: plain causal attention
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, **gqa)
        else:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=attn_mask, **gqa)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_up = nn.Linear(config.dim, 2 * config.ffn_dim, bias=False)
        self.down = nn.Linear(config.ffn_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(config.dim, config.norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.dim, config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, step: ForwardStep, layer: int) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), step, layer)
        return x + self.mlp(self.mlp_norm(x))


@dataclass(frozen=True)
class CacheView:
    """Which cache rows a forward pass uses: `slots` [B] (device), `positions` [B, seq] to
    write, `span` positions to attend over, and `rows` when the slots are consecutive."""

    slots: torch.Tensor
    positions: torch.Tensor
    span: int
    rows: slice | None = None


@dataclass(frozen=True)
class ForwardStep:
    """What every layer of one forward pass shares: rotary tables at the view's positions,
    the cache and which rows of it, and the attention mask (None: causal prefill)."""

    cos: torch.Tensor
    sin: torch.Tensor
    cache: KVCache
    view: CacheView
    attn_mask: torch.Tensor | None


class KVCache:
    """Keys and values for `slots` concurrent requests, up to `context` positions each."""

    def __init__(
        self, config: ModelConfig, slots: int, context: int, device: torch.device, dtype: torch.dtype
    ):
        shape = (slots, config.n_kv_heads, context, config.head_dim)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layers)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layers)]
        self.slots, self.context = slots, context

    def write_and_read(
        self, layer: int, view: CacheView, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k/v ([batch, kv_heads, seq, hd]) at the view's positions of its slots;
        return the cached keys/values of those slots up to `view.span` positions."""
        keys_cache, values_cache = self.keys[layer], self.values[layer]
        slot_index = view.slots[:, None].expand_as(view.positions)
        keys_cache[slot_index, :, view.positions] = k.transpose(1, 2)
        values_cache[slot_index, :, view.positions] = v.transpose(1, 2)
        if view.rows is not None:  # consecutive slots: a view of the cache, nothing copied
            return keys_cache[view.rows, :, : view.span], values_cache[view.rows, :, : view.span]
        return keys_cache[view.slots, :, : view.span], values_cache[view.slots, :, : view.span]


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)

    @torch.no_grad()
    def init_random(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                fan_in = param.shape[-1]
                param.copy_(torch.randn(param.shape, generator=generator) / math.sqrt(fan_in))


class LlamaLikeModel:
    """The model plus its KV cache and rotary tables; prefill and batched decode."""

    def __init__(
        self,
        config: ModelConfig,
        slots: int,
        context: int,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        state_dict: dict[str, torch.Tensor] | None = None,
    ):
        self.config, self.slots, self.context = config, slots, context
        self.device, self.dtype = torch.device(device), dtype
        module = Transformer(config)
        if state_dict is None:
            module.init_random(seed)
        else:  # real weights (servprof.demo.hf), named as Transformer names them
            module.load_state_dict(state_dict, strict=True)
        self.module = module.to(device=self.device, dtype=dtype).eval()
        self.cache = KVCache(config, slots, context, self.device, dtype)
        self.cos, self.sin = rotary_tables(config, context, self.device)
        self.slot_ids = torch.arange(slots, device=self.device)

    def _run(self, tokens: torch.Tensor, view: CacheView, attn_mask: torch.Tensor | None) -> torch.Tensor:
        step = ForwardStep(self.cos[view.positions][:, None], self.sin[view.positions][:, None], self.cache,
                           view, attn_mask)
        x = self.module.embed(tokens)
        for index, block in enumerate(self.module.layers):
            x = block(x, step, index)
        return self.module.lm_head(self.module.norm(x[:, -1]))

    @torch.inference_mode()
    def prefill(self, slot: int, prompt: torch.Tensor) -> torch.Tensor:
        """Fill `slot`'s cache with `prompt` (1-D token tensor); logits of the last position."""
        length = prompt.shape[0]
        slots = self.slot_ids[slot : slot + 1]  # a view of a device tensor: no host-to-device copy
        positions = torch.arange(length, device=self.device)[None]
        view = CacheView(slots, positions, length, slice(slot, slot + 1))
        return self._run(prompt[None].to(self.device), view, None)[0]

    @torch.inference_mode()
    def decode(
        self,
        tokens: torch.Tensor,
        slots: torch.Tensor,
        lengths: torch.Tensor,
        max_length: int,
        rows: slice | None = None,
    ) -> torch.Tensor:
        """One step for a batch: `tokens` [B] at position `lengths` [B] of `slots` [B].
        `max_length` (a host int, the longest length + 1) bounds attention without a sync;
        `rows` (slots[0]..slots[-1] when they are consecutive) lets attention read the cache in place."""
        visible = torch.arange(max_length, device=self.device)[None, :] <= lengths[:, None]
        attn_mask = visible[:, None, None, :]  # [B, 1, 1, span]: each row sees its own prefix
        view = CacheView(slots, lengths[:, None], max_length, rows)
        return self._run(tokens[:, None], view, attn_mask)
