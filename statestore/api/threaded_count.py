"""The HTTP side of a count over a thread (`POST /v1/messages/count_tokens` with `thread` or a session header, PROTOCOL
§11): the request the turn would send goes to the backend's `count_tokens` with the turn's credential, and its answer
comes back as it came (its count, or its refusal); a backend without that route is answered by the estimate. A
header says which counted."""

from __future__ import annotations

import orjson
from starlette.responses import Response

from statestore.api.responses import bytes_response
from statestore.auth import Principal
from statestore.core.token_count import count_header
from statestore.threads.count import CountedRequest
from statestore.upstream.client import request_headers_for_upstream, response_headers_for_client
from statestore.upstream.token_counts import MessagesCounter

COUNT_TOKENS = "/v1/messages/count_tokens"
_JSON = (b"content-type", b"application/json")


async def counted_response(
    counter: MessagesCounter | None,
    counted: CountedRequest,
    principal: Principal,
    headers: list[tuple[bytes, bytes]],
    query: str,
) -> Response:
    if counter is not None:
        upstream_headers = request_headers_for_upstream(
            headers, threaded=True, credential=principal.upstream_credential
        )
        path = COUNT_TOKENS + (f"?{query}" if query else "")
        reply = await counter.count(path, upstream_headers, counted.body)
        if reply is not None:
            relayed = response_headers_for_client(reply.headers, keep_length=False)
            if reply.status == 200:
                relayed.append(count_header("backend"))
            return bytes_response(reply.status, reply.body, relayed)
    body = orjson.dumps({"input_tokens": counted.estimate})
    return bytes_response(200, body, [_JSON, count_header("estimate")])
