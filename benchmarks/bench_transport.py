"""R3 from the engine core to the frontend: rows per step (vLLM's transport) against rows held
in the engine and sent once at each request's end (ours), against no R3, side by side.

A decode round like the H200 benchmark's (``docs/benchmarks.md``): 256 requests, 256 prompt
rows each on their first step, then 255 decode steps of one row each (256 output tokens),
DeepSeek-V3's R3 shape (58 layers x top-8, uint8). Per step, the real scheduler connector's
``take_output`` gives each request's rows (``ArtifactSchedulerConnector``: a request with a
stop string gets them per step, as vLLM's own connector sends every request's; one without is
held), the step's ``EngineCoreOutputs`` are encoded with vLLM's ``MsgpackEncoder`` and sent
over a ZMQ IPC socket with ``copy=False``, as the engine core's output thread does. A second
process receives them, decodes with vLLM's ``MsgpackDecoder`` and joins each request's chunks
at its end, as the frontend does. The three modes alternate in rounds (machine drift hits
them alike).

Prints per mode the medians over rounds of: the scheduler's ``take_output`` CPU, the output
thread's encode + send CPU, the frontend's receive + decode + join CPU (``time.thread_time``),
the frames sent, and the round's wall time; then the ratios to per-step rows, and a numpy
copy of the round's R3 as the machine's floor.

Run: ``.venv/bin/python benchmarks/bench_transport.py [--rounds R] [--requests N]
[--steps S] [--json out.json]`` (~1 min)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import zmq
from copy_floor import copy_floor_seconds
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.request import RequestStatus
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from vllm_artifact.contract import EmittedRows, StepResult
from vllm_artifact.integration.scheduler_connector import ArtifactSchedulerConnector

LAYERS, TOP_K = 58, 8
MODES = ("off", "per_step", "held")


class _Request(SimpleNamespace):
    def is_finished(self) -> bool:
        return bool(RequestStatus.is_finished(self.status))


def _requests(count: int, prompt: int, per_step: bool, round_index: int) -> dict[str, Any]:
    stop = ["a stop string"] if per_step else []
    return {
        f"r{round_index}-{i}": _Request(
            request_id=f"r{round_index}-{i}",
            num_tokens=prompt,
            num_prompt_tokens=prompt,
            num_output_tokens=0,
            block_hashes=[],
            status=RequestStatus.RUNNING,
            sampling_params=SimpleNamespace(
                routed_experts_prompt_start=0, stop=stop, extra_args=None
            ),
            resumable=False,
        )
        for i in range(count)
    }


def _receiver(address: str, results: Any) -> None:
    """The frontend: receive, decode and join each request's chunks at its end."""
    decoder = MsgpackDecoder(EngineCoreOutputs)
    with zmq.Context() as context, context.socket(zmq.PULL) as socket:
        socket.connect(address)
        while True:
            first = socket.recv_multipart(copy=False)
            if first[0].bytes == b"quit":
                return
            cpu = time.thread_time()
            chunks: dict[str, list[np.ndarray]] = {}
            joined_rows = 0
            frames = list(first)
            while True:
                outputs = decoder.decode(frames)
                for output in outputs.outputs:
                    if output.routed_experts is not None:
                        chunks.setdefault(output.request_id, []).append(output.routed_experts)
                    if output.finish_reason is not None:
                        parts = chunks.pop(output.request_id, [])
                        if parts:
                            joined_rows += len(np.concatenate(parts))
                if outputs.wave_complete is not None:  # the round's last step
                    break
                frames = socket.recv_multipart(copy=False)
            results.put((time.thread_time() - cpu, joined_rows))


