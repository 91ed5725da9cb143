"""Compare policy losses on the tiny task: the small-scale counterpart of MASPO's Table 1 / Figure 3.

Runs ``maspo train`` (the tiny recipe: SFT warm start, then RL) once per (method, seed), each in its own
process, and writes ``<out>/table.md``, ``<out>/results.json`` and ``<out>/reward.png`` / ``entropy.png``.
Results are reported as measured, whatever they show; on a 2-core CPU the differences between methods
are within seed noise for a task this small, which the table's spread column makes visible.
``<out>/settings.md`` (also printed) states the loss settings each method ran with, resolved from the
config with each source label; the PPO-clip baselines run twice, with verl's dual-clip c = 3 (not a
MASPO-paper value) and without it (``*_nodual``).

    python scripts/compare_losses.py --seeds 1 2 3 --out runs/compare
    python scripts/compare_losses.py --methods maspo grpo --seeds 1 --set train.steps=20
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from megatron_maspo.recipes.base import ADV_REWEIGHT, ENTROPY_ADV, ENTROPY_REG_COEF

# Every Table-1 method of MASPO plus entropy regularisation and advantage reweighting, with the same
# settings as the cluster recipes (megatron_maspo/recipes/base.py): clip 0.2 with verl's dual-clip 3
# (and a *_nodual run without it), Clip-Higher ε_high 0.265 (its group default), SAPO with its own
# seq-mean-token-mean ('auto'); then methods the MASPO paper only cites (CISPO, GPPO), GSPO and the
# QUATRO reconstruction (query-adaptive REPS dual by default).
METHODS = {
    "grpo": ["loss.method=grpo"],
    "clip_higher": ["loss.method=clip_higher"],
    "dac": ["loss.method=dac"],
    "entropy_adv": ["loss.method=grpo", f"loss.entropy_adv.coef={ENTROPY_ADV.coef}",
                    f"loss.entropy_adv.kappa={ENTROPY_ADV.kappa}"],
    "bapo": ["loss.method=bapo"],
    "sapo": ["loss.method=sapo", "loss.aggregation=auto"],
    "maspo": ["loss.method=maspo"],
    "entropy_reg": ["loss.method=grpo", f"loss.entropy_coef={ENTROPY_REG_COEF}"],
    "adv_reweight": ["loss.method=grpo", f"loss.adv_reweight.alpha={ADV_REWEIGHT[0].alpha}"],
    "quatro": ["loss.method=quatro"],
    "gspo": ["loss.method=gspo"],
    "cispo": ["loss.method=cispo"],
    "gppo": ["loss.method=gppo"],
}
DUAL_CLIP_GROUPS = {"grpo": "grpo", "clip_higher": "clip_higher", "dac": "dac", "bapo": "bapo",
                    "entropy_adv": "grpo", "entropy_reg": "grpo", "adv_reweight": "grpo"}
"""Methods with verl's dual-clip on by default, and the parameter group that holds it."""
METHODS.update({f"{m}_nodual": [*METHODS[m], f"loss.{g}.dual_clip_c=null"] for m, g in DUAL_CLIP_GROUPS.items()
                if m in ("grpo", "clip_higher", "dac", "bapo")})


def method_settings(method: str, extra: list[str]) -> str:
    """The loss settings ``method`` runs with: its parameter group and the shared loss fields that
    differ from the defaults, resolved from the tiny recipe plus the overrides (one line)."""
    import dataclasses

    from megatron_maspo.loss.config import LossConfig
    from megatron_maspo.overrides import apply_overrides
    from megatron_maspo.recipes.tiny import config

    cfg = apply_overrides(config(), [*METHODS[method], *extra]).loss
    group = {f.name: getattr(cfg.params, f.name) for f in dataclasses.fields(cfg.params)}
    default = LossConfig()
    shared = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
              if f.name != "method" and not hasattr(getattr(cfg, f.name), "__dataclass_fields__")
              and getattr(cfg, f.name) != getattr(default, f.name)}
    for name in ("entropy_adv", "adv_reweight", "rollout_correction"):
        if getattr(cfg, name) != getattr(default, name):
            shared[name] = dataclasses.asdict(getattr(cfg, name))
    shared["aggregation"] = cfg.effective_aggregation
    return f"loss.method={cfg.method}; loss.{cfg.method}: {group}; shared: {shared}"


def run_one(method: str, seed: int, out: Path, extra: list[str]) -> Path:
    run_dir = out / f"{method}_seed{seed}"
    if (run_dir / "metrics.jsonl").exists() and (run_dir / "plots").exists():
        return run_dir  # already done: the script is resumable
    sets = [*METHODS[method], f"train.seed={seed}", f"checkpoint.run_dir={run_dir}",
            "logging.progress=false", "logging.tensorboard=false", *extra]
    cmd = [sys.executable, "-m", "megatron_maspo.cli.main", "train"]
    for s in sets:
        cmd += ["--set", s]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return run_dir


def summarise(run_dir: Path) -> dict[str, float]:
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rewards = [r["reward/mean"] for r in recs]
    ent = [r.get("entropy/mean") for r in recs if r.get("entropy/mean") is not None]
    k = min(10, len(rewards))
    return {"first10": sum(rewards[:k]) / k, "last10": sum(rewards[-k:]) / k, "best": max(rewards),
            "final_entropy": ent[-1] if ent else float("nan"), "curve": rewards,
            "entropy_curve": ent}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    ap.add_argument("--out", default="runs/compare")
    ap.add_argument("--set", dest="extra", action="append", default=[], help="extra --set for every run")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = ["| run | loss settings it ran with (sources: docs/losses.md) |", "|---|---|"]
    settings += [f"| {m} | {method_settings(m, args.extra)} |" for m in args.methods]
    (out / "settings.md").write_text("\n".join(settings) + "\n")
    print("\n".join(settings), flush=True)
    results: dict[str, list[dict]] = {}
    for m in args.methods:
        for s in args.seeds:
            results.setdefault(m, []).append(summarise(run_one(m, s, out, args.extra)))
    (out / "results.json").write_text(json.dumps(results, indent=1))
    lines = ["| method | last-10 reward (mean ± sd over seeds) | first-10 | best | final entropy |",
             "|---|---|---|---|---|"]
    for m, rs in results.items():
        last = [r["last10"] for r in rs]
        sd = statistics.stdev(last) if len(last) > 1 else 0.0
        lines.append(f"| {m} | {statistics.mean(last):+.3f} ± {sd:.3f} | "
                     f"{statistics.mean(r['first10'] for r in rs):+.3f} | "
                     f"{statistics.mean(r['best'] for r in rs):+.3f} | "
                     f"{statistics.mean(r['final_entropy'] for r in rs):.3f} |")
    table = "\n".join(lines)
    (out / "table.md").write_text(table + "\n")
    print(table)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        for key, fname, title in (("curve", "reward.png", "mean reward"),
                                  ("entropy_curve", "entropy.png", "entropy")):
            fig, ax = plt.subplots(figsize=(6, 3.5))
            for m, rs in results.items():
                n = min(len(r[key]) for r in rs)
                if n:
                    avg = [statistics.mean(r[key][i] for r in rs) for i in range(n)]
                    ax.plot(range(n), avg, label=m)
            ax.set_xlabel("rollout step")
            ax.set_title(f"{title} (mean over seeds {args.seeds})", fontsize=9)
            ax.legend(fontsize=7)
            fig.tight_layout()
            fig.savefig(out / fname, dpi=110)
            plt.close(fig)
    except ImportError:
        print("matplotlib missing: no plots")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
