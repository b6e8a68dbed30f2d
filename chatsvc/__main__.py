"""Command line: ``python -m chatsvc serve | chat | migrate``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="chatsvc")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the HTTP service")
    serve.add_argument("--host", default=None)
    serve.add_argument("--port", type=int, default=None)
    args = parser.parse_args(argv)

    if args.command == "serve":
        import uvicorn

        from chatsvc.api.app import create_app

        uvicorn.run(create_app(), host=args.host or "127.0.0.1", port=args.port or 8000)
    return 0


if __name__ == "__main__":
    sys.exit(main())
