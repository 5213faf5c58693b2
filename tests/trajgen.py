"""Generators of native trajectories for tests: valid Claude Code 2.1.220 and Codex 0.149.0 sessions,
and broken variants of them. They follow pvisor 0.3.1's adapters (see docs/trajectories.md):

* Claude Code: one JSONL event per line; every event has ``version`` 2.1.220 and one ``sessionId`` (a
  UUID, with ``timestamp``s, so a real ``claude --resume`` accepts it too); a tool call is an assistant
  event whose ``message.content`` holds a ``tool_use``, answered by a user event with a ``tool_result``
  whose ``parentUuid`` and ``sourceToolAssistantUUID`` name that assistant event; parallel calls are
  fragments sharing one ``message.id`` (the first with ``stop_reason: null``).
* Codex: ``session_meta`` (id, cwd), user messages, then per batch an assistant message followed by
  ``function_call``s and their ``function_call_output``s.

Run as a script to regenerate ``examples/claude-code-demo.jsonl``.
"""

from __future__ import annotations

import json
import shutil
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

CLAUDE_VERSION = "2.1.220"
CODEX_VERSION = "0.149.0"


@dataclass
class Call:
    """One tool call and the observation the recording saw."""

    name: str
    input: dict[str, Any]
    result: str = ""
    is_error: bool = False


@dataclass
class Turn:
    """An assistant turn: optional text and zero or more (parallel) tool calls."""

    calls: list[Call] = field(default_factory=list)
    text: str | None = None


class _Clock:
    def __init__(self) -> None:
        self.now = datetime(2026, 11, 29, 12, 0, 0, tzinfo=UTC)

    def tick(self) -> str:
        self.now += timedelta(seconds=1)
        return self.now.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def claude_session(
    task: str,
    turns: list[Turn],
    *,
    cwd: str = "/workspace",
    session_id: str | None = None,
    version: str = CLAUDE_VERSION,
) -> list[dict[str, Any]]:
    """A Claude Code session: the task, then ``turns`` (tool batches and text-only turns)."""
    sid = session_id or str(uuid.UUID(int=0x7F3C2A10_0000_4000_8000_00000000ABCD))
    clock = _Clock()
    common = {
        "isSidechain": False,
        "userType": "external",
        "cwd": cwd,
        "sessionId": sid,
        "version": version,
        "gitBranch": "",
    }
    events: list[dict[str, Any]] = []
    parent = None
    first = {
        **common,
        "type": "user",
        "uuid": "u0",
        "parentUuid": None,
        "timestamp": clock.tick(),
        "message": {"role": "user", "content": task},
    }
    events.append(first)
    parent = "u0"
    for index, turn in enumerate(turns, start=1):
        message_id = f"msg_{index:02d}"
        if not turn.calls:
            events.append(
                _assistant(common, clock, f"a{index}", parent, message_id, [_text(turn.text or "Done.")], "end_turn")
            )
            parent = f"a{index}"
            continue
        fragments = []
        for n, call in enumerate(turn.calls):
            content = [_text(turn.text)] if (turn.text and n == 0) else []
            call_id = f"toolu_{index:02d}{chr(ord('a') + n)}"
            content.append({"type": "tool_use", "id": call_id, "name": call.name, "input": call.input})
            last = n == len(turn.calls) - 1
            uid = f"a{index}{chr(ord('a') + n)}"
            events.append(_assistant(common, clock, uid, parent, message_id, content, "tool_use" if last else None))
            fragments.append((uid, call_id, call))
            parent = uid
        for uid, call_id, call in fragments:
            result_uuid = f"r{uid[1:]}"
            block: dict[str, Any] = {"type": "tool_result", "tool_use_id": call_id, "content": call.result}
            if call.is_error:
                block["is_error"] = True
            events.append(
                {
                    **common,
                    "type": "user",
                    "uuid": result_uuid,
                    "parentUuid": uid,
                    "timestamp": clock.tick(),
                    "message": {"role": "user", "content": [block]},
                    "sourceToolAssistantUUID": uid,
                    "toolUseResult": {"stdout": call.result, "stderr": "", "interrupted": False},
                }
            )
            parent = result_uuid
    return events


