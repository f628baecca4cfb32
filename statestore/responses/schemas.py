"""The Responses and Conversations front door in /openapi.json: what statestore accepts and returns (docs/responses.md).

For speed the routes read raw bodies and send stored bytes, so FastAPI never validates against these models: they
only describe the wire. Request models reach the document through `request_body` (an `openapi_extra`) and
`add_components` (the app's OpenAPI hook); response models through `ok` (a route's `responses=`). The live test
(tests/integration/test_typed_api.py) checks what the `openai` SDK sends and receives against them."""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, RootModel

Metadata = Annotated[
    dict[str, Annotated[str, Field(max_length=512)]],
    Field(max_length=16, description="up to 16 pairs; keys up to 64, values up to 512 characters"),
]
ItemStatus = Literal["in_progress", "completed", "incomplete"]
Role = Literal["user", "system", "developer", "assistant"]
ItemId = Annotated[str, Field(min_length=1, max_length=200)]
MessagePhase = Literal["commentary", "final_answer"]
# Items of the kinds the `openai` SDK sends that statestore does not run (hosted tools' calls, client tools' calls and
# outputs, tools added mid-conversation): stored and returned as given, never sent to a Chat Completions backend,
# which has no form for them. Items that ask for something to be done (`item_reference`, `compaction_trigger`,
# `configuration_update`) are refused rather than kept undone.
OpaqueItemType = Literal[
    "additional_tools",
    "apply_patch_call",
    "apply_patch_call_output",
    "code_interpreter_call",
    "computer_call",
    "computer_call_output",
    "custom_tool_call",
    "custom_tool_call_output",
    "file_search_call",
    "image_generation_call",
    "local_shell_call",
    "local_shell_call_output",
    "mcp_approval_request",
    "mcp_approval_response",
    "mcp_call",
    "mcp_list_tools",
    "program",
    "program_output",
    "shell_call",
    "shell_call_output",
    "tool_search_call",
    "tool_search_output",
    "web_search_call",
]
OPAQUE_ITEM_TYPES = frozenset(get_args(OpaqueItemType))


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error (400, 401, 404, ...), or server_error")
    param: str | None
    code: str | None = Field(description="previous_response_not_found, conversation_locked, invalid_value, ...")


class OpenAIError(BaseModel):
    """OpenAI's error shape, on every Responses and Conversations route."""

    error: OpenAIErrorDetail


# -- content parts and items, as statestore stores and returns them ---------------------------------------------


