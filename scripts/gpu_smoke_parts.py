"""The GPU smoke parts that test the colocated path between processes and precisions (one ``SMOKE`` line each).

    python scripts/gpu_smoke_parts.py lp_bf16 [--cpu]   log-prob / entropy kernels on bf16 inputs vs float64
                                                        of the same inputs (max abs error <= tolerance)
    python scripts/gpu_smoke_parts.py ipc [--cpu]       a real model's buckets through rollout/transport.py
                                                        (CUDA IPC; shared memory with --cpu), packed by the
                                                        prefetch thread, into a built-in engine in a spawned
                                                        process: every parameter bit-identical, GB/s
    python scripts/gpu_smoke_parts.py sleep [--cpu]     engine sleep/wake and trainer offload/reload round
                                                        trip: bit-exact, device memory per phase
    python scripts/gpu_smoke_parts.py mismatch [--cpu]  Megatron trainer vs built-in engine log-probs of the
                                                        same sampled tokens (bf16 on GPU, fp32 with --cpu)
    python scripts/gpu_smoke_parts.py varlen [--cpu]    a varlen attention backend vs packed_sdpa logits, if
                                                        this checkout has one; else "not available" (exit 0)

Uses only what the lent GPU machine has (torch, transformers, megatron-core, this project): no vLLM, no
Transformer Engine, no network. ``--cpu`` runs the same code with small shapes (the rehearsal).
Tolerances are constants below, each with the reason for its size.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import zlib

import torch

# bf16 log-probs vs float64 of the same bf16 inputs. The kernels accumulate in fp32, so the error of
# the logits path is fp32 rounding of the log-sum-exp (~1e-5 on |log p| ~ 10); the hidden path multiplies
# in bf16 (its logits are rounded to 8 mantissa bits, ~|z| * 2^-9), so it gets a looser bound.
LP_BF16_TOL = {"logits": 1e-3, "hidden": 5e-2}
# Trainer vs engine |Δ log p| on the same tokens. fp32 (--cpu): two implementations of one model agree to
# float rounding. bf16: slime / NeMo-RL report mean |Δ| ~1e-2 between engines and trainers; a wrong weight
# or a wrong rotary base gives mean |Δ| >= 1.
MISMATCH_TOL = {"fp32": (1e-4, 1e-3), "bf16": (0.05, 1.0)}  # (mean, max)
VARLEN_TOL = {"fp32": 1e-4, "bf16": 2e-2}  # max relative logits error vs packed_sdpa
VARLEN_CANDIDATES = ("varlen", "torch_varlen", "sdpa_varlen", "flash_varlen", "te_thd")
"""Names a varlen ``model.attention_backend`` may have (the first this checkout's config accepts is used);
``SMOKE_VARLEN_BACKEND`` names one explicitly."""


def _device(cpu: bool) -> torch.device:
    if cpu:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("CUDA is not available (use --cpu for the CPU rehearsal)")
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)


def _init_group(cpu: bool) -> None:
    import torch.distributed as dist

    from megatron_maspo.parallel.launch import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    dist.init_process_group("gloo" if cpu else "nccl", rank=0, world_size=1)


def _peak_gb(dev: torch.device) -> float:
    return torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else 0.0


def _reset_peak(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)


def _crc(t: torch.Tensor) -> int:
    """crc32 of a tensor's bytes (on the host): the bitwise identity used by every check here."""
    # a copy: numpy views of a CPU tensor would pin its storage (no longer resizable, so not offloadable)
    return zlib.crc32(t.detach().reshape(-1).view(torch.uint8).to("cpu", copy=True).numpy())


def qwen2_config(cpu: bool, gpu_layers: int = 12):
    """A Qwen2 config small on CPU and ~250M parameters (12 layers; ~0.5 GB in bf16) on the GPU."""
    import transformers

    size = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=512) if cpu else \
        dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=gpu_layers, num_attention_heads=16,
             num_key_value_heads=4, vocab_size=32000)
    return transformers.Qwen2Config(**size, max_position_embeddings=512, tie_word_embeddings=False)


