"""Routing oracle: the router top-k a Hugging Face ``transformers`` forward pass picks.

vLLM's routed-expert output (R3) for a sequence must match what the model's
routers choose when the whole sequence is run once, in float32, through the
reference implementation. This module runs that reference pass and compares.

How the router logits are read: a forward hook on each MoE layer's
``mlp.gate``. In ``transformers`` 5.x that module is ``Qwen3MoeTopKRouter``,
whose output is ``(router_logits, top_k_weights, top_k_indices)``; in 4.x it is
an ``nn.Linear`` returning the logits. The hook takes the logits either way and
the top-k is taken here on the logits, as vLLM's CPU and GPU routers do
(``transformers`` takes it on the softmax, which is the same set except at
exact ties). Hooks, rather than ``output_router_logits=True``, keep the layer
index of every logit tensor explicit (that output lists MoE layers only).

Routers with a score correction bias (DeepSeek-V3, GLM-4.5: ``e_score_correction_bias``)
choose differently: sigmoid scores plus the bias, the best ``topk_group`` of ``n_group``
groups (a group's score is the sum of its two best), then the top-k within those groups. Their
top-k is not the top-k of the logits, so the oracle applies that rule from the model's config,
as vLLM's grouped top-k does, and checks it against the indices the ``transformers`` router
returns where it returns them.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

DENSE_FILL = -1
"""Expert ID the oracle puts in every slot of a dense (non-MoE) layer."""


@dataclass(frozen=True)
class RouterOracle:
    """Router decisions of the reference forward pass for one token sequence.

    ``topk_ids[t, l]`` are layer ``l``'s top-k experts for token ``t``, in
    descending logit order (biased score order for a bias-corrected router); dense
    layers hold ``DENSE_FILL`` (-1).
    ``topk_gap[t, l]`` is the k-th minus the (k+1)-th largest router logit: the
    margin by which the choice is made (small means a near-tie that float noise
    may flip); it is ``+inf`` for dense layers and when ``top_k == num_experts``.
    For a bias-corrected router it is in biased sigmoid-score units, the smaller of
    the group choice's margin and the expert choice's (within the chosen groups).
    ``router_logits[t, l]`` are the raw logits (zeros for dense layers).
    """

    token_ids: tuple[int, ...]
    topk_ids: np.ndarray  # int64 [T, L, k]
    topk_gap: np.ndarray  # float32 [T, L]
    router_logits: np.ndarray  # float32 [T, L, E]
    moe_layers: np.ndarray  # bool [L]
    num_experts: int
    top_k: int

    @property
    def num_tokens(self) -> int:
        return int(self.topk_ids.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.topk_ids.shape[1])


_MODELS: dict[str, Any] = {}
_MODELS_LOCK = threading.Lock()
# Hooks are registered on a shared cached model, so forward passes must not overlap.
_FORWARD_LOCK = threading.Lock()


def load_hf_model(model_dir: str | Path) -> Any:
    """Load (once per path and process) the float32 eval-mode ``transformers`` model."""
    from transformers import AutoModelForCausalLM

    key = str(Path(model_dir).resolve())
    with _MODELS_LOCK:
        model = _MODELS.get(key)
        if model is None:
            model = AutoModelForCausalLM.from_pretrained(
                key, dtype=torch.float32, attn_implementation="eager"
            )
            model.eval()
            _MODELS[key] = model
        return model


def clear_model_cache() -> None:
    """Drop the cached ``transformers`` models (to free memory)."""
    with _MODELS_LOCK:
        _MODELS.clear()


def _decoder_layers(model: Any) -> Sequence[Any]:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__} has no model.layers; not a decoder-only MoE?")
    return list(layers)


def _router_of(layer: Any) -> Any | None:
    """The router module of a decoder layer, or None for a dense MLP layer."""
    mlp = getattr(layer, "mlp", None)
    if mlp is None or not hasattr(mlp, "experts"):
        return None
    return getattr(mlp, "gate", None)


def _capture_router_logits(
    model: Any, layers: Sequence[Any], ids: list[int]
) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """One no-grad forward pass; returns {layer index: router logits [T, E]} for MoE layers,
    and {layer index: the indices [T, k] the router returned} where it returns them."""
    captured: dict[int, torch.Tensor] = {}
    returned: dict[int, torch.Tensor] = {}
    handles = []
    for idx, layer in enumerate(layers):
        router = _router_of(layer)
        if router is None:
            continue

        def hook(_mod: Any, _inp: Any, out: Any, idx: int = idx) -> None:
            logits = out[0] if isinstance(out, tuple) else out
            captured[idx] = logits.detach().reshape(-1, logits.shape[-1]).to(torch.float32)
            if isinstance(out, tuple) and len(out) == 3:
                returned[idx] = out[2].detach().reshape(logits.shape[0], -1)

        handles.append(router.register_forward_hook(hook))
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return captured, returned


def _logit_topk(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Top-k of the logits (softmax routers) and the k-th minus (k+1)-th logit."""
    kk = min(top_k + 1, logits.shape[-1])
    values, indices = torch.topk(logits, kk, dim=-1, sorted=True)
    gap = values[:, top_k - 1] - values[:, top_k] if kk > top_k else None
    return indices[:, :top_k], gap


