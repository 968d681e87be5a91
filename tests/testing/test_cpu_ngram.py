"""The CPU support package's PyTorch n-gram proposer (stand-in for MRV2's Triton kernels).

Checked against a plain per-row reference of the rule, against vLLM's own scan kernel run in
Triton's interpreter (the finalize kernel is the one that cannot run there), and through the
wrapper installed on ``NgramGPUSpeculator.propose``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm_artifact_cpu_support import ngram

MAX_NUM_REQS = 12
MAX_MODEL_LEN = 64
K = 3


def reference_drafts(
    tokens: list[int], num_sampled: int, last: int, min_n: int, max_n: int, k: int
) -> tuple[int, list[int]]:
    """(packed score, drafts) for one row, by the rule in ``ngram``'s docstring, with loops."""
    seq_len = len(tokens)
    if num_sampled > 0 and seq_len >= min_n:
        for n in range(max_n, min_n - 1, -1):
            suffix = tokens[seq_len - n :] if seq_len >= n else None
            for pos in range(seq_len - n - 1, -1, -1):
                if tokens[pos : pos + n] == suffix:
                    start = pos + n
                    drafts = [tokens[i] if i < seq_len else last for i in range(start, start + k)]
                    return n * (MAX_MODEL_LEN + 1) + pos + 1, drafts
    return 0, [last] * k


def random_batch(seed: int, num_reqs: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    # Tiny vocabulary: plenty of matches of every length; stale tokens past total_len.
    token_ids = torch.randint(0, 3, (MAX_NUM_REQS, MAX_MODEL_LEN), generator=generator)
    total_len = torch.randint(0, MAX_MODEL_LEN + 1, (MAX_NUM_REQS,), generator=generator)
    total_len[:3] = torch.tensor([0, 1, MAX_MODEL_LEN])
    idx_mapping = torch.randperm(MAX_NUM_REQS, generator=generator)[:num_reqs]
    num_sampled = torch.randint(0, 3, (num_reqs,), generator=generator)
    last_sampled = torch.randint(100, 200, (MAX_NUM_REQS, 1), generator=generator)
    return {
        "token_ids": token_ids.to(torch.int32),
        "idx_mapping": idx_mapping.to(torch.int64),
        "total_len": total_len.to(torch.int32),
        "num_sampled": num_sampled.to(torch.int32),
        "last_sampled": last_sampled.to(torch.int64),
    }


def expected(batch: dict[str, torch.Tensor], min_n: int, max_n: int) -> tuple[list, list]:
    scores, drafts = [], []
    for b, r in enumerate(batch["idx_mapping"].tolist()):
        seq_len = int(batch["total_len"][r])
        score, row = reference_drafts(
            batch["token_ids"][r, :seq_len].tolist(),
            int(batch["num_sampled"][b]),
            int(batch["last_sampled"][r, 0]),
            min_n,
            max_n,
            K,
        )
        scores.append(score)
        drafts.append(row)
    return scores, drafts


@pytest.mark.parametrize(("min_n", "max_n"), [(2, 4), (1, 1), (3, 5)])
@pytest.mark.parametrize("seed", range(4))
def test_drafts_match_reference(seed: int, min_n: int, max_n: int) -> None:
    batch = random_batch(seed, num_reqs=10)
    out = torch.full((MAX_NUM_REQS, K), -7, dtype=torch.int64)
    drafts = ngram.propose_ngram_drafts(**batch, min_n=min_n, max_n=max_n, num_drafts=K, out=out)
    scores, rows = expected(batch, min_n, max_n)
    assert drafts.dtype == torch.int64 and drafts.shape == (10, K)
    assert drafts.data_ptr() == out.data_ptr()
    assert drafts.tolist() == rows
    assert (out[10:] == -7).all()
    got_scores = ngram.match_scores(
        batch["token_ids"],
        batch["idx_mapping"],
        batch["total_len"],
        batch["num_sampled"],
        min_n,
        max_n,
    )
    assert got_scores.tolist() == scores
    assert sum(score > 0 for score in scores) >= 3, "the batch should hold matches"


def test_scan_matches_vllm_scan_kernel_in_the_interpreter() -> None:
    from vllm.v1.worker.gpu.spec_decode.ngram import speculator as vllm_ngram

    num_reqs = 8
    batch = random_batch(seed=11, num_reqs=num_reqs)
    min_n, max_n, block_l = 2, 4, 16  # four blocks per row: the per-block maxima matter
    n_blocks = MAX_MODEL_LEN // block_l
    scratch = torch.full((num_reqs, n_blocks), -1, dtype=torch.int64)
    token_ids = batch["token_ids"]
    vllm_ngram._ngram_scan_kernel[(num_reqs, n_blocks)](
        token_ids,
        token_ids.stride(0),
        batch["idx_mapping"],
        batch["total_len"],
        batch["num_sampled"],
        scratch,
        scratch.stride(0),
        MAX_MODEL_LEN,
        min_n,
        max_n,
        4,
        block_l,
    )
    ours = ngram.match_scores(
        token_ids, batch["idx_mapping"], batch["total_len"], batch["num_sampled"], min_n, max_n
    )
    assert ours.tolist() == scratch.max(dim=1).values.tolist()
    assert (ours > 0).sum() >= 3


def test_installed_wrapper_replaces_the_kernels() -> None:
    from vllm.v1.worker.gpu.spec_decode.ngram.speculator import NgramGPUSpeculator

    ngram.install()
    ngram.install()  # idempotent
    assert NgramGPUSpeculator.propose._artifact_cpu_ngram  # type: ignore[attr-defined]
    batch = random_batch(seed=5, num_reqs=6)
    speculator = object.__new__(NgramGPUSpeculator)
    speculator.min_n, speculator.max_n = 2, 4
    speculator.drafts = torch.zeros((MAX_NUM_REQS, K), dtype=torch.int64)
    speculator.req_states = SimpleNamespace(
        all_token_ids=SimpleNamespace(gpu=batch["token_ids"]),
        total_len=SimpleNamespace(gpu=batch["total_len"]),
    )
    input_batch = SimpleNamespace(num_reqs=6, idx_mapping=batch["idx_mapping"])
    unused = torch.zeros(1)
    # Positional, as the model runner's sampling step calls it.
    drafts = speculator.propose(
        input_batch,
        None,
        None,
        unused,
        None,
        batch["num_sampled"],
        torch.zeros(6, dtype=torch.int32),
        batch["last_sampled"],
        unused,
        unused,
        unused,
        num_speculative_tokens=K,
    )
    assert drafts.tolist() == expected(batch, 2, 4)[1]
    # The dummy run (by keyword, as in the model runner) returns the buffer untouched.
    speculator.drafts.fill_(9)
    dummy = speculator.propose(
        input_batch=input_batch,
        attn_metadata=None,
        slot_mappings=None,
        last_hidden_states=unused,
        aux_hidden_states=None,
        num_sampled=torch.ones(6, dtype=torch.int32),
        num_rejected=torch.zeros(6, dtype=torch.int32),
        last_sampled=batch["last_sampled"],
        next_prefill_tokens=unused,
        temperature=unused,
        seeds=unused,
        dummy_run=True,
    )
    assert dummy.shape == (6, K) and (dummy == 9).all()
