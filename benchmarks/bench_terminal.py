"""Terminal R3 of one 32K-token DeepSeek-V3-sized request: store -> base64 ``.npy`` -> client.

What the server does for a request whose R3 sits in the store (a prefix hit, e.g. a repeated
prompt): rank zero reads the rows (``RequestTracker._read_span``: ``ShmStore.read_into`` with
every object's envelope and xxh3 checksum verified) and vLLM's serving layer encodes the
finished array with ``vllm.utils.serial_utils.numpy2base64`` (``np.save`` into a ``BytesIO``
plus ``pybase64.b64encode``). Timed side by side, round robin, on the same 14.5 MiB:

* ``copy``: a plain numpy copy of the same bytes (+ the same encoding): the floor;
* ``vLLM``: vLLM 0.32's own path: ``materialize_routed_experts`` on its in-process
  ``BlockObjectStore`` (``get_concatenated`` + ``np.frombuffer``) + ``numpy2base64``;
* ``ours``: ``materialize`` from our /dev/shm ``ShmStore`` (checksums verified) + the encoder
  our ``terminal_output`` hook puts in vLLM's serving layer in place of ``numpy2base64``
  (``vllm_artifact.core.npy.encode_npy_base64``: the same text);
* the client: ``vllm_artifact.client.decode_routed_experts`` of the payload string;
* the keys-only handoff (``routed_experts_format="keys"``): what the scheduler does at the
  request's end (keys from the KV block hashes, the ``R3Keys`` JSON) and what a trainer on the
  node does with it (``R3Reader.read``: parse, look up, copy with checksums verified), next to
  the array path's server encode + client decode; and the frontend's check before it answers
  (``R3Reader.verify`` from the objects' envelopes against a read of every payload), with the
  digest the engine makes of the request's rows for each;

Targets (issue 6): ours <= 1.25x vLLM's path and <= 8 ms in total; client decode <= 6 ms.

"As served" lines add what both paths also pay inside vLLM for a realistic request
(32761-token prompt, 32752 tokens served by the prefix cache, 8 generated tokens): the rows
of the first step, where vLLM's worker concatenates the store rows with the rows computed in
that step (ours reads the store rows into the step's array, ``RequestTracker._emit``, so it
makes no such copy), and the ``OutputProcessor``'s concatenation of the per-step chunks at
finish (which ours makes into an ``.npy`` file, so its encoding needs no further copy). The
lines "+ the response's JSON" add building vLLM's ``CompletionResponse`` and rendering it as
its router does (Starlette's ``JSONResponse``: ``json.dumps``), which for ours is the
terminal_output hook's rendering (``render_spliced``: the same bytes, base64 joined in).
"Alternative" lines time paths nothing runs (see the end of the output and docs/benchmarks.md).

Three allocator regimes, each in its own process: ``default`` (glibc as configured: every
multi-MiB ``bytes``/``str`` is a fresh ``mmap`` whose pages fault in on first touch, ~3 us per
4 KiB page on this VM, which dominates the encoding), ``keep`` (``MALLOC_MMAP_THRESHOLD_``
and ``MALLOC_TRIM_THRESHOLD_`` set so freed heap memory is reused: what a long-running server
sees once its heap has grown) and ``thp`` (``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``: glibc
asks for transparent huge pages on its multi-MiB mappings, so a fresh 19.3 MiB ``str`` took 122
page faults instead of 4,721 in a scratch check, and freed memory still goes back to the
kernel). Targets are judged in each.

Run: ``.venv/bin/python benchmarks/bench_terminal.py [--reps N] [--tokens T] [--json FILE]``
(``--malloc default``, ``keep`` or ``thp`` runs one regime only).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pybase64
from bench_store import Rounds
from server_processes import tree_memory
from starlette.responses import JSONResponse
from vllm.distributed.aux_output_connector.routed_experts import (
    materialize_routed_experts,
    publish_routed_experts,
)
from vllm.distributed.aux_output_connector.store import BlockObjectStore
from vllm.entrypoints.openai.completion.protocol import CompletionResponse, CompletionResponseChoice
from vllm.entrypoints.serve.engine.protocol import UsageInfo
from vllm.utils.serial_utils import numpy2base64

from vllm_artifact.client import R3Keys, R3Reader, decode_routed_experts
from vllm_artifact.core import Namespace, R3Layout, full_block_keys
from vllm_artifact.core.handoff import RowsDigest, StoreAddress
from vllm_artifact.core.json_splice import render_spliced
from vllm_artifact.core.npy import concatenate_into_npy, empty_npy_file, encode_npy_base64
from vllm_artifact.core.objects_digest import objects_digest
from vllm_artifact.core.store import ShmStore
from vllm_artifact.integration.hooks import WRAPPED_MARK

# vLLM's own encoder, not our hook's wrap of it (hooks install only in vLLM's processes).
assert not getattr(numpy2base64, WRAPPED_MARK, False), "run without our hooks"
USAGE = UsageInfo(prompt_tokens=32761, completion_tokens=8, total_tokens=32769)
TARGET_VS_VLLM = 1.25
TARGET_TOTAL_S = 8e-3
TARGET_DECODE_S = 6e-3
GENERATED = 8  # generated tokens of the "as served" request
#: glibc settings of each allocator regime (read at process start). ``keep``: no mmap (and no
#: page faults) for buffers up to 32 MiB, and freed memory stays in the heap for the next
#: request. ``thp``: multi-MiB mappings are advised as transparent huge pages (glibc >= 2.35,
#: with /sys/kernel/mm/transparent_hugepage/enabled at ``madvise`` or ``always``).
REGIMES: dict[str, dict[str, str]] = {
    "default": {},
    "keep": {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)},
    "thp": {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"},
}
MALLOC_VARIABLES = sorted({k for env in REGIMES.values() for k in env})


# ------------------------------------------------------------ alternatives (not used)


def decode_bytearray(payload: str) -> np.ndarray:
    """The client decode before ``decode_npy_base64``: one ``bytearray`` from pybase64 and a
    view of it (fast when the heap has the pages already, slow when they fault in)."""
    raw = pybase64.b64decode_as_bytearray(payload, validate=True)
    fp = io.BytesIO(raw[:4096])
    np.lib.format.read_magic(fp)
    shape, fortran, dtype = np.lib.format.read_array_header_1_0(fp)
    assert not fortran and not dtype.hasobject
    return np.frombuffer(raw, dtype=dtype, offset=fp.tell()).reshape(shape)


# ------------------------------------------------------------------------------ the run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--block-size", type=int, default=16, help="KV / R3 block size")
    ap.add_argument(
        "--malloc", choices=("all", *REGIMES), default="all", help="allocator regime(s)"
    )
    ap.add_argument("--json", type=Path, help="write the measurements here (for plotting)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.tokens % args.block_size:
        ap.error("--tokens must be a multiple of --block-size")
    if not args.child:
        # glibc reads its settings at process start: each regime runs in a fresh process.
        sys.exit(run_regimes(args, list(REGIMES) if args.malloc == "all" else [args.malloc]))
    regime = args.malloc
    data: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "tokens": args.tokens,
        "block_size": args.block_size,
        "reps": args.reps,
        "targets": {
            "vs_vllm": TARGET_VS_VLLM,
            "total_ms": TARGET_TOTAL_S * 1e3,
            "decode_ms": TARGET_DECODE_S * 1e3,
        },
        "regimes": {regime: run_regime(regime, args.tokens, args.block_size, args.reps)},
    }
    if args.json:
        args.json.write_text(json.dumps(data, indent=2) + "\n")


def run_regimes(args: argparse.Namespace, regimes: list[str]) -> int:
    """Run each regime in a child process with exactly its glibc settings; merge the JSON."""
    merged: dict[str, Any] = {}
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for regime in regimes:
            child_json = Path(tmp) / f"{regime}.json"
            cmd = [sys.executable, __file__, "--reps", str(args.reps), "--tokens"]
            cmd += [str(args.tokens), "--block-size", str(args.block_size)]
            cmd += ["--malloc", regime, "--child", "--json", str(child_json)]
            env = {k: v for k, v in os.environ.items() if k not in MALLOC_VARIABLES}
            sys.stdout.flush()
            if subprocess.run(cmd, env={**env, **REGIMES[regime]}, check=False).returncode:
                failed += 1
                continue
            child = json.loads(child_json.read_text())
            if not merged:
                merged = {**child, "command": " ".join([Path(sys.executable).name, *sys.argv])}
            else:
                merged["regimes"].update(child["regimes"])
    if args.json and merged:
        args.json.write_text(json.dumps(merged, indent=2) + "\n")
        print(f"\nmeasurements written to {args.json}")
    return 1 if failed else 0


def thp_setting() -> str:
    """The kernel's transparent huge page mode (the bracketed word), or "unknown"."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "unknown"
    return text.split("[", 1)[-1].split("]", 1)[0] if "[" in text else text.strip()