def _biased_grouped_topk(
    logits: torch.Tensor, bias: torch.Tensor, config: Any, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The DeepSeek-V3 / GLM-4.5 choice (module docstring) and its margin: the smaller of
    the ``topk_group``-th minus next group score and the k-th minus next expert score."""
    scoring = getattr(config, "scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise ValueError(f"bias-corrected router with scoring_func={scoring!r}: not supported")
    n_group, topk_group = int(config.n_group), int(config.topk_group)
    num_tokens, num_experts = logits.shape
    scores = logits.sigmoid() + bias.to(torch.float32)
    group_scores = scores.view(num_tokens, n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
    group_values, group_idx = torch.topk(group_scores, n_group, dim=-1, sorted=True)
    inf = torch.full((num_tokens,), float("inf"))
    group_gap = (
        group_values[:, topk_group - 1] - group_values[:, topk_group]
        if topk_group < n_group
        else inf
    )
    mask = torch.zeros_like(group_scores, dtype=torch.bool)
    mask.scatter_(1, group_idx[:, :topk_group], True)
    allowed = mask.repeat_interleave(num_experts // n_group, dim=1)
    masked = scores.masked_fill(~allowed, float("-inf"))
    kk = min(top_k + 1, num_experts)
    values, indices = torch.topk(masked, kk, dim=-1, sorted=True)
    expert_gap = inf
    if kk > top_k:
        expert_gap = torch.where(
            torch.isinf(values[:, top_k]), inf, values[:, top_k - 1] - values[:, top_k]
        )
    return indices[:, :top_k], torch.minimum(group_gap, expert_gap)


def hf_router_topk(model_dir: str | Path, token_ids: Sequence[int]) -> RouterOracle:
    """Run ``token_ids`` (one sequence, positions 0..T-1) and return every layer's router top-k."""
    ids = [int(t) for t in token_ids]
    if not ids:
        raise ValueError("token_ids is empty")
    model = load_hf_model(model_dir)
    config = model.config
    num_experts = int(getattr(config, "num_experts", None) or config.n_routed_experts)
    top_k = int(config.num_experts_per_tok)
    layers = _decoder_layers(model)
    num_layers, num_tokens = len(layers), len(ids)

    with _FORWARD_LOCK:
        captured, returned = _capture_router_logits(model, layers, ids)
    if not captured:
        raise RuntimeError(f"no router logits captured from {type(model).__name__}: no mlp.gate?")

    moe_layers = np.zeros(num_layers, dtype=bool)
    topk_ids = np.full((num_tokens, num_layers, top_k), DENSE_FILL, dtype=np.int64)
    topk_gap = np.full((num_tokens, num_layers), np.inf, dtype=np.float32)
    router_logits = np.zeros((num_tokens, num_layers, num_experts), dtype=np.float32)
    for idx, logits in captured.items():
        if tuple(logits.shape) != (num_tokens, num_experts):
            raise RuntimeError(f"layer {idx}: router logits {tuple(logits.shape)} unexpected")
        moe_layers[idx] = True
        router_logits[:, idx] = logits.numpy()
        bias = getattr(_router_of(layers[idx]), "e_score_correction_bias", None)
        if bias is None:
            indices, gap = _logit_topk(logits, top_k)
        else:
            indices, gap = _biased_grouped_topk(logits, bias, config, top_k)
            if idx in returned and not torch.equal(
                indices.sort(dim=-1).values, returned[idx].sort(dim=-1).values.to(indices.dtype)
            ):
                raise RuntimeError(
                    f"layer {idx}: the grouped top-k rule disagrees with the indices "
                    f"{type(_router_of(layers[idx])).__name__} returned; update the oracle"
                )
        topk_ids[:, idx] = indices.numpy()
        if gap is not None:
            topk_gap[:, idx] = gap.numpy()
    return RouterOracle(
        token_ids=tuple(ids),
        topk_ids=topk_ids,
        topk_gap=topk_gap,
        router_logits=router_logits,
        moe_layers=moe_layers,
        num_experts=num_experts,
        top_k=top_k,
    )


def assert_routing_matches(
    actual: np.ndarray,
    oracle: RouterOracle,
    *,
    rows: slice | None = None,
    near_tie_gap: float = 0.0,
    dense_mark: int | None = None,
) -> None:
    """Check routed experts ``actual`` [T, L, k] against the oracle, row by row.

    ``rows`` picks the oracle rows ``actual`` stands for (default: all; e.g.
    ``slice(0, n)`` when the engine returned experts for the first n tokens).
    Each MoE-layer row is compared as a multiset (the order within the top-k is
    not part of the contract); every entry of a dense layer must be
    ``dense_mark`` (default: the largest value of ``actual``'s unsigned dtype, the
    mark vllm-artifact writes; vLLM's own connector leaves 0 there). Mismatches at
    rows whose logit gap is below ``near_tie_gap`` are tolerated (default 0: none are).
    Raises AssertionError naming the first mismatching token and layer.
    """
    act = np.asarray(actual)
    sel = rows if rows is not None else slice(None)
    expected = oracle.topk_ids[sel]
    gaps = oracle.topk_gap[sel]
    first_row = range(oracle.num_tokens)[sel]
    if act.ndim != 3 or act.shape != expected.shape:
        raise AssertionError(
            f"routed experts have shape {act.shape}, expected {expected.shape} "
            f"(oracle has {oracle.num_tokens} tokens, rows={rows})"
        )
    if dense_mark is None:
        if act.dtype not in (np.uint8, np.uint16):
            raise TypeError(f"pass dense_mark for routed experts of dtype {act.dtype}")
        dense_mark = int(np.iinfo(act.dtype).max)
    act = act.astype(np.int64)

    dense = ~oracle.moe_layers
    if dense.any():
        bad = np.argwhere(act[:, dense, :] != dense_mark)
        if len(bad):
            t, li, _ = bad[0]
            layer = int(np.flatnonzero(dense)[li])
            raise AssertionError(
                f"dense layer {layer} must hold the dense mark {dense_mark}, token "
                f"{first_row[t]} has {act[t, layer].tolist()} ({len(bad)} other entries in "
                "dense layers)"
            )

    moe = np.flatnonzero(oracle.moe_layers)
    act_sorted = np.sort(act[:, moe, :], axis=-1)
    exp_sorted = np.sort(expected[:, moe, :], axis=-1)
    mismatch = (act_sorted != exp_sorted).any(axis=-1) & ~(gaps[:, moe] < near_tie_gap)
    if mismatch.any():
        t, li = (int(v) for v in np.argwhere(mismatch)[0])
        layer = int(moe[li])
        raise AssertionError(
            f"routing mismatch at token {first_row[t]} (row {t} of actual), layer {layer}: "
            f"actual {sorted(act[t, layer].tolist())} != expected "
            f"{sorted(expected[t, layer].tolist())}; top-{oracle.top_k} logit gap "
            f"{float(gaps[t, layer]):.6g}; {int(mismatch.sum())} mismatching "
            f"(token, layer) pairs of {mismatch.size}"
        )


@dataclass(frozen=True)
class Agreement:
    """How many (token, layer) rows of an R3 array equal the oracle's (a dense layer's row
    must hold the dense mark); ``near_ties`` of the unequal ones were decided by a router
    logit gap below the threshold (float noise, e.g. TF32 matmuls, may flip those)."""

    rows: int
    equal: int
    near_ties: int
    first_problem: str | None

    @property
    def ok(self) -> bool:
        return self.rows > 0 and self.equal == self.rows


def routing_agreement(
    actual: np.ndarray, oracle: RouterOracle, *, near_tie_gap: float = 1e-3
) -> Agreement:
    """Compare every row of ``actual`` [T, L, k] (uint8/uint16, dense layers marked with the
    dtype's largest value) with the oracle; never raises on a mismatch."""
    act = np.asarray(actual)
    total = oracle.num_tokens * oracle.num_layers
    if act.ndim != 3 or act.shape != oracle.topk_ids.shape or act.dtype.kind != "u":
        shape = f"R3 has shape {act.shape} ({act.dtype}), expected {oracle.topk_ids.shape}"
        return Agreement(total, 0, 0, shape)
    mark = int(np.iinfo(act.dtype).max)
    values = act.astype(np.int64)
    equal = np.empty((oracle.num_tokens, oracle.num_layers), dtype=bool)
    dense = ~oracle.moe_layers
    equal[:, dense] = (values[:, dense, :] == mark).all(axis=-1)
    moe = oracle.moe_layers
    equal[:, moe] = (
        np.sort(values[:, moe, :], axis=-1) == np.sort(oracle.topk_ids[:, moe, :], axis=-1)
    ).all(axis=-1)
    unequal = ~equal
    near = unequal & (oracle.topk_gap < near_tie_gap)
    problem: str | None = None
    if unequal.any():
        t, layer = (int(v) for v in np.argwhere(unequal)[0])
        expected = (
            f"the dense mark {mark}"
            if dense[layer]
            else f"{sorted(oracle.topk_ids[t, layer].tolist())} (logit gap "
            f"{float(oracle.topk_gap[t, layer]):.3g})"
        )
        problem = (
            f"token {t}, layer {layer}: {sorted(values[t, layer].tolist())}, expected {expected}"
        )
    return Agreement(total, int(equal.sum()), int(near.sum()), problem)