def cmd_lp_bf16(a: argparse.Namespace) -> int:
    import torch.distributed as dist

    from megatron_maspo.parallel import vocab_parallel_logprobs as vpl
    from megatron_maspo.parallel import vocab_parallel_logprobs_from_hidden as vplh

    dev = _device(a.cpu)
    _init_group(a.cpu)
    n, v, h = (256, 4096, 64) if a.cpu else (4096, 152064, 3584)
    g = torch.Generator(device=dev).manual_seed(0)
    labels = torch.randint(0, v, (n,), device=dev, generator=g)
    z = (torch.randn(n, v, device=dev, generator=g) * 3).bfloat16()
    hid = torch.randn(n, h, device=dev, generator=g).bfloat16()
    w = (torch.randn(v, h, device=dev, generator=g) / h**0.5).bfloat16()

    def ref(logits64: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logp = torch.log_softmax(logits64, dim=-1)
        return logp.gather(1, labels[:, None]).squeeze(1), -(logp.exp() * logp).sum(-1)

    with torch.no_grad():
        got = {"logits": vpl(z, labels, dist.group.WORLD), "hidden": vplh(hid, w, labels, dist.group.WORLD)}
        want = {"logits": ref(z.double()), "hidden": ref(hid.double() @ w.double().t())}
    dist.destroy_process_group()
    parts, ok = [], True
    for kind in ("logits", "hidden"):
        lp_err = (got[kind][0].double() - want[kind][0]).abs().max().item()
        ent_err = (got[kind][1].double() - want[kind][1]).abs().max().item()
        good = max(lp_err, ent_err) <= LP_BF16_TOL[kind]
        ok &= good
        parts.append(f"{kind}: logp={lp_err:.1e} ent={ent_err:.1e} tol={LP_BF16_TOL[kind]:.0e}"
                     + ("" if good else " ABOVE"))
    print(f"SMOKE lp_bf16: N={n} V={v} bf16 vs float64: " + "; ".join(parts))
    return 0 if ok else 1


# ---- ipc: trainer process -> engine process through the project's bucket transport -------------------

def _receiver(cfg, dtype: torch.dtype, dev: str, inbox, outbox) -> None:
    """The engine process: a built-in engine that loads buckets opened from the sender's handles."""
    try:
        from megatron_maspo.rollout.buckets import Bucket
        from megatron_maspo.rollout.builtin_engine import BuiltinEngine
        from megatron_maspo.rollout.transport import MappedBuffers

        device = torch.device(dev)
        with device:  # random init on the device (the sync overwrites it): seconds saved on the GPU
            engine = BuiltinEngine.from_hf_config(cfg, dtype=dtype, device=device)
        outbox.put(("ready", None))

        mapped = MappedBuffers(device.index if device.type == "cuda" else None)  # each pool buffer once

        def buckets():
            prev = None
            while True:
                msg = inbox.get()
                if prev is not None:  # the previous bucket's tensors were copied: its buffer is free
                    outbox.put(("done", prev))
                if msg is None:
                    return
                slot, handle, nbytes, metas, index = msg
                prev = index
                yield Bucket(mapped.view(slot, handle, nbytes), list(metas), None, index)

        engine.load_buckets(buckets(), verify=False)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        outbox.put(("loaded", time.time()))  # the last byte is in the engine: the end of the transfer
        t0 = time.perf_counter()
        crcs = {n: _crc(p) for n, p in engine.model.named_parameters()}
        outbox.put(("crc", (crcs, time.perf_counter() - t0)))
    except BaseException as e:  # noqa: BLE001 (reported to the sender, which fails the part)
        outbox.put(("error", f"{type(e).__name__}: {e}"))


def cmd_ipc(a: argparse.Namespace) -> int:
    import torch.multiprocessing as mp
    import transformers

    from megatron_maspo.rollout.buckets import pack_buckets
    from megatron_maspo.rollout.transport import BucketPool, HandleSlots, prefetch

    dev = _device(a.cpu)
    dtype = torch.float32 if a.cpu else torch.bfloat16
    cfg = qwen2_config(a.cpu)
    torch.manual_seed(1)
    with dev:  # initialised on the device: a CPU init of 250M parameters costs seconds of the window
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    want = {n: _crc(t) for n, t in named}
    total = sum(t.numel() * t.element_size() for _, t in named)
    bucket_bytes = max(t.numel() * t.element_size() for _, t in named)  # the largest tensor fills one
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(cfg, dtype, str(dev), inbox, outbox), daemon=True)
    proc.start()

    def get(kind: str):
        got, val = outbox.get(timeout=120)
        if got == "error" or got != kind:
            raise SystemExit(f"SMOKE ipc: receiver {got}: {val}")
        return val

    get("ready")
    pool = BucketPool(bucket_bytes, dev, count=2)
    slots = HandleSlots()  # each pool buffer's handle is sent once (the product's protocol)
    t0 = time.time()  # wall clock: the receiver's end is read in another process
    pending: dict[int, object] = {}
    n_buckets = 0
    # The prefetch thread packs bucket k+1 into the second buffer while the engine loads bucket k.
    for b in prefetch(pack_buckets(named, bucket_bytes, with_checksum=False, alloc=pool), depth=1,
                      on_drop=lambda x: x.done()):
        slot, handle = slots(b.buffer)
        # the metadata travels as pickled TensorMeta (whatever fields this checkout's buckets.py has)
        inbox.put((slot, handle, b.buffer.numel(), b.metas, b.index))
        pending[b.index] = b
        n_buckets += 1
        if b.index > 0:
            pending.pop(get("done")).done()
    inbox.put(None)
    pending.pop(get("done")).done()
    secs = get("loaded") - t0  # first bucket packed .. last byte loaded in the engine, synchronised
    crcs, verify_s = get("crc")  # verification, timed apart
    proc.join(timeout=30)
    bad = [n for n in want if crcs.get(n) != want[n]]
    ok = not bad and set(crcs) == set(want)
    print(f"SMOKE ipc: {'cuda-ipc' if dev.type == 'cuda' else 'shared-memory'} {total / 2**20:.0f} MiB "
          f"{str(dtype).removeprefix('torch.')} in {n_buckets} buckets of {bucket_bytes / 2**20:.1f} MiB "
          f"into a spawned engine, bitwise " + ("ok" if ok else f"WRONG ({len(bad)} tensors differ, e.g. {bad[:2]})")
          + f": transfer {total / secs / 1e9:.3f} GB/s ({secs:.3f} s, first pack to last load), verify "
          f"{verify_s:.3f} s apart; {len(slots)} buffers, each mapped once")
    return 0 if ok else 1


