"""Off-policy study on the tiny task: policy losses x off-policy-ness (mini-batches per step, staleness).

For each seed, one supervised warm start is run once and saved (``<out>/init_seed<s>``); every RL run
of that seed resumes a copy of it (weights, Adam moments, RNG, data position), so methods and
conditions differ only in the RL phase, and each run equals one that did its own warm start. Each run is its own ``maspo train`` process under ``nice``,
one at a time; finished runs are skipped, so the script resumes after an interruption.

Off-policy-ness comes from two knobs: ``train.mini_batches_per_step`` (the later mini-batches of a
step train on data the earlier updates made off-policy: the gates act on ρ = π_θ/π_old) and
``rollout.max_staleness`` (batches generated k weight versions back: truncated IS π_old/π_rollout,
``loss.tis_cap=2``, corrects for it; the gate still sees the recomputed π_old).

    python scripts/offpolicy_study.py --out runs/offpolicy --seeds 1 2 3            # the full grid
    python scripts/offpolicy_study.py --methods maspo grpo --conditions 4:0 16:2 \\
        --seeds 1 --set train.steps=20 --doc docs/offpolicy-study.md

Writes ``<out>/results.json``, ``<out>/table.md``, ``<out>/reward.png`` / ``entropy.png`` and, with
``--doc``, the same table and plots into the results block of that Markdown file (copying the plots
beside it under ``figures/``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _docblock import write_block  # noqa: E402

METHODS = {
    "grpo": ["loss.method=grpo"],
    "clip_higher": ["loss.method=clip_higher"],
    "sapo": ["loss.method=sapo", "loss.aggregation=auto"],
    "cispo": ["loss.method=cispo"],
    "maspo": ["loss.method=maspo"],
}
CONDITIONS = ["1:0", "4:0", "16:0", "4:2", "16:2", "16:4"]
"""``mini_batches:staleness`` pairs of the default grid (the 1/4/16 x 0/2/4 cross without the cells
that add nothing: staleness with one mini-batch is studied at 4 and 16)."""
TIS_CAP = 2.0
COMMON = ["logging.progress=false", "logging.tensorboard=false", "logging.plots=false",
          "checkpoint.save_every=0"]
BEGIN, END = "<!-- offpolicy-study:begin -->", "<!-- offpolicy-study:end -->"

# Supervised warm start only, saved as checkpoints/step_0: the shared initial policy of one seed.
_INIT = """
import sys
from megatron_maspo.recipes.registry import resolve_config
from megatron_maspo.parallel.groups import destroy_parallel
from megatron_maspo.train.loop import Trainer
from megatron_maspo.train.sft import sft_warm_start

cfg = resolve_config(None, None, sys.argv[1:])
t = Trainer(cfg)
sft_warm_start(t.actor, t.examples, t.tokenizer, cfg.train, rank=t.rank)
t.sft_done = True
t.save()
destroy_parallel()
"""


def _run(cmd: list[str], log: Path) -> None:
    print("+", " ".join(cmd), flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    with open(log, "w") as f:
        subprocess.run(["nice", "-n", "10", *cmd], check=True, stdout=f, stderr=subprocess.STDOUT, env=env)


def _sets(sets: list[str]) -> list[str]:
    return [x for s in sets for x in ("--set", s)]


def prepare_init(seed: int, out: Path, extra: list[str]) -> Path:
    """The seed's warm-started policy (runs the warm start once); returns its checkpoint folder."""
    root = out / f"init_seed{seed}"
    ckpt = root / "checkpoints" / "step_0"
    if not ckpt.is_dir():
        shutil.rmtree(root, ignore_errors=True)
        sets = [f"train.seed={seed}", f"checkpoint.run_dir={root}", *COMMON, *extra]
        out.mkdir(parents=True, exist_ok=True)
        _run([sys.executable, "-c", _INIT, *sets], out / f"init_seed{seed}.log")
    return ckpt


