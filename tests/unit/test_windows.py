"""`context_window_tokens: auto` (docs/protocol.md §9, "context_window_tokens: auto"): the policy value, the window each
backend states where it states it, what a refusal teaches, and the window a refused turn is cut to."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from statestore.auth import Principal
from statestore.core import planner
from statestore.core.windows import Windows, window_in_models, window_in_props
from statestore.core.windows import resolved as resolved_window
from statestore.policy import Policy
from statestore.policy_fields import AUTO, BY_NAME, STORED_AUTO, PolicyValueError, validate_values
from statestore.responses.request import read_turn as read_response_turn
from statestore.responses.turns import ResponseTurns
from statestore.threads.refusal_retry import with_window as threads_with_window
from statestore.threads.turn import read_turn as read_thread_turn

BASE: dict[str, Any] = {
    "threads_enabled": True,
    "sessions_enabled": True,
    "default_ttl_seconds": 60,
    "max_ttl_seconds": 600,
    "max_thread_bytes": 1 << 20,
    "max_messages": 1000,
}


def test_auto_is_a_window_value_stored_as_its_sentinel() -> None:
    checked = validate_values({**BASE, "context_strategy": "truncate", "context_window_tokens": "auto"})
    assert checked["context_window_tokens"] == AUTO
    field = BY_NAME["context_window_tokens"]
    assert field.to_column(AUTO) == STORED_AUTO and field.from_column(STORED_AUTO) == AUTO
    assert field.to_column(4096) == 4096 and field.from_column(4096) == 4096
    with pytest.raises(PolicyValueError, match="whole number or auto"):
        validate_values({**BASE, "context_window_tokens": "automatic"})
    with pytest.raises(PolicyValueError, match="at least 1024"):
        validate_values({**BASE, "context_window_tokens": STORED_AUTO})  # the sentinel is not a window


def test_llama_cpp_states_its_runtime_window_in_models_and_props() -> None:
    models = {"object": "list", "data": [{"id": "tiny", "meta": {"n_ctx": 2048, "n_ctx_train": 32768}}]}
    assert window_in_models(models, "tiny") == 2048
    # One model served: llama.cpp answers whatever a request names it, so its only entry is the one.
    assert window_in_models(models, "claude-anything") == 2048
    assert window_in_props({"default_generation_settings": {"n_ctx": 4096}, "total_slots": 1}) == 4096


def test_vllm_states_max_model_len_per_model() -> None:
    models = {"data": [{"id": "a", "max_model_len": 8192}, {"id": "b", "max_model_len": 32768}]}
    assert window_in_models(models, "b") == 32768
    assert window_in_models(models, "c") is None  # two models, neither named: not a guess


@pytest.mark.parametrize("body", [None, [], {"data": "x"}, {"data": [{"id": "a", "max_model_len": True}]}])
def test_bodies_that_state_no_window(body: Any) -> None:
    assert window_in_models(body, "a") is None
    assert window_in_props(body) is None


class _Response:
    def __init__(self, status: int, body: Any) -> None:
        self.status = status
        self._body = orjson.dumps(body)

    async def read(self) -> bytes:
        return self._body

    async def aclose(self) -> None:
        return None


class _Backend:
    """An upstream that answers GETs from a table and counts them."""

    base_url = "http://backend"

    def __init__(self, routes: dict[str, tuple[int, Any]]) -> None:
        self.routes = routes
        self.asked: list[str] = []
        self.headers: list[list[tuple[bytes, bytes]]] = []

    async def send(self, method: str, path: str, headers: list[tuple[bytes, bytes]], body: bytes) -> Any:
        self.asked.append(path)
        self.headers.append(headers)
        status, answer = self.routes.get(path, (404, {}))
        return _Response(status, answer)

    async def aclose(self) -> None:
        return None


async def test_a_discovered_window_is_believed_until_the_refresh() -> None:
    now = [0.0]
    backend = _Backend(
        {"/v1/models": (200, {"data": []}), "/props": (200, {"default_generation_settings": {"n_ctx": 2048}})}
    )
    windows = Windows(backend, clock=lambda: now[0])
    assert await windows.window("m", []) == 2048
    assert await windows.window("m", []) == 2048
    assert backend.asked == ["/v1/models", "/props"]
    now[0] = 301.0
    assert await windows.window("m", []) == 2048
    assert len(backend.asked) == 4


async def test_a_window_a_refusal_states_is_learned_when_the_backend_says_nothing() -> None:
    now = [0.0]
    backend = _Backend({})
    windows = Windows(backend, clock=lambda: now[0])
    assert await windows.window("claude", []) is None
    windows.learn("claude", 200_000)
    assert await windows.window("claude", []) == 200_000
    now[0] = 400.0  # past the refresh, the backend still says nothing: the refusal's word stands
    assert await windows.window("claude", []) == 200_000


def test_an_auto_window_resolves_per_turn_and_stays_unmanaged_while_unknown() -> None:
    policy = Policy(True, True, 60, 600, 1 << 20, 1000, context_strategy="truncate", context_window_tokens="auto")
    assert planner.window_of(policy) is None
    assert planner.window_of(planner.resolved_window(policy, None)) is None
    window = planner.window_of(planner.resolved_window(policy, 2048))
    assert window is not None and window.tokens == 2048 and window.strategy == "truncate"


def test_a_refused_turn_is_cut_to_the_narrower_of_its_window_and_the_stated_one() -> None:
    policy = Policy(True, True, 60, 600, 1 << 20, 1000, context_strategy="summarize", context_window_tokens=100_000)
    managed = planner.window_of(policy)
    assert managed is not None
    cut = planner.window_after_refusal(policy, managed, 2048)
    assert cut is not None and (cut.tokens, cut.strategy) == (2048, "summarize")
    assert planner.window_after_refusal(policy, managed, None) == managed
    unknown = Policy(True, True, 60, 600, 1 << 20, 1000, context_strategy="truncate", context_window_tokens="auto")
    taught = planner.window_after_refusal(unknown, None, 4096)
    assert taught is not None and taught.tokens == 4096
    assert planner.window_after_refusal(unknown, None, None) is None
    unmanaged = Policy(True, True, 60, 600, 1 << 20, 1000)
    assert planner.window_after_refusal(unmanaged, None, 4096) is None


def _auto(strategy: str) -> Policy:
    return Policy(True, True, 60, 600, 1 << 20, 1000, context_strategy=strategy, context_window_tokens="auto")  # type: ignore[arg-type]


async def test_an_auto_window_is_resolved_once_for_both_doors_with_each_doors_credential() -> None:
    """core/windows.py resolves `auto` for both doors: each asks with the credential it sends its turn with (the
    client's in passthrough, the deployment's key in keys mode), and a turn that does not manage its context
    (strategy `none`; `truncation: "disabled"`) asks nothing."""
    states = {"/v1/models": (200, {"data": [{"id": "m", "max_model_len": 4096}]})}
    passthrough = Principal("owner", None, None)
    keys = Principal("owner", None, (b"x-api-key", b"deployment"))
    client = [(b"x-api-key", b"client"), (b"statestore-session-id", b"s1")]
    thread_turn = read_thread_turn({"model": "m", "max_tokens": 8, "messages": []}, client)
    assert thread_turn is not None

    backend = _Backend(states)
    windows = Windows(backend)
    resolved = await threads_with_window(windows, _auto("summarize"), thread_turn, client, passthrough)
    assert resolved.context_window_tokens == 4096 and resolved.context_strategy == "summarize"
    assert (b"x-api-key", b"client") in backend.headers[0]
    assert await threads_with_window(windows, _auto("none"), thread_turn, [], passthrough) == _auto("none")

    backend = _Backend(states)
    turns = ResponseTurns.__new__(ResponseTurns)
    turns.windows = Windows(backend)
    auto_turn = read_response_turn(orjson.dumps({"model": "m", "input": "hi", "truncation": "auto"}))
    resolved = await turns._with_window(_auto("none"), auto_turn, keys, [])
    assert resolved.context_window_tokens == 4096
    assert (b"authorization", b"Bearer deployment") in backend.headers[0]
    disabled = read_response_turn(orjson.dumps({"model": "m", "input": "hi"}))
    assert await turns._with_window(_auto("truncate"), disabled, keys, []) == _auto("truncate")
    assert len(backend.asked) == 1
    # passthrough: the Responses door asks with the client's own credential, as the Messages door does.
    backend = _Backend(states)
    turns.windows = Windows(backend)
    assert (await turns._with_window(_auto("none"), auto_turn, passthrough, client)).context_window_tokens == 4096
    assert (b"authorization", b"Bearer client") in backend.headers[0]

    # No backend to ask, or a policy with a window of its own: the policy as it is, and nothing built to ask with.
    def never() -> list[tuple[bytes, bytes]]:
        raise AssertionError("asked")

    assert await resolved_window(None, _auto("truncate"), "m", never) == planner.resolved_window(
        _auto("truncate"), None
    )
    fixed = Policy(True, True, 60, 600, 1 << 20, 1000, context_strategy="truncate", context_window_tokens=2048)
    assert await resolved_window(Windows(_Backend({})), fixed, "m", never) is fixed
