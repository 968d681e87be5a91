"""PyTorch n-gram draft proposer for Model Runner V2 on vLLM's CPU platform (vLLM 0.32.0).

What it replaces: ``NgramGPUSpeculator.propose`` in
``vllm.v1.worker.gpu.spec_decode.ngram.speculator`` (MRV2's speculator for
``speculative_config={"method": "ngram" | "ngram_gpu", ...}``), which launches two Triton
kernels, ``_ngram_scan_kernel`` and ``_ngram_finalize_kernel``.

Why: on a machine without a GPU those kernels run in Triton's interpreter, and the finalize
kernel dies there ("mask has unsupported dtype"), killing the engine on the first decode step.
:func:`propose_ngram_drafts` computes the same drafts with a few tensor operations; the wrapper
that :func:`install` puts in place of ``propose`` (from :func:`install_on_import`, called by the
CPU support plugin on vLLM's CPU platform only) calls it instead of the kernels.

Semantics (those of the kernels in vLLM 0.32.0), for each batch row ``b`` with request state
``r = idx_mapping[b]``, its tokens ``t = token_ids[r, :seq_len]`` and ``seq_len = total_len[r]``:

* the row is eligible when ``num_sampled[b] > 0`` and ``seq_len >= min_n``;
* a match of length ``n`` (``min_n <= n <= max_n``) at position ``p`` means
  ``t[p:p + n] == t[seq_len - n:]`` with ``p <= seq_len - n - 1`` (the match starts before the
  suffix does); the longest ``n`` wins, and among those the rightmost ``p``;
* the drafts are the ``K`` tokens after the match, ``t[p + n : p + n + K]``; slots past the end
  of the sequence, and every slot of a row that is ineligible or has no match, hold the row's
  last sampled token ``last_sampled[r]``.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.util
import inspect
import logging
import sys
import types
from typing import Any

import torch

logger = logging.getLogger(__name__)

_SPECULATOR_MODULE = "vllm.v1.worker.gpu.spec_decode.ngram.speculator"
_REPLACED_KERNELS = ("_ngram_scan_kernel", "_ngram_finalize_kernel")
# Parameters of NgramGPUSpeculator.propose (vLLM 0.32.0) that the replacement reads.
_USED_PARAMETERS = ("input_batch", "num_sampled", "last_sampled", "dummy_run")
# Attributes NgramGPUSpeculator.__init__ sets (vLLM 0.32.0) that the replacement reads.
_USED_ATTRIBUTES = ("req_states", "drafts", "min_n", "max_n")


def match_scores(
    token_ids: torch.Tensor,
    idx_mapping: torch.Tensor,
    total_len: torch.Tensor,
    num_sampled: torch.Tensor,
    min_n: int,
    max_n: int,
) -> torch.Tensor:
    """Best match per batch row, packed as the scan kernel packs it: ``n * (L + 1) + p + 1``
    for the longest ``n`` and rightmost ``p`` (``L = token_ids.shape[1]``), 0 for no match.

    ``token_ids`` ``[max_num_reqs, L]``, ``idx_mapping`` ``[num_reqs]`` (batch row to request
    state), ``total_len`` ``[max_num_reqs]``, ``num_sampled`` ``[num_reqs]``; returns int64
    ``[num_reqs]``.
    """
    num_reqs = idx_mapping.shape[0]
    width = token_ids.shape[1]
    device = token_ids.device
    scores = torch.zeros(num_reqs, dtype=torch.int64, device=device)
    if num_reqs == 0:
        return scores
    rows_idx = idx_mapping.long()
    seq_len = total_len[rows_idx].long()
    eligible = (num_sampled[:num_reqs] > 0) & (seq_len >= min_n)
    # Every candidate window ends before the last token, so only the longest row's prefix of
    # the token table matters (a small slice, not max_model_len columns, on CPU).
    span = int(seq_len.max().clamp(min=0, max=width))
    if span <= min_n:
        return scores
    rows = token_ids[rows_idx, :span]
    lp1 = width + 1
    for n in range(min_n, max_n + 1):
        if span <= n:
            break
        # Window p covers rows[:, p:p + n]; the suffix is rows[:, seq_len - n:seq_len].
        windows = rows.unfold(1, n, 1)  # [B, span - n + 1, n]
        suffix_idx = (seq_len - n).clamp(min=0)[:, None] + torch.arange(n, device=device)
        suffix = torch.gather(rows, 1, suffix_idx.clamp(max=span - 1))
        positions = torch.arange(windows.shape[1], device=device)
        valid = positions[None, :] <= (seq_len - n - 1)[:, None]
        match = (windows == suffix[:, None, :]).all(dim=2) & valid & eligible[:, None]
        candidate = torch.where(match, n * lp1 + positions[None, :] + 1, 0)
        scores = torch.maximum(scores, candidate.max(dim=1).values)
    return scores


def propose_ngram_drafts(
    token_ids: torch.Tensor,
    idx_mapping: torch.Tensor,
    total_len: torch.Tensor,
    num_sampled: torch.Tensor,
    last_sampled: torch.Tensor,
    min_n: int,
    max_n: int,
    num_drafts: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Drafts ``[num_reqs, num_drafts]`` int64 (written into ``out[:num_reqs]`` when given and
    returned as that view); ``last_sampled`` is indexed by request state (``[max_num_reqs]``
    or ``[max_num_reqs, 1]``). See the module docstring for the rule."""
    num_reqs = idx_mapping.shape[0]
    device = token_ids.device
    width = token_ids.shape[1]
    rows_idx = idx_mapping.long()
    scores = match_scores(token_ids, idx_mapping, total_len, num_sampled, min_n, max_n)
    seq_len = total_len[rows_idx].long()
    last_tok = last_sampled.reshape(-1)[rows_idx].long()

    has_match = scores > 0
    packed = scores - 1
    best_n = torch.where(has_match, torch.div(packed, width + 1, rounding_mode="floor"), 0)
    best_pos = torch.where(has_match, packed - best_n * (width + 1), 0)
    draft_start = best_pos + best_n
    tokens_avail = (seq_len - draft_start).clamp(min=0)
    write_ok = (num_sampled[:num_reqs] > 0) & has_match

    k = torch.arange(num_drafts, device=device)
    gather_idx = (draft_start[:, None] + k[None, :]).clamp(max=width - 1)
    slot_valid = (k[None, :] < tokens_avail[:, None]) & write_ok[:, None]
    gathered = torch.gather(token_ids[rows_idx], 1, gather_idx).long()
    drafts = torch.where(slot_valid, gathered, last_tok[:, None])
    if out is None:
        return drafts
    out[:num_reqs].copy_(drafts)
    return out[:num_reqs]


