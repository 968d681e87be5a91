"""A tiny EAGLE-1 draft for a tiny target model, built locally (no hub), for tests.

Random draft weights would never be accepted, so speculative decoding would only ever reject
drafts. This draft instead *looks up* the target's greedy next token for the tokens of given
prompts (a bigram table from a transformers greedy run of the target), so most drafts are
accepted and some are not: both paths of verification run.

Layout as vLLM 0.32's ``EagleLlamaForCausalLM`` loads it: a one-layer ``LlamaForCausalLM``
config with the target's hidden size, heads and vocabulary; weights ``fc`` (2H -> H), one
decoder layer without ``input_layernorm`` (vLLM replaces it in layer 0), and the draft's own
``embed_tokens``; no ``lm_head`` (vLLM always uses the target's). ``fc`` passes the token
embedding through and the layer's output projections are zero, so the draft's hidden state is
its token embedding, which points at the target's ``lm_head`` row of the looked-up token.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

_SEED = 4321


def greedy_bigrams(target: Path, prompts: Sequence[str], new_tokens: int) -> dict[int, int]:
    """token -> the token the target greedily generates after it (first occurrence wins)."""
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    model = AutoModelForCausalLM.from_pretrained(
        str(target), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    following: dict[int, int] = {}
    for prompt in prompts:
        ids = list(tokenizer(prompt)["input_ids"])
        start = len(ids)
        with torch.no_grad():
            for _ in range(new_tokens):
                logits = model(torch.tensor([ids])).logits[0, -1]
                ids.append(int(logits.argmax()))
        for a, b in zip(ids[start - 1 : -1], ids[start:], strict=True):
            following.setdefault(a, b)
    return following


def build_bigram_eagle_draft(
    target: Path, out_dir: Path, prompts: Sequence[str], new_tokens: int = 32
) -> Path:
    """Write the draft into ``out_dir`` (config.json, model.safetensors); returns it."""
    config = json.loads((target / "config.json").read_text())
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv_heads, vocab = config["num_key_value_heads"], config["vocab_size"]
    head_dim = config.get("head_dim") or hidden // heads
    inner = 2 * hidden
    generator = torch.Generator().manual_seed(_SEED)

    def random(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * 0.02

    lm_head = load_file(str(target / "model.safetensors"))["lm_head.weight"].float()
    embed = torch.randn(vocab, hidden, generator=generator)
    embed = 0.1 * embed / embed.norm(dim=1, keepdim=True)
    for token, following in greedy_bigrams(target, prompts, new_tokens).items():
        embed[token] = 50.0 * lm_head[following] / lm_head[following].norm()
    passthrough = torch.zeros(hidden, 2 * hidden)
    passthrough[:, :hidden] = torch.eye(hidden)
    weights = {
        "embed_tokens.weight": embed,
        "fc.weight": passthrough,
        "layers.0.self_attn.q_proj.weight": random(heads * head_dim, hidden),
        "layers.0.self_attn.k_proj.weight": random(kv_heads * head_dim, hidden),
        "layers.0.self_attn.v_proj.weight": random(kv_heads * head_dim, hidden),
        "layers.0.self_attn.o_proj.weight": torch.zeros(hidden, heads * head_dim),
        "layers.0.post_attention_layernorm.weight": torch.ones(hidden),
        "layers.0.mlp.gate_proj.weight": random(inner, hidden),
        "layers.0.mlp.up_proj.weight": random(inner, hidden),
        "layers.0.mlp.down_proj.weight": torch.zeros(hidden, inner),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(
        {name: tensor.float().contiguous() for name, tensor in weights.items()},
        str(out_dir / "model.safetensors"),
        metadata={"format": "pt"},
    )
    draft_config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": inner,
        "num_hidden_layers": 1,
        "vocab_size": vocab,
        "max_position_embeddings": config.get("max_position_embeddings", 4096),
        "rope_theta": config.get("rope_theta", 10000.0),
        "rms_norm_eps": config.get("rms_norm_eps", 1e-6),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": config.get("bos_token_id"),
        "eos_token_id": config.get("eos_token_id"),
        "pad_token_id": config.get("pad_token_id"),
        "torch_dtype": "float32",
    }
    (out_dir / "config.json").write_text(json.dumps(draft_config, indent=2) + "\n")
    return out_dir
