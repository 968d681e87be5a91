"""A deterministic tiny GLM-4.5-style MoE with one MTP (next-token) layer, built locally.

Why GLM-4.5 (``Glm4MoeForCausalLM``): vLLM 0.32 drafts for it with ``Glm4MoeMTP``
(``speculative_config={"method": "mtp"}``), its attention is standard GQA (runs on the CPU
backend and on Triton attention, unlike DeepSeek-V3's MLA), and its router is the
DeepSeek-V3 kind R3 must get right: sigmoid scores, a per-expert correction bias, and grouped
selection (``n_group``/``topk_group``), so its top-k is not the top-k of the logits. Layer 0 is
dense (``first_k_dense_replace``). ``transformers`` loads the target layers (the oracle) and
ignores the MTP layer, ``model.layers.{num_layers}.*`` in the hub's naming.

Random MTP weights would never guess right, so drafts would only be rejected. The MTP layer
instead *looks up* the target's greedy next token (a bigram table from a transformers greedy
run of :data:`MTP_PROMPTS`, as ``eagle_draft`` does): ``eh_proj`` maps the normalised embedding
of each table token onto the target ``lm_head`` row of its successor, its attention and expert
outputs are zero (the residual carries that through), and vLLM shares the target's embedding
and ``lm_head`` with the draft. Its router still runs on random weights, so a draft MoE layer
routes every draft step, which R3 must never see.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from vllm_artifact.selftest.tiny_models import (
    CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    WEIGHTS_FILE,
    default_cache_dir,
    install_atomically,
    write_manifest,
    write_tokenizer_files,
)
from vllm_artifact.selftest.tokenizer import ENDOFTEXT, IM_END

BUILDER_VERSION = "1"

#: Prompts the MTP layer's bigram table is learnt from (tests generate from them, greedy).
MTP_PROMPTS: tuple[str, ...] = (
    " ".join(f"Matrix sentence {i} picks expert {i * 3 % 8}." for i in range(6)),
    "one two three four five one two three four five one two three four five one two",
    " ".join(["the cat sat on the mat and the dog sat on the log"] * 2),
)
MTP_NEW_TOKENS = 24


@dataclasses.dataclass(frozen=True)
class MtpModelSpec:
    """Shape and seed of the tiny GLM-4.5-style model (``num_layers`` target layers + 1 MTP)."""

    name: str = "glm4-moe-mtp-16x4-dense0"
    num_layers: int = 4
    first_k_dense_replace: int = 1
    num_experts: int = 16
    top_k: int = 4
    n_group: int = 4
    topk_group: int = 2
    n_shared_experts: int = 1
    moe_intermediate_size: int = 64
    routed_scaling_factor: float = 2.5
    hidden_size: int = 128
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    partial_rotary_factor: float = 0.5
    intermediate_size: int = 256
    vocab_size: int = 512
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    init_std: float = 0.02
    embed_std: float = 0.1
    # Router logits ~ N(0, 2^2): sigmoid scores spread over (0, 1) instead of saturating (a
    # saturated sigmoid makes near-ties that float noise flips).
    router_scale: float = 9.0
    # Big enough to change the choice against top-k of the scores for some tokens.
    bias_std: float = 0.05
    seed: int = 2345

    @property
    def mtp_layer(self) -> int:
        return self.num_layers

    def digest(self) -> str:
        blob = json.dumps(dataclasses.asdict(self), sort_keys=True).encode()
        blob += json.dumps([MTP_PROMPTS, MTP_NEW_TOKENS]).encode()
        return hashlib.sha256(blob).hexdigest()[:10]


SPEC = MtpModelSpec()


def config_dict(spec: MtpModelSpec, token_ids: dict[str, int]) -> dict[str, Any]:
    """``config.json`` in the layout of the published GLM-4.5 checkpoints."""
    return {
        "architectures": ["Glm4MoeForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": token_ids[ENDOFTEXT],
        "eos_token_id": token_ids[IM_END],
        "first_k_dense_replace": spec.first_k_dense_replace,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "hidden_size": spec.hidden_size,
        "initializer_range": spec.init_std,
        "intermediate_size": spec.intermediate_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "model_type": "glm4_moe",
        "moe_intermediate_size": spec.moe_intermediate_size,
        "n_group": spec.n_group,
        "n_routed_experts": spec.num_experts,
        "n_shared_experts": spec.n_shared_experts,
        "norm_topk_prob": True,
        "num_attention_heads": spec.num_attention_heads,
        "num_experts_per_tok": spec.top_k,
        "num_hidden_layers": spec.num_layers,
        "num_key_value_heads": spec.num_key_value_heads,
        "num_nextn_predict_layers": 1,
        "pad_token_id": token_ids[ENDOFTEXT],
        "partial_rotary_factor": spec.partial_rotary_factor,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_scaling": None,
        "rope_theta": spec.rope_theta,
        "routed_scaling_factor": spec.routed_scaling_factor,
        "tie_word_embeddings": False,
        "topk_group": spec.topk_group,
        "torch_dtype": "float32",
        "use_cache": True,
        "use_qk_norm": False,
        "vocab_size": spec.vocab_size,
    }


def _layer_shapes(spec: MtpModelSpec, i: int) -> list[tuple[str, tuple[int, ...]]]:
    """One decoder layer's tensors in hub naming (the MTP layer's block uses the same)."""
    h, d, p = spec.hidden_size, spec.head_dim, f"model.layers.{i}"
    shapes: list[tuple[str, tuple[int, ...]]] = [
        (f"{p}.input_layernorm.weight", (h,)),
        (f"{p}.post_attention_layernorm.weight", (h,)),
        (f"{p}.self_attn.q_proj.weight", (spec.num_attention_heads * d, h)),
        (f"{p}.self_attn.k_proj.weight", (spec.num_key_value_heads * d, h)),
        (f"{p}.self_attn.v_proj.weight", (spec.num_key_value_heads * d, h)),
        (f"{p}.self_attn.o_proj.weight", (h, spec.num_attention_heads * d)),
    ]
    if i < spec.first_k_dense_replace:
        n = spec.intermediate_size
        shapes += [
            (f"{p}.mlp.gate_proj.weight", (n, h)),
            (f"{p}.mlp.up_proj.weight", (n, h)),
            (f"{p}.mlp.down_proj.weight", (h, n)),
        ]
        return shapes
    m, s = spec.moe_intermediate_size, spec.moe_intermediate_size * spec.n_shared_experts
    shapes += [
        (f"{p}.mlp.gate.weight", (spec.num_experts, h)),
        (f"{p}.mlp.gate.e_score_correction_bias", (spec.num_experts,)),
        (f"{p}.mlp.shared_experts.gate_proj.weight", (s, h)),
        (f"{p}.mlp.shared_experts.up_proj.weight", (s, h)),
        (f"{p}.mlp.shared_experts.down_proj.weight", (h, s)),
    ]
    for e in range(spec.num_experts):
        shapes += [
            (f"{p}.mlp.experts.{e}.gate_proj.weight", (m, h)),
            (f"{p}.mlp.experts.{e}.up_proj.weight", (m, h)),
            (f"{p}.mlp.experts.{e}.down_proj.weight", (h, m)),
        ]
    return shapes


def _random_weights(
    spec: MtpModelSpec, shapes: list[tuple[str, tuple[int, ...]]], gen: torch.Generator
) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for name, shape in shapes:
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape)
            continue
        std = spec.embed_std if name == "model.embed_tokens.weight" else spec.init_std
        if name.endswith("e_score_correction_bias"):
            std = spec.bias_std
        elif name.endswith(".mlp.gate.weight"):
            std = spec.init_std * spec.router_scale
        weights[name] = (torch.randn(shape, generator=gen) * std).contiguous()
    return weights


def target_weights(spec: MtpModelSpec) -> dict[str, torch.Tensor]:
    """The target model's weights from ``spec.seed`` (what transformers loads)."""
    h = spec.hidden_size
    shapes: list[tuple[str, tuple[int, ...]]] = [
        ("model.embed_tokens.weight", (spec.vocab_size, h))
    ]
    for i in range(spec.num_layers):
        shapes += _layer_shapes(spec, i)
    shapes += [("model.norm.weight", (h,)), ("lm_head.weight", (spec.vocab_size, h))]
    return _random_weights(spec, shapes, torch.Generator().manual_seed(spec.seed))


