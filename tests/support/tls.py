"""One TLS context for the suite's HTTP clients. The servers under test speak plain HTTP, but an httpx client (an SDK
client has one) given no context makes its own and loads the CA bundle into it: about twenty milliseconds of CPU, for
each of the thousands of clients the suite makes."""

from __future__ import annotations

import ssl

CONTEXT = ssl.create_default_context()
