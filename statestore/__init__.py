"""statestore: a server-side conversation state store for the Claude Messages API."""

__version__ = "0.1.0"
