"""`/v1/conversations`: create (with initial items), read, update metadata, delete; list, append, read and delete
items."""

from __future__ import annotations

import time
from typing import Any

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from statestore.api.deps import ResourcesDep
from statestore.api.idempotent import key_of, keyed_write, outcome_of, with_key, write_once
from statestore.api.openai_responses import JSON, header, json_response, list_params, page, turns_of
from statestore.api.responses import bytes_response
from statestore.core.idempotency import Claim, Outcome
from statestore.policy import Policy
from statestore.resources import Resources
from statestore.responses import request_schemas, schemas
from statestore.responses.context import conversation_cache_key
from statestore.responses.conversation_append import append_items, items_measures
from statestore.responses.errors import NotFound, conversation_locked, conversation_not_found
from statestore.responses.ids import looks_like, new_id
from statestore.responses.items import normalise_input, stored
from statestore.responses.turns import enforced
from statestore.responses.validation import read_body
from statestore.store.conversation_store import Locked
from statestore.store.response_records import ConversationRow

router = APIRouter(tags=["conversations"], responses=schemas.ERRORS)


def _object(row: ConversationRow) -> Response:
    body = b'{"id":"%s","object":"conversation","created_at":%d,"metadata":%s}' % (
        row.id.encode(),
        row.created_ms // 1000,
        row.metadata,
    )
    return bytes_response(200, body, JSON)


async def _principal_owner(request: Request, resources: Resources) -> tuple[str, str | None]:
    principal = await resources.authenticator.authenticate(request.headers.raw)
    return principal.owner, principal.tenant_id


def _checked(conversation_id: str) -> str:
    if not looks_like("conv_", conversation_id):
        raise conversation_not_found(conversation_id)
    return conversation_id


@router.post(
    "/v1/conversations",
    openapi_extra=with_key(request_schemas.request_body(request_schemas.ConversationCreateRequest)),
    responses=schemas.ok(schemas.Conversation, "the new conversation"),
)
async def create_conversation(request: Request, resources: ResourcesDep) -> Response:
    headers = request.headers.raw
    principal = await resources.authenticator.authenticate(headers)
    turns = turns_of(resources)
    raw = await request.body()
    body = read_body(request_schemas.ConversationCreateRequest, raw)
    metadata = body.metadata or {}
    items = [stored(item) for item in normalise_input(body.items or [])]
    policy = await turns.policy(principal, storing=True)
    ttl_header = header(headers, b"statestore-ttl")
    ttl = enforced(policy, items_measures(items, requested_ttl=ttl_header))

    async def run(conversation_id: str) -> Response:
        now = resources.clock()
        row = ConversationRow(conversation_id, orjson.dumps(metadata), int(time.time()) * 1000)
        await turns.conversations.create(
            conversation_id=row.id,
            owner=principal.owner,
            tenant_id=principal.tenant_id,
            metadata_user_id=metadata.get("user_id"),
            metadata=row.metadata,
            items=items,
            now_ms=now,
            expires_ms=now + ttl * 1000,
        )
        return _object(row)

    async def recover(conversation_id: str) -> Outcome | None:
        # Created under the id the key's claim named: found, it was created (its acknowledgement lost).
        row = await turns.conversations.get(principal.owner, conversation_id, now_ms=resources.clock())
        return None if row is None else outcome_of(_object(row))

    return await write_once(
        resources.idempotency,
        principal,
        headers,
        route="POST /v1/conversations",
        body=raw,
        shaping=(ttl_header,),
        intended=new_id("conv_"),
        run=run,
        recover=recover,
    )


@router.get("/v1/conversations/{conversation_id}", responses=schemas.ok(schemas.Conversation, "the conversation"))
async def get_conversation(conversation_id: str, request: Request, resources: ResourcesDep) -> Response:
    owner, _ = await _principal_owner(request, resources)
    row = await turns_of(resources).conversations.get(owner, _checked(conversation_id), now_ms=resources.clock())
    if row is None:
        raise conversation_not_found(conversation_id)
    return _object(row)


