"""The `statestore` command: serve, migrate, echo-backend."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from statestore import __version__
from statestore.admin_parser import add_commands as add_admin_commands

if TYPE_CHECKING:
    from statestore.config import Settings


async def _pending(settings: Settings) -> str | None:
    from statestore.store.engine import create_engine
    from statestore.store.migrate import pending_revision

    engine = create_engine(settings.database_url, pool_size=1)
    try:
        return await pending_revision(engine, allow_newer=settings.allow_newer_schema)
    finally:
        await engine.dispose()


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """The protocols and options statestore is served with under uvicorn: by `statestore serve`, and by the bench's
    profiled server (bench/profiling.py), whose profile must hold statestore's own reads and writes."""
    from statestore.http_protocol import StatestoreHttpProtocol
    from statestore.logs import uvicorn_log_config
    from statestore.socket_protocol import StatestoreWebSocketProtocol

    return {
        "loop": "uvloop" if sys.platform != "win32" else "asyncio",
        "http": StatestoreHttpProtocol,
        # WebSocket mode on /v1/responses (api/responses_socket.py): a message is limited as a body is.
        "ws": StatestoreWebSocketProtocol,
        "ws_max_size": settings.max_body_bytes,
        "ws_per_message_deflate": settings.socket_compression,
        "ws_ping_interval": settings.socket_ping_seconds,
        "ws_ping_timeout": settings.socket_ping_seconds,
        "access_log": False,
        "log_config": uvicorn_log_config(),
        "server_header": False,
    }


def cmd_serve(args: argparse.Namespace) -> None:
    import asyncio

    import uvicorn

    from statestore.command_setup import load_settings, require_database
    from statestore.logs import configure_logging

    settings = load_settings()
    if (problem := settings.serving_problem()) is not None:
        sys.exit(f"statestore: {problem}")
    require_database(settings)
    configure_logging(settings.log_level, settings.log_json)
    try:
        pending = asyncio.run(_pending(settings))
    except FileNotFoundError as exc:
        sys.exit(f"statestore: {exc}")
    except Exception as exc:
        sys.exit(f"statestore: cannot reach the database ({type(exc).__name__}: {exc})")
    if pending is not None:
        sys.exit(f"statestore: {pending}. Run `statestore migrate` first.")
    from statestore.encryption.setup import encryption_problem

    if (problem := asyncio.run(encryption_problem(settings))) is not None:
        sys.exit(f"statestore: {problem}")
    uvicorn.run(
        "statestore.app:create_server_app",
        factory=True,
        host=args.host,
        port=args.port,
        workers=args.workers,
        timeout_graceful_shutdown=args.graceful_timeout,
        proxy_headers=False,
        **uvicorn_options(settings),
    )


def cmd_migrate(args: argparse.Namespace) -> None:
    import asyncio

    from sqlalchemy.engine import make_url

    from statestore.command_setup import load_settings, safe_url
    from statestore.store.engine import missing_sqlite_database
    from statestore.store.migrate import upgrade

    settings = load_settings()
    if missing_sqlite_database(settings.database_url) is not None:
        # The one command that creates a database: SQLite creates the file, not its folder.
        Path(make_url(settings.database_url).database or "").expanduser().resolve().parent.mkdir(
            parents=True, exist_ok=True
        )
    try:
        migrated = upgrade(settings.database_url, args.revision)
    except Exception as exc:
        sys.exit(f"statestore: migration failed ({type(exc).__name__}: {exc})")
    print(f"statestore: {migrated.describe()} ({safe_url(settings.database_url)})")
    if settings.keystore_url:
        from statestore.store.keystore import create_keystore

        asyncio.run(create_keystore(settings.keystore_url))
        print(f"statestore: key store ready ({safe_url(settings.keystore_url)})")


def cmd_echo_backend(args: argparse.Namespace) -> None:
    from statestore.upstream.echo import run_echo_backend

    run_echo_backend(
        args.host,
        args.port,
        delay_seconds=args.delay,
        reply_bytes=args.reply_bytes,
        context_window=args.context_window,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="statestore",
        description="Server-side conversation state for LLM APIs: the Claude Messages API with threads and sessions, "
        "and the OpenAI Responses and Conversations APIs. Settings come from STATESTORE_* environment variables (see "
        "the README).",
    )
    parser.add_argument("--version", action="version", version=f"statestore {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser(
        "serve",
        help="serve the API",
        description="Serve both front doors: the Messages API with threads and sessions (/v1/messages) and the "
        "Responses and Conversations APIs (/v1/responses, /v1/conversations). Needs STATESTORE_OWNER_SECRET; the "
        "database is STATESTORE_DATABASE_URL (default: the SQLite file ./statestore.db), the backends "
        "STATESTORE_UPSTREAM_URL (Messages) and STATESTORE_CHAT_UPSTREAM_URL (Chat Completions, for the Responses "
        "door).",
    )
    serve.add_argument(
        "--host", default=os.environ.get("STATESTORE_HOST", "127.0.0.1"), help="address to bind (default 127.0.0.1)"
    )
    serve.add_argument(
        "--port", type=int, default=int(os.environ.get("STATESTORE_PORT", "8080")), help="port (default 8080)"
    )
    serve.add_argument("--workers", type=int, default=1, help="worker processes (default 1)")
    serve.add_argument(
        "--graceful-timeout",
        type=int,
        default=30,
        help="seconds in-flight requests get to finish on shutdown (default 30)",
    )
    serve.set_defaults(func=cmd_serve)

    migrate = commands.add_parser(
        "migrate",
        help="bring the database schema up to date",
        description="Run the Alembic migrations on STATESTORE_DATABASE_URL (default: the SQLite file "
        "./statestore.db, created if missing).",
    )
    migrate.add_argument("--revision", default="head", help="target revision (default head)")
    migrate.set_defaults(func=cmd_migrate)

    echo = commands.add_parser(
        "echo-backend",
        help="run the local echo model backend",
        description="A local stand-in for the model backend that speaks the Messages API and Chat Completions wire "
        "formats (JSON and SSE) and echoes the last user text. For trying statestore without a key or network.",
    )
    echo.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    echo.add_argument("--port", type=int, default=8090, help="port (default 8090)")
    echo.add_argument("--delay", type=float, default=0.0, help="seconds to wait before each reply (default 0)")
    echo.add_argument("--reply-bytes", type=int, default=None, help="pad each reply's text to about this size")
    window = os.environ.get("STATESTORE_ECHO_CONTEXT_WINDOW")
    echo.add_argument(
        "--context-window",
        type=int,
        default=int(window) if window else None,
        help="refuse requests of more input tokens, as the API does (default: STATESTORE_ECHO_CONTEXT_WINDOW, or none)",
    )
    echo.set_defaults(func=cmd_echo_backend)

    add_admin_commands(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if getattr(args, "operation", None) is not None:
        from statestore.admin_cli import run
        from statestore.command_setup import load_settings, require_database

        settings = load_settings()
        require_database(settings)
        run(settings, args)
        return
    args.func(args)


if __name__ == "__main__":
    main()