def _round(
    connector: ArtifactSchedulerConnector,
    mode: str,
    socket: Any,
    requests: dict[str, Any],
    prompt: int,
    steps: int,
) -> dict[str, float]:
    ids = list(requests)
    scheduled = SimpleNamespace(
        num_scheduled_tokens=dict.fromkeys(ids, 1), total_num_scheduled_tokens=len(ids)
    )
    connector.build_connector_meta(scheduled, requests)  # type: ignore[arg-type]
    encoder = MsgpackEncoder()
    rng = np.random.default_rng(0)
    take_cpu = send_cpu = 0.0
    frames = 0
    wall = time.perf_counter()
    for step in range(steps + 1):
        if step == 0:
            rows = rng.integers(0, 256, (len(ids), prompt, LAYERS, TOP_K), np.uint8)
            result = StepResult(entries={rid: EmittedRows(0, rows[i]) for i, rid in enumerate(ids)})
        else:
            result = StepResult(
                decode_ids=ids,
                decode_token_starts=[prompt + step - 1] * len(ids),
                decode_rows=rng.integers(0, 256, (len(ids), LAYERS, TOP_K), np.uint8),
            )
        last = step == steps
        cpu = time.thread_time()
        outputs = []
        for rid, request in requests.items():
            request.num_tokens = prompt + step + 1 if step else prompt + 1
            request.num_output_tokens = step + 1
            if last:
                request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            routed = None if mode == "off" else connector.take_output(request, result)
            outputs.append(
                EngineCoreOutput(
                    request_id=rid,
                    new_token_ids=[step],
                    finish_reason=FinishReason.LENGTH if last else None,
                    routed_experts=routed,
                )
            )
        if last:
            for request in requests.values():
                connector.request_finished(request)
        take_cpu += time.thread_time() - cpu
        cpu = time.thread_time()
        message = EngineCoreOutputs(outputs=outputs, wave_complete=1 if last else None)
        buffers = encoder.encode(message)
        socket.send_multipart(buffers, copy=False)
        send_cpu += time.thread_time() - cpu
        frames += len(buffers)
    return {
        "take_output_s": take_cpu,
        "encode_send_s": send_cpu,
        "frames": frames,
        "engine_wall_s": time.perf_counter() - wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--steps", type=int, default=255)
    parser.add_argument("--json", help="write the per-round figures here")
    args = parser.parse_args()

    address = f"ipc:///tmp/bench-transport-{time.time_ns()}"
    results: Any = mp.get_context("spawn").Queue()
    receiver = mp.get_context("spawn").Process(target=_receiver, args=(address, results))
    samples: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    with zmq.Context() as context, context.socket(zmq.PUSH) as socket:
        socket.bind(address)
        receiver.start()
        expected = args.requests * (args.prompt + args.steps)
        # One connector per mode for the whole run, as an engine has one for its life.
        connectors = {mode: ArtifactSchedulerConnector() for mode in MODES}
        for round_index in range(args.rounds):
            order = MODES[round_index % 3 :] + MODES[: round_index % 3]
            for mode in order:
                requests = _requests(args.requests, args.prompt, mode == "per_step", round_index)
                figures = _round(connectors[mode], mode, socket, requests, args.prompt, args.steps)
                frontend_s, rows = results.get(timeout=600)
                if rows != (0 if mode == "off" else expected):
                    raise SystemExit(f"{mode}: the frontend joined {rows} rows, not {expected}")
                figures["frontend_s"] = frontend_s
                samples[mode].append(figures)
        socket.send_multipart([b"quit"])
        receiver.join(timeout=30)

    floor_s = copy_floor_seconds((expected, LAYERS, TOP_K))

    def med(mode: str, key: str) -> float:
        return statistics.median(s[key] for s in samples[mode])

    print(
        f"{args.requests} requests x ({args.prompt} prompt rows + {args.steps} decode steps), "
        f"{LAYERS} layers x top-{TOP_K} uint8, {args.rounds} rounds; medians per round"
    )
    keys = ("take_output_s", "encode_send_s", "frontend_s", "engine_wall_s")
    print(f"{'mode':9} {'take_output':>12} {'encode+send':>12} {'frontend':>10} {'frames':>8}")
    for mode in MODES:
        print(
            f"{mode:9} {med(mode, 'take_output_s'):11.3f}s {med(mode, 'encode_send_s'):11.3f}s "
            f"{med(mode, 'frontend_s'):9.3f}s {med(mode, 'frames'):8.0f}"
        )
    for key in keys[:3]:
        extra = {m: med(m, key) - med("off", key) for m in ("per_step", "held")}
        print(
            f"{key}: R3's cost over off, held / per step = "
            f"{extra['held'] * 1e3:.1f} / {extra['per_step'] * 1e3:.1f} ms"
        )
    total = {m: sum(med(m, k) - med("off", k) for k in keys[:3]) for m in ("per_step", "held")}
    print(
        f"all three threads: R3 costs {total['held'] * 1e3:.1f} ms held, "
        f"{total['per_step'] * 1e3:.1f} ms per step (ratio {total['held'] / total['per_step']:.3f})"
    )
    print(
        f"floor: numpy copy of the round's R3 ({expected * LAYERS * TOP_K / 1e6:.1f} MB): "
        f"{floor_s * 1e3:.1f} ms"
    )
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"args": vars(args), "samples": samples, "floor_s": floor_s}, out, indent=1)


if __name__ == "__main__":
    main()