def _text(text: str | None) -> dict[str, Any]:
    return {"type": "text", "text": text or ""}


def _assistant(
    common: dict[str, Any],
    clock: _Clock,
    uid: str,
    parent: str | None,
    message_id: str,
    content: list[dict[str, Any]],
    stop: str | None,
) -> dict[str, Any]:
    return {
        **common,
        "type": "assistant",
        "uuid": uid,
        "parentUuid": parent,
        "timestamp": clock.tick(),
        "requestId": f"req_{message_id}",
        "message": {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": "claude-sonnet-4-5",
            "content": content,
            "stop_reason": stop,
            "stop_sequence": None,
            "usage": {"input_tokens": 10, "output_tokens": 5},
        },
    }


def codex_rollout(
    task: str, turns: list[Turn], *, cwd: str = "/workspace", session_id: str = "019a0000-1111-7222-8333-444455556666"
) -> list[dict[str, Any]]:
    """A Codex rollout: ``session_meta``, the task, then per turn an assistant message and its calls."""
    clock = _Clock()

    def line(kind: str, payload: dict[str, Any]) -> dict[str, Any]:
        return {"timestamp": clock.tick(), "type": kind, "payload": payload}

    events = [
        line(
            "session_meta",
            {
                "id": session_id,
                "timestamp": clock.tick(),
                "cwd": cwd,
                "originator": "codex_exec",
                "cli_version": CODEX_VERSION,
                "instructions": None,
                "source": "exec",
                "model_provider": "openai",
            },
        ),
        line("response_item", _message("user", f"<environment_context>\n  <cwd>{cwd}</cwd>\n</environment_context>")),
        line("response_item", _message("user", task)),
        line(
            "turn_context",
            {
                "cwd": cwd,
                "approval_policy": "never",
                "sandbox_policy": {"mode": "danger-full-access"},
                "model": "gpt-5-codex",
                "summary": "auto",
            },
        ),
    ]
    for index, turn in enumerate(turns, start=1):
        events.append(line("response_item", _message("assistant", turn.text or f"Step {index}.")))
        for n, call in enumerate(turn.calls):
            call_id = f"call_{index}{chr(ord('a') + n)}"
            events.append(
                line(
                    "response_item",
                    {
                        "type": "function_call",
                        "name": call.name,
                        "arguments": json.dumps(call.input),
                        "call_id": call_id,
                    },
                )
            )
        for n, call in enumerate(turn.calls):
            call_id = f"call_{index}{chr(ord('a') + n)}"
            events.append(
                line("response_item", {"type": "function_call_output", "call_id": call_id, "output": call.result})
            )
    return events


def _message(role: str, text: str) -> dict[str, Any]:
    kind = "input_text" if role == "user" else "output_text"
    return {"type": "message", "role": role, "content": [{"type": kind, "text": text}]}


PI_VERSION = "0.83.0"
MINI_VERSION = "2.4.6"


def pi_session(task: str, turns: list[Turn], *, model: str = "stub-model") -> list[dict[str, Any]]:
    """A Pi RPC event stream: the user's ``message_end``, then one ``turn_end`` per assistant turn with the
    assistant message (text and ``toolCall`` parts) and its ``toolResults``."""
    clock = _Clock()
    stamp = int(clock.now.timestamp() * 1000)

    def ms() -> int:
        nonlocal stamp
        stamp += 1000
        return stamp

    user = {"role": "user", "content": [{"type": "text", "text": task}], "timestamp": ms()}
    events: list[dict[str, Any]] = [
        {"type": "agent_start"},
        {"type": "turn_start"},
        {"type": "message_start", "message": user},
        {"type": "message_end", "message": user},
    ]
    usage = {
        "input": 10,
        "output": 5,
        "cacheRead": 0,
        "cacheWrite": 0,
        "totalTokens": 15,
        "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0, "total": 0},
    }
    for index, turn in enumerate(turns, start=1):
        content: list[dict[str, Any]] = [{"type": "text", "text": turn.text}] if turn.text else []
        calls = [(f"call_{index}{chr(ord('a') + n)}", call) for n, call in enumerate(turn.calls)]
        content += [{"type": "toolCall", "id": cid, "name": call.name, "arguments": call.input} for cid, call in calls]
        assistant = {
            "role": "assistant",
            "content": content,
            "api": "openai-completions",
            "provider": "sweeval",
            "model": model,
            "usage": usage,
            "stopReason": "toolUse" if calls else "stop",
            "timestamp": ms(),
        }
        results = [
            {
                "role": "toolResult",
                "toolCallId": cid,
                "toolName": call.name,
                "content": [{"type": "text", "text": call.result}],
                "details": {},
                "isError": call.is_error,
                "timestamp": ms(),
            }
            for cid, call in calls
        ]
        events += [
            {"type": "message_end", "message": assistant},
            {"type": "turn_end", "message": assistant, "toolResults": results},
        ]
        if index < len(turns):
            events.append({"type": "turn_start"})
    events.append({"type": "agent_end"})
    return events


