"""Console script ``lightning-offpolicy``.

Subcommands:
    selfcheck   run every correction preset on real model outputs with a real training-inference
                gap, check the invariants, print the metrics (see :mod:`lightning_offpolicy.selfcheck`).
"""

from __future__ import annotations

import argparse
import sys

from lightning_offpolicy import selfcheck


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lightning-offpolicy", description="Off-policy-corrected RL for Lightning.")
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("selfcheck", help=selfcheck.__doc__.splitlines()[0])
    selfcheck.add_arguments(check)
    args = parser.parse_args(argv)
    if args.command == "selfcheck":
        return selfcheck.run(
            args.batch, args.prompt_length, args.new_tokens, args.staleness_noise, args.seed, args.logdir or None
        )
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
