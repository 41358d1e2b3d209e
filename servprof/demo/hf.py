"""Serve a local Hugging Face Llama-family checkpoint through the demo's own batched model.

`--model-path DIR` reads DIR with transformers (`local_files_only=True`: nothing is
ever downloaded), checks that the architecture is one the demo model computes exactly
(Llama / Mistral shapes: RMSNorm, rotary with optional Llama-3 scaling, GQA, SiLU-gated
MLP, no biases), and copies the weights into `LlamaLikeModel`, so decode stays batched
over the slot KV cache. The tokenizer is DIR/tokenizer.json through `tokenizers`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from servprof.demo.model import LlamaLikeModel, ModelConfig
from servprof.demo.tokenizer import DemoTokenizer

SUPPORTED_TYPES = ("llama", "mistral")


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ValueError("--model-path needs transformers: pip install 'servprof[hf]'") from None
    return transformers


def model_config_from_hf(hf_config: Any) -> ModelConfig:
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_TYPES:
        raise ValueError(
            f"model type {model_type!r} is not supported by the demo model "
            f"(supported: {', '.join(SUPPORTED_TYPES)})"
        )
    problems = []
    if getattr(hf_config, "attention_bias", False) or getattr(hf_config, "mlp_bias", False):
        problems.append("biases in attention or MLP")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        problems.append(f"activation {hf_config.hidden_act}")
    n_heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // n_heads
    if head_dim * n_heads != hf_config.hidden_size:
        problems.append("head_dim * heads != hidden size")
    rope = getattr(hf_config, "rope_scaling", None) or getattr(hf_config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        problems.append(f"rope scaling {rope_type!r}")
    if getattr(hf_config, "sliding_window", None):
        problems.append("sliding-window attention")
    if problems:
        raise ValueError("the demo model cannot compute this checkpoint exactly: " + ", ".join(problems))
    scaling = None
    if rope_type == "llama3":
        scaling = (
            float(rope["factor"]),
            float(rope["low_freq_factor"]),
            float(rope["high_freq_factor"]),
            int(rope["original_max_position_embeddings"]),
        )
    theta = rope.get("rope_theta") or getattr(hf_config, "rope_theta", None) or 10000.0
    return ModelConfig(
        dim=hf_config.hidden_size,
        n_layers=hf_config.num_hidden_layers,
        n_heads=n_heads,
        n_kv_heads=getattr(hf_config, "num_key_value_heads", None) or n_heads,
        ffn_dim=hf_config.intermediate_size,
        vocab_size=hf_config.vocab_size,
        rope_theta=float(theta),
        norm_eps=float(hf_config.rms_norm_eps),
        rope_scaling=scaling,
    )


def state_dict_from_hf(hf_model: Any, n_layers: int) -> dict[str, torch.Tensor]:
    """HF parameter names -> LlamaLikeModel's (K/V and gate/up projections fused)."""
    source = {name.removeprefix("model."): tensor for name, tensor in hf_model.state_dict().items()}
    weights = {
        "embed.weight": source["embed_tokens.weight"],
        "norm.weight": source["norm.weight"],
        "lm_head.weight": hf_model.get_output_embeddings().weight,
    }
    for i in range(n_layers):
        layer = f"layers.{i}."
        weights[layer + "attn_norm.weight"] = source[layer + "input_layernorm.weight"]
        weights[layer + "mlp_norm.weight"] = source[layer + "post_attention_layernorm.weight"]
        weights[layer + "attn.wq.weight"] = source[layer + "self_attn.q_proj.weight"]
        weights[layer + "attn.wkv.weight"] = torch.cat(
            [source[layer + "self_attn.k_proj.weight"], source[layer + "self_attn.v_proj.weight"]]
        )
        weights[layer + "attn.wo.weight"] = source[layer + "self_attn.o_proj.weight"]
        weights[layer + "mlp.gate_up.weight"] = torch.cat(
            [source[layer + "mlp.gate_proj.weight"], source[layer + "mlp.up_proj.weight"]]
        )
        weights[layer + "mlp.down.weight"] = source[layer + "mlp.down_proj.weight"]
    return weights


def load_hf(
    path: str, *, slots: int, context: int, device: str, dtype: torch.dtype, slow_us_per_token: float = 0.0
) -> tuple[LlamaLikeModel, DemoTokenizer]:
    directory = Path(path).expanduser()
    if not (directory / "config.json").is_file():
        raise ValueError(f"--model-path {path}: no config.json there (a local Hugging Face model directory)")
    if not (directory / "tokenizer.json").is_file():
        raise ValueError(
            f"--model-path {path}: no tokenizer.json there (the demo reads it with `tokenizers`)"
        )
    transformers = _transformers()
    hf_config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    config = model_config_from_hf(hf_config)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(directory, local_files_only=True)
    model = LlamaLikeModel(
        config,
        slots=slots,
        context=context,
        device=device,
        dtype=dtype,
        state_dict=state_dict_from_hf(hf_model, config.n_layers),
    )
    del hf_model
    eos = hf_config.eos_token_id
    eos_ids = set(eos) if isinstance(eos, list) else ({eos} if eos is not None else set())
    tokenizer = DemoTokenizer(
        Tokenizer.from_file(str(directory / "tokenizer.json")),
        slow_us_per_token,
        eos_ids=eos_ids,
        add_special_tokens=True,
    )
    tokenizer.vocab_size = min(tokenizer.vocab_size, config.vocab_size)
    return model, tokenizer