def mini_trajectory(
    task: str, turns: list[Turn], *, cwd: str = "/workspace", model_name: str | None = "openai/stub-model"
) -> dict[str, Any]:
    """A mini-swe-agent 2.4.6 trajectory (``trajectory_format`` mini-swe-agent-1.1) recorded with the
    text-based litellm model: one bash action per assistant message, each followed by its observation.
    ``model_name=None``: a config that names no model (mini then falls back to its user config)."""
    observation = "<returncode>{{output.returncode}}</returncode>\n<output>\n{{ output.output -}}\n</output>"
    config = {
        "agent": {
            "system_template": "You are a helpful assistant that can interact with a computer.",
            "instance_template": "Please solve this issue: {{task}}",
            "step_limit": 0,
            "cost_limit": 3.0,
            "wall_time_limit_seconds": 0,
            "max_consecutive_format_errors": 3,
            "output_path": None,
        },
        "agent_type": "minisweagent.agents.default.DefaultAgent",
        "model": {
            "model_name": "openai/stub-model",
            "model_kwargs": {"drop_params": True},
            "observation_template": observation,
            "format_error_template": "Please always provide EXACTLY ONE action.",
            "cost_tracking": "ignore_errors",
        },
        "model_type": "minisweagent.models.litellm_textbased_model.LitellmTextbasedModel",
        "environment": {"cwd": cwd, "env": {}, "timeout": 30},
        "environment_type": "minisweagent.environments.local.LocalEnvironment",
    }
    if model_name is None:
        del config["model"]["model_name"]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": config["agent"]["system_template"]},
        {"role": "user", "content": f"Please solve this issue: {task}"},
    ]
    stamp = 1795000000.0
    for index, turn in enumerate(turns, start=1):
        for call in turn.calls:
            command = call.input["command"]
            text = f"THOUGHT: {turn.text or 'Next step.'}\n\n```mswea_bash_command\n{command}\n```"
            response = {
                "id": f"chatcmpl-{index}",
                "object": "chat.completion",
                "model": "stub-model",
                "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}],
                "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
            }
            stamp += 1
            messages.append(
                {
                    "role": "assistant",
                    "content": text,
                    "extra": {"actions": [{"command": command}], "response": response, "cost": 0.0, "timestamp": stamp},
                }
            )
            code = 1 if call.is_error else 0
            messages.append(
                {
                    "role": "user",
                    "content": f"<returncode>{code}</returncode>\n<output>\n{call.result}</output>",
                    "extra": {
                        "raw_output": call.result,
                        "returncode": code,
                        "timestamp": stamp + 0.5,
                        "exception_info": "",
                    },
                }
            )
    return {
        "info": {
            "model_stats": {"instance_cost": 0.0, "api_calls": len(turns)},
            "config": config,
            "mini_version": MINI_VERSION,
            "exit_status": "",
            "submission": "",
        },
        "messages": messages,
        "trajectory_format": "mini-swe-agent-1.1",
    }


def write_json(path: Path, document: dict[str, Any]) -> Path:
    """Write a JSON document."""
    path.write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
    return path


OPENHANDS_VERSION = "0.53.0"


