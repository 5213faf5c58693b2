"""A deterministic OpenAI-compatible server for tests: a test aid, never a model.

It serves ``POST /v1/chat/completions`` and ``POST /v1/responses`` (streaming and not) and ``GET /v1/models``.
Its answer depends only on the request, so one server can serve many runs at once:

* no answer yet to a tool call of its own (ids start with ``call_stub_``) → one tool call to the request's
  shell tool (Claude's ``Bash``, Codex's ``exec_command``, ...) running :attr:`StubModel.command`;
* otherwise → a final text.

Every request is recorded (path, headers with lower-case names, JSON body), and so is the most model calls it
ever had in flight at once (:attr:`StubModel.peak`). :meth:`StubModel.fail_next` makes the next requests fail,
:meth:`StubModel.fail_sessions` every request of chosen runs, :meth:`StubModel.fail_for` every request for a
while: with an HTTP status (429, 500, ...; ``retry_after`` adds the header), ``"hang"`` (no answer),
``"close"`` (drop the connection) or ``"cut"`` (start a stream, then drop the connection before its end).
:attr:`StubModel.first_byte_delay` holds every answer back before its first byte, :attr:`StubModel.chunk_delay`
spaces a stream's events out, and :attr:`StubModel.hold` keeps each model call in flight that long (so a
test can see how many calls come at once).
Run as a script to serve on a port or a unix socket.
"""

from __future__ import annotations

import argparse
import json
import os
import socketserver
import threading
import time
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

DEFAULT_COMMAND = "echo continued > continued.txt"
FINAL_TEXT = "Done: the continuation step wrote continued.txt."
_SHELL_TOOLS = ("Bash", "bash", "exec_command", "shell", "local_shell", "run_shell_command", "execute_bash")


