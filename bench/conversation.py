"""Synthetic but realistic conversations of a chosen size, and the request bodies each arm sends.

An agent-style history: a system prompt with a cache marker, four tool definitions, user requests, assistant turns
with thinking blocks (and their base64 signatures), text and tool_use blocks, and user turns of tool_result blocks
whose content has quotes, newlines and tabs (so JSON escapes are exercised) and some non-ASCII text. Deterministic
for a given size, so every run sends the same bytes.

Sizes are sizes of the *full* request body an arm without server-side state sends (A, R and B): fields, system,
tools and every message. The threaded arms (C, D) send only the new turn; statestore rebuilds a body of about the
same size from the thread, which starts a little below the target and grows by one small turn per continue.
"""

from __future__ import annotations

import base64
import random
from dataclasses import dataclass
from typing import Any, Literal

import orjson

MODEL = "echo-1"
MAX_TOKENS = 1024
THREADS_BETA = "message-threads-2026-08-12"

_VOCABULARY = (
    "the a of to and in is that for it with as on be this are by file function return value module test request "
    "response thread cache server client error handler config update query result state index buffer stream parse "
    "encode bytes token model turn history commit lease message user assistant tool input output path line column "
    "run check build install fix change add remove rename move refactor note: because, however, then, so; while "
    "donn\u00e9es caf\u00e9 na\u00efve \u2014 \u201cquoted\u201d \u00abguillemets\u00bb \u65e5\u672c\u8a9e "
    "\u6d4b\u8bd5 \u2713 \u2192 \u03bb"
)
_WORDS = _VOCABULARY.split()
_CODE_LINES = (
    'def handle(request):\n\treturn {"status": "ok", "items": [1, 2, 3]}',
    "SELECT id, body FROM thread_messages WHERE thread_id = $1 ORDER BY position;",
    'error: expected "}" at line 42, column 7\n  --> src/main.rs:42:7',
    'PASS tests/test_api.py::test_continue "quoted" \\ backslash',
    "  File \"/srv/app/service.py\", line 118, in _history\n    raise InternalError('inconsistent')",
    '{"key": "value", "nested": {"list": [true, false, null], "n": 3.14}}',
)

SYSTEM_TEXT_BYTES = 800
_TOOLS: list[dict[str, Any]] = [
    {
        "name": "read_file",
        "description": "Read a file of the repository and return its content with line numbers.",
        "input_schema": {
            "type": "object",
            "properties": {
                "path": {"type": "string", "description": "Path relative to the repository root."},
                "start_line": {"type": "integer", "description": "First line to return (1-based)."},
                "end_line": {"type": "integer", "description": "Last line to return (inclusive)."},
            },
            "required": ["path"],
        },
    },
    {
        "name": "search",
        "description": "Search the repository for a regular expression; returns matching lines with their paths.",
        "input_schema": {
            "type": "object",
            "properties": {
                "pattern": {"type": "string", "description": "A regular expression."},
                "glob": {"type": "string", "description": "Only files matching this glob."},
            },
            "required": ["pattern"],
        },
    },
    {
        "name": "run_command",
        "description": "Run a shell command in the sandbox and return its exit code, stdout and stderr.",
        "input_schema": {
            "type": "object",
            "properties": {
                "command": {"type": "string"},
                "timeout_seconds": {"type": "number", "description": "Kill the command after this long."},
            },
            "required": ["command"],
        },
    },
    {
        "name": "edit_file",
        "description": "Replace an exact string in a file with another string.",
        "input_schema": {
            "type": "object",
            "properties": {
                "path": {"type": "string"},
                "old": {"type": "string", "description": "Text to replace; must occur exactly once."},
                "new": {"type": "string", "description": "Replacement text."},
            },
            "required": ["path", "old", "new"],
        },
    },
]


def _text(rng: random.Random, n_bytes: int) -> str:
    words: list[str] = []
    size = 0
    while size < n_bytes:
        word = rng.choice(_WORDS)
        words.append(word)
        size += len(word.encode()) + 1
    return " ".join(words)


def _tool_output(rng: random.Random, n_bytes: int) -> str:
    lines: list[str] = []
    size = 0
    while size < n_bytes:
        line = rng.choice(_CODE_LINES) if rng.random() < 0.4 else _text(rng, rng.randint(30, 90))
        lines.append(f"{len(lines) + 1:4d}\t{line}")
        size += len(line.encode()) + 8
    return "\n".join(lines)