@router.post(
    "/v1/conversations/{conversation_id}",
    openapi_extra=with_key(request_schemas.request_body(request_schemas.ConversationUpdateRequest)),
    responses=schemas.ok(schemas.Conversation, "the conversation, its metadata replaced"),
)
async def update_conversation(conversation_id: str, request: Request, resources: ResourcesDep) -> Response:
    principal = await resources.authenticator.authenticate(request.headers.raw)
    owner = principal.owner
    conversations = turns_of(resources).conversations
    raw = await request.body()
    metadata = read_body(request_schemas.ConversationUpdateRequest, raw).metadata or {}

    async def run(_intended: str) -> Response:
        # Setting the same metadata again changes nothing: a retry whose outcome was lost runs again.
        now = resources.clock()
        changed = await conversations.update_metadata(
            owner,
            _checked(conversation_id),
            metadata=orjson.dumps(metadata),
            user_id=metadata.get("user_id"),
            now_ms=now,
        )
        row = await conversations.get(owner, conversation_id, now_ms=now) if changed else None
        if row is None:
            raise conversation_not_found(conversation_id)
        return _object(row)

    return await write_once(
        resources.idempotency,
        principal,
        request.headers.raw,
        route=f"POST /v1/conversations/{conversation_id}",
        body=raw,
        intended=conversation_id,
        run=run,
    )


@router.delete(
    "/v1/conversations/{conversation_id}",
    openapi_extra=with_key({}),
    responses=schemas.ok(
        schemas.ConversationDeleted,
        "deleted, with its items (stored once: gone from the input_items of its responses too)",
    ),
)
async def delete_conversation(conversation_id: str, request: Request, resources: ResourcesDep) -> Response:
    principal = await resources.authenticator.authenticate(request.headers.raw)
    owner = principal.owner
    conversations = turns_of(resources).conversations
    deleted = json_response({"id": conversation_id, "object": "conversation.deleted", "deleted": True})

    async def run(_intended: str) -> Response:
        if not await conversations.delete(owner, _checked(conversation_id), now_ms=resources.clock()):
            raise conversation_not_found(conversation_id)
        await resources.retention.forget_conversations([conversation_id])
        return deleted

    async def recover(_intended: str) -> Outcome | None:
        # The first attempt ended without an outcome: the conversation gone, it was deleted.
        gone = await conversations.get(owner, conversation_id, now_ms=resources.clock()) is None
        return outcome_of(deleted) if gone else None

    return await write_once(
        resources.idempotency,
        principal,
        request.headers.raw,
        route=f"DELETE /v1/conversations/{conversation_id}",
        body=b"",
        intended=conversation_id,
        run=run,
        recover=recover,
    )


@router.get(
    "/v1/conversations/{conversation_id}/items",
    responses=schemas.ok(schemas.ItemList, "a page of the conversation's items"),
    openapi_extra=schemas.LIST_PARAMETERS,
)
async def list_items(conversation_id: str, request: Request, resources: ResourcesDep) -> Response:
    owner, _ = await _principal_owner(request, resources)
    descending, after, limit = list_params(request)
    found = await turns_of(resources).conversations.items(
        owner, _checked(conversation_id), now_ms=resources.clock(), descending=descending, after=after, limit=limit
    )
    if found is None:
        raise conversation_not_found(conversation_id)
    return page(*found)


@router.post(
    "/v1/conversations/{conversation_id}/items",
    openapi_extra=with_key(request_schemas.request_body(request_schemas.ConversationItemsRequest)),
    responses=schemas.ok(schemas.ItemList, "the items added, in order"),
)
async def add_items(conversation_id: str, request: Request, resources: ResourcesDep) -> Response:
    principal = await resources.authenticator.authenticate(request.headers.raw)
    owner = principal.owner
    conversations = turns_of(resources).conversations
    raw = await request.body()
    items = normalise_input(read_body(request_schemas.ConversationItemsRequest, raw).items)
    raw_key = key_of(request.headers.raw)
    policy = await turns_of(resources).policies.for_tenant(principal.tenant_id)
    if raw_key is None:
        return await _append(resources, policy, owner, conversation_id, items)
    # The items are the conversation's user's: its erasure erases the key, and the outcome that holds them.
    user_id = await conversations.user_id(owner, _checked(conversation_id), now_ms=resources.clock())

    async def run(claim: Claim) -> Response:
        # Under the item ids the key's claim named, so a retry can find them stored.
        ids = orjson.loads(claim.intended)
        return await _append(
            resources, policy, owner, conversation_id, [{**i, "id": n} for i, n in zip(items, ids, strict=True)]
        )

    async def recover(intended: str) -> Outcome | None:
        now = resources.clock()
        bodies = [
            await conversations.item(owner, _checked(conversation_id), n, now_ms=now) for n in orjson.loads(intended)
        ]
        if not bodies or any(b is None for b in bodies):
            return None
        kept = page([b for b in bodies if b is not None], False)
        return Outcome(status=200, headers=tuple(JSON), body=bytes(kept.body))

    return await keyed_write(
        resources.idempotency,
        principal,
        raw_key,
        route=f"POST /v1/conversations/{conversation_id}/items",
        body=raw,
        intended=orjson.dumps([item["id"] for item in items]).decode(),
        run=run,
        recover=recover,
        user_id=user_id,
    )