class InputText(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["input_text"]
    text: str


class InputImage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["input_image"]
    image_url: str
    detail: Literal["auto", "low", "high"]


class OutputText(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any]


class Refusal(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[InputText | InputImage | OutputText | Refusal, Field(discriminator="type")]


class MessageItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["message"]
    id: str = Field(examples=["msg_4B2mQh0pSa1Y0bXkzGmT8c"])
    role: Role
    content: list[ContentPart] = Field(description="user, system, developer: input parts; assistant: output parts")
    status: ItemStatus
    phase: MessagePhase | None = Field(
        default=None, description="an assistant message's, as its client sent it; absent otherwise"
    )


class FunctionCallItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function_call"]
    id: str = Field(examples=["fc_4B2mQh0pSa1Y0bXkzGmT8c"])
    call_id: str = Field(description="the backend's tool call id, or a minted call_... when it gave none")
    name: str
    arguments: str = Field(description="JSON text, as the model wrote it")
    status: ItemStatus


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function_call_output"]
    id: str
    call_id: str
    output: str | list[ContentPart]
    status: ItemStatus


class ReasoningItem(BaseModel):
    """Stored and returned, never sent to the backend."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["reasoning"]
    id: str
    summary: list[Any]
    content: list[Any] | None = None
    encrypted_content: str | None = None


class CompactionItem(BaseModel):
    """What a compaction left of the context before it (docs/responses.md, "Compaction"): its summary, sealed for the
    owner. Opaque; sent back in a later `input`, it stands for that context."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["compaction"]
    id: str = Field(examples=["cmp_4B2mQh0pSa1Y0bXkzGmT8c"])
    encrypted_content: str
    created_by: str | None = None


class OpaqueItem(BaseModel):
    """An item of a kind statestore does not run (OPAQUE_ITEM_TYPES), as its client sent it, with an id minted when
    it had none. Never sent to the backend."""

    model_config = ConfigDict(extra="allow")
    type: OpaqueItemType
    id: str


Item = Annotated[
    MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem | CompactionItem | OpaqueItem,
    Field(discriminator="type"),
]


class ConversationItem(RootModel[Item]):
    """One item: a message, a function call, its output, reasoning, a compaction, or one statestore does not run."""


class ItemList(BaseModel):
    """A page of items (`order` desc by default, `after`, `limit`)."""

    model_config = ConfigDict(extra="forbid")
    object: Literal["list"]
    data: list[Item]
    first_id: str | None
    last_id: str | None
    has_more: bool


# -- the Response object -----------------------------------------------------------------------------------------


class InputTokensDetails(BaseModel):
    model_config = ConfigDict(extra="forbid")
    cached_tokens: int
    cache_write_tokens: int


class OutputTokensDetails(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reasoning_tokens: int


class ResponseUsage(BaseModel):
    """The backend's usage, translated (0 where it does not say)."""

    model_config = ConfigDict(extra="forbid")
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reason: Literal["max_output_tokens", "content_filter"]


class ConversationRef(BaseModel):
    id: str = Field(examples=["conv_4B2mQh0pSa1Y0bXkzGmT8c"])


class ReasoningConfig(BaseModel):
    effort: str | None
    summary: str | None


class FormatText(BaseModel):
    type: Literal["text"]


class FormatJsonObject(BaseModel):
    type: Literal["json_object"]


class FormatJsonSchema(BaseModel):
    """Sent to the backend as `response_format: {"type": "json_schema", "json_schema": {...}}`; echoed in the
    Response with `description` and `strict` (null and false when they were left out)."""

    type: Literal["json_schema"]
    name: str
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


TextFormat = Annotated[FormatText | FormatJsonObject | FormatJsonSchema, Field(discriminator="type")]


class TextConfig(BaseModel):
    format: TextFormat | None = Field(default=None, description='absent or null: {"type": "text"}')


class EchoedTool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str
    description: str | None
    parameters: dict[str, Any] | None
    strict: bool | None


class FunctionChoice(BaseModel):
    type: Literal["function"]
    name: str


ToolChoice = Literal["auto", "none", "required"] | FunctionChoice


class ResponseErrorInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")
    code: str = Field(examples=["server_error"])
    message: str


class Response(BaseModel):
    """A turn's result, as returned, stored and retrieved: complete and typed as the Open Responses specification
    (2026-04-24) says. Request fields are echoed as they were sent; those left out say the values the turn used."""

    model_config = ConfigDict(extra="forbid")
    id: str = Field(examples=["resp_4B2mQh0pSa1Y0bXkzGmT8c"])
    object: Literal["response"]
    created_at: int = Field(description="seconds since the epoch")
    completed_at: int | None = Field(
        description="seconds since the epoch, when the status is completed; null otherwise (a response stored by an "
        "earlier version of statestore: its created_at)"
    )
    status: Literal["completed", "incomplete", "in_progress", "queued", "failed", "cancelled"] = Field(
        description="in_progress only in a stream's response.created and response.in_progress, and while a background "
        "response runs; queued, failed and cancelled only for a background response"
    )
    background: bool
    error: ResponseErrorInfo | None = Field(description="why a background response failed; null otherwise")
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    max_tool_calls: int | None = Field(description="as sent (statestore runs no built-in tools)")
    model: str
    output: list[Item]
    parallel_tool_calls: bool
    previous_response_id: str | None
    conversation: ConversationRef | None
    reasoning: ReasoningConfig
    store: bool
    temperature: float = Field(description="as sent, else 1 (the specification's default, Chat Completions' own)")
    top_p: float = Field(description="as sent, else 1")
    presence_penalty: float = Field(description="as sent, else 0")
    frequency_penalty: float = Field(description="as sent, else 0")
    top_logprobs: int = Field(description="as sent, else 0 (no log probabilities are returned)")
    service_tier: Literal["default"] = Field(description="the backend is asked for no other tier")
    safety_identifier: str | None = Field(description="as sent")
    prompt_cache_key: str | None = Field(description="as sent")
    text: TextConfig
    tool_choice: ToolChoice
    tools: list[EchoedTool]
    truncation: Literal["auto", "disabled"]
    usage: ResponseUsage | None = Field(description="null only while in progress")
    metadata: dict[str, str]


class CompactedResponse(BaseModel):
    """`POST /v1/responses/compact`: every user message of the context, then one compaction item. Nothing is stored."""

    model_config = ConfigDict(extra="forbid")
    id: str = Field(examples=["resp_4B2mQh0pSa1Y0bXkzGmT8c"])
    object: Literal["response.compaction"]
    created_at: int = Field(description="seconds since the epoch")
    output: list[Item]
    usage: ResponseUsage = Field(description="the summary request's")


class InputTokens(BaseModel):
    """`POST /v1/responses/input_tokens`: the turn's input tokens; the `statestore-token-count` header says whether the
    backend's tokenizer counted them (`backend`) or statestore's estimator (`estimate`)."""

    model_config = ConfigDict(extra="forbid")
    object: Literal["response.input_tokens"]
    input_tokens: int = Field(ge=0)


class ResponseDeleted(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    object: Literal["response.deleted"]
    deleted: Literal[True]


class ResponseStreamEvent(BaseModel):
    """One `data:` of the SSE stream a `stream: true` turn answers with (its `event:` line repeats `type`). Each
    output item's events are framed by `response.output_item.added` and `.done`; the stream ends with
    `response.completed` or `response.incomplete` after the turn is stored, and is cut with no ending otherwise. A
    background response's stream opens with `response.created` and `response.queued`, and may end with
    `response.failed` or `response.cancelled`. A
    turn that compacted its context opens its output with the compaction item, `response.compaction.compacting`
    between that item's `.added` and `.done`."""

    model_config = ConfigDict(extra="forbid")
    type: Literal[
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.compaction.compacting",
        "response.completed",
        "response.incomplete",
        "response.queued",
        "response.failed",
        "response.cancelled",
    ]
    sequence_number: int = Field(description="0, 1, 2, ... in the order sent")
    response: Response | None = Field(
        default=None, description="created, in_progress, completed, incomplete; queued, failed, cancelled"
    )
    output_index: int | None = None
    item_id: str | None = None
    content_index: int | None = None
    item: Item | None = None
    part: ContentPart | None = None
    delta: str | None = None
    text: str | None = None
    name: str | None = None
    arguments: str | None = None
    logprobs: list[Any] | None = None


# -- the Conversation object -------------------------------------------------------------------------------------


class Conversation(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str = Field(examples=["conv_4B2mQh0pSa1Y0bXkzGmT8c"])
    object: Literal["conversation"]
    created_at: int = Field(description="seconds since the epoch")
    metadata: dict[str, str]


class ConversationDeleted(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    object: Literal["conversation.deleted"]
    deleted: Literal[True]


def ok(model: Any, description: str, **extra: Any) -> dict[int | str, dict[str, Any]]:
    """A route's `responses=`: its 200 (the route sends bytes, so this only describes them)."""
    return {200: {"model": model, "description": description, **extra}}


ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": OpenAIError, "description": "invalid request (previous_response_not_found, conversation_locked...)"},
    401: {"model": OpenAIError, "description": "missing or unknown credential (keys mode)"},
    404: {"model": OpenAIError, "description": "not found: unknown, expired, deleted or another owner's"},
    "default": {"model": OpenAIError, "description": "any other error: 413, 503, or the backend's, relayed"},
}

LIST_PARAMETERS = {
    "parameters": [
        {"name": "order", "in": "query", "schema": {"enum": ["asc", "desc"], "default": "desc"}},
        {"name": "after", "in": "query", "schema": {"type": "string"}, "description": "an item id: the page after it"},
        {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 100, "default": 20}},
    ]
}
