"""Encryption at rest: master keys that wrap data keys, a data key per erasure scope, and the sealed form of every
stored content byte (docs/encryption.md)."""