def run_regime(regime: str, tokens: int, bs: int, reps: int) -> dict[str, Any]:
    layout = R3Layout(num_layers=58, top_k=8, num_experts=256, block_size=bs)
    ns = Namespace("deepseek-ai/DeepSeek-V3", layout, "bench-terminal")
    data = np.random.default_rng(0).integers(0, 256, size=(tokens, 58, 8), dtype=np.uint8)
    n_blocks = tokens // bs
    load = os.getloadavg()
    env = " ".join(f"{k}={os.environ[k]}" for k in MALLOC_VARIABLES if k in os.environ) or "unset"
    print(
        f"\n=== allocator regime {regime!r} (glibc {env})\n"
        f"{tokens} tokens x 58 layers x top-8 uint8 = {data.nbytes / 2**20:.1f} MiB "
        f"({n_blocks} objects of {bs} tokens); min and median of {reps} runs; "
        f"load average {load[0]:.2f} on {os.cpu_count()} CPUs"
    )

    # vLLM's in-process store, filled through its own publish helper.
    vstore = BlockObjectStore(max_bytes=2 * data.nbytes, object_nbytes=layout.block_nbytes)
    vkeys = [f"r0-b{i}" for i in range(n_blocks)]
    publish_routed_experts(
        vstore,
        batches=[(vkeys, [(i * bs, data[i * bs : (i + 1) * bs]) for i in range(n_blocks)])],
        block_size=bs,
    )
    # Ours: a private root under /dev/shm, one writer store (rank zero reads through it).
    root = tempfile.mkdtemp(prefix="vllm-artifact-bench-terminal-", dir="/dev/shm")
    store = ShmStore.create_or_open_writer(
        root, "terminal", layout=layout, capacity_bytes=data.nbytes + (8 << 20)
    )
    try:
        keys = full_block_keys(ns, [f"r0/{i}".encode() for i in range(n_blocks)])
        store.put_blocks(keys, data, 0, pin=False)
        results = measure(data, layout, vstore, vkeys, store, keys, reps, ns)
    finally:
        store.close()
        vstore.close()
        shutil.rmtree(root, ignore_errors=True)
    huge = tree_memory(os.getpid())[2]  # this process alone: it starts no children
    print(
        f"\ntransparent huge pages: {thp_setting()}; this process has {huge / 2**20:.0f} MiB "
        "of anonymous memory in them"
    )
    return {
        "load": load,
        "anon_huge_pages": huge,
        "results_ms": {k: [v[0] * 1e3, v[1] * 1e3] for k, v in results.items()},
    }


