"""Batched token sampling on the model's device: temperature, top-p and per-request seeds.

Everything stays on the device (no `.item()`), so sampling adds no host-device
synchronisation to a decode step. Per-slot parameters live in device tables
written once at admission, so a step uploads nothing but the slot indices.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens whatever the model says


class SlotSampler:
    """Samples one token per active slot from a batch of logits."""

    def __init__(self, slots: int, vocab_limit: int, device: torch.device):
        self.vocab_limit = vocab_limit  # logits past the tokenizer's vocabulary are never sampled
        self.device = device
        self.temperature = torch.ones(slots, device=device)
        self.top_p = torch.ones(slots, device=device)
        self.greedy = torch.zeros(slots, dtype=torch.bool, device=device)
        self.generators: dict[int, torch.Generator] = {}
        self.greedy_slots: set[int] = set()
        self.top_p_slots: set[int] = set()
        self._shared = torch.Generator(device=device)
        # Fresh entropy without touching torch's global RNG (other code may rely on its seed).
        self._shared.manual_seed(int.from_bytes(os.urandom(8), "little"))

    def assign(self, slot: int, params: SamplingParams) -> None:
        self.temperature[slot] = max(params.temperature, 1e-5)
        self.top_p[slot] = params.top_p
        self.greedy[slot] = params.temperature == 0
        self.greedy_slots.discard(slot)
        self.top_p_slots.discard(slot)
        self.generators.pop(slot, None)
        if params.temperature == 0:
            self.greedy_slots.add(slot)
        if params.top_p < 1.0:
            self.top_p_slots.add(slot)
        if params.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
            self.generators[slot] = generator

    def sample(self, logits: torch.Tensor, slots: list[int], slot_index: torch.Tensor) -> torch.Tensor:
        """logits [B, V] for `slots` (host list, same order as the device tensor `slot_index`)."""
        logits = logits[:, : self.vocab_limit].float()
        if all(slot in self.greedy_slots for slot in slots):
            return logits.argmax(dim=-1)
        probs = torch.softmax(logits / self.temperature[slot_index][:, None], dim=-1)
        if any(slot in self.top_p_slots for slot in slots):
            probs = _top_p_filter(probs, self.top_p[slot_index])
        # Exponential-race sampling (argmax of p / Exp(1)) equals multinomial sampling
        # and lets seeded rows draw their noise from their own generator.
        uniform = torch.rand(probs.shape, device=probs.device, generator=self._shared)
        for row, slot in enumerate(slots):
            generator = self.generators.get(slot)
            if generator is not None:
                uniform[row] = torch.rand(probs.shape[1], device=probs.device, generator=generator)
        noise = -torch.log(uniform.clamp_min(1e-20))
        sampled = (probs / noise).argmax(dim=-1)
        if self.greedy_slots.intersection(slots):
            sampled = torch.where(self.greedy[slot_index], logits.argmax(dim=-1), sampled)
        return sampled


def _top_p_filter(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    outside = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p[:, None]
    sorted_probs = sorted_probs.masked_fill(outside, 0.0)
    return torch.zeros_like(probs).scatter(-1, order, sorted_probs)