def _signature(rng: random.Random) -> str:
    return base64.b64encode(rng.randbytes(rng.randint(240, 600))).decode()


def _tool_id(rng: random.Random) -> str:
    return "toolu_01" + "".join(
        rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz0123456789") for _ in range(22)
    )


def _tool_input(rng: random.Random, name: str) -> dict[str, Any]:
    if name == "read_file":
        return {"path": f"src/module_{rng.randint(1, 60)}.py", "start_line": 1, "end_line": rng.randint(40, 400)}
    if name == "search":
        return {"pattern": rng.choice(["def handle", r"class \w+Error", "TODO|FIXME", "thread_id"]), "glob": "*.py"}
    if name == "run_command":
        return {"command": rng.choice(["pytest -x -q", "ruff check .", "git diff --stat", "make lint"])}
    return {"path": f"src/module_{rng.randint(1, 60)}.py", "old": _text(rng, 40), "new": _text(rng, 50)}


def _size(message: dict[str, Any]) -> int:
    return len(orjson.dumps(message)) + 1  # and its comma


@dataclass(frozen=True, slots=True)
class Conversation:
    """A stored-side history (ends with a user turn, ready for a create) and what goes around it."""

    target_bytes: int
    system: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    history: list[dict[str, Any]]
    # The turns a thread gains per continue: a user turn of about this size, and the echo of it.
    growth_per_turn: int
    turns_per_thread: int

    @property
    def history_bytes(self) -> int:
        return len(orjson.dumps(self.history))


def new_turn(n: int) -> dict[str, Any]:
    """The new user turn of request number `n`: short, as a person or a tool runner types it."""
    return {"role": "user", "content": [{"type": "text", "text": f"Step {n:07d}: carry on with the next file."}]}


def echo_of(turn: dict[str, Any]) -> dict[str, Any]:
    """The assistant message the echo backend stores for `turn` (without thinking: the new turns do not ask)."""
    return {"role": "assistant", "content": [{"type": "text", "text": "echo: " + turn["content"][0]["text"]}]}


def _fields(stream: bool) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": MAX_TOKENS, "stream": stream}


Shape = Literal["agent", "text"]


def shape_of(size_label: str) -> Shape:
    """A size label ending in `-text` ("200k-text") asks for the plain-text shape."""
    return "text" if size_label.endswith("-text") else "agent"