def measure(
    data: np.ndarray,
    layout: R3Layout,
    vstore: BlockObjectStore,
    vkeys: list[str],
    store: ShmStore,
    keys: list[Any],
    reps: int,
    ns: Namespace,
) -> dict[str, tuple[float, float]]:
    tokens, bs = len(data), layout.block_size
    shape = (58, 8)
    dtype = np.dtype(np.uint8)

    def v_mat(n: int = len(vkeys)) -> np.ndarray:
        return materialize_routed_experts(vstore, vkeys[:n], shape_per_token=shape, dtype=dtype)

    def s_mat() -> np.ndarray:
        out = layout.empty(tokens)
        store.read_into(keys, out, token_start=0)  # every object verified, as a reader does
        return out

    # Same bytes on every path, and the client gets the original array back.
    payload = numpy2base64(data)
    assert numpy2base64(v_mat()) == payload
    assert numpy2base64(s_mat()) == payload
    assert encode_npy_base64(s_mat()) == payload
    assert np.array_equal(decode_routed_experts(payload), data)
    assert np.array_equal(decode_bytearray(payload), data)

    # "As served": prompt = tokens - GENERATED + 1, the prefix cache serves whole blocks up
    # to the last prompt token, the rest of the prompt is computed in the first step and every
    # later step adds one row; vLLM's OutputProcessor concatenates the chunks at finish.
    prompt = tokens - GENERATED + 1
    hit_blocks = (prompt - 1) // bs
    hit = hit_blocks * bs
    computed = data[hit:prompt].copy()
    decode_rows = [data[t : t + 1].copy() for t in range(prompt, tokens)]

    def v_served() -> str:
        chunk0 = np.concatenate((v_mat(hit_blocks)[:hit], computed))  # store + step rows
        return numpy2base64(np.concatenate([chunk0, *decode_rows]))  # OutputProcessor

    def s_served() -> str:
        # RequestTracker._emit: one array for the step's rows, the store rows read straight
        # into it (_read_span), the computed rows copied after them: no concatenation
        chunk0 = layout.empty(prompt)
        store.read_into(keys[:hit_blocks], chunk0[:hit], token_start=0)
        chunk0[hit:] = computed
        # our frontend hook (terminal_output): the OutputProcessor's concatenation goes into
        # an .npy file, and the serving layer's numpy2base64 is encode_npy_base64
        merged = concatenate_into_npy([chunk0, *decode_rows])
        assert merged is not None
        return encode_npy_base64(merged)

    assert v_served() == payload and s_served() == payload

    # ... and the HTTP response's text: vLLM's router renders the response model with
    # Starlette's JSONResponse (json.dumps); ours (the terminal_output hook's subclass) joins
    # the base64 in with render_spliced. Timed: model, model_dump and rendering.
    renderer = JSONResponse(content=None)

    def response_content(r3: str) -> dict[str, Any]:
        choice = CompletionResponseChoice(index=0, text="", routed_experts=r3)
        response = CompletionResponse(
            id="cmpl-0", created=0, model="m", choices=[choice], usage=USAGE
        )
        return response.model_dump()

    def v_rendered() -> bytes:
        return renderer.render(response_content(v_served()))

    def s_rendered() -> bytes:
        content = response_content(s_served())
        spliced = render_spliced(content, renderer.render)
        assert spliced is not None
        return spliced

    assert v_rendered() == s_rendered()

    def s_into_npy() -> str:
        """Alternative: read straight into the ``.npy`` buffer, encode to ``str``."""
        made = empty_npy_file(data.shape, dtype)
        assert made is not None
        store.read_into(keys, made[1], token_start=0)
        return pybase64.b64encode_as_string(made[0].data)

    assert s_into_npy() == payload
    encoded = io.BytesIO()
    np.save(encoded, data, allow_pickle=False)
    npy_bytes = encoded.getvalue()

    block_hashes = [f"r0/{i}".encode() for i in range(len(keys))]
    address = StoreAddress(root=str(store.root), name=store.name)

    def k_handle() -> str:
        """The scheduler's work at a keys-only request's end (its keys were made step by
        step while it ran: ``k_keys``)."""
        return R3Keys.of(
            store=address,
            layout=layout.canonical(),
            block_size=bs,
            token_start=0,
            first_row=0,
            num_rows=tokens,
            keys=keys,
            last_block_tokens=bs,
            trusted=True,
        ).to_json()

    handle_json = k_handle()
    reader = R3Reader()
    assert np.array_equal(reader.read(handle_json).experts, data)
    # The frontend's check before it answers: from the envelopes (the handle's objects digest,
    # the engine's usual) against a read of every payload (the rows digest).
    plain = R3Keys.from_json(handle_json)
    objects_json = plain.model_copy(
        update={"objects_xxh3": objects_digest(layout, keys, 0, data)}
    ).to_json()
    rows_json = plain.model_copy(update={"rows_xxh3": RowsDigest.of(data)}).to_json()
    assert reader.envelopes_match(R3Keys.from_json(objects_json)) is True
    assert np.array_equal(reader.read(rows_json).experts, data)

    rounds = Rounds()
    rounds.add("copy", lambda: data.copy())
    rounds.add("copy_enc", lambda: numpy2base64(data.copy()))
    rounds.add("v_mat", v_mat)
    rounds.add("v_enc", lambda: numpy2base64(v_mat()))
    rounds.add("s_mat", s_mat)
    rounds.add("s_enc", lambda: encode_npy_base64(s_mat()))
    rounds.add("s_enc_vllm", lambda: numpy2base64(s_mat()))
    rounds.add("enc", lambda: numpy2base64(data))
    rounds.add("our_enc", lambda: encode_npy_base64(data))
    rounds.add("np_save", lambda: np.save(io.BytesIO(), data, allow_pickle=False))
    rounds.add("b64", lambda: pybase64.b64encode(npy_bytes).decode("ascii"))
    rounds.add("b64_str", lambda: pybase64.b64encode_as_string(npy_bytes))
    rounds.add("decode", lambda: decode_routed_experts(payload))
    rounds.add("v_served", v_served)
    rounds.add("s_served", s_served)
    rounds.add("v_rendered", v_rendered)
    rounds.add("s_rendered", s_rendered)
    rounds.add("alt_s_into", s_into_npy)
    rounds.add("alt_decode", lambda: decode_bytearray(payload))
    rounds.add("k_handle", k_handle)
    rounds.add("k_keys", lambda: full_block_keys(ns, block_hashes))
    rounds.add("k_read", lambda: reader.read(objects_json))  # the engine's handles
    rounds.add("k_digest_objects", lambda: objects_digest(layout, keys, 0, data))
    rounds.add("k_digest_rows", lambda: RowsDigest.of(data))
    rounds.add("k_check", lambda: reader.verify(objects_json))
    rounds.add("k_check_rows", lambda: reader.read(rows_json))
    rounds.run(reps)
    reader.close()
    r = {name: rounds[name] for name in rounds.times}
    report(r, tokens, hit, len(payload), len(handle_json))
    return r


