"""The OpenAI Responses and Conversations APIs, served by statestore in front of a Chat Completions backend."""
