"""Tests for the tiny-model builder and the transformers routing oracle.

Every engine test trusts these two pieces: the models must be reproducible and
loadable, and the oracle must report what the reference implementation routes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

from vllm_artifact.selftest import tiny_models as tm
from vllm_artifact.selftest.oracle import (
    DENSE_FILL,
    RouterOracle,
    assert_routing_matches,
    hf_router_topk,
    load_hf_model,
)

VARIANTS = sorted(tm.VARIANTS)
SAMPLE_TEXT = (
    "The router sends each token to a few experts. Numbers: 12345, 3.14; "
    "names: Ada, Linus; unicode: caf\u00e9 \u4f60\u597d \U0001f600.\n"
)


def _digests(model_dir: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(model_dir.iterdir())
        if p.is_file()
    }


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("built")
    return {v: tm.build_tiny_model(v, root / v) for v in VARIANTS}


@pytest.fixture(scope="module")
def sample_ids(built: dict[str, Path]) -> list[int]:
    """A few hundred tokens: real text plus seeded random IDs (both variants share a vocab)."""
    tok = AutoTokenizer.from_pretrained(built[VARIANTS[0]])
    ids = [int(i) for i in tok.encode(SAMPLE_TEXT * 4)]
    rng = np.random.default_rng(7)
    ids += rng.integers(len(tm.SPECIAL_TOKENS), tm.VARIANTS[VARIANTS[0]].vocab_size, 240).tolist()
    return ids


@pytest.fixture(scope="module")
def oracles(built: dict[str, Path], sample_ids: list[int]) -> dict[str, RouterOracle]:
    return {v: hf_router_topk(built[v], sample_ids) for v in VARIANTS}


# ------------------------------------------------------------------- builder


@pytest.mark.parametrize("variant", VARIANTS)
def test_rebuild_is_byte_identical(variant: str, built: dict[str, Path], tmp_path: Path) -> None:
    again = tm.build_tiny_model(variant, tmp_path / "again")
    first, second = _digests(built[variant]), _digests(again)
    assert set(first) == {*tm.MODEL_FILES, tm.MANIFEST_FILE}
    assert first == second


@pytest.mark.parametrize("variant", VARIANTS)
def test_default_cache_matches_a_fresh_build(variant: str, built: dict[str, Path]) -> None:
    """A cached model must equal what the builder makes now (else bump BUILDER_VERSION)."""
    cached = tm.ensure_tiny_model(variant)
    assert _digests(cached) == _digests(built[variant]), (
        f"{cached} differs from a fresh build: bump tiny_models.BUILDER_VERSION"
    )


def test_seed_changes_weights(built: dict[str, Path], tmp_path: Path) -> None:
    spec = tm.VARIANTS["qwen3-moe-8x2"]
    other = tm.build_from_spec(dataclasses.replace(spec, seed=spec.seed + 1), tmp_path / "s")
    a, b = _digests(built["qwen3-moe-8x2"]), _digests(other)
    assert a[tm.WEIGHTS_FILE] != b[tm.WEIGHTS_FILE]
    assert spec.digest() != dataclasses.replace(spec, seed=spec.seed + 1).digest()


@pytest.mark.parametrize("variant", VARIANTS)
def test_config_and_weights_load_in_transformers(variant: str, built: dict[str, Path]) -> None:
    spec = tm.VARIANTS[variant]
    cfg = AutoConfig.from_pretrained(built[variant])
    assert cfg.model_type == "qwen3_moe"
    assert cfg.num_experts == spec.num_experts
    assert cfg.num_experts_per_tok == spec.top_k
    assert list(cfg.mlp_only_layers) == list(spec.mlp_only_layers)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.head_dim) == (spec.num_layers, 128, 32)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)
    assert cfg.vocab_size == 512 and cfg.max_position_embeddings >= 4096
    assert cfg.norm_topk_prob is True and cfg.tie_word_embeddings is False
    assert cfg.dtype == torch.float32

    model = load_hf_model(built[variant])
    params = dict(model.named_parameters())
    assert all(p.dtype == torch.float32 for p in params.values())
    # Every layer is MoE except the dense ones, and nothing was left at init.
    for i, layer in enumerate(model.model.layers):
        assert hasattr(layer.mlp, "experts") == spec.moe_layers[i]
    assert not any(torch.isnan(p).any() for p in params.values())


def test_variant_b_has_300_experts_and_dense_layer_1(built: dict[str, Path]) -> None:
    spec = tm.VARIANTS["qwen3-moe-300x4-dense1"]
    assert spec.num_experts == 300 and spec.num_experts > 256  # forces uint16 IDs
    assert spec.top_k == 4
    assert spec.moe_layers == [True, False, True, True]
    size = (built["qwen3-moe-300x4-dense1"] / tm.WEIGHTS_FILE).stat().st_size
    assert size < 20 * 2**20


def test_tokenizer_round_trip_and_chat_template(built: dict[str, Path]) -> None:
    tok = AutoTokenizer.from_pretrained(built["qwen3-moe-8x2"])
    cfg = AutoConfig.from_pretrained(built["qwen3-moe-8x2"])
    assert len(tok) == cfg.vocab_size
    ids = tok.encode(SAMPLE_TEXT)
    assert all(0 <= i < cfg.vocab_size for i in ids)
    assert len(ids) < len(SAMPLE_TEXT.encode())  # merges were learned
    assert tok.decode(ids) == SAMPLE_TEXT
    for special in tm.SPECIAL_TOKENS:
        assert len(tok.encode(special)) == 1
    assert tok.eos_token == tm.IM_END and tok.eos_token_id == cfg.eos_token_id
    assert tok.pad_token_id is not None and tok.bos_token_id is not None

    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello?"},
    ]
    turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    assert tok.apply_chat_template(messages, tokenize=False) == turns
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == turns + "<|im_start|>assistant\n"
    assert tok.decode(tok.encode(prompt)) == prompt


def test_vllm_parses_config_and_tokenizer(built: dict[str, Path]) -> None:
    from vllm.tokenizers import get_tokenizer
    from vllm.transformers_utils.config import get_config

    path = built["qwen3-moe-300x4-dense1"]
    cfg = get_config(path, trust_remote_code=False)
    assert cfg.architectures == ["Qwen3MoeForCausalLM"]
    assert (cfg.num_experts, cfg.num_experts_per_tok, list(cfg.mlp_only_layers)) == (300, 4, [1])
    tok = get_tokenizer(str(path))
    assert tok.encode(SAMPLE_TEXT, add_special_tokens=False) == (
        AutoTokenizer.from_pretrained(path).encode(SAMPLE_TEXT)
    )


# --------------------------------------------------------------------- cache


def test_ensure_tiny_model_caches_repairs_and_races(tmp_path: Path) -> None:
    results: list[Path] = []

    def build() -> None:
        results.append(tm.ensure_tiny_model("qwen3-moe-8x2", tmp_path))

    threads = [threading.Thread(target=build) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2 and results[0] == results[1]
    path = results[0]
    assert path.parent == tmp_path and f"-b{tm.BUILDER_VERSION}-" in path.name
    assert tm.is_complete(path)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp leftovers

    mtime = (path / tm.WEIGHTS_FILE).stat().st_mtime_ns
    assert tm.ensure_tiny_model("qwen3-moe-8x2", tmp_path) == path
    assert (path / tm.WEIGHTS_FILE).stat().st_mtime_ns == mtime  # not rebuilt

    digests = _digests(path)
    (path / tm.WEIGHTS_FILE).write_bytes(b"truncated")
    assert not tm.is_complete(path)
    assert tm.ensure_tiny_model("qwen3-moe-8x2", tmp_path) == path
    assert _digests(path) == digests
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_default_cache_dir_honours_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(tm.CACHE_ENV_VAR, str(tmp_path))
    assert tm.default_cache_dir() == tmp_path / "models"
    monkeypatch.delenv(tm.CACHE_ENV_VAR)
    assert tm.default_cache_dir().name == "models"


def test_cli_builds_all_and_prints_paths(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert tm.main(["--all", "--cache-dir", str(tmp_path)]) == 0
    printed = capsys.readouterr().out.split()
    assert sorted(Path(p).name for p in printed) == sorted(tm.model_dir_name(v) for v in VARIANTS)
    assert all(tm.is_complete(Path(p)) for p in printed)
    with pytest.raises(ValueError, match="unknown tiny model variant"):
        tm.ensure_tiny_model("nope", tmp_path)


# -------------------------------------------------------------------- oracle


@pytest.mark.parametrize("variant", VARIANTS)
def test_oracle_shape_and_ids(
    variant: str, built: dict[str, Path], oracles: dict[str, RouterOracle], sample_ids: list[int]
) -> None:
    spec = tm.VARIANTS[variant]
    o = oracles[variant]
    assert o.topk_ids.shape == (len(sample_ids), spec.num_layers, spec.top_k)
    assert o.topk_gap.shape == (len(sample_ids), spec.num_layers)
    assert o.moe_layers.tolist() == spec.moe_layers
    assert (o.num_experts, o.top_k) == (spec.num_experts, spec.top_k)
    moe = o.topk_ids[:, o.moe_layers]
    assert ((moe >= 0) & (moe < spec.num_experts)).all()
    srt = np.sort(moe, axis=-1)
    assert (np.diff(srt, axis=-1) > 0).all()  # distinct within each row
    assert (o.topk_ids[:, ~o.moe_layers] == DENSE_FILL).all()
    assert (o.topk_gap[:, o.moe_layers] >= 0).all()
    # The same tokens give the same routing (the model is cached, eval, no dropout).
    again = hf_router_topk(built[variant], sample_ids)
    np.testing.assert_array_equal(again.topk_ids, o.topk_ids)


@pytest.mark.parametrize("variant", VARIANTS)
def test_oracle_agrees_with_transformers_own_router_outputs(
    variant: str, built: dict[str, Path], oracles: dict[str, RouterOracle], sample_ids: list[int]
) -> None:
    model = load_hf_model(built[variant])
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor([sample_ids]), output_router_logits=True, use_cache=False
        )
    o = oracles[variant]
    recorded = [r.reshape(len(sample_ids), -1).numpy() for r in out.router_logits]
    assert len(recorded) == int(o.moe_layers.sum())
    for logits, layer in zip(recorded, np.flatnonzero(o.moe_layers), strict=True):
        np.testing.assert_allclose(logits, o.router_logits[:, layer], rtol=0, atol=1e-6)
        hf_choice = torch.topk(torch.softmax(torch.from_numpy(logits), -1), o.top_k).indices
        same = np.sort(hf_choice.numpy(), -1) == np.sort(o.topk_ids[:, layer], -1)
        assert same.all()


@pytest.mark.parametrize("variant", VARIANTS)
def test_routing_is_spread_and_decisive(variant: str, oracles: dict[str, RouterOracle]) -> None:
    o = oracles[variant]
    for layer in np.flatnonzero(o.moe_layers):
        ids = o.topk_ids[:, layer].ravel()
        counts = np.bincount(ids, minlength=o.num_experts)
        share = counts.max() / counts.sum()
        assert share <= 0.5, f"layer {layer}: one expert takes {share:.0%}"
        if ids.size >= 20 * o.num_experts:  # enough draws to expect every expert
            unused = np.flatnonzero(counts == 0)
            assert not unused.size, f"layer {layer}: unused experts {unused}"
        else:
            assert (counts > 0).mean() >= 0.5, f"layer {layer}: only {(counts > 0).sum()} used"
        # Float32 noise between engines is ~1e-5 here; gaps must dwarf it.
        gaps = o.topk_gap[:, layer]
        assert (gaps > 1e-3).mean() >= 0.95, f"layer {layer}: too many near-ties"
        assert np.median(gaps) > 0.05


def test_routing_depends_on_context(oracles: dict[str, RouterOracle]) -> None:
    """Repeats of a token route differently at other positions: rows are not just token IDs."""
    o = oracles["qwen3-moe-8x2"]
    first: dict[int, np.ndarray] = {}
    differ = total = 0
    for t, token in enumerate(o.token_ids):
        rows = np.sort(o.topk_ids[t], axis=-1)
        if token in first:
            differ += int((rows != first[token]).any(axis=-1).sum())
            total += rows.shape[0]
        else:
            first[token] = rows
    assert total > 100
    assert differ / total > 0.05


# ---------------------------------------------------------------- assertions


def _engine_like(o: RouterOracle, dtype: type[np.unsignedinteger]) -> np.ndarray:
    """What vLLM returns: unsigned IDs, arbitrary order within top-k, zeros in dense layers."""
    act = np.flip(o.topk_ids, axis=-1).copy()
    act[:, ~o.moe_layers] = np.iinfo(dtype).max  # vllm-artifact's dense-layer mark
    return act.astype(dtype)


@pytest.mark.parametrize("variant", VARIANTS)
def test_assert_routing_matches_accepts_engine_layout(
    variant: str, oracles: dict[str, RouterOracle]
) -> None:
    o = oracles[variant]
    dtype = np.uint8 if o.num_experts <= 256 else np.uint16
    act = _engine_like(o, dtype)
    assert_routing_matches(act, o)
    assert_routing_matches(act[3:10], o, rows=slice(3, 10))
    assert_routing_matches(act[:-1], o, rows=slice(0, o.num_tokens - 1))


def test_assert_routing_matches_reports_mismatches(oracles: dict[str, RouterOracle]) -> None:
    o = oracles["qwen3-moe-300x4-dense1"]
    act = _engine_like(o, np.uint16).astype(np.int64)
    layer = 2
    t = 5
    wrong = next(e for e in range(o.num_experts) if e not in o.topk_ids[t, layer])
    act[t, layer, 0] = wrong
    mark = int(np.iinfo(np.uint16).max)
    with pytest.raises(AssertionError, match=rf"token {t} .*layer {layer}.*logit gap"):
        assert_routing_matches(act, o, dense_mark=mark)
    # A tolerance above this row's gap lets it pass.
    assert_routing_matches(act, o, near_tie_gap=float(o.topk_gap[t, layer]) + 1.0, dense_mark=mark)

    act = _engine_like(o, np.uint16)
    act[0, 1, 0] = 0  # dense layer 1 must hold the mark, not expert 0
    with pytest.raises(AssertionError, match="dense layer 1"):
        assert_routing_matches(act, o)
    with pytest.raises(TypeError, match="dense_mark"):
        assert_routing_matches(act.astype(np.int64), o)
    with pytest.raises(AssertionError, match="shape"):
        assert_routing_matches(act[:-1], o)
    act = _engine_like(o, np.uint16).astype(np.int64)
    act[9, 0] = act[9, 0, 0]  # duplicated IDs are not the expected set
    with pytest.raises(AssertionError, match="token 9 "):
        assert_routing_matches(act, o, dense_mark=mark)