async def _append(
    resources: Resources, policy: Policy, owner: str, conversation_id: str, items: list[dict[str, Any]]
) -> Response:
    turns = turns_of(resources)
    rows = [stored(item) for item in items]
    await append_items(
        turns.leased_log,
        turns.conversations,
        owner,
        _checked(conversation_id),
        rows,
        cache=turns.cache,
        policy=policy,
        now_ms=resources.clock(),
        lease_ms=turns.lease_ms,
    )
    # The append moved the position, so the cached context no longer matches; it goes all the same, unread.
    await resources.cache.delete(conversation_cache_key(conversation_id))
    return page([row.body for row in rows], False)


@router.get(
    "/v1/conversations/{conversation_id}/items/{item_id}", responses=schemas.ok(schemas.ConversationItem, "the item")
)
async def get_item(conversation_id: str, item_id: str, request: Request, resources: ResourcesDep) -> Response:
    owner, _ = await _principal_owner(request, resources)
    conversations = turns_of(resources).conversations
    body = await conversations.item(owner, _checked(conversation_id), item_id, now_ms=resources.clock())
    if body is None:
        raise NotFound(f"Item with id '{item_id}' not found.", param="item_id")
    return bytes_response(200, body, JSON)


@router.delete(
    "/v1/conversations/{conversation_id}/items/{item_id}",
    openapi_extra=with_key({}),
    responses=schemas.ok(
        schemas.Conversation,
        "the conversation the item was deleted from (stored once: it is gone from the input_items of the response it "
        "came in with, and from every context)",
    ),
)
async def delete_item(conversation_id: str, item_id: str, request: Request, resources: ResourcesDep) -> Response:
    principal = await resources.authenticator.authenticate(request.headers.raw)
    owner = principal.owner
    conversations = turns_of(resources).conversations

    async def run(_intended: str) -> Response:
        now = resources.clock()
        try:
            deleted = await conversations.delete_item(owner, _checked(conversation_id), item_id, now_ms=now)
        except Locked:
            raise conversation_locked() from None
        if deleted:
            # The item is stored once: it is gone from the conversation's context and from the input_items and
            # contexts of the responses that pointed at it.
            await resources.retention.forget_conversations([conversation_id])
        row = await conversations.get(owner, conversation_id, now_ms=now) if deleted else None
        if row is None:
            raise NotFound(f"Item with id '{item_id}' not found.", param="item_id")
        return _object(row)

    keyed = key_of(request.headers.raw) is not None
    # The outcome holds the conversation's metadata: erased with its user.
    user_id = await conversations.user_id(owner, _checked(conversation_id), now_ms=resources.clock()) if keyed else None

    async def recover(_intended: str) -> Outcome | None:
        # The first attempt ended without an outcome: the item gone from a conversation still there, it was deleted.
        now = resources.clock()
        if await conversations.item(owner, _checked(conversation_id), item_id, now_ms=now) is not None:
            return None
        row = await conversations.get(owner, conversation_id, now_ms=now)
        return None if row is None else outcome_of(_object(row))

    return await write_once(
        resources.idempotency,
        principal,
        request.headers.raw,
        route=f"DELETE /v1/conversations/{conversation_id}/items/{item_id}",
        body=b"",
        intended=item_id,
        run=run,
        recover=recover,
        user_id=user_id,
    )
