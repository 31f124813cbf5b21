"""Weight updates in place: how long they take, and what they cost requests in flight.

The default model on the real scheduler (its model engine), detokenizer and gateway. A second
checkpoint of it (noise on every layer) is written to a temporary directory; updates alternate
between the two, so each one changes every tensor. Measured from the client:

- update_weights_from_disk (HTTP) and PushWeights (gRPC, safetensors chunks: the whole model, and
  one layer) with nothing running: the call's wall time, read + check + stage + swap;
- update_weights_from_distributed: a trainer process (harness/trainer.py, rank 0 of a gloo group the
  scheduler joined first) broadcasts the whole model; the call's wall time, receive + check + swap;
- update_weights_from_tensor, the colocated trainer's call (this process is the trainer: the tensors go into
  shared memory under torch's file_system strategy, harness/sglang_payloads.py): SGLang's engine format (a list of
  (name, tensor) pairs) of fresh tensors (each serialize moves them into shared memory: a copy), of tensors already
  there (a trainer's parameters stay in shared memory once moved; updated in place they need no second move), and
  slime's flattened bucket (one concatenation: a copy); the trainer's serialize and the call, read + check + copy
  + swap;
- the same updates made the way an RL trainer does between rollout steps while C requests stream:
  pause_generation(in_place), the update, continue_generation. The requests in flight stop for the
  whole sequence: the largest gap between two of their tokens, against their median gap;
- update_weights_from_disk without pausing (abort_all_requests false) while they stream: they run
  on to the end on the old weights (their largest gap shows they never stop); the call returns
  once they have ended and the new weights are in;
- nothing, for the gaps' baseline: the largest gap of the same streams over the same window.

    python -m bench.weights                  # writes bench/out/weights.{md,json}
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import orjson
from flatwire_client import FlatwireClient
from safetensors.torch import load_file

from bench.common import OUT_DIR, Progress, Table, fmt_time, write_results
from harness.checkpoints import perturbed_checkpoint
from harness.procs import free_port
from harness.sglang_payloads import flattened_bucket, serialize, shared_memory
from harness.stack import Stack, running
from services.common.model_store import resolve_model

SEED = 20260202
SCHEDULER_ARGS = ("--max-running-requests", "64")  # what the notes of its table say
ONE_LAYER = ".layers.1."


class Stream(threading.Thread):
    """One streaming /generate: when each of its events arrived."""

    def __init__(self, url: str, seed: int, tokens: int):
        super().__init__(daemon=True)
        self.url, self.tokens = url, tokens
        self.ids = [1000 + seed * 7 + i for i in range(12)]
        self.arrivals: list[float] = []
        self.finish: str | None = None

    def run(self) -> None:
        body = {"input_ids": self.ids, "stream": True,
                "sampling_params": {"max_new_tokens": self.tokens, "temperature": 0, "ignore_eos": True}}
        with httpx.stream("POST", f"{self.url}/generate", json=body, timeout=600) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    self.arrivals.append(time.perf_counter())
                    self.finish = (orjson.loads(line[6:])["meta_info"]["finish_reason"] or {}).get("type")

    def gaps(self, start: float, end: float) -> list[float]:
        """Gaps between consecutive tokens that arrived within [start, end]."""
        times = [t for t in self.arrivals if start <= t <= end]
        return [b - a for a, b in zip(times, times[1:])]


def under_load(stack: Stack, concurrency: int, tokens: int, action) -> dict:
    """`action()` while `concurrency` requests stream; their gaps around it, and its wall time."""
    streams = [Stream(stack.http_url, i, tokens) for i in range(concurrency)]
    for stream in streams:
        stream.start()
    deadline = time.monotonic() + 120
    while min(len(s.arrivals) for s in streams) < 20:  # all running, past their prefill
        if time.monotonic() > deadline or not all(s.is_alive() for s in streams):
            raise RuntimeError("the streaming requests did not all get going: see the services' logs")
        time.sleep(0.01)
    time.sleep(0.5)
    before = time.perf_counter()
    action()
    after = time.perf_counter()
    time.sleep(0.5)
    httpx.post(f"{stack.http_url}/abort_request", json={"abort_all": True}, timeout=60)  # end the long ones
    for stream in streams:
        stream.join(600)
    window = [gap for s in streams for gap in s.gaps(before - 0.5, after + 0.5)]
    steady = [gap for s in streams for gap in s.gaps(0, before)]
    return {"seconds": after - before, "max_gap": max(window), "median_gap": statistics.median(steady),
            "finished_whole": sum(s.finish == "length" for s in streams)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.weights", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args(argv)
    model_dir = resolve_model(None)
    log_dir = OUT_DIR / "weights-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    progress = Progress(12, "weights")
    with tempfile.TemporaryDirectory() as scratch, \
            running(model_dir, log_dir, scheduler_args=SCHEDULER_ARGS) as stack, \
            FlatwireClient(stack.grpc_address) as client, httpx.Client(timeout=600) as http:
        stack.wait_ready()
        other = perturbed_checkpoint(model_dir, Path(scratch), SEED)  # noise on every layer
        checkpoints = [other, model_dir]
        tensors = [load_file(path / "model.safetensors") for path in checkpoints]
        model_bytes = sum(t.numel() * t.element_size() for t in tensors[0].values())
        layer = [{name: t for name, t in state.items() if ONE_LAYER in name} for state in tensors]
        layer_bytes = sum(t.numel() * t.element_size() for t in layer[0].values())
        count = iter(range(10**6))

        def from_disk() -> None:
            reply = http.post(f"{stack.http_url}/update_weights_from_disk",
                              json={"model_path": str(checkpoints[next(count) % 2])})
            assert reply.status_code == 200 and reply.json()["success"], reply.text

        def pushed(states: list[dict]):
            def push() -> None:
                response = client.push_weights(states[next(count) % 2])
                assert response.success, response.message
            return push

        def broadcast() -> None:
            port = free_port()
            trainer = subprocess.Popen([sys.executable, "-m", "harness.trainer", "--port", str(port), "--world-size",
                                        "2", "--checkpoint", str(checkpoints[next(count) % 2])],
                                       stdout=subprocess.PIPE, text=True)
            assert trainer.stdout is not None
            body = json.loads(trainer.stdout.readline())
            joined = http.post(f"{stack.http_url}/init_weights_update_group", json={
                "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
                "backend": "gloo"})
            assert joined.json()["success"], joined.text
            start = time.perf_counter()
            reply = http.post(f"{stack.http_url}/update_weights_from_distributed", json=body)
            own_times.append(time.perf_counter() - start)
            assert reply.json()["success"], reply.text
            assert trainer.wait(timeout=60) == 0
            assert http.post(f"{stack.http_url}/destroy_weights_update_group", json={}).json()["success"]

        def from_tensor(shape: str):
            """`shape`: "fresh" tensors, tensors already "shared", or a "bucket" of fresh tensors."""
            def update() -> None:
                state = tensors[next(count) % 2]
                named = [(name, tensor if shape == "shared" else tensor.clone()) for name, tensor in state.items()]
                start = time.perf_counter()  # the trainer's tensors are at hand: its serialize and the call
                with shared_memory():
                    payload = flattened_bucket(named) if shape == "bucket" else named
                    entry = serialize(payload)
                body = {"serialized_named_tensors": [entry]}
                if shape == "bucket":
                    body["load_format"] = "flattened_bucket"
                reply = http.post(f"{stack.http_url}/update_weights_from_tensor", json=body)
                own_times.append(time.perf_counter() - start)
                assert reply.status_code == 200 and reply.json()["success"], reply.text
            return update

        def paused(update):
            def sequence() -> None:
                assert client.pause_generation("in_place").success
                update()
                assert client.continue_generation().success
            return sequence

        idle = {"update_weights_from_disk": from_disk, "PushWeights, whole model": pushed(tensors),
                "PushWeights, one layer": pushed(layer),
                "update_weights_from_distributed (gloo), whole model": broadcast,
                "update_weights_from_tensor (shared memory), whole model": from_tensor("fresh"),
                "update_weights_from_tensor, whole model already in shared memory": from_tensor("shared"),
                "update_weights_from_tensor, whole model in a flattened bucket (slime)": from_tensor("bucket")}
        rows = []
        timings: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in idle}
        for _ in range(args.repeats):  # interleaved: a change in the machine's load weighs on every operation alike
            for name, update in idle.items():
                times, own_times = timings[name]  # own_times: what the update appends itself
                start = time.perf_counter()
                update()
                times.append(time.perf_counter() - start)
        for name, (times, own_times) in timings.items():
            # What an update times itself: a broadcast's call (the trainer's start and the group's join are not
            # the update), a tensor update's serialize and call (the clone that makes its tensors fresh is not).
            rows.append({"operation": name, "in_flight": 0, "seconds": statistics.median(own_times or times)})
            progress.step(f"{name}, idle: {fmt_time(rows[-1]['seconds'])}")
        loaded = {"none (the gaps' baseline: 0.2 s of streaming)": (lambda: time.sleep(0.2), 4000),
                  "pause(in_place) + update_weights_from_disk + continue": (paused(from_disk), 4000),
                  "pause(in_place) + PushWeights whole model + continue": (paused(pushed(tensors)), 4000),
                  "pause(in_place) + PushWeights one layer + continue": (paused(pushed(layer)), 4000),
                  "update_weights_from_disk, no pause (running requests finish first)": (from_disk, 300)}
        for name, (action, tokens) in loaded.items():
            runs = [under_load(stack, args.concurrency, tokens, action) for _ in range(3)]
            rows.append({"operation": name, "in_flight": args.concurrency,
                         **{key: statistics.median(run[key] for run in runs) for key in runs[0]}})
            progress.step(f"{name}: {fmt_time(rows[-1]['seconds'])}, max gap {fmt_time(rows[-1]['max_gap'])}")

    table = Table("Weight updates in place: time, and the pause they cause to streaming requests",
                  ["operation", "requests streaming", "wall time", "their largest token gap", "their median gap"],
                  f"The default model: {model_bytes / 1e6:.0f} MB of float32 tensors (one layer: "
                  f"{layer_bytes / 1e6:.2f} MB); every update changes the tensors it carries. Medians of "
                  f"{args.repeats} idle updates (the operations interleaved), of 3 runs under load. Paused, the "
                  "requests stop for the whole sequence, the read and check of the new weights included (the swap "
                  "itself is one step boundary). "
                  "Without a pause the running requests never stop: the update waits for them, and new requests "
                  "wait for it.")
    for row in rows:
        loaded_row = row["in_flight"] > 0
        table.add(row["operation"], row["in_flight"] or "-", fmt_time(row["seconds"]),
                  fmt_time(row["max_gap"]) if loaded_row else "-", fmt_time(row["median_gap"]) if loaded_row else "-")
    by_name = {row["operation"]: row["seconds"] for row in rows}
    disk, gloo = by_name["update_weights_from_disk"], by_name["update_weights_from_distributed (gloo), whole model"]
    checks = Table("Targets", ["target", "measured", "verdict"],
                   f"On a GPU the same call moves the same {model_bytes / 1e6:.0f} MB (half of it in bfloat16) over "
                   "NCCL: at NVLink's hundreds of GB/s well under a millisecond, so the check and the swap between "
                   "two steps are what remain; not measured here (no GPU), nor is update_weights_from_tensor's CUDA "
                   "IPC path (a device-to-device copy from the trainer's memory).")
    checks.add("gloo broadcast of the default model within 2x of the disk update", f"{fmt_time(gloo)} vs "
               f"{fmt_time(disk)}: {gloo / disk:.2f}x", "met" if gloo <= 2 * disk else "missed")
    tensor = by_name["update_weights_from_tensor (shared memory), whole model"]
    checks.add("update_weights_from_tensor of the default model (CPU, shared memory, fresh tensors) within 2x of "
               "the disk update", f"{fmt_time(tensor)} vs {fmt_time(disk)}: {tensor / disk:.2f}x",
               "met" if tensor <= 2 * disk else "missed")
    print(write_results("weights", "python -m bench.weights", [table, checks],
                        {"rows": rows, "model_bytes": model_bytes, "layer_bytes": layer_bytes},
                        "Scheduler with --max-running-requests 64 on this machine's CPU; client on the same host."))


if __name__ == "__main__":
    main()
