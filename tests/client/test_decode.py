"""Client decoding: payloads, raw JSON, the openai client's objects, dense-layer marks."""

from __future__ import annotations

import base64
import io
import pickle

import numpy as np
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from vllm_artifact.client import RoutedExperts, decode_r3, decode_routed_experts, dense_layers


def npy_b64(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode()


def r3(tokens: int = 5, dtype: type = np.uint8, dense: tuple[int, ...] = (1,)) -> np.ndarray:
    """Routed rows (distinct top-2 ids per token) with ``dense`` layers marked."""
    rng = np.random.default_rng(0)
    rows = np.stack(
        [rng.permutation(8)[:2] for _ in range(tokens * 4)]  # distinct ids per (token, layer)
    ).reshape(tokens, 4, 2)
    rows = rows.astype(dtype)
    rows[:, list(dense), :] = np.iinfo(dtype).max
    return rows


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16])
def test_payload_round_trip_and_dense_layers(dtype: type) -> None:
    rows = r3(dtype=dtype, dense=(0, 3))
    decoded = decode_r3(npy_b64(rows))
    assert isinstance(decoded, RoutedExperts)
    np.testing.assert_array_equal(decoded.experts, rows)
    assert decoded.experts.dtype == dtype
    assert decoded.dense_layers == (0, 3) and decoded.moe_layers == (1, 2)


def test_expert_zero_is_not_a_dense_layer() -> None:
    rows = r3(dense=())
    rows[:, 2, 0] = 0  # layer 2 routes every token to expert 0 (and another one)
    assert dense_layers(rows) == ()
    assert dense_layers(rows[:0]) == ()  # no rows, no evidence


def test_raw_json_openai_objects_and_offline_arrays() -> None:
    rows = r3()
    payload = npy_b64(rows)
    completion = Completion.model_validate(
        {
            "id": "c",
            "object": "text_completion",
            "created": 0,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "text": "hi",
                    "finish_reason": "length",
                    "logprobs": None,
                    "routed_experts": payload,
                }
            ],
        }
    )
    chat = ChatCompletion.model_validate(
        {
            "id": "c",
            "object": "chat.completion",
            "created": 0,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "stop",
                    "message": {"role": "assistant", "content": "hi"},
                    "routed_experts": payload,
                }
            ],
        }
    )
    sources = [
        {"text": "hi", "routed_experts": payload},
        completion.choices[0],
        chat.choices[0],
        rows,
    ]
    for source in sources:
        decoded = decode_r3(source)
        np.testing.assert_array_equal(decoded.experts, rows)
        assert decoded.dense_layers == (1,)


def test_missing_field_and_hostile_payloads_fail_clearly() -> None:
    with pytest.raises(ValueError, match="--enable-routed-experts"):
        decode_r3({"text": "hi", "routed_experts": None})
    with pytest.raises(ValueError):
        decode_routed_experts("not base64!")
    pickled = io.BytesIO()
    np.save(pickled, np.array([{"x": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError):
        decode_routed_experts(base64.b64encode(pickled.getvalue()))
    with pytest.raises(ValueError, match="3-D"):
        decode_routed_experts(npy_b64(np.zeros((2, 3), np.uint8)))
    with pytest.raises(ValueError, match="uint8 or uint16"):
        decode_routed_experts(npy_b64(np.zeros((2, 3, 2), np.int64)))
    assert pickle.loads(pickle.dumps(decode_r3(npy_b64(r3())))).dense_layers == (1,)


def test_decoded_array_is_writable_and_fortran_payloads_decode() -> None:
    rows = r3()
    decoded = decode_routed_experts(npy_b64(rows))
    decoded[0, 0, 0] = 7  # a trainer may edit in place
    np.testing.assert_array_equal(decode_routed_experts(npy_b64(np.asfortranarray(rows))), rows)
    with pytest.raises(ValueError, match="does not hold"):
        decode_routed_experts(base64.b64encode(base64.b64decode(npy_b64(rows))[:-3]))
