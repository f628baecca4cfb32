"""The request bodies of the Responses and Conversations front door in /openapi.json (RESPONSES.md), and how they
reach the document: the routes read their bodies themselves, so these models only describe them (`request_body` is
a route's `openapi_extra`, `add_components` the app's OpenAPI hook); statestore/responses/schemas.py holds the
objects it returns."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from statestore.responses.schemas import (
    ConversationRef,
    ItemId,
    ItemStatus,
    Metadata,
    ResponseStreamEvent,
    Role,
    TextConfig,
    ToolChoice,
)

# -- request bodies ----------------------------------------------------------------------------------------------
# Fields statestore does not know are ignored inside items and parts (the SDK resends what it received); at the top
# of a `POST /v1/responses` body they are a 400 `unknown_parameter`.


class InputTextParam(BaseModel):
    type: Literal["input_text", "output_text", "text"] = Field(description="output_text in an assistant message")
    text: str


class InputImageParam(BaseModel):
    type: Literal["input_image"]
    image_url: str = Field(description="a URL or a data: URL (file_id is not supported)")
    detail: Literal["auto", "low", "high"] = "auto"


class RefusalParam(BaseModel):
    type: Literal["refusal"] = Field(description="in an assistant message only")
    refusal: str


PartParam = Annotated[InputTextParam | InputImageParam | RefusalParam, Field(discriminator="type")]


class MessageParam(BaseModel):
    type: Literal["message"] | None = Field(default=None, description="may be left out: an item with a role is one")
    id: ItemId | None = Field(default=None, description="kept as given; minted (msg_...) when absent")
    role: Role
    content: str | Annotated[list[PartParam], Field(min_length=1)]
    status: ItemStatus | None = None


class FunctionCallParam(BaseModel):
    type: Literal["function_call"]
    id: ItemId | None = Field(default=None, description="kept as given; minted (fc_...) when absent")
    call_id: str
    name: str
    arguments: str
    status: ItemStatus | None = None


class FunctionCallOutputParam(BaseModel):
    type: Literal["function_call_output"]
    id: ItemId | None = None
    call_id: str
    output: str | list[PartParam]
    status: ItemStatus | None = None


class ReasoningParam(BaseModel):
    type: Literal["reasoning"]
    id: ItemId | None = None
    summary: list[Any] = []
    content: list[Any] | None = None
    encrypted_content: str | None = None


ItemParam = MessageParam | FunctionCallParam | FunctionCallOutputParam | ReasoningParam


class FunctionToolParam(BaseModel):
    """Only function tools: sent to the backend as `{"type": "function", "function": {...}}`."""

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = Field(default=None, description="a JSON Schema")
    strict: bool | None = None


class ResponseCreateRequest(BaseModel):
    """A turn. The context is the chain of `previous_response_id` (or the `conversation`'s items), then `input`;
    `instructions` and `tools` are this request's only, never carried over."""

    model_config = ConfigDict(extra="forbid")
    model: str = Field(min_length=1, max_length=256, description="passed to the backend as it is")
    input: str | list[ItemParam] = Field(description="a user message's text, or items")
    instructions: str | None = Field(default=None, description="sent as the first system message")
    previous_response_id: str | None = Field(default=None, description="any stored response of the owner's")
    conversation: str | ConversationRef | None = Field(
        default=None, description="a conversation's id, or {id}; not with previous_response_id"
    )
    store: bool | None = Field(default=True, description="false: returned, never stored")
    stream: bool | None = Field(default=False, description="true: server-sent events")
    metadata: Metadata | None = Field(default=None, description="kept; `user_id` is what erasure by user finds")
    tools: Annotated[list[FunctionToolParam], Field(max_length=512)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=10_000_000)] | None = Field(
        default=None, description="sent as max_tokens"
    )
    text: TextConfig | None = Field(default=None, description="format json_schema or json_object: response_format")
    truncation: Literal["auto", "disabled"] | None = Field(
        default="disabled", description="auto: the owner's context policy cuts the oldest turns (PROTOCOL §9)"
    )
    # Accepted so that clients which always send them work; they change nothing here.
    user: Any = Field(default=None, description="accepted, not used")
    safety_identifier: Any = Field(default=None, description="accepted, not used")
    prompt_cache_key: Any = Field(default=None, description="accepted, not used")
    include: Any = Field(default=None, description="accepted, not used")
    reasoning: Any = Field(default=None, description="accepted, not used")
    background: Any = Field(default=None, description="accepted, not used")
    service_tier: Any = Field(default=None, description="accepted, not used")
    stream_options: Any = Field(default=None, description="accepted, not used")
    top_logprobs: Any = Field(default=None, description="accepted, not used")
    max_tool_calls: Any = Field(default=None, description="accepted, not used")


class ConversationCreateRequest(BaseModel):
    items: Annotated[list[ItemParam], Field(max_length=20)] | None = Field(default=None, description="initial items")
    metadata: Metadata | None = None


class ConversationUpdateRequest(BaseModel):
    metadata: Metadata | None = Field(default=None, description="replaces the conversation's metadata (absent: none)")


class ConversationItemsRequest(BaseModel):
    items: Annotated[list[ItemParam], Field(min_length=1, max_length=20)]


REQUEST_MODELS: tuple[type[BaseModel], ...] = (
    ResponseCreateRequest,
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
