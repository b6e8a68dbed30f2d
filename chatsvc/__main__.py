"""Command line: ``python -m chatsvc serve | chat | migrate``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

# Exit status of ``serve`` when the engine thread died (or stalled: its watchdog): the
# process cannot serve again by itself, so it ends and lets its supervisor start a fresh one.
EXIT_ENGINE_DIED = 70  # EX_SOFTWARE
# uvicorn's own status for a start-up that failed (its lifespan raised).
EXIT_STARTUP_FAILED = 3


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from chatsvc.api.app import create_app
    from chatsvc.api.http_server import uvicorn_config
    from chatsvc.config import Settings
    from chatsvc.logs import configure_logging

    settings = Settings.from_env().with_overrides(host=args.host, port=args.port)
    configure_logging(args.log_level, log_text=settings.log_text)
    app = create_app(settings)
    server = uvicorn.Server(
        uvicorn_config(
            app,
            settings.host,
            settings.port,
            log_level=args.log_level,
            # Logging is configured above (request ids on every line); uvicorn keeps out.
            log_config=None,
            # Streams end on their own; this only bounds how long shutdown waits.
            timeout_graceful_shutdown=10,
        )
    )
    died: list[BaseException] = []
    failed: list[BaseException] = []

    def engine_died(error: BaseException) -> None:
        died.append(error)
        server.should_exit = True  # uvicorn's graceful shutdown, as on SIGTERM

    def start_failed(error: BaseException) -> None:
        failed.append(error)
        server.should_exit = True

    def watch(app) -> None:
        # Runs once the app's lifespan has started the store; the engine comes up after.
        services = app.state.services
        services.engine.add_death_callback(engine_died)
        services.on_start_failure.append(start_failed)

    app.on_startup.append(watch)
    server.run()
    if died:
        from chatsvc.engine.watchdog import EngineStalledError

        what = "stalled" if isinstance(died[0], EngineStalledError) else "thread died"
        print(
            f"chatsvc: the engine {what}; exiting so a supervisor restarts the service",
            file=sys.stderr,
        )
        return _exit(EXIT_ENGINE_DIED)
    return _exit(0 if server.started and not failed else EXIT_STARTUP_FAILED)


def _exit(code: int) -> int:
    """``code``, or the process's end now when a model load is still running.

    A SIGTERM during the load leaves its thread behind (a load cannot be
    interrupted, and the shutdown did not wait for it); the interpreter's own exit
    could then block on a lock that thread holds. Everything else is stopped and
    flushed by now, so ending the process at once loses nothing.
    """
    import threading

    # Not imported here when it is not loaded yet: it imports torch, and no engine
    # thread can run without it.
    engine = sys.modules.get("chatsvc.engine.async_engine")
    name = getattr(engine, "THREAD_NAME", None)
    if not any(t.name == name and t.is_alive() for t in threading.enumerate()):
        return code
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _chat(args: argparse.Namespace) -> int:
    from chatsvc.chat_client import ChatClient, ChatClientError, run

    client = ChatClient(args.url, api_key=args.api_key or os.environ.get("CHATSVC_API_KEY"))
    try:
        return run(client, args.session, args.system, max_tokens=args.max_tokens)
    except ChatClientError as exc:
        print(f"chatsvc chat: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        client.close()


def _migrate(args: argparse.Namespace) -> int:
    from chatsvc.config import Settings
    from chatsvc.store.schema import migrate

    settings = Settings.from_env()
    url = args.redis_url or settings.redis_url
    prefix = args.prefix or settings.key_prefix
    if url is not None:
        applied = asyncio.run(migrate(url, prefix))
    else:
        from chatsvc.store.embedded import EmbeddedRedis

        with EmbeddedRedis(settings.redis_dir()) as server:
            applied = asyncio.run(migrate(server.url, prefix))
    print("applied: " + (", ".join(applied) if applied else "nothing (already current)"))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="chatsvc", description="Multi-turn chat service")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the HTTP service (settings: CHATSVC_* env vars)")
    serve.add_argument("--host", default=None, help="overrides CHATSVC_HOST")
    serve.add_argument("--port", type=int, default=None, help="overrides CHATSVC_PORT")
    serve.add_argument("--log-level", default="info")
    serve.set_defaults(run=_serve)

    chat = sub.add_parser("chat", help="chat in the terminal, streaming")
    chat.add_argument("--url", default="http://127.0.0.1:8000")
    chat.add_argument("--session", default=None, help="continue this session id")
    chat.add_argument("--system", default=None, help="system prompt of a new session")
    chat.add_argument("--api-key", default=None, help="default: $CHATSVC_API_KEY")
    chat.add_argument("--max-tokens", type=int, default=None)
    chat.set_defaults(run=_chat)

    mig = sub.add_parser("migrate", help="apply pending Redis keyspace migrations")
    mig.add_argument("--redis-url", default=None, help="default: CHATSVC_REDIS_URL or embedded")
    mig.add_argument("--prefix", default=None, help="default: CHATSVC_KEY_PREFIX")
    mig.set_defaults(run=_migrate)

    args = parser.parse_args(argv)
    from chatsvc.config import SettingsError

    try:
        return args.run(args)
    except SettingsError as exc:
        print(f"chatsvc: bad settings: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