def build_conversation(
    target_bytes: int, *, seed: int = 7, growth_budget: float = 0.12, shape: Shape = "agent"
) -> Conversation:
    """A conversation whose full request body (see `FullBody`) is about `target_bytes` at the middle of a thread's
    life: a thread is created at `target - budget/2` and retired after `budget` of growth. `agent`: an agent's
    history (thinking with signatures, tool calls and results); `text`: a chat of plain-text turns, the cheapest
    shape to parse."""
    rng = random.Random(seed * 1_000_003 + target_bytes)
    system = [
        {
            "type": "text",
            "text": "You are a careful coding agent working in a sandboxed repository. "
            + _text(rng, SYSTEM_TEXT_BYTES),
            "cache_control": {"type": "ephemeral"},
        }
    ]
    turn = new_turn(0)
    growth = _size(turn) + _size(echo_of(turn))
    turns_per_thread = max(4, int(growth_budget * target_bytes / growth))
    fixed = len(orjson.dumps({**_fields(True), "system": system, "tools": _TOOLS, "messages": []}))
    # The create's own reply (one echo) plus half a thread's growth, plus the new turn, sit on top of the history.
    history_budget = target_bytes - fixed - (turns_per_thread // 2) * growth - growth
    history: list[dict[str, Any]] = []
    used = 0

    def add(message: dict[str, Any]) -> None:
        nonlocal used
        history.append(message)
        used += _size(message)

    # Scale block sizes with the target so an 8 KB history still has every kind of block.
    scale = 1.0 if target_bytes >= 60_000 else 0.35
    while shape == "text" and used < history_budget - 400:
        add({"role": "user", "content": _text(rng, int(rng.randint(120, 900) * scale))})
        add(
            {
                "role": "assistant",
                "content": [{"type": "text", "text": _text(rng, int(rng.randint(300, 2000) * scale))}],
            }
        )
    while used < history_budget - 400:
        add({"role": "user", "content": [{"type": "text", "text": _text(rng, int(rng.randint(120, 500) * scale))}]})
        for _ in range(rng.randint(1, 4)):
            if used >= history_budget - 400:
                break
            calls = [rng.choice(_TOOLS)["name"] for _ in range(1 if rng.random() < 0.7 else 2)]
            uses = [
                {"type": "tool_use", "id": _tool_id(rng), "name": name, "input": _tool_input(rng, name)}
                for name in calls
            ]
            add(
                {
                    "role": "assistant",
                    "content": [
                        {
                            "type": "thinking",
                            "thinking": _text(rng, int(rng.randint(150, 600) * scale)),
                            "signature": _signature(rng),
                        },
                        {"type": "text", "text": _text(rng, int(rng.randint(40, 200) * scale))},
                        *uses,
                    ],
                }
            )
            results = [
                {
                    "type": "tool_result",
                    "tool_use_id": use["id"],
                    "content": _tool_output(rng, int(rng.randint(200, 1500) * scale)),
                }
                for use in uses
            ]
            add({"role": "user", "content": results})
        if used < history_budget - 400:
            add(
                {
                    "role": "assistant",
                    "content": [
                        {
                            "type": "thinking",
                            "thinking": _text(rng, int(rng.randint(100, 400) * scale)),
                            "signature": _signature(rng),
                        },
                        {"type": "text", "text": _text(rng, int(rng.randint(150, 700) * scale))},
                    ],
                }
            )
    # End on a user turn sized to land on the budget.
    if history and history[-1]["role"] == "user":
        last = history.pop()
        used -= _size(last)
    filler = max(20, history_budget - used - 60)
    add({"role": "user", "content": [{"type": "text", "text": _text(rng, filler)}]})
    return Conversation(
        target_bytes=target_bytes,
        system=system,
        tools=_TOOLS,
        history=history,
        growth_per_turn=growth,
        turns_per_thread=turns_per_thread,
    )


class FullBody:
    """The full request body of a stateless arm (A, R, B): the whole conversation plus request `n`'s new turn.

    The body is cut around the new turn once, so each request costs one concatenation, not a re-encoding.
    """

    def __init__(self, conversation: Conversation, *, stream: bool) -> None:
        messages = list(conversation.history)
        messages.append(_create_reply(conversation))
        for k in range(conversation.turns_per_thread // 2):
            turn = new_turn(9_000_000 + k)
            messages += [turn, echo_of(turn)]
        body = orjson.dumps(
            {**_fields(stream), "system": conversation.system, "tools": conversation.tools, "messages": messages}
        )
        assert body.endswith(b"]}")
        self._prefix = body[:-2] + b","
        self.stream = stream

    def render(self, n: int) -> tuple[bytes, int]:
        """The body of request `n` and the size of its new turn."""
        turn = orjson.dumps(new_turn(n))
        return self._prefix + turn + b"]}", len(turn)


def _create_reply(conversation: Conversation) -> dict[str, Any]:
    # What the echo backend answers the create with: the echo of the history's last user text.
    last = conversation.history[-1]["content"][0]
    return {"role": "assistant", "content": [{"type": "text", "text": "echo: " + str(last.get("text", ""))}]}


def create_body(conversation: Conversation) -> bytes:
    """A thread create: an ordinary full request (the history, ending with a user turn) plus `thread`."""
    return orjson.dumps(
        {
            **_fields(False),
            "thread": {"type": "create"},
            "system": conversation.system,
            "tools": conversation.tools,
            "messages": conversation.history,
        }
    )


def continue_body(previous_message_id: str, n: int, *, stream: bool) -> tuple[bytes, int]:
    """A continue: this turn's fields, the thread reference and only the new turn. Returns the body and the size of
    the new turn's JSON."""
    turn = orjson.dumps(new_turn(n))
    head = orjson.dumps({**_fields(stream), "thread": {"type": "continue", "previous_message_id": previous_message_id}})
    return head[:-1] + b',"messages":[' + turn + b"]}", len(turn)
