"""The HTTP protocol statestore serves with: uvicorn's httptools protocol, except that a request too malformed to
reach the app (a bad header line, a broken Content-Length) still gets an Anthropic error body and a request id."""

from __future__ import annotations

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from statestore.errors import InvalidRequest
from statestore.logs import new_request_id


class StatestoreHttpProtocol(HttpToolsProtocol):
    def send_400_response(self, msg: str) -> None:
        request_id = new_request_id()
        body = InvalidRequest(f"malformed HTTP request: {msg}").body(request_id)
        head = [
            b"HTTP/1.1 400 Bad Request\r\n",
            b"content-type: application/json\r\n",
            b"request-id: " + request_id.encode() + b"\r\n",
            b"content-length: " + str(len(body)).encode() + b"\r\n",
            b"connection: close\r\n\r\n",
        ]
        self.transport.write(b"".join(head) + body)
        self.transport.close()