def greedy_bigrams(model_dir: Path, prompts: Sequence[str], new_tokens: int) -> dict[int, int]:
    """token -> the token the target greedily generates after it (first occurrence wins).

    ``generate`` with its KV cache: recomputing the whole sequence per token, as
    ``eagle_draft.greedy_bigrams`` does, took a minute here for this model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    following: dict[int, int] = {}
    for prompt in prompts:
        ids = list(tokenizer(prompt)["input_ids"])
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
            )
        tokens = [int(t) for t in out[0]]
        for a, b in zip(tokens[len(ids) - 1 : -1], tokens[len(ids) :], strict=True):
            following.setdefault(a, b)
    return following


def mtp_weights(
    spec: MtpModelSpec, target: dict[str, torch.Tensor], bigrams: dict[int, int]
) -> dict[str, torch.Tensor]:
    """The MTP layer: random router and attention inputs, zero outputs, and an ``eh_proj``
    that sends each table token's normalised embedding to its successor's lm_head row."""
    h, p = spec.hidden_size, f"model.layers.{spec.mtp_layer}"
    gen = torch.Generator().manual_seed(spec.seed + 1)
    weights = _random_weights(spec, _layer_shapes(spec, spec.mtp_layer), gen)
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = torch.zeros_like(weights[name])
    tokens = sorted(bigrams)
    if len(tokens) > h:
        raise ValueError(f"{len(tokens)} bigram tokens exceed hidden size {h}: fewer prompts")
    embed = target["model.embed_tokens.weight"][tokens].double()
    normed = embed * torch.rsqrt(embed.pow(2).mean(-1, keepdim=True) + spec.rms_norm_eps)
    heads = target["lm_head.weight"][[bigrams[t] for t in tokens]].double()
    wanted = 10.0 * heads / heads.norm(dim=-1, keepdim=True)
    eh_proj = torch.zeros(h, 2 * h, dtype=torch.float64)
    eh_proj[:, :h] = (torch.linalg.pinv(normed) @ wanted).T
    weights[f"{p}.eh_proj.weight"] = eh_proj.float().contiguous()
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        weights[f"{p}.{norm}.weight"] = torch.ones(h)
    return weights


def build_mtp_model(out_dir: Path, spec: MtpModelSpec = SPEC) -> Path:
    """Write the complete model into ``out_dir``: target first, then (from a transformers
    greedy run of it) the MTP layer, then the manifest."""
    out_dir.mkdir(parents=True, exist_ok=True)
    token_ids = write_tokenizer_files(
        out_dir, spec.vocab_size, spec.seed, spec.max_position_embeddings
    )
    (out_dir / CONFIG_FILE).write_text(
        json.dumps(config_dict(spec, token_ids), indent=2, sort_keys=True) + "\n"
    )
    generation = {
        "bos_token_id": token_ids[ENDOFTEXT],
        "do_sample": False,
        "eos_token_id": [token_ids[IM_END], token_ids[ENDOFTEXT]],
        "pad_token_id": token_ids[ENDOFTEXT],
    }
    (out_dir / GENERATION_CONFIG_FILE).write_text(
        json.dumps(generation, indent=2, sort_keys=True) + "\n"
    )
    target = target_weights(spec)
    weights_file = out_dir / WEIGHTS_FILE
    save_file(target, str(weights_file), metadata={"format": "pt"})
    bigrams = greedy_bigrams(out_dir, MTP_PROMPTS, MTP_NEW_TOKENS)
    save_file({**target, **mtp_weights(spec, target, bigrams)}, str(weights_file), {"format": "pt"})
    os.chmod(weights_file, 0o644)  # safetensors creates it owner-only
    write_manifest(out_dir, BUILDER_VERSION, spec.name, dataclasses.asdict(spec))
    return out_dir


def ensure_mtp_model(cache_dir: Path | None = None, spec: MtpModelSpec = SPEC) -> Path:
    """The cached model directory (built when missing or broken, atomically)."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache / f"{spec.name}-b{BUILDER_VERSION}-{spec.digest()}"
    return install_atomically(target, lambda tmp: build_mtp_model(tmp, spec))


def bound_routers(worker: Any) -> dict[str, list[str]]:
    """Per MoE layer of the target and of the draft model: its router's class, with ``+capture``
    when it has a capture callback (runs in a worker, through ``collective_rpc``)."""
    from vllm.model_executor.layers.fused_moe.layer import MoERunner

    runner = worker.model_runner
    models = {"target": runner.model, "draft": runner.speculator.model}
    return {
        name: [
            type(module.router).__name__
            + ("+capture" if getattr(module.router, "capture_fn", None) else "")
            for module in model.modules()
            if isinstance(module, MoERunner)
        ]
        for name, model in models.items()
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--cache-dir", type=Path, default=None)
    print(ensure_mtp_model(parser.parse_args(argv).cache_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