def openhands_events(task: str, turns: list[Turn], *, cwd: str = "/workspace") -> list[dict[str, Any]]:
    """An OpenHands 0.53.0 event array: the user's message, then per turn one ``run`` action (the first call's
    ``command``) and its ``run`` observation, linked by ``cause``."""
    clock = _Clock()
    events: list[dict[str, Any]] = [
        {
            "id": 0,
            "timestamp": clock.tick(),
            "source": "user",
            "message": task,
            "action": "message",
            "args": {"content": task, "file_urls": None, "image_urls": None, "wait_for_response": False},
        },
    ]
    for turn in turns:
        call = turn.calls[0]
        command = call.input["command"]
        action_id, observation_id = len(events), len(events) + 1
        events.append(
            {
                "id": action_id,
                "timestamp": clock.tick(),
                "source": "agent",
                "message": f"Running command: {command}",
                "action": "run",
                "args": {
                    "command": command,
                    "is_input": False,
                    "thought": turn.text or "",
                    "blocking": False,
                    "is_static": False,
                    "cwd": None,
                    "hidden": False,
                    "confirmation_state": "confirmed",
                    "security_risk": -1,
                },
            }
        )
        events.append(
            {
                "id": observation_id,
                "timestamp": clock.tick(),
                "source": "agent",
                "message": f"Command `{command}` executed with exit code 0.",
                "cause": action_id,
                "observation": "run",
                "content": call.result,
                "extras": {
                    "command": command,
                    "hidden": False,
                    "metadata": {
                        "exit_code": 1 if call.is_error else 0,
                        "pid": -1,
                        "username": "root",
                        "hostname": "sandbox",
                        "working_dir": cwd,
                        "py_interpreter_path": None,
                        "prefix": "",
                        "suffix": "",
                    },
                },
                "success": not call.is_error,
            }
        )
    return events


def openhands_files_session() -> list[dict[str, Any]]:
    """3 batches of one run action each."""
    return openhands_events(
        "Create f.txt with hi, copy it to g.txt and change the copy.",
        [
            Turn([Call("run", {"command": "echo hi > f.txt"}, "")]),
            Turn([Call("run", {"command": "cp f.txt g.txt && cat g.txt"}, "hi")]),
            Turn([Call("run", {"command": "sed -i 's/hi/bye from openhands/' g.txt"}, "")]),
        ],
    )


def write_jsonl(path: Path, events: list[dict[str, Any]]) -> Path:
    """Write events as JSONL (one compact object per line)."""
    path.write_text("".join(json.dumps(e, separators=(",", ":")) + "\n" for e in events), encoding="utf-8")
    return path


# -- ready-made sessions -------------------------------------------------------------------------------------


def claude_files_session(cwd: str = "/workspace") -> list[dict[str, Any]]:
    """5 batches, 6 calls: Bash, Read, Write, a parallel Bash+Grep pair, Edit; then a text-only turn."""
    return claude_session(
        "Create f.txt containing hi, read it back, write g.txt, list and grep, then edit g.txt.",
        [
            Turn(
                [Call("Bash", {"command": "echo hi > f.txt", "description": "create f.txt"})], "I'll create the file."
            ),
            Turn([Call("Read", {"file_path": f"{cwd}/f.txt"}, "     1\u2192hi\n")]),
            Turn([Call("Write", {"file_path": f"{cwd}/g.txt", "content": "hello from write\n"}, "File created")]),
            Turn(
                [
                    Call("Bash", {"command": "ls -1", "description": "list"}, "f.txt\ng.txt"),
                    Call("Grep", {"pattern": "hi", "path": "."}, "f.txt"),
                ]
            ),
            Turn([Call("Edit", {"file_path": f"{cwd}/g.txt", "old_string": "hello", "new_string": "bye"}, "updated")]),
            Turn(text="All done."),
        ],
        cwd=cwd,
    )


def codex_files_session(cwd: str = "/workspace") -> list[dict[str, Any]]:
    """4 batches: two commands, a parallel pair, a write and an edit."""
    return codex_rollout(
        "Create f.txt with hi, show it, write g.txt, then edit it.",
        [
            Turn([Call("exec_command", {"cmd": "echo hi > f.txt"}, "")]),
            Turn([Call("exec_command", {"cmd": "cat f.txt"}, "hi\n"), Call("exec_command", {"cmd": "ls"}, "f.txt\n")]),
            Turn([Call("write", {"path": "g.txt", "content": "hello from codex\n"}, "ok")]),
            Turn([Call("edit", {"path": "g.txt", "old_str": "hello", "new_str": "bye"}, "ok")]),
        ],
        cwd=cwd,
    )


