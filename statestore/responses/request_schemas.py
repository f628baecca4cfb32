"""The request bodies of the Responses and Conversations front door: the models that validate them
(statestore/responses/validation.py) and describe them in /openapi.json (docs/responses.md), and how they reach the
document (`request_body` is a route's `openapi_extra`, `add_components` the app's OpenAPI hook);
statestore/responses/schemas.py holds the objects it returns.

Where an error is reported is part of the contract (a 400's `param`), and the models say it: a union's members are
tagged `<name>`, and a tag is no part of a path; an unsupported `type` names the object that carries it; a value
annotated `reported_here` names itself, whatever inside it is wrong."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    WithJsonSchema,
    WrapValidator,
)
from pydantic_core import PydanticCustomError

from statestore.responses.schemas import (
    OPAQUE_ITEM_TYPES,
    FunctionChoice,
    ItemId,
    ItemStatus,
    MessagePhase,
    ResponseStreamEvent,
    TextFormat,
)

MAX_TEXT_CHARS = 10 * 1024 * 1024
MAX_ITEMS_PER_REQUEST = 20
Text = Annotated[str, Field(max_length=MAX_TEXT_CHARS)]


def reported_here(expected: str) -> WrapValidator:
    """Whatever is wrong inside the value, the error names the value and says what it expects: the client mends the
    value as a whole (an id or a reference; metadata's pairs; a format)."""

    def validate(value: object, handler: Any) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("invalid_value", expected) from None

    return WrapValidator(validate)


def _text_or_array(value: object) -> str | None:
    if isinstance(value, str):
        return "<text>"
    return "<array>" if isinstance(value, list) else None


def _tag_of(value: object, key: str) -> str | None:
    kind = value.get(key) if isinstance(value, dict) else None
    return f"<{kind}>" if isinstance(kind, str) else None


# -- request bodies ----------------------------------------------------------------------------------------------
# Fields statestore does not know are ignored inside items and parts (the SDK resends what it received); at the top
# of a `POST /v1/responses` body they are a 400 `unknown_parameter`.


class InputTextParam(BaseModel):
    type: Literal["input_text", "output_text", "text"] = Field(description="output_text in an assistant message")
    text: Text


class InputImageParam(BaseModel):
    type: Literal["input_image"]
    image_url: Text = Field(description="a URL or a data: URL (file_id is not supported)")
    detail: Literal["auto", "low", "high"] = "auto"


class RefusalParam(BaseModel):
    type: Literal["refusal"] = Field(description="in an assistant message only")
    refusal: Text


def _part_kind(value: object) -> str | None:
    tag = _tag_of(value, "type")
    return "<text>" if tag in ("<input_text>", "<output_text>", "<text>") else tag


InputPartParam = Annotated[
    Annotated[InputTextParam, Tag("<text>")] | Annotated[InputImageParam, Tag("<input_image>")],
    Discriminator(
        _part_kind,
        custom_error_type="unsupported_value",
        custom_error_message="an input_text or input_image part expected (input_file and input_audio are refused)",
    ),
]
OutputPartParam = Annotated[
    Annotated[InputTextParam, Tag("<text>")] | Annotated[RefusalParam, Tag("<refusal>")],
    Discriminator(
        _part_kind,
        custom_error_type="unsupported_value",
        custom_error_message="an output_text or refusal part expected in an assistant message",
    ),
]
_CONTENT = "a string or a non-empty array of parts expected"


class MessageParam(BaseModel):
    type: Literal["message"] | None = Field(default=None, description="may be left out: an item with a role is one")
    id: ItemId | None = Field(default=None, description="kept as given; minted (msg_...) when absent")
    role: Literal["user", "system", "developer"]
    content: Annotated[
        Annotated[Text, Tag("<text>")] | Annotated[list[InputPartParam], Tag("<array>"), Field(min_length=1)],
        Discriminator(_text_or_array, custom_error_type="invalid_type", custom_error_message=_CONTENT),
    ]
    status: ItemStatus | None = None


class AssistantMessageParam(BaseModel):
    type: Literal["message"] | None = Field(default=None, description="may be left out: an item with a role is one")
    id: ItemId | None = Field(default=None, description="kept as given; minted (msg_...) when absent")
    role: Literal["assistant"]
    content: Annotated[
        Annotated[Text, Tag("<text>")] | Annotated[list[OutputPartParam], Tag("<array>"), Field(min_length=1)],
        Discriminator(_text_or_array, custom_error_type="invalid_type", custom_error_message=_CONTENT),
    ]
    status: ItemStatus | None = None
    phase: MessagePhase | None = Field(default=None, description="kept and returned; sent as any assistant message")


class FunctionCallParam(BaseModel):
    type: Literal["function_call"]
    id: ItemId | None = Field(default=None, description="kept as given; minted (fc_...) when absent")
    call_id: Text
    name: Text
    arguments: Text
    status: ItemStatus | None = None


class FunctionCallOutputParam(BaseModel):
    type: Literal["function_call_output"]
    id: ItemId | None = None
    call_id: Text
    output: Annotated[
        Annotated[Text, Tag("<text>")] | Annotated[list[InputPartParam], Tag("<array>")],
        Discriminator(_text_or_array, custom_error_type="invalid_type", custom_error_message="a string or parts"),
    ]
    status: ItemStatus | None = None


class ReasoningParam(BaseModel):
    type: Literal["reasoning"]
    id: ItemId | None = None
    summary: list[Any] = []
    content: list[Any] | None = None
    encrypted_content: str | None = None


def _opaque(value: dict[str, Any]) -> dict[str, Any]:
    item_id = value.get("id")
    if item_id is not None and not (isinstance(item_id, str) and 0 < len(item_id) <= 200):
        raise PydanticCustomError("invalid_value", "an id of 1 to 200 characters expected")
    return value


OpaqueItemParam = Annotated[
    dict[str, Any],
    AfterValidator(_opaque),
    WithJsonSchema(
        {
            "type": "object",
            "description": "an item of a kind statestore does not run (a hosted or client tool's call or output, "
            "additional_tools, ...): stored and returned as given (an id minted when it has none), never sent to "
            "the backend",
            "properties": {
                "type": {"enum": sorted(OPAQUE_ITEM_TYPES)},
                "id": {"type": "string", "minLength": 1, "maxLength": 200},
            },
            "required": ["type"],
        }
    ),
]


def _item_kind(value: object) -> str | None:
    """An item's tag: its `type`, a message told apart by its role (an item with a role and no type is one)."""
    if not isinstance(value, dict):
        return None
    kind = value.get("type") or ("message" if "role" in value else None)
    if kind == "message":
        return "<assistant>" if value.get("role") == "assistant" else "<message>"
    if kind in OPAQUE_ITEM_TYPES:
        return "<opaque>"
    return f"<{kind}>" if isinstance(kind, str) else None


ItemParam = Annotated[
    Annotated[MessageParam, Tag("<message>")]
    | Annotated[AssistantMessageParam, Tag("<assistant>")]
    | Annotated[FunctionCallParam, Tag("<function_call>")]
    | Annotated[FunctionCallOutputParam, Tag("<function_call_output>")]
    | Annotated[ReasoningParam, Tag("<reasoning>")]
    | Annotated[OpaqueItemParam, Tag("<opaque>")],
    Discriminator(_item_kind, custom_error_type="unsupported_value", custom_error_message="a supported item expected"),
]


class CompactionItemParam(BaseModel):
    """A compaction item as a turn returned it (or `/v1/responses/compact`): statestore opens its `encrypted_content`
    and sends its summary in its place. Only in a response's `input` (a conversation's items are never one)."""

    type: Literal["compaction"]
    id: ItemId | None = Field(default=None, description="kept as given; minted (cmp_...) when absent")
    encrypted_content: Text = Field(description="as statestore returned it; opened for this owner only")
    created_by: str | None = None


TurnItemParam = Annotated[
    Annotated[MessageParam, Tag("<message>")]
    | Annotated[AssistantMessageParam, Tag("<assistant>")]
    | Annotated[FunctionCallParam, Tag("<function_call>")]
    | Annotated[FunctionCallOutputParam, Tag("<function_call_output>")]
    | Annotated[ReasoningParam, Tag("<reasoning>")]
    | Annotated[CompactionItemParam, Tag("<compaction>")]
    | Annotated[OpaqueItemParam, Tag("<opaque>")],
    Discriminator(_item_kind, custom_error_type="unsupported_value", custom_error_message="a supported item expected"),
]
InputParam = Annotated[
    Annotated[Text, Tag("<text>")] | Annotated[list[TurnItemParam], Tag("<array>")],
    Discriminator(_text_or_array, custom_error_type="invalid_type", custom_error_message="a string or items expected"),
]


class FunctionToolParam(BaseModel):
    """Only function tools: sent to the backend as `{"type": "function", "function": {...}}`."""

    type: Literal["function"] = Field(description="only function tools are supported by this backend")
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = Field(default=None, description="a JSON Schema")
    strict: bool | None = None


class CompactionParam(BaseModel):
    """Compact the context before the turn when it would pass `compact_threshold` tokens (docs/responses.md)."""

    type: Literal["compaction"] = Field(description="the one kind of context management")
    compact_threshold: Annotated[int, Field(ge=1, le=100_000_000)] | None = Field(
        default=None, description="tokens; absent: the trigger of the owner's context window, when it has one"
    )


class ConversationRefParam(BaseModel):
    id: str = Field(min_length=1)


class TextParam(BaseModel):
    format: Annotated[TextFormat | None, reported_here("a text, json_object or json_schema format expected")] = Field(
        default=None, description='absent or null: {"type": "text"}'
    )


Metadata = Annotated[
    dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
    Field(max_length=16, description="up to 16 pairs; keys up to 64, values up to 512 characters"),
    reported_here("an object of at most 16 pairs, keys up to 64 and string values up to 512 characters expected"),
]


class ResponseCreateRequest(BaseModel):
    """A turn. The context is the chain of `previous_response_id` (or the `conversation`'s items), then `input`;
    `instructions` and `tools` are this request's only, never carried over."""

    model_config = ConfigDict(extra="forbid")
    model: str = Field(min_length=1, max_length=256, description="passed to the backend as it is")
    input: InputParam = Field(description="a user message's text, or items")
    instructions: str | None = Field(default=None, description="sent as the first system message")
    previous_response_id: str | None = Field(default=None, description="any stored response of the owner's")
    conversation: Annotated[
        Annotated[str, Field(min_length=1)] | ConversationRefParam | None,
        reported_here('an id or {"id": ...} expected'),
    ] = Field(default=None, description="a conversation's id, or {id}; not with previous_response_id")
    store: bool | None = Field(default=True, description="false: returned, never stored")
    stream: bool | None = Field(default=False, description="true: server-sent events")
    metadata: Metadata | None = Field(default=None, description="kept; `user_id` is what erasure by user finds")
    tools: Annotated[list[FunctionToolParam], Field(max_length=512)] | None = None
    tool_choice: Annotated[
        Literal["auto", "none", "required"] | FunctionChoice | None,
        reported_here('"auto", "none", "required" or a function expected'),
    ] = None
    parallel_tool_calls: bool | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=10_000_000)] | None = Field(
        default=None, description="sent as max_tokens"
    )
    text: TextParam | None = Field(default=None, description="format json_schema or json_object: response_format")
    truncation: Literal["auto", "disabled"] | None = Field(
        default="disabled", description="auto: the owner's context policy cuts the oldest turns (docs/protocol.md §9)"
    )
    context_management: Annotated[list[CompactionParam], Field(max_length=1)] | None = Field(
        default=None, description="compaction past a threshold; not on a conversation"
    )
    background: bool | None = Field(
        default=None,
        description="run the turn detached from this request: answered at once `queued`, then polled, streamed from "
        "any replica (`GET /v1/responses/{id}?stream=true&starting_after=N`) or cancelled; needs `store`",
    )
    # Echoed in the Response as sent; nothing a Chat Completions backend is sent does what they ask.
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = Field(
        default=None, description="echoed; no log probabilities are returned"
    )
    max_tool_calls: Annotated[int, Field(ge=1)] | None = Field(
        default=None, description="echoed; statestore runs no built-in tools"
    )
    safety_identifier: Annotated[str, Field(max_length=64)] | None = Field(default=None, description="echoed")
    prompt_cache_key: Annotated[str, Field(max_length=64)] | None = Field(default=None, description="echoed")
    # Accepted so that clients which always send them work; they change nothing here.
    user: Any = Field(default=None, description="accepted, not used")
    include: Any = Field(default=None, description="accepted, not used")
    reasoning: Any = Field(default=None, description="accepted, not used")
    service_tier: Any = Field(default=None, description='accepted, not used: the Response says "default"')
    stream_options: Any = Field(default=None, description="accepted, not used")


