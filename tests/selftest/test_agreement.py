"""The self-test's verdicts: a row that differs from the oracle, or a dense layer without its
mark, fails its case; near-ties are counted, not hidden."""

from __future__ import annotations

import numpy as np

from vllm_artifact.selftest.cases import CaseResult
from vllm_artifact.selftest.oracle import RouterOracle, routing_agreement


def oracle() -> RouterOracle:
    """Three tokens, layers [dense, MoE, MoE], 6 experts, top-2."""
    topk = np.array([[[-1, -1], [0, 1], [2, 3]]] * 3, dtype=np.int64)
    gap = np.array([[np.inf, 0.5, 0.0001]] * 3, dtype=np.float32)
    return RouterOracle(
        token_ids=(1, 2, 3),
        topk_ids=topk,
        topk_gap=gap,
        router_logits=np.zeros((3, 3, 6), np.float32),
        moe_layers=np.array([False, True, True]),
        num_experts=6,
        top_k=2,
    )


def r3() -> np.ndarray:
    return np.array([[[255, 255], [1, 0], [3, 2]]] * 3, dtype=np.uint8)  # order is free


def test_equal_rows_pass() -> None:
    found = routing_agreement(r3(), oracle())
    assert (found.rows, found.equal, found.near_ties, found.first_problem) == (9, 9, 0, None)
    assert CaseResult.of("case", [found]).status == "PASS"


def test_a_different_expert_fails_and_says_where() -> None:
    rows = r3()
    rows[1, 1] = [0, 4]
    found = routing_agreement(rows, oracle())
    assert (found.equal, found.near_ties) == (8, 0)
    result = CaseResult.of("case", [found])
    assert result.status == "FAIL" and "token 1, layer 1: [0, 4], expected [0, 1]" in result.detail


def test_a_near_tie_still_fails_but_is_reported_as_one() -> None:
    rows = r3()
    rows[2, 2] = [2, 5]  # layer 2's choice was made by a logit gap of 1e-4
    found = routing_agreement(rows, oracle())
    assert (found.equal, found.near_ties) == (8, 1)
    assert CaseResult.of("case", [found]).status == "FAIL"


def test_a_dense_layer_without_its_mark_fails() -> None:
    rows = r3()
    rows[0, 0] = [0, 0]  # vLLM's own capture leaves dense layers 0
    found = routing_agreement(rows, oracle())
    assert found.equal == 8 and "expected the dense mark 255" in (found.first_problem or "")


def test_a_wrong_shape_or_a_problem_of_the_case_fails() -> None:
    assert routing_agreement(r3()[:2], oracle()).equal == 0
    result = CaseResult.of("case", [routing_agreement(r3(), oracle())], "not a prefix hit")
    assert result.status == "FAIL" and result.detail == "not a prefix hit"
    assert CaseResult.of("case", []).status == "FAIL"  # nothing compared is not a pass


def test_the_report_never_hides_a_case_that_did_not_run() -> None:
    from vllm_artifact.selftest.runner import Versions, report

    found = Versions("3.11", "0.32.0", "2.13", "0.1.0", "CPU", "-")
    ran = CaseResult.of("batch", [routing_agreement(r3(), oracle())])
    skipped = CaseResult.not_runnable("speculative", RuntimeError("no kernels"))
    text = report([ran, skipped], found)
    assert text.endswith("every case that ran; not runnable on this install: speculative")
    assert report([ran], found).endswith("PASS: R3 equals the oracle in every case")
    failed = CaseResult.failed("engine start", "RuntimeError: no GPU")
    assert report([failed], found).endswith("FAIL")
