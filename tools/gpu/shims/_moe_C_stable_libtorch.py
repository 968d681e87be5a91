"""GPU-probe SHIM (not vLLM code): stands in for vllm/_moe_C_stable_libtorch*.so. PyTorch
implementations of the MoE helper ops on the unquantized Triton fused-MoE path. NOTE: the
router top-k (topk_softmax) that R3 reports is computed HERE, by torch.topk on the softmax,
not by vLLM's CUDA kernel."""

import os
import sys

import torch

SHIMMED = []
CALLED = set()
_lib = torch.library.Library("_moe_C", "FRAGMENT")


def _note(name):
    if name not in CALLED:
        CALLED.add(name)
        print(
            f"[gpuprobe-shim] first call of torch.ops._moe_C.{name} (pid {os.getpid()})",
            file=sys.stderr,
            flush=True,
        )


def _define(schema, fn):
    name = schema.split("(")[0]
    _lib.define(schema)

    def wrapped(*args, **kwargs):
        _note(name)
        return fn(*args, **kwargs)

    _lib.impl(name, wrapped, "CompositeExplicitAutograd")
    SHIMMED.append(name)


def _topk_softmax(
    topk_weights, topk_ids, token_expert_indices, gating_output, renormalize, bias, is_padding
):
    m, k = topk_ids.shape
    scores = torch.softmax(gating_output.float(), dim=-1)
    sel = scores if bias is None else scores + bias.float()
    _, idx = torch.topk(sel, k, dim=-1, sorted=True)
    w = scores.gather(-1, idx)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    if is_padding is not None:
        pad = is_padding[:m].bool().view(-1, 1)
        w = torch.where(pad, torch.zeros_like(w), w)
    topk_weights.copy_(w.to(topk_weights.dtype))
    topk_ids.copy_(idx.to(topk_ids.dtype))
    rows = torch.arange(m, device=idx.device, dtype=torch.int64).view(-1, 1)
    ks = torch.arange(k, device=idx.device, dtype=torch.int64).view(1, -1)
    token_expert_indices.copy_((ks * m + rows).to(token_expert_indices.dtype))


def _moe_align_block_size(
    topk_ids,
    num_experts,
    block_size,
    sorted_token_ids,
    experts_ids,
    num_tokens_post_pad,
    expert_map,
    scatter_idx,
):
    # Host-sync free (no .item(), bincount or boolean indexing) so CUDA graphs can capture it.
    flat = topk_ids.reshape(-1).long()
    n = flat.numel()
    dev = flat.device
    if expert_map is not None:  # ignore_invalid_experts: routes to other ranks are dropped
        valid = expert_map[flat.clamp(0, expert_map.numel() - 1)] >= 0
    else:
        valid = (flat >= 0) & (flat < num_experts)
    e = torch.where(valid, flat, torch.full_like(flat, num_experts))
    cnt = torch.zeros(num_experts + 1, dtype=torch.long, device=dev)
    cnt.scatter_add_(0, e, torch.ones_like(e))
    cnt = cnt[:num_experts]
    padded = (cnt + block_size - 1) // block_size * block_size
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    order = torch.argsort(e, stable=True)
    se = e[order]
    keep = se < num_experts
    sec = se.clamp(max=num_experts - 1)
    cstart = torch.cumsum(cnt, 0) - cnt
    rank = torch.arange(n, device=dev) - cstart[sec]
    cap = sorted_token_ids.numel()
    pos = torch.where(keep, starts[sec] + rank, torch.full_like(rank, cap))
    tmp = torch.full((cap + 1,), n, dtype=sorted_token_ids.dtype, device=dev)
    tmp.scatter_(0, pos, order.to(tmp.dtype))
    sorted_token_ids.copy_(tmp[:cap])
    num_tokens_post_pad.copy_(ends[-1:].to(num_tokens_post_pad.dtype))
    blk_ends = ends // block_size
    b = torch.arange(experts_ids.numel(), device=dev)
    eb = torch.searchsorted(blk_ends, b, right=True)
    experts_ids.copy_(
        torch.where(eb < num_experts, eb, torch.full_like(eb, -1)).to(experts_ids.dtype)
    )
    if scatter_idx is not None:
        ident = torch.arange(n, device=dev)
        scatter_idx.copy_(
            torch.where(valid, ident, torch.full_like(ident, -1)).view(-1, 1).to(scatter_idx.dtype)
        )


def _moe_sum(inp, out, topk_ids, expert_map):
    x = inp
    if topk_ids is not None and expert_map is not None:
        local = (expert_map[topk_ids.long()] >= 0).unsqueeze(-1)
        x = torch.where(local, x, torch.zeros_like(x))
    out.copy_(x.sum(dim=1).to(out.dtype))


_define(
    "topk_softmax(Tensor(a!) topk_weights, Tensor(b!) topk_indices, Tensor(c!) "
    "token_expert_indices, Tensor gating_output, bool renormalize, Tensor? bias, "
    "Tensor? is_padding) -> ()",
    _topk_softmax,
)
_define(
    "moe_align_block_size(Tensor topk_ids, int num_experts, int block_size, Tensor(a!) "
    "sorted_token_ids, Tensor(b!) experts_ids, Tensor(c!) num_tokens_post_pad, "
    "Tensor? expert_map, Tensor(d!)? scatter_idx) -> ()",
    _moe_align_block_size,
)
_define(
    "moe_sum(Tensor input, Tensor(a!) output, Tensor? topk_ids, Tensor? expert_map) -> ()", _moe_sum
)

print(
    f"[gpuprobe-shim] vllm._moe_C_stable_libtorch shim loaded: torch.ops._moe_C.{SHIMMED}",
    file=sys.stderr,
    flush=True,
)
