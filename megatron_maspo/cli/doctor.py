"""``maspo doctor``: this environment's GPU stack next to the supported set (constraints/gpu.txt).

    maspo doctor            # versions of torch, CUDA, NCCL, driver, vLLM, TE, Apex, megatron-core,
                            # transformers; the GPUs seen; every mismatch and known-broken combination
    maspo doctor --no-te    # do not import Transformer Engine (its import test can take seconds)

Exit status 1 when a known-broken combination is found (the one ``maspo train`` refuses on a GPU), else 0.
"""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="check the GPU stack against the supported set",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--no-te", action="store_true",
                   help="skip importing Transformer Engine (by default tried when it is installed)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from megatron_maspo.stack import collect, findings, format_report

    report = collect(try_te=not args.no_te)
    found = findings(report)
    print(format_report(report, found))
    return 1 if any(kind == "broken" for kind, _ in found) else 0