def pi_files_session() -> list[dict[str, Any]]:
    """3 batches: bash, write + read in parallel, edit."""
    return pi_session(
        "Create f.txt with hi, write g.txt and read f.txt back, then edit g.txt.",
        [
            Turn([Call("bash", {"command": "echo hi > f.txt"}, "")], "Creating f.txt."),
            Turn(
                [
                    Call("write", {"path": "g.txt", "content": "hello from pi\n"}, "Successfully wrote 14 bytes"),
                    Call("read", {"path": "f.txt"}, "hi\n"),
                ]
            ),
            Turn([Call("edit", {"path": "g.txt", "edits": [{"oldText": "hello", "newText": "bye"}]}, "edited")]),
            Turn(text="Done."),
        ],
    )


def mini_files_session(cwd: str = "/workspace") -> dict[str, Any]:
    """3 batches of one bash action each."""
    return mini_trajectory(
        "Create f.txt with hi, copy it to g.txt and change the copy.",
        [
            Turn([Call("bash", {"command": "echo hi > f.txt"}, "")]),
            Turn([Call("bash", {"command": "cp f.txt g.txt && cat g.txt"}, "hi\n")]),
            Turn([Call("bash", {"command": "sed -i 's/hi/bye from mini/' g.txt"}, "")]),
        ],
        cwd=cwd,
    )


def demo_session() -> list[dict[str, Any]]:
    """The example shipped for `make demo` (workspace: examples/demo-workspace). Its observations are what the pinned
    pvisor's tools answer in that workspace, byte for byte, so every replayed call reproduces exactly."""
    return claude_session(
        "Greet everyone listed in names.txt in a new file greeting.txt, then make the last greeting excited.",
        [
            Turn([Call("Bash", {"command": "ls -1", "description": "look around"}, "names.txt\n")], "Let me look."),
            Turn([Call("Read", {"file_path": "/workspace/names.txt"}, "Ada\nGrace")]),
            Turn(
                [
                    Call(
                        "Bash",
                        {
                            "command": "sed 's/^/Hello, /' names.txt > greeting.txt && cat greeting.txt",
                            "description": "write greetings",
                        },
                        "Hello, Ada\nHello, Grace\n",
                    )
                ]
            ),
            Turn(
                [
                    Call(
                        "Edit",
                        {
                            "file_path": "/workspace/greeting.txt",
                            "old_string": "Hello, Grace",
                            "new_string": "Hello, Grace!",
                        },
                        "Updated /workspace/greeting.txt",
                    )
                ]
            ),
            Turn(text="greeting.txt greets Ada and Grace."),
        ],
        session_id="5d1e6c2a-9b7f-4c3e-8a21-0f4b6d8e9a10",
    )


if __name__ == "__main__":
    root = Path(__file__).resolve().parents[1] / "examples"
    write_jsonl(root / "claude-code-demo.jsonl", demo_session())
    print(root / "claude-code-demo.jsonl")


def linked_copy(batch: Path, target: Path, items: int) -> Path:
    """A batch directory of ``items`` items made of ``batch``'s: each item's results row under a new id, its
    directory (its record, pvisor's outputs, logs) a link to one of the real batch's. What a dataset of that
    size leaves, as the report reads it (the tests' and the benchmark's 100,000-item report)."""
    rows = [json.loads(line) for line in (batch / "results.jsonl").read_text().splitlines()]
    target.mkdir()
    with (target / "results.jsonl").open("w") as handle:
        for n in range(items):
            row = dict(rows[n % len(rows)])
            original = row["id"]
            row["id"], row["line"] = f"{original}-{n:06d}", n + 1
            if row.get("path"):
                row["path"] = row["id"]
                (target / row["id"]).symlink_to(batch / original, target_is_directory=True)
            handle.write(json.dumps(row) + "\n")
    shutil.copyfile(batch / "summary.json", target / "summary.json")
    return target