class ResponseCompactRequest(BaseModel):
    """`POST /v1/responses/compact`: the context (the chain of `previous_response_id`, then `input`) summarised into
    one compaction item after its user messages. Nothing is stored."""

    model_config = ConfigDict(extra="forbid")
    model: str = Field(min_length=1, max_length=256, description="the summary's, unless the policy names one")
    input: InputParam | None = Field(default=None, description="a user message's text, or items")
    instructions: str | None = Field(default=None, description="the summary request's system message")
    previous_response_id: str | None = Field(default=None, description="any stored response of the owner's")
    # Accepted so that clients which always send them work; they change nothing here.
    prompt_cache_key: Any = Field(default=None, description="accepted, not used")
    prompt_cache_options: Any = Field(default=None, description="accepted, not used")
    prompt_cache_retention: Any = Field(default=None, description="accepted, not used")
    service_tier: Any = Field(default=None, description="accepted, not used")
    image: Any = Field(default=None, description="accepted, not used")


class ResponseInputTokensRequest(BaseModel):
    """`POST /v1/responses/input_tokens`: the input tokens of the turn these fields would make, counted over the
    stored context (the chain of `previous_response_id`, or the `conversation`'s items) after the owner's context
    policy, by the backend's tokenizer where it has one (docs/responses.md). Nothing is stored and the model is not
    run."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = Field(default=None, min_length=1, max_length=256, description="passed to the tokenizer")
    input: InputParam | None = Field(default=None, description="a user message's text, or items")
    instructions: str | None = Field(default=None, description="sent as the first system message")
    previous_response_id: str | None = Field(default=None, description="any stored response of the owner's")
    conversation: Annotated[
        Annotated[str, Field(min_length=1)] | ConversationRefParam | None,
        reported_here('an id or {"id": ...} expected'),
    ] = Field(default=None, description="a conversation's id, or {id}; not with previous_response_id")
    tools: Annotated[list[FunctionToolParam], Field(max_length=512)] | None = None
    tool_choice: Annotated[
        Literal["auto", "none", "required"] | FunctionChoice | None,
        reported_here('"auto", "none", "required" or a function expected'),
    ] = None
    parallel_tool_calls: bool | None = None
    text: TextParam | None = Field(default=None, description="format json_schema or json_object: response_format")
    truncation: Literal["auto", "disabled"] | None = Field(
        default="disabled", description="auto: counted after the owner's context policy cuts the oldest turns"
    )
    # Accepted so that clients which always send them work; they change nothing here.
    reasoning: Any = Field(default=None, description="accepted, not used")
    personality: Any = Field(default=None, description="accepted, not used")


class ConversationCreateRequest(BaseModel):
    items: Annotated[list[ItemParam], Field(max_length=MAX_ITEMS_PER_REQUEST)] | None = Field(
        default=None,
        description="initial items; over the owner's max_messages or max_thread_bytes, 400 as an append over them "
        "(too_many_messages, context_too_large) and nothing stored",
    )
    metadata: Metadata | None = None


class ConversationUpdateRequest(BaseModel):
    metadata: Metadata | None = Field(default=None, description="replaces the conversation's metadata (absent: none)")


class ConversationItemsRequest(BaseModel):
    items: Annotated[list[ItemParam], Field(min_length=1, max_length=MAX_ITEMS_PER_REQUEST)]


REQUEST_MODELS: tuple[type[BaseModel], ...] = (
    ResponseCreateRequest,
    ResponseCompactRequest,
    ResponseInputTokensRequest,
    ConversationCreateRequest,
    ConversationUpdateRequest,
    ConversationItemsRequest,
    ResponseStreamEvent,
)
_REF = "#/components/schemas/{model}"


def add_components(document: dict[str, Any]) -> None:
    """Put the models no route declares (request bodies, stream events) into the document's components; each keeps a
    component FastAPI already made from a response model of the same name."""
    components = document.setdefault("components", {}).setdefault("schemas", {})
    for model in REQUEST_MODELS:
        schema = model.model_json_schema(ref_template=_REF)
        for name, definition in schema.pop("$defs", {}).items():
            components.setdefault(name, definition)
        components.setdefault(model.__name__, schema)


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """The `openapi_extra` of a route that reads its body itself."""
    assert model in REQUEST_MODELS
    schema = {"$ref": _REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}
