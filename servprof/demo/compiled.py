"""The demo's decode step under torch.compile (``--compile``), the way servers run it.

Compiled with static shapes (``dynamic=False``) except the attention span, which grows by
one every step and is marked dynamic. A decode batch is padded to the next of a few bucket
sizes (1, 2, 4, 8, ... up to the slots), and every bucket is compiled once at start-up, so
serving never compiles. Padded rows repeat the batch's last row: they write the same keys
and values to the same cache positions as that row, and their logits are dropped.

Fault knob ``unpadded_batches``: run each batch at its own size. Every size outside the
warmed-up buckets then compiles the model again, inside a serving step (Dynamo's guard on
dimension 0 fails), which is what servprof's recompilation detector names.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from servprof.demo.model import CacheView, LlamaLikeModel


def bucket_sizes(max_batch: int) -> list[int]:
    sizes = [1 << i for i in range(max_batch.bit_length()) if 1 << i <= max_batch]
    return sizes if sizes[-1] == max_batch else [*sizes, max_batch]


class CompiledDecode:
    """Drop-in for ``LlamaLikeModel.decode`` that runs a compiled forward."""

    def __init__(self, model: LlamaLikeModel, backend: str = "inductor", pad: bool = True) -> None:
        import torch._dynamo

        self.model, self.pad = model, pad
        self.buckets = bucket_sizes(model.slots)
        self._configured = threading.local()
        self._step = torch.compile(self._forward, dynamic=False, backend=backend)

    def _configure_thread(self) -> None:
        # One compiled graph per batch size the server may run: without padding that is every
        # size up to the slots, more than Dynamo's default limit of 8 per function. (torch 2.13's
        # dynamo config is per thread: set on the thread that calls the compiled function.)
        import torch._dynamo

        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, self.model.slots + 1)
        self._configured.done = True

    def _forward(self, tokens: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor,
                 attn_mask: torch.Tensor) -> torch.Tensor:
        view = CacheView(slots, lengths[:, None], attn_mask.shape[-1], None)
        return self.model._run(tokens[:, None], view, attn_mask)

    def __call__(self, tokens: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor, max_length: int,
                 rows: slice | None = None) -> torch.Tensor:
        if not getattr(self._configured, "done", False):
            self._configure_thread()
        batch = tokens.shape[0]
        size = next((b for b in self.buckets if b >= batch), batch) if self.pad else batch
        if size > batch:
            tokens, slots, lengths = (torch.cat([t, t[-1:].expand(size - batch)]) for t in (tokens, slots, lengths))
        visible = torch.arange(max_length, device=tokens.device)[None, :] <= lengths[:, None]
        attn_mask = visible[:, None, None, :]
        torch._dynamo.mark_dynamic(attn_mask, 3)  # the span grows every step: one graph for all of them
        return self._step(tokens, slots, lengths, attn_mask)[:batch]

    @torch.inference_mode()
    def warm_up(self) -> list[int]:
        """Compile every bucket size before serving (slot 0, position 1: the cache is not in use yet)."""
        device = self.model.device
        for size in self.buckets:
            # Three distinct tensors, as serving passes: the same one twice would add an aliasing guard.
            tokens, slots, lengths = (torch.full((size,), fill, dtype=torch.long, device=device) for fill in (0, 0, 1))
            self(tokens, slots, lengths, 2)
        return self.buckets

    def info(self) -> dict[str, Any]:
        """For /demo/stats: the buckets, and torch's own record of every compile in this process."""
        from torch._dynamo.utils import get_compilation_metrics

        compiles = [{"compile_id": m.compile_id, "function": m.co_name,
                     "duration_ms": (m.duration_us or 0) / 1e3, "reason": m.recompile_reason}
                    for m in get_compilation_metrics()]
        return {"buckets": self.buckets, "padded": self.pad, "torch_compiles": compiles}