class StubModel:
    """The server's state: what it answers, what it received, what should fail next."""

    def __init__(self, command: str = DEFAULT_COMMAND) -> None:
        self.command = command
        self.requests: list[dict[str, Any]] = []
        self._failures: list[int | str] = []
        self._session_rule: tuple[Callable[[str], bool], int | str] | None = None
        self._until: tuple[float, int | str] | None = None
        self._lock = threading.Lock()
        self.retry_after: float | None = None
        """Sent as ``Retry-After`` with every failure status."""
        self.first_byte_delay = 0.0
        self.chunk_delay = 0.0
        self.hold = 0.0
        self.stream_bytes = 0
        """Pad every streamed chat answer to about this many bytes (filler events before the last)."""
        self.in_flight = 0
        self.peak = 0
        """The most model calls in flight at once so far."""
        self.served_usage: list[dict[str, int]] = []
        """The usage of every successful answer, in order."""

    def fail_next(self, behaviour: int | str, times: int = 1) -> None:
        """Answer the next ``times`` model requests with an HTTP status, ``"hang"`` or ``"close"``."""
        with self._lock:
            self._failures += [behaviour] * times

    def fail_sessions(self, predicate: Callable[[str], bool], behaviour: int | str) -> None:
        """Fail every request whose ``X-LiteLLM-Session-ID`` (pvisor's run id) satisfies ``predicate``."""
        with self._lock:
            self._session_rule = (predicate, behaviour)

    def fail_for(self, seconds: float, behaviour: int | str, *, retry_after: float | None = None) -> None:
        """Fail every model request for the next ``seconds``."""
        with self._lock:
            self._until = (time.monotonic() + seconds, behaviour)
            self.retry_after = retry_after

    def take_failure(self, session: str = "") -> int | str | None:
        with self._lock:
            if self._session_rule is not None and self._session_rule[0](session):
                return self._session_rule[1]
            if self._until is not None and time.monotonic() < self._until[0]:
                return self._until[1]
            return self._failures.pop(0) if self._failures else None

    def enter(self) -> None:
        with self._lock:
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)

    def leave(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def record(self, entry: dict[str, Any]) -> None:
        with self._lock:
            self.requests.append(entry)

    def model_requests(self) -> list[dict[str, Any]]:
        """Recorded requests to the two model endpoints."""
        return [r for r in self.requests if r["path"].endswith(("/chat/completions", "/responses"))]


def _tool_name(tools: list[dict[str, Any]]) -> tuple[str, str]:
    """(name, style) of the request's shell tool: style ``command``, ``cmd`` or ``argv``."""
    names = []
    for tool in tools or []:
        function = tool.get("function") if isinstance(tool.get("function"), dict) else tool
        name = function.get("name") or tool.get("type")
        if name:
            names.append((name, function.get("parameters") or {}))
    for wanted in _SHELL_TOOLS:
        for name, parameters in names:
            if name == wanted:
                properties = (parameters or {}).get("properties", {})
                if "cmd" in properties:
                    return name, "cmd"
                if properties.get("command", {}).get("type") == "array":
                    return name, "argv"
                return name, "command"
    return "bash", "command"


def _arguments(style: str, command: str) -> dict[str, Any]:
    if style == "cmd":
        return {"cmd": command}
    if style == "argv":
        return {"command": ["bash", "-lc", command]}
    return {"command": command, "description": "stub continuation step"}


def _answered(items: list[Any], key: str) -> bool:
    return any(isinstance(i, dict) and str(i.get(key, "")).startswith("call_stub_") for i in items)


def chat_answer(body: dict[str, Any], command: str) -> dict[str, Any]:
    """The chat-completions message for a request: a tool call, or the final text once it was answered."""
    messages = body.get("messages") or []
    if _answered([m for m in messages if m.get("role") == "tool"], "tool_call_id"):
        return {"role": "assistant", "content": FINAL_TEXT}
    name, style = _tool_name(body.get("tools") or [])
    call = {
        "id": f"call_stub_{uuid.uuid4().hex[:12]}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(_arguments(style, command))},
    }
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def responses_answer(body: dict[str, Any], command: str) -> dict[str, Any]:
    """The Responses output item for a request."""
    items = body.get("input") or []
    items = items if isinstance(items, list) else []
    if _answered([i for i in items if i.get("type") == "function_call_output"], "call_id"):
        return {
            "type": "message",
            "id": f"msg_{uuid.uuid4().hex[:12]}",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": FINAL_TEXT, "annotations": []}],
        }
    name, style = _tool_name(body.get("tools") or [])
    return {
        "type": "function_call",
        "id": f"fc_{uuid.uuid4().hex[:12]}",
        "status": "completed",
        "call_id": f"call_stub_{uuid.uuid4().hex[:12]}",
        "name": name,
        "arguments": json.dumps(_arguments(style, command)),
    }


def _lower(headers: Any) -> dict[str, str]:
    """Header names lower-cased (HTTP header names are case-insensitive; clients differ)."""
    return {name.lower(): value for name, value in headers.items()}


USAGE = {"prompt_tokens": 100, "completion_tokens": 10, "total_tokens": 110}


class _Handler(BaseHTTPRequestHandler):
    server: Any
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # a chunk a write: without it, each answer waits out a delayed ACK (40 ms)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
        return

    def _json(self, status: int, value: Any, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(value).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, header in (headers or {}).items():
            self.send_header(name, header)
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802
        self.server.model.record({"path": self.path, "method": "GET", "headers": _lower(self.headers), "body": None})
        if self.path.rstrip("/").endswith("/models"):
            self._json(200, {"object": "list", "data": [{"id": "stub-model", "object": "model"}]})
        else:
            self._json(200, {"ok": True})

    def do_POST(self) -> None:  # noqa: N802
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            body = {}
        model: StubModel = self.server.model
        model.record({"path": self.path, "method": "POST", "headers": _lower(self.headers), "body": body})
        model.enter()
        try:
            time.sleep(model.hold)
            self._post(body, model)
        finally:
            model.leave()

    def _post(self, body: dict[str, Any], model: StubModel) -> None:
        failure = model.take_failure(self.headers.get("X-LiteLLM-Session-ID") or "")
        if failure == "hang":
            time.sleep(3600)
            return
        if failure == "close":
            self.close_connection = True
            self.connection.shutdown(2)
            return
        if failure == "cut":  # a stream that starts, then breaks off: no last chunk
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            event = b'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hel"}}]}\n\n'
            self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(2)
            return
        if failure == "echo-key":  # a wrong key, as OpenAI answers it (masked), and a careless upstream (whole)
            key = self.headers.get("Authorization", "").removeprefix("Bearer ")
            message = f"Incorrect API key provided: {key[:8]}{'*' * 24}{key[-4:]}. You sent: {key}"
            self._json(401, {"error": {"message": message, "type": "invalid_request_error", "code": "invalid_api_key"}})
            return
        if isinstance(failure, int):
            error = {"error": {"message": f"stub failure {failure}", "type": "stub_error", "code": failure}}
            extra = {"Retry-After": f"{model.retry_after:g}"} if model.retry_after is not None else {}
            self._json(failure, error, extra)
            return
        time.sleep(model.first_byte_delay)
        if self.path.endswith("/chat/completions"):
            self._chat(body, model)
        elif self.path.endswith("/responses"):
            self._responses(body, model)
        else:
            self._json(404, {"error": {"message": f"no route {self.path}"}})

    def _chat(self, body: dict[str, Any], model: StubModel) -> None:
        message = chat_answer(body, model.command)
        finish = "tool_calls" if message.get("tool_calls") else "stop"
        ident = f"chatcmpl-stub-{uuid.uuid4().hex[:8]}"
        model.served_usage.append(USAGE)
        if not body.get("stream"):
            self._json(
                200,
                {
                    "id": ident,
                    "object": "chat.completion",
                    "created": int(time.time()),
                    "model": body.get("model", "stub-model"),
                    "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                    "usage": USAGE,
                },
            )
            return
        delta: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
        if message.get("tool_calls"):
            delta["tool_calls"] = [dict(call, index=0) for call in message["tool_calls"]]
        filler = [{"choices": [{"index": 0, "delta": {"content": "x" * 65536}, "finish_reason": None}]}
                  for _ in range(model.stream_bytes // 65600)]  # fmt: skip
        chunks = [
            {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
            *filler,
            {"choices": [{"index": 0, "delta": {}, "finish_reason": finish}], "usage": USAGE},
        ]
        self._sse([dict(c, id=ident, object="chat.completion.chunk", model="stub-model") for c in chunks], done=True)

    def _responses(self, body: dict[str, Any], model: StubModel) -> None:
        item = responses_answer(body, model.command)
        ident = f"resp_{uuid.uuid4().hex[:12]}"
        usage = {"input_tokens": 100, "output_tokens": 10, "total_tokens": 110}
        model.served_usage.append(usage)
        response = {
            "id": ident,
            "object": "response",
            "created_at": int(time.time()),
            "status": "completed",
            "model": body.get("model", "stub-model"),
            "output": [item],
            "usage": usage,
        }
        if not body.get("stream"):
            self._json(200, response)
            return
        created = dict(response, status="in_progress", output=[], usage=None)
        events = [
            {"type": "response.created", "response": created},
            {"type": "response.in_progress", "response": created},
            {"type": "response.output_item.added", "output_index": 0, "item": dict(item, status="in_progress")},
        ]
        if item["type"] == "function_call":
            events += [
                {
                    "type": "response.function_call_arguments.delta",
                    "item_id": item["id"],
                    "output_index": 0,
                    "delta": item["arguments"],
                },
                {
                    "type": "response.function_call_arguments.done",
                    "item_id": item["id"],
                    "output_index": 0,
                    "arguments": item["arguments"],
                },
            ]
        else:
            text = item["content"][0]["text"]
            part = {"type": "output_text", "text": "", "annotations": []}
            events += [
                {
                    "type": "response.content_part.added",
                    "item_id": item["id"],
                    "output_index": 0,
                    "content_index": 0,
                    "part": part,
                },
                {
                    "type": "response.output_text.delta",
                    "item_id": item["id"],
                    "output_index": 0,
                    "content_index": 0,
                    "delta": text,
                },
                {
                    "type": "response.output_text.done",
                    "item_id": item["id"],
                    "output_index": 0,
                    "content_index": 0,
                    "text": text,
                },
                {
                    "type": "response.content_part.done",
                    "item_id": item["id"],
                    "output_index": 0,
                    "content_index": 0,
                    "part": dict(part, text=text),
                },
            ]
        events += [
            {"type": "response.output_item.done", "output_index": 0, "item": item},
            {"type": "response.completed", "response": response},
        ]
        self._sse(events, done=False, named=True)

    def _sse(self, events: list[dict[str, Any]], *, done: bool, named: bool = False) -> None:
        """A stream as the model APIs send it: chunked, an event a chunk, the connection kept alive."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        lines = [(f"event: {e['type']}\n" if named else "") + f"data: {json.dumps(e)}\n\n" for e in events]
        for n, line in enumerate([*lines, "data: [DONE]\n\n"] if done else lines):
            data = line.encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()
            if n < len(lines) - 1:
                time.sleep(self.server.model.chunk_delay)
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


class _UnixServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    request_queue_size = 128


class _TCPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # dozens of sandboxes connect at once

    def get_request(self) -> tuple[Any, Any]:
        connection, _ = super().get_request()
        return connection, ("unix", 0)


class StubServer:
    """The stub served on ``127.0.0.1`` (any free port) or a unix socket, in a background thread."""

    def __init__(
        self, *, host: str = "127.0.0.1", port: int = 0, unix: str | None = None, command: str = DEFAULT_COMMAND
    ):
        self.model = StubModel(command)
        if unix:
            self.httpd: Any = _UnixServer(unix, _Handler)
            os.chmod(unix, 0o666)
        else:
            self.httpd = _TCPServer((host, port), _Handler)
        self.httpd.model = self.model
        # shutdown() waits for the loop's next look: every 20 ms, not the default half second
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)

    @property
    def base_url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}/v1"

    def __enter__(self) -> StubServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=18931)
    parser.add_argument("--unix")
    parser.add_argument("--stream-bytes", type=int, default=0, help="pad streamed chat answers to this size")
    args = parser.parse_args()
    with StubServer(host=args.host, port=args.port, unix=args.unix) as server:
        server.model.stream_bytes = args.stream_bytes
        print(f"serving on {args.unix or server.base_url}", flush=True)
        server.thread.join()