# ---- sleep: engine sleep/wake and trainer offload/reload ----------------------------------------------

def cmd_sleep(a: argparse.Namespace) -> int:
    import transformers

    from megatron_maspo.rollout.builtin_engine import BuiltinEngine
    from megatron_maspo.rollout.types import SamplingParams
    from megatron_maspo.train.actor.offload import CATEGORIES, StateOffloader, training_tensors

    dev = _device(a.cpu)
    dtype = torch.float32 if a.cpu else torch.bfloat16
    cfg = qwen2_config(a.cpu, gpu_layers=4)  # ~125M parameters: 2 GB of fp32 training state on the GPU
    torch.manual_seed(2)
    with dev:
        engine = BuiltinEngine(transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype), device=dev)
        # The trainer: the same architecture in fp32 with AdamW after one real step (params, grads, moments).
        trainer = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    opt = torch.optim.AdamW(trainer.parameters(), lr=1e-3)
    ids = torch.randint(0, cfg.vocab_size, (2, 32), device=dev)
    trainer(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    off = StateOffloader(lambda: training_tensors([trainer], opt), CATEGORIES, dev)
    tensors = training_tensors([trainer], opt)
    before_t = [_crc(t) for c in CATEGORIES for t in tensors[c]]
    before_e = {n: _crc(p) for n, p in engine.model.named_parameters()}
    mem, phase = {}, "start"

    def mark(name: str) -> None:
        nonlocal phase
        mem[phase] = _peak_gb(dev)
        phase = name
        _reset_peak(dev)
        mem[name + "@"] = torch.cuda.memory_allocated(dev) / 2**30 if dev.type == "cuda" else 0.0

    _reset_peak(dev)
    mark("engine_sleep")
    engine.sleep(1)
    mark("offload")
    moved = off.offload()
    mark("generate")
    engine.wake_up()
    engine.generate([[1, 2, 3]], SamplingParams(n=2, max_tokens=8, seed=0))
    engine.sleep(1)
    mark("reload")
    back = off.reload()
    engine.wake_up()
    mark("end")
    after_t = [_crc(t) for c in CATEGORIES for t in training_tensors([trainer], opt)[c]]
    after_e = {n: _crc(p) for n, p in engine.model.named_parameters()}
    ok_t, ok_e = after_t == before_t, after_e == before_e
    freed = mem["engine_sleep@"] - mem["generate@"]
    figs = " ".join(f"{k}={mem[k]:.2f}" for k in ("engine_sleep", "offload", "generate", "reload"))
    print(f"SMOKE sleep: offloaded {moved / 2**20:.0f} MiB (reloaded {back / 2**20:.0f}), engine+trainer "
          f"bit-exact={'yes' if ok_t and ok_e else f'NO (trainer {ok_t}, engine {ok_e})'}; "
          f"freed_gb={freed:.2f} peak_gb[{figs}]")
    ok = ok_t and ok_e and moved > 0 and back == moved and (a.cpu or freed > 0)
    return 0 if ok else 1


# ---- mismatch: trainer (Megatron) vs engine (transformers) log-probs ----------------------------------

def cmd_mismatch(a: argparse.Namespace) -> int:
    import tempfile

    import transformers

    from megatron_maspo.conversion.hf_to_megatron import load_hf_weights
    from megatron_maspo.conversion.verify import megatron_logits
    from megatron_maspo.model.hf_config import arch_spec_from_hf
    from megatron_maspo.model.provider import ModelBuildOptions, build_model_chunks
    from megatron_maspo.model.tiny_hf import make_tiny_hf_model
    from megatron_maspo.parallel.groups import init_parallel
    from megatron_maspo.rollout.builtin_engine import BuiltinEngine
    from megatron_maspo.rollout.diagnostics import mismatch_metrics
    from megatron_maspo.rollout.types import SamplingParams

    dev = _device(a.cpu)
    dtype = torch.float32 if a.cpu else torch.bfloat16
    prec = "fp32" if a.cpu else "bf16"
    hf_dir = tempfile.mkdtemp(prefix="smoke_mismatch_")
    make_tiny_hf_model("qwen2", hf_dir, vocab_size=301, seed=3, num_hidden_layers=2)
    engine = BuiltinEngine(transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype), device=dev)
    prompts = [[5, 17, 42, 7], [100, 3], [9, 9, 9, 250, 11, 2]]
    comps = [c for group in engine.generate(prompts, SamplingParams(n=4, max_tokens=16, seed=0))
             for c in group]

    _init_group(a.cpu)
    spec = arch_spec_from_hf(hf_dir)
    groups = init_parallel(tp=1, pp=1, ep=1)
    chunks = build_model_chunks(spec, ModelBuildOptions(params_dtype=dtype, bf16=not a.cpu),
                                pp_rank=groups.pp_rank)
    load_hf_weights(chunks, spec, groups, hf_dir)
    train_lp, eng_lp = [], []
    for k, c in enumerate(comps):
        prompt = prompts[k // 4]
        row = torch.tensor([prompt + c.token_ids])
        logits = megatron_logits(chunks, spec, groups, row)[0]  # [s, V] fp32
        logp = torch.log_softmax(logits, dim=-1)
        targets = torch.tensor(c.token_ids, device=logp.device)
        train_lp.append(logp[len(prompt) - 1:-1].gather(1, targets[:, None]).squeeze(1).cpu())
        eng_lp.append(torch.tensor(c.logprobs))
    t, e = torch.cat(train_lp), torch.cat(eng_lp)
    m = mismatch_metrics(t, e, torch.ones_like(t))
    mean, mx = m["mismatch/logprob_abs_diff_mean"].item(), m["mismatch/logprob_abs_diff_max"].item()
    tol_mean, tol_max = MISMATCH_TOL[prec]
    ok = mean <= tol_mean and mx <= tol_max
    print(f"SMOKE mismatch: {prec} {t.numel()} tokens: |dlogp| mean={mean:.1e} (tol {tol_mean:.0e}) "
          f"max={mx:.1e} (tol {tol_max:.0e}) kl_k3={m['mismatch/kl_k3'].item():.1e}"
          + ("" if ok else " ABOVE TOLERANCE"))
    return 0 if ok else 1


# ---- varlen: pluggable, runs only when the checkout has such a backend --------------------------------

def varlen_backend() -> str | None:
    """The varlen ``attention_backend`` this checkout accepts (``SMOKE_VARLEN_BACKEND`` first), or None."""
    from megatron_maspo.model.config import ModelConfig

    names = [os.environ["SMOKE_VARLEN_BACKEND"]] if os.environ.get("SMOKE_VARLEN_BACKEND") else \
        list(VARLEN_CANDIDATES)
    for name in names:
        try:
            ModelConfig(attention_backend=name)
        except (ValueError, TypeError):
            continue
        return name
    return None


def packed_logits(backend: str, spec, dtype: torch.dtype, hf_dir: str, groups, tokens: torch.Tensor,
                  bounds: list[int]) -> torch.Tensor:
    """Logits ``[S, V]`` of one packed row (sequences at ``bounds``) through a model built with ``backend``."""
    from megatron_maspo.conversion.hf_to_megatron import load_hf_weights
    from megatron_maspo.model.packed_attention import build_packed_seq_params
    from megatron_maspo.model.provider import ModelBuildOptions, build_model_chunks

    opts = ModelBuildOptions(params_dtype=dtype, bf16=dtype == torch.bfloat16, attention_backend=backend)
    chunks = build_model_chunks(spec, opts, pp_rank=groups.pp_rank)
    load_hf_weights(chunks, spec, groups, hf_dir)
    model = chunks[0].eval()
    dev = next(model.parameters()).device
    pos = torch.cat([torch.arange(b - a) for a, b in zip(bounds[:-1], bounds[1:])])[None].to(dev)
    with torch.no_grad():
        out = model(tokens[None].to(dev), pos, None, packed_seq_params=build_packed_seq_params(bounds, dev))
    return out.reshape(-1, out.shape[-1])[:, : spec.vocab_size].float()


def cmd_varlen(a: argparse.Namespace) -> int:
    import tempfile

    backend = varlen_backend()
    if backend is None:
        print(f"SMOKE varlen: not available (no model.attention_backend in {'/'.join(VARLEN_CANDIDATES)}; "
              "SMOKE_VARLEN_BACKEND names one)")
        return 0
    if a.cpu and backend == "varlen":  # model/varlen_attention.py: torch's varlen kernel is CUDA only
        print("SMOKE varlen: skipped with --cpu (attention_backend='varlen' runs only on CUDA)")
        return 0
    from megatron_maspo.model.hf_config import arch_spec_from_hf
    from megatron_maspo.model.tiny_hf import make_tiny_hf_model
    from megatron_maspo.parallel.groups import init_parallel

    dev = _device(a.cpu)
    dtype = torch.float32 if a.cpu else torch.bfloat16
    hf_dir = tempfile.mkdtemp(prefix="smoke_varlen_")
    make_tiny_hf_model("qwen2", hf_dir, vocab_size=301, seed=4, num_hidden_layers=2)
    _init_group(a.cpu)
    spec = arch_spec_from_hf(hf_dir)
    groups = init_parallel(tp=1, pp=1, ep=1)
    bounds = [0, 7, 20, 21, 48]
    tokens = torch.randint(0, 301, (bounds[-1],), generator=torch.Generator().manual_seed(0))
    got = packed_logits(backend, spec, dtype, hf_dir, groups, tokens, bounds)
    ref = packed_logits("packed_sdpa", spec, dtype, hf_dir, groups, tokens, bounds)
    err = ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()
    tol = VARLEN_TOL["fp32" if a.cpu else "bf16"]
    ok = err <= tol
    print(f"SMOKE varlen: {backend} vs packed_sdpa, {len(bounds) - 1} packed sequences ({bounds[-1]} tokens)"
          f" on {dev.type}: max_rel_logits_err={err:.1e} tol={tol:.0e}" + ("" if ok else " ABOVE TOLERANCE"))
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    cmds = {"lp_bf16": cmd_lp_bf16, "ipc": cmd_ipc, "sleep": cmd_sleep, "mismatch": cmd_mismatch,
            "varlen": cmd_varlen}
    for name in cmds:
        sub.add_parser(name).add_argument("--cpu", action="store_true")
    a = p.parse_args(argv)
    return cmds[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
