"""labkit's command line: ``python -m labkit {env,compare,check,memory,demo,comm,schedule,layout,
dryrun}``.

Every ``RunConfig`` field is a flag of the commands that run strategies (``labkit.flags``).
"""

from __future__ import annotations

import argparse
import sys
import warnings

from . import comm, dryrun, layout, run, schedule


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m labkit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run.add_parsers(sub)
    comm.add_parser(sub)
    schedule.add_parser(sub)
    layout.add_parser(sub)
    dryrun.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("default")
            return args.func(args)
    except (ValueError, TypeError) as exc:  # bad input: one line saying what to change
        print(f"labkit: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # every rank was stopped by the launcher
        print("labkit: interrupted: every rank stopped", file=sys.stderr)
        return 130