def install_on_import() -> None:
    """Run :func:`install` as soon as vLLM's n-gram speculator module is imported (now, if
    it already is). Importing it eagerly would cost every vLLM process ~0.6 s of attention
    imports; only the worker of an engine with n-gram speculation ever loads it."""
    if _SPECULATOR_MODULE in sys.modules:
        install()
    elif not any(isinstance(finder, _InstallAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _InstallAfterImport())


class _InstallAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: hands the speculator module's ordinary spec back with its loader's
    ``exec_module`` followed by :func:`install`, then leaves ``sys.meta_path``."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != _SPECULATOR_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        loader = None if spec is None else spec.loader
        if loader is None:
            return spec
        exec_module = loader.exec_module

        def exec_then_install(module: types.ModuleType) -> None:
            exec_module(module)
            install()

        loader.exec_module = exec_then_install  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Route ``NgramGPUSpeculator.propose`` to :func:`propose_ngram_drafts` (call only on
    vLLM's CPU platform). Asserts that the vLLM names it relies on still exist."""
    module = importlib.import_module(_SPECULATOR_MODULE)
    speculator = getattr(module, "NgramGPUSpeculator", None)
    assert speculator is not None, (
        f"{_SPECULATOR_MODULE}.NgramGPUSpeculator is gone: update vllm_artifact_cpu_support.ngram"
    )
    for name in _REPLACED_KERNELS:
        assert hasattr(module, name), (
            f"{_SPECULATOR_MODULE}.{name} is gone: the n-gram proposer changed, "
            "update vllm_artifact_cpu_support.ngram"
        )
    original = speculator.__dict__.get("propose")
    assert callable(original), "NgramGPUSpeculator.propose is gone: update ngram.py"
    if getattr(original, "_artifact_cpu_ngram", False):
        return
    signature = inspect.signature(original)
    missing = [name for name in _USED_PARAMETERS if name not in signature.parameters]
    assert not missing, f"NgramGPUSpeculator.propose lost parameters {missing}: update ngram.py"
    init_source = inspect.getsource(speculator.__init__)
    gone = [name for name in _USED_ATTRIBUTES if f"self.{name}" not in init_source]
    assert not gone, f"NgramGPUSpeculator no longer sets {gone}: update ngram.py"

    @functools.wraps(original)
    @torch.inference_mode()
    def propose(self: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        values = bound.arguments
        input_batch = values["input_batch"]
        num_reqs = input_batch.num_reqs
        if values["dummy_run"]:
            return self.drafts[:num_reqs]
        req_states = self.req_states
        return propose_ngram_drafts(
            req_states.all_token_ids.gpu,
            input_batch.idx_mapping[:num_reqs],
            req_states.total_len.gpu,
            values["num_sampled"],
            values["last_sampled"],
            self.min_n,
            self.max_n,
            self.drafts.shape[1],
            out=self.drafts,
        )

    propose._artifact_cpu_ngram = True  # type: ignore[attr-defined]
    speculator.propose = propose
    logger.debug("vllm-artifact-cpu-support: n-gram drafts are proposed with PyTorch")
