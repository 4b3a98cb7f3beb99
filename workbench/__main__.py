"""`python -m workbench <command>`: zoo, models, bench, serve-bench, serve.

Each subcommand module registers its own parser."""
from __future__ import annotations

import argparse
import importlib
import sys

# name -> module exposing register(subparsers); imported lazily so `zoo list` does not pay for torch's import
COMMANDS = {
    "zoo": "workbench.zoo.cli",
    "models": "workbench.models.cli",
    "bench": "workbench.harness.bench_cli",
    "serve-bench": "workbench.serving.cli",
    "serve": "workbench.serving.server_cli",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m workbench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    wanted = argv[0] if argv and argv[0] in COMMANDS else None
    for name, module in COMMANDS.items():
        if wanted is None or name == wanted:
            importlib.import_module(module).register(sub)
        else:
            sub.add_parser(name)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
