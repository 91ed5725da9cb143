"""``maspo``: one command line with a subcommand per job.

    maspo train                       # the tiny recipe on CPU: SFT warm start, then MASPO RL
    maspo train --recipe r1_distill_qwen_1p5b_maspo --set loss.maspo.alpha=0.5
    maspo eval --checkpoint runs/maspo --k 8
    maspo convert hf-to-megatron --hf DIR --out DIR [--tp 2 --pp 2] [--verify]
    maspo plan r1_distill_qwen_7b_maspo --nodes 4 --gpus-per-node 8
    maspo check r1_distill_qwen_7b_maspo           # every shape of the full-size run, meta device
    maspo launch r1_distill_qwen_7b_maspo --executor slurm --nodes 4 --dry-run
    maspo engines add runs/maspo      # one more rollout engine in a running job (supervised engines)
    maspo doctor                      # this environment's GPU stack vs the supported set

Only subcommands whose module is present are registered: nothing prints "not implemented". Each
subcommand module exposes ``add_parser(subparsers)`` and ``run(args) -> int`` and imports its heavy
dependencies inside ``run``.

Errors a user fixes by changing the command (``megatron_maspo.errors.USER_ERRORS``: configuration,
unusable input files, missing paths) print as one line and exit 2; anything else keeps its traceback.
Third-party start-up noise stays off the console unless ``--verbose`` (``cli/quiet.py``).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import sys

SUBCOMMANDS = ("train", "eval", "convert", "plan", "check", "launch", "engines", "doctor", "recipes")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="maspo", description="RL fine-tuning of LLMs on Megatron-Core with MASPO.")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="debug logging, and third-party warnings / INFO logs left on the console")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        modname = f"megatron_maspo.cli.{name}"
        if importlib.util.find_spec(modname) is None:
            continue
        importlib.import_module(modname).add_parser(sub)
    for p in sub.choices.values():  # the modules' docstrings are the help text: shown without markup
        p.description = plain_text(p.description)
    return parser


def plain_text(doc: str | None) -> str | None:
    """``doc`` without reStructuredText markup: ``code`` and :role:`x` become plain words."""
    if not doc:
        return doc
    import re

    doc = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", doc)
    return doc.replace("``", "")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from megatron_maspo.cli.quiet import configure_console
    from megatron_maspo.errors import USER_ERRORS

    configure_console(args.verbose)  # before any subcommand imports megatron
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="[maspo] %(levelname)s %(name)s: %(message)s")
    if not args.command:
        parser.print_help()
        return 0
    from megatron_maspo.parallel.failure import exit_on_error

    try:
        with exit_on_error(f"maspo {args.command}"):  # several ranks: an error ends this rank at once
            return int(args.run(args) or 0)
    except USER_ERRORS as e:
        # Fixed by changing the command: one clear line, no traceback.
        print(f"maspo {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
