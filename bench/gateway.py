"""``gateway``: the model gateway's added latency per call, against the stub model server called directly: 1 and
32 concurrent streamed answers, time to the first byte and to the whole answer, p50 and p99; and the gateway
process's peak RSS while 32 streams of 10 MB each pass through it. No engine needed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import ROOT, scaled

GATEWAY = r"""
import json, sys, time
from pathlib import Path
from pvisor_host.backend.docker.gateway import Gateway
from pvisor_host.models.spec import ModelUpstream
base_url, streams, work = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
config = ModelUpstream(base_url=base_url, model="stub-model", api_key_env="X", network="unix")
with Gateway(config, "bench-key") as gateway:
    tokens = [gateway.access(f"bench-{n}", work / f"j{n}.jsonl").api_key for n in range(streams)]
    print(json.dumps({"socket": gateway.address, "tokens": tokens}), flush=True)
    sys.stdin.readline()
status = Path("/proc/self/status").read_text()
print(json.dumps({"peak_rss": int(status.split("VmHWM:")[1].split()[0]) * 1024}), flush=True)
"""


def gateway(work: Path) -> dict[str, Any]:
    """See the module docstring: the gateway in a process of its own, as in a batch, the stub in another."""
    rounds = scaled(200, 20)
    rows: dict[str, Any] = {}
    with _stub(0) as small, _gateway_process(small, 32, work / "small") as (path, tokens):
        for streams in (1, 32):
            direct = _timed_streams(lambda n: _tcp(small), streams, rounds)
            through = _timed_streams(lambda n: _unix(path, tokens[n]), streams, rounds)
            rows[f"{streams} stream{'s' if streams > 1 else ''}"] = {
                f"{what}_{q}_ms_added": round((through[what][q] - direct[what][q]) * 1000, 2)
                for what in ("first_byte", "whole") for q in ("p50", "p99")
            } | {"direct_whole_p50_ms": round(direct["whole"]["p50"] * 1000, 2)}  # fmt: skip
    with _stub(10 * 2**20) as big:
        with _gateway_process(big, 32, work / "big") as (path, tokens):
            started = time.monotonic()
            _timed_streams(lambda n: _unix(path, tokens[n]), 32, 32)
            seconds = time.monotonic() - started
        peak = _gateway_process.peak
    return {
        "calls_per_row": rounds,
        "added_latency": rows,
        "big_streams": {
            "streams": 32,
            "bytes_each": 10 * 2**20,
            "seconds": round(seconds, 2),
            "gateway_peak_rss_mib": round(peak / 2**20, 1),
        },  # fmt: skip
        "targets": "p50 added <= 2 ms, p99 added <= 10 ms; peak RSS < 150 MB with 32 streams of 10 MB",
    }


class _stub:
    """The stub model server in a process of its own, on a free port."""

    def __init__(self, stream_bytes: int) -> None:
        self.stream_bytes = stream_bytes

    def __enter__(self) -> str:
        import socket

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.process = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "modelserver.py"), "--port", str(port), "--stream-bytes",
             str(self.stream_bytes)], stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self.process.stdout is not None
        self.process.stdout.readline()  # "serving on ..."
        return f"127.0.0.1:{port}"

    def __exit__(self, *exc: object) -> None:
        self.process.terminate()
        self.process.wait()


class _gateway_process:
    """A gateway in front of ``address`` in a process of its own (as in a batch); its peak RSS when it ends."""

    peak = 0

    def __init__(self, address: str, streams: int, work: Path) -> None:
        self.address, self.streams, self.work = address, streams, work

    def __enter__(self) -> tuple[str, list[str]]:
        self.work.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [sys.executable, "-c", GATEWAY, f"http://{self.address}/v1", str(self.streams), str(self.work)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self.process.stdout is not None
        ready = json.loads(self.process.stdout.readline())
        return ready["socket"], ready["tokens"]

    def __exit__(self, *exc: object) -> None:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write("\n")
        self.process.stdin.flush()
        _gateway_process.peak = json.loads(self.process.stdout.readline())["peak_rss"]
        self.process.wait()


def _tcp(address: str) -> Any:
    import http.client

    host, port = address.split(":")
    return http.client.HTTPConnection(host, int(port), timeout=60), "stub"


def _unix(path: str, token: str) -> Any:
    import http.client
    import socket

    class Unix(http.client.HTTPConnection):
        def connect(self) -> None:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.connect(path)

    return Unix("gateway", timeout=60), token


def _timed_streams(connect: Callable[[int], Any], streams: int, calls: int) -> dict[str, dict[str, float]]:
    """``calls`` streamed chat answers over ``streams`` kept-alive connections at once: the seconds to each
    answer's first byte and to its end, p50 and p99."""
    import threading

    body = json.dumps({"model": "stub-model", "stream": True, "messages": [{"role": "user", "content": "hi"}]})
    first: list[float] = []
    whole: list[float] = []
    lock = threading.Lock()

    def worker(n: int, count: int) -> None:
        connection, token = connect(n)
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {token}"}
        for _ in range(count):
            started = time.perf_counter()
            connection.request("POST", "/v1/chat/completions", body, headers)
            answer = connection.getresponse()
            answer.read(1)
            at_first = time.perf_counter()
            while answer.read(65536):
                pass
            done = time.perf_counter()
            with lock:
                first.append(at_first - started)
                whole.append(done - started)
        connection.close()

    threads = [threading.Thread(target=worker, args=(n, calls // streams)) for n in range(streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    def quantiles(values: list[float]) -> dict[str, float]:
        ordered = sorted(values)
        return {"p50": ordered[len(ordered) // 2], "p99": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]}

    return {"first_byte": quantiles(first), "whole": quantiles(whole)}