def run_one(method: str, cond: str, seed: int, init: Path, out: Path, extra: list[str]) -> Path:
    mb, k = (int(x) for x in cond.split(":"))
    run_dir = out / f"{method}_mb{mb}_k{k}_seed{seed}"
    if (run_dir / "DONE").exists():
        return run_dir
    shutil.rmtree(run_dir, ignore_errors=True)
    # Resume a copy of the warm-started checkpoint: model, Adam moments, RNG and data position exactly
    # as a run that did its own warm start would have them (the config's own warm-start flag is set).
    shutil.copytree(init.parent.parent, run_dir)
    sets = [*METHODS[method], f"train.mini_batches_per_step={mb}", f"rollout.max_staleness={k}",
            *COMMON, *extra]
    if k > 0:
        sets.append(f"loss.tis_cap={TIS_CAP}")
    _run([sys.executable, "-m", "megatron_maspo.cli.main", "train", "--resume", str(run_dir), *_sets(sets)],
         out / f"{run_dir.name}.log")
    (run_dir / "DONE").write_text("")
    return run_dir


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def _fmt(x: float) -> str:
    return f"{x:.3f}" if math.isfinite(x) else "–"  # TIS is off at staleness 0


def summarise(run_dir: Path, window: int) -> dict:
    """Per-run figures: reward gain (last ``window`` steps minus first), entropy start/end/min, mean
    fraction of tokens with gate weight < 0.9, mean hard-clip fraction (w = 0), collapse flag."""
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    recs = [r for r in recs if "reward/mean" in r]
    rew = [r["reward/mean"] for r in recs]
    ent = [r.get("entropy/mean", float("nan")) for r in recs]
    w = max(1, min(window, len(rew) // 2))
    first, last = _mean(rew[:w]), _mean(rew[-w:])
    e0, e1 = _mean(ent[:w]), _mean(ent[-w:])
    # Collapse: the policy ends clearly worse than it started, or its entropy has all but vanished.
    collapsed = last < first - 0.2 or (e0 > 0 and e1 < 0.25 * e0)
    return {"steps": len(rew), "first": first, "last": last, "gain": last - first,
            "entropy_first": e0, "entropy_last": e1, "entropy_min": min(ent) if ent else float("nan"),
            "gate_w_lt_0p9": _mean([r.get("gate/w_lt_0.9_frac") for r in recs]),
            "clip_frac": _mean([r.get("clip/frac_pos", 0.0) + r.get("clip/frac_neg", 0.0) for r in recs]),
            "tis_weight": _mean([r.get("tis/weight_mean") for r in recs]),
            "staleness": _mean([r.get("rollout/staleness_mean", 0.0) for r in recs]),
            "step_s": _mean([r.get("time/step") for r in recs]),
            "collapsed": bool(collapsed), "curve": rew, "entropy_curve": ent}


def tables(results: dict[str, dict[str, dict[int, dict]]]) -> str:
    """Per-run rows, then per (condition, method) means over seeds."""
    head = ("| condition (mb:k) | method | seed | reward gain | first → last | entropy first → last (min) "
            "| gate w<0.9 | clip frac | TIS w | collapse |")
    lines = [head, "|" + "---|" * 10]
    for cond, by_m in results.items():
        for m, by_s in by_m.items():
            for s, r in by_s.items():
                lines.append(f"| {cond} | {m} | {s} | {r['gain']:+.3f} | {r['first']:+.3f} → {r['last']:+.3f} | "
                             f"{r['entropy_first']:.3f} → {r['entropy_last']:.3f} ({r['entropy_min']:.3f}) | "
                             f"{100 * r['gate_w_lt_0p9']:.2f}% | {100 * r['clip_frac']:.2f}% | "
                             f"{_fmt(r['tis_weight'])} | {'yes' if r['collapsed'] else 'no'} |")
    lines += ["", "| condition (mb:k) | method | seeds | mean gain (± sd) | gate w<0.9 | clip frac | collapses |",
              "|" + "---|" * 7]
    for cond, by_m in results.items():
        for m, by_s in by_m.items():
            g = [r["gain"] for r in by_s.values()]
            sd = f" ± {statistics.stdev(g):.3f}" if len(g) > 1 else ""
            lines.append(f"| {cond} | {m} | {len(g)} | {statistics.mean(g):+.3f}{sd} | "
                         f"{100 * _mean([r['gate_w_lt_0p9'] for r in by_s.values()]):.2f}% | "
                         f"{100 * _mean([r['clip_frac'] for r in by_s.values()]):.2f}% | "
                         f"{sum(r['collapsed'] for r in by_s.values())}/{len(g)} |")
    return "\n".join(lines)


def plots(results: dict, out: Path) -> list[Path]:
    """Reward and entropy curves, one panel per condition, one line per method (mean over seeds)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plots")
        return []
    paths = []
    conds = list(results)
    for key, name, label in (("curve", "reward.png", "mean reward"), ("entropy_curve", "entropy.png", "entropy")):
        fig, axes = plt.subplots(1, len(conds), figsize=(3.2 * len(conds), 3), squeeze=False, sharey=True)
        for ax, cond in zip(axes[0], conds):
            for m, by_s in results[cond].items():
                curves = [r[key] for r in by_s.values()]
                n = min(len(c) for c in curves)
                ax.plot(range(1, n + 1), [statistics.mean(c[i] for c in curves) for i in range(n)], label=m)
            ax.set_title(f"mb:k = {cond}", fontsize=9)
            ax.set_xlabel("RL step", fontsize=8)
        axes[0][0].set_ylabel(label, fontsize=8)
        axes[0][-1].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        paths.append(out / name)
    return paths


def markers(block: str | None) -> tuple[str, str]:
    """The begin/end comments of the main results block (None) or of a named one (e.g. an lr sweep)."""
    if block is None:
        return BEGIN, END
    return f"<!-- offpolicy-study:{block}:begin -->", f"<!-- offpolicy-study:{block}:end -->"


def write_doc(doc: Path, table: str, figs: list[Path], command: str, block: str | None = None) -> None:
    """Replace the results block ``block`` of ``doc`` (created if missing) with the table and plots."""
    begin, end = markers(block)
    prefix = "offpolicy_" if block is None else f"offpolicy_{block}_"
    write_block(doc, begin, end, f"Produced by `{command}`.\n\n{table}", figs, prefix, "Off-policy study")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--conditions", nargs="+", default=CONDITIONS, help="mini_batches:staleness pairs")
    ap.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    ap.add_argument("--out", default="runs/offpolicy")
    ap.add_argument("--window", type=int, default=5, help="steps averaged at each end for the gain")
    ap.add_argument("--set", dest="extra", action="append", default=[], help="extra --set for every run")
    ap.add_argument("--doc", default=None, help="Markdown file whose results block to rewrite")
    ap.add_argument("--block", default=None,
                    help="name of another results block in --doc (e.g. lr-sweep); default: the main one")
    args = ap.parse_args(argv)
    for c in args.conditions:
        mb, _, k = c.partition(":")
        if not (mb.isdigit() and k.isdigit()):
            ap.error(f"condition {c!r} is not mini_batches:staleness (e.g. 16:2)")
    out = Path(args.out)
    results: dict[str, dict[str, dict[int, dict]]] = {}
    for s in args.seeds:
        init = prepare_init(s, out, args.extra)
        for c in args.conditions:
            for m in args.methods:
                run = run_one(m, c, s, init, out, args.extra)
                results.setdefault(c, {}).setdefault(m, {})[s] = summarise(run, args.window)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    table = tables(results)
    (out / "table.md").write_text(table + "\n")
    print(table)
    figs = plots(results, out)
    if args.doc:
        write_doc(Path(args.doc), table, figs, "python scripts/offpolicy_study.py " + " ".join(
            argv if argv is not None else sys.argv[1:]), args.block)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