def line(name: str, t: tuple[float, float], ref: float | None = None, what: str = "") -> str:
    lo, med = t
    rel = f"  {lo / ref:5.2f}x {what}" if ref else ""
    return f"  {name:<50} {lo * 1e3:6.2f} ms (median {med * 1e3:6.2f}){rel}"


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def report(
    r: dict[str, tuple[float, float]], tokens: int, hit: int, payload_len: int, handle_len: int
) -> None:
    v, s = r["v_enc"][0], r["s_enc"][0]
    print(f"\npayload {payload_len / 2**20:.1f} MiB of base64 .npy\n")
    print("components")
    print(line("numpy copy (new array)", r["copy"]))
    print(line("vLLM BlockObjectStore materialize", r["v_mat"], r["copy"][0], "copy"))
    print(line("ShmStore materialize (checksums verified)", r["s_mat"], r["copy"][0], "copy"))
    print(line("numpy2base64 (np.save + pybase64)", r["enc"]))
    print(line("  of which np.save into BytesIO", r["np_save"]))
    print(line("  of which pybase64.b64encode + decode('ascii')", r["b64"]))
    print(line("floor of any encoder: b64encode_as_string alone", r["b64_str"]))
    print(
        line(
            "ours: encode_npy_base64 (header + one copy + b64)",
            r["our_enc"],
            r["enc"][0],
            "numpy2base64",
        )
    )
    print("\nterminal R3: materialize + encode (targets on these)")
    print(line("copy + numpy2base64", r["copy_enc"]))
    print(
        line("vLLM's path (materialize + numpy2base64)", r["v_enc"], r["copy_enc"][0], "copy path")
    )
    print(line("ours (materialize + encode_npy_base64)", r["s_enc"], v, "vLLM's path"))
    print(line("  ours materialize + vLLM's numpy2base64", r["s_enc_vllm"], v, "vLLM's path"))
    print(line("client: decode_routed_experts", r["decode"]))
    print(
        f"\nas served ({tokens - GENERATED + 1}-token prompt, {hit} tokens from the prefix "
        f"cache, {GENERATED} generated; + vLLM's two concatenations)"
    )
    for theirs, ours, what in (
        ("v_served", "s_served", ("", " (frontend concatenation into the .npy file)")),
        (
            "v_rendered",
            "s_rendered",
            (" + the response's JSON (json.dumps)", " + the same (base64 joined in)"),
        ),
    ):
        print(line("vLLM's path" + what[0], r[theirs]))
        print(line("ours" + what[1], r[ours], r[theirs][0], "vLLM's path"))
    print("\nalternatives (same payload bytes; not what runs)")
    print(
        line(
            "ours read_into the .npy buffer + b64encode_as_string",
            r["alt_s_into"],
            v,
            "vLLM's path",
        )
    )
    print(
        line(
            "client: one b64decode_as_bytearray + frombuffer",
            r["alt_decode"],
            r["decode"][0],
            "decode_routed_experts",
        )
    )
    array_path = r["s_enc"][0] + r["decode"][0]
    keys_path = r["k_handle"][0] + r["k_keys"][0] + r["k_read"][0]
    print(
        f"\nkeys-only handoff (a {handle_len / 2**10:.0f} KiB JSON handle instead of the payload)"
    )
    print(line("server, at the end: R3Keys JSON", r["k_handle"]))
    print(line("server, spread over the steps: keys of the blocks", r["k_keys"]))
    print(line("trainer: R3Reader.read (checksums verified)", r["k_read"]))
    print(
        line(
            "server, over the steps: objects digest",
            r["k_digest_objects"],
            r["k_digest_rows"][0],
            "the rows digest",
        )
    )
    print(
        line(
            "frontend: R3Reader.verify from the envelopes",
            r["k_check"],
            r["k_check_rows"][0],
            "a read (rows digest)",
        )
    )
    print(
        f"  keys path (all three) {keys_path * 1e3:.2f} ms vs array path (ours encode + client "
        "decode) "
        f"{array_path * 1e3:.2f} ms: {keys_path / array_path:.2f}x"
    )
    ok_ratio = s <= TARGET_VS_VLLM * v
    ok_total = s <= TARGET_TOTAL_S
    ok_decode = r["decode"][0] <= TARGET_DECODE_S
    print(
        f"\ntargets (min times): ours <= {TARGET_VS_VLLM}x vLLM's path: {s / v:.2f}x "
        f"{verdict(ok_ratio)}; ours <= {TARGET_TOTAL_S * 1e3:.0f} ms: {s * 1e3:.2f} ms "
        f"{verdict(ok_total)}; client decode <= {TARGET_DECODE_S * 1e3:.0f} ms: "
        f"{r['decode'][0] * 1e3:.2f} ms {verdict(ok_decode)}"
    )


if __name__ == "__main__":
    main()
