"""Whole-checkpoint conversion jobs (what the scripts and ``maspo convert`` run).

Each job runs one worker per rank: under ``torchrun`` (``RANK``/``WORLD_SIZE`` set) in the current
process, otherwise on ``tp·pp·ep`` spawned local ranks (``run_workers``). Either way each rank first
binds GPU ``LOCAL_RANK`` (on CPU a no-op), and the model is built in the checkpoint's own dtype (HF
``config.json`` ``torch_dtype``; the dist checkpoint's tensor metadata) on that device. The worker
functions are module-level so spawn can pickle them; entry scripts must keep their work under
``if __name__ == "__main__":`` (dist-checkpoint save spawns a helper that re-imports ``__main__``).

User mistakes fail before any rank starts, as :mod:`megatron_maspo.errors` types (one line in the
CLI): an existing output or impossible layout (``ConfigError``), a missing input (``MissingPathError``),
an unsupported config.json or a bad safetensors folder (``InputError``, via ``validate.py``). An
``InputError`` a rank still raises reaches the caller as that ``InputError``, not as the ranks'
tracebacks, and a failed job leaves no output or temporary folder behind.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from megatron_maspo.errors import ConfigError, InputError, MissingPathError
from megatron_maspo.parallel import comm

logger = logging.getLogger(__name__)


def _world(tp: int, pp: int, ep: int) -> int:
    # EP ranks are laid over the TP x DP ranks (expert TP is 1): the smallest world holding both.
    return tp * pp * max(1, ep // tp)


_HF_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def hf_checkpoint_dtype(hf_dir: str | Path) -> torch.dtype:
    """The parameter dtype an HF folder declares (``torch_dtype``, or ``dtype`` in newer
    transformers); float32 when it declares none."""
    import json

    cfg = json.loads((Path(hf_dir) / "config.json").read_text())
    name = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
    if name not in _HF_DTYPES:
        raise ValueError(f"{hf_dir}/config.json: torch_dtype={name!r}; accepted: {sorted(_HF_DTYPES)}")
    return _HF_DTYPES[name]


def megatron_checkpoint_dtype(ckpt: str | Path) -> torch.dtype:
    """The model tensors' dtype in a dist checkpoint, from its metadata (no tensor is read).

    Optimizer state (fp32 next to bf16 weights in a training checkpoint) is ignored; mixed model
    dtypes give the widest one, so nothing is rounded. The ``.metadata`` pickle is read by the screened
    unpickler (``model/safe_load.py``): Megatron's ``load_tensors_metadata`` would unpickle it unrestricted.

    Raises:
        InputError: the metadata is refused or unreadable (naming the file).
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from megatron_maspo.model.safe_load import read_dcp_metadata

    meta = Path(ckpt) / ".metadata"
    if not meta.is_file():
        raise InputError(f"{ckpt}: not a torch_dist checkpoint (no .metadata)")
    md = read_dcp_metadata(meta)
    found = {v.properties.dtype for k, v in md.state_dict_metadata.items()
             if not k.startswith("optimizer") and isinstance(v, TensorStorageMetadata)
             and isinstance(v.properties.dtype, torch.dtype) and v.properties.dtype.is_floating_point}
    if not found:
        raise ValueError(f"{ckpt}: no floating-point model tensor in the checkpoint metadata")
    return max(found, key=lambda d: torch.finfo(d).bits)


def _groups_and_chunks(spec, tp: int, pp: int, ep: int, dtype: torch.dtype, spec_fields: dict | None = None,
                       split: tuple[int | None, int | None] = (None, None)):
    """Parallel state, this rank's chunks (built in ``dtype`` on this rank's device) and their options.

    ``split``: layers of the first and last pipeline stage (None = even; ``parallel/pipeline_split.py``).

    ``spec_fields``: the layer spec to build (``spec_record.build_fields`` of a checkpoint's record); None =
    the local spec, the trainer's default, on every machine (not "TE whenever it imports").
    """
    from megatron_maspo.model.provider import ModelBuildOptions, build_model_chunks
    from megatron_maspo.parallel.config import sequence_parallel_on
    from megatron_maspo.parallel.groups import init_parallel

    groups = init_parallel(tp=tp, pp=pp, ep=ep)
    # jit_fusions off: a conversion runs one forward, which compiled fusions would only delay
    opts = ModelBuildOptions(tp=tp, pp=pp, ep=ep, params_dtype=dtype, bf16=dtype == torch.bfloat16,
                             jit_fusions=False, pp_first_layers=split[0], pp_last_layers=split[1],
                             **(spec_fields or {"use_te": False}))
    # the trainer's default (parallel.sequence_parallel=None): MoE at TP > 1 runs with sequence parallelism
    opts.sequence_parallel = sequence_parallel_on(None, opts.attention_backend, tp, spec.is_moe)
    return groups, build_model_chunks(spec, opts, pp_rank=groups.pp_rank), opts


def _verify(chunks, spec, groups, hf_dir: str | Path) -> float | None:
    """Logits error vs transformers on a few prompts; the figure on last-stage TP-rank-0 ranks."""
    from megatron_maspo.conversion.verify import (
        hf_logits,
        max_relative_error,
        megatron_logits,
        verify_prompts,
    )

    tokenizer = None
    if (Path(hf_dir) / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    tokens = verify_prompts(spec.vocab_size, tokenizer=tokenizer)
    got = megatron_logits(chunks, spec, groups, tokens)
    if got is None or groups.tp_rank != 0:
        return None
    from transformers import AutoModelForCausalLM

    # The reference runs in the Megatron model's dtype on its device (the HF folder's own dtype).
    param = next(chunks[0].parameters())
    ref_model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=param.dtype)
    ref_model = ref_model.to(param.device).eval()
    err = max_relative_error(got, hf_logits(ref_model, tokens))
    logger.info("verify: max relative logits error %.3e over %s tokens", err, tuple(tokens.shape))
    return err


def hf_to_megatron_rank(rank: int, world: int, hf_dir: str, out: str, tp: int, pp: int, ep: int,
                        verify: bool, split: tuple[int | None, int | None] = (None, None)) -> dict[str, Any]:
    """One rank of HF folder -> Megatron dist checkpoint (then reload and verify, if asked)."""
    from megatron_maspo.conversion.dist_ckpt import load_model_checkpoint, save_model_checkpoint
    from megatron_maspo.conversion.hf_to_megatron import load_hf_weights
    from megatron_maspo.model.hf_config import arch_spec_from_hf

    spec = arch_spec_from_hf(hf_dir)
    groups, chunks, opts = _groups_and_chunks(spec, tp, pp, ep, hf_checkpoint_dtype(hf_dir), split=split)
    load_hf_weights(chunks, spec, groups, hf_dir)
    save_model_checkpoint(chunks, out, spec, hf_assets=hf_dir, opts=opts)
    if rank == 0:
        _store_passthrough(spec, hf_dir, out)
    result: dict[str, Any] = {"rank": rank, "out": out}
    if verify:
        for m in chunks:  # reload from disk into zeroed weights: verify the checkpoint, not memory
            for p in m.parameters():
                p.data.zero_()
        load_model_checkpoint(chunks, out)
        result["max_rel_error"] = _verify(chunks, spec, groups, hf_dir)
    return result


def _store_passthrough(spec, hf_dir: str | Path, out: str | Path) -> None:
    """The family's pass-through tensors (MTP layers) of ``hf_dir``, bytes unchanged, into the checkpoint."""
    from megatron_maspo.conversion.dist_ckpt import ASSETS_DIR
    from megatron_maspo.conversion.hf_to_megatron import HFSource
    from megatron_maspo.conversion.passthrough import passthrough_keys, save_passthrough

    with HFSource(hf_dir) as src:
        keys = passthrough_keys(spec, src.keys())
        if keys:
            (Path(out) / ASSETS_DIR).mkdir(exist_ok=True)
            save_passthrough({k: src.get(k) for k in keys}, Path(out) / ASSETS_DIR)
            logger.info("passed %d tensors through by name (%s ...)", len(keys), keys[0])


def megatron_to_hf_rank(rank: int, world: int, ckpt: str, out: str, tp: int, pp: int, ep: int,
                        dtype: str | None, verify: bool,
                        split: tuple[int | None, int | None] = (None, None)) -> dict[str, Any]:
    """One rank of Megatron dist checkpoint -> HF folder (rank 0 writes; all ranks export)."""
    from megatron_maspo.conversion.dist_ckpt import (
        ASSETS_DIR,
        load_arch_spec,
        load_model_checkpoint,
    )
    from megatron_maspo.conversion.megatron_to_hf import export_hf_weights, save_hf_folder
    from megatron_maspo.model.hf_config import hf_config_dict
    from megatron_maspo.model.spec_record import build_fields, read_spec_record
    from megatron_maspo.model.te_spec import te_available

    spec = load_arch_spec(ckpt)
    # Build the spec that wrote the checkpoint (its keys), not whatever happens to import here.
    fields = build_fields(read_spec_record(ckpt), te_buildable=te_available())
    groups, chunks, _ = _groups_and_chunks(spec, tp, pp, ep, megatron_checkpoint_dtype(ckpt), fields, split)
    load_model_checkpoint(chunks, ckpt)
    tdtype = getattr(torch, dtype) if dtype else next(chunks[0].parameters()).dtype
    stream = export_hf_weights(chunks, spec, groups, dtype=tdtype)
    if rank == 0:
        config = hf_config_dict(spec)
        config["torch_dtype"] = str(tdtype).removeprefix("torch.")
        assets = Path(ckpt) / ASSETS_DIR
        try:
            from megatron_maspo.conversion.passthrough import load_passthrough
            from megatron_maspo.conversion.plan import hf_state_dict_keys

            named = itertools.chain(stream, load_passthrough(assets))  # MTP layers: as they were read
            save_hf_folder(named, out, config, copy_from=assets if assets.is_dir() else None,
                           total=len(hf_state_dict_keys(spec)))
        except BaseException:
            for _ in stream:  # keep the other ranks' collectives matched, then fail
                pass
            raise
    else:
        for _ in stream:
            pass
    comm.barrier()
    result: dict[str, Any] = {"rank": rank, "out": out}
    if verify:
        result["max_rel_error"] = _verify(chunks, spec, groups, out)
    return result


def run_job(fn, tp: int, pp: int, ep: int, *args: Any, timeout_s: float = 3600) -> list[dict]:
    """Run ``fn(rank, world, *args)`` on every rank: in-process under torchrun, else spawned."""
    world = _world(tp, pp, ep)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        from megatron_maspo.parallel.failure import exit_on_error

        if int(os.environ["WORLD_SIZE"]) != world:
            raise ValueError(f"torchrun WORLD_SIZE={os.environ['WORLD_SIZE']} but tp*pp*ep layout needs {world}")
        rank, _ = comm.init_default_group()  # binds GPU LOCAL_RANK first
        with exit_on_error(f"conversion rank {rank}"):
            return [fn(rank, world, *args)]
    from megatron_maspo.parallel.launch import WorkerError, run_workers

    with tempfile.TemporaryDirectory(prefix="maspo_input_errors_") as err_dir:
        try:
            return run_workers(_report_input_errors, world, fn, err_dir, *args, timeout_s=timeout_s)
        except WorkerError:
            reports = sorted(Path(err_dir).glob("rank*.txt"))
            if reports:  # the same bad input fails on every rank that reads it: say it once
                raise InputError(reports[0].read_text()) from None
            raise


def _report_input_errors(rank: int, world: int, fn, err_dir: str, *args: Any) -> Any:
    """Run one rank of ``fn``; an ``InputError`` leaves its one-line message for the parent."""
    try:
        return fn(rank, world, *args)
    except InputError as e:
        Path(err_dir, f"rank{rank}.txt").write_text(str(e))
        raise


def _remove_partial(out: str | Path) -> None:
    """Temporary folders a failed collective save left next to ``out`` (killed ranks skip cleanup)."""
    out = Path(out)
    for tmp in out.parent.glob(f".{out.name}.tmp-*"):
        shutil.rmtree(tmp, ignore_errors=True)


def _reject_existing(out: str | Path) -> None:
    if Path(out).exists():
        raise ConfigError(f"output path {out} already exists; refusing to overwrite")


def _checked_layout(spec, tp: int, pp: int, ep: int, split: tuple[int | None, int | None] = (None, None)) -> None:
    try:  # conversion builds MoE at TP > 1 with sequence parallelism, as the trainer does (_groups_and_chunks)
        spec.validate_layout(tp, pp, ep, sequence_parallel=spec.is_moe and tp > 1, pp_first=split[0],
                             pp_last=split[1])
    except ValueError as e:
        msg = str(e).replace("parallel.pp_first_layers=", "--pp-first-layers ").replace(
            "parallel.pp_last_layers=", "--pp-last-layers ")
        raise ConfigError(f"--tp {tp} --pp {pp} --ep {ep}: {msg}") from None


def convert_hf_to_megatron(hf_dir: str | Path, out: str | Path, *, tp: int = 1, pp: int = 1,
                           ep: int = 1, verify: bool = False, pp_first_layers: int | None = None,
                           pp_last_layers: int | None = None) -> list[dict]:
    """HF folder -> Megatron distributed checkpoint written at layout ``tp x pp x ep`` (loadable at
    any layout, even or uneven: ``pp_first_layers`` / ``pp_last_layers``). Validates the architecture
    and layout before starting any rank."""
    split = (pp_first_layers, pp_last_layers)
    from megatron_maspo.conversion.validate import validate_hf_folder
    from megatron_maspo.model.hf_config import arch_spec_from_hf

    _reject_existing(out)
    if not Path(hf_dir).is_dir():
        raise MissingPathError(f"HF folder {hf_dir} does not exist")
    try:
        spec = arch_spec_from_hf(hf_dir)
    except ValueError as e:
        raise InputError(f"{Path(hf_dir) / 'config.json'}: {e}") from None
    _checked_layout(spec, tp, pp, ep, split)
    validate_hf_folder(hf_dir, spec)  # headers only: a bad file fails here, before any rank starts
    try:
        return run_job(hf_to_megatron_rank, tp, pp, ep, str(hf_dir), str(out), tp, pp, ep, verify, split)
    except BaseException:
        _remove_partial(out)
        raise


def convert_megatron_to_hf(ckpt: str | Path, out: str | Path, *, tp: int = 1, pp: int = 1,
                           ep: int = 1, dtype: str | None = None, verify: bool = False,
                           pp_first_layers: int | None = None, pp_last_layers: int | None = None) -> list[dict]:
    """Megatron distributed checkpoint (saved at any layout) -> HF folder (safetensors + config +
    tokenizer files), exported through a model built at ``tp x pp x ep`` (uneven stages as in
    :func:`convert_hf_to_megatron`)."""
    split = (pp_first_layers, pp_last_layers)
    from megatron_maspo.conversion.dist_ckpt import load_arch_spec

    _reject_existing(out)
    if dtype not in (None, "float32", "bfloat16", "float16"):
        raise ConfigError(f"dtype={dtype!r}; accepted: None, 'float32', 'bfloat16', 'float16'")
    if not Path(ckpt).is_dir():
        raise MissingPathError(f"checkpoint folder {ckpt} does not exist")
    try:
        spec = load_arch_spec(ckpt)
    except ValueError as e:
        raise InputError(str(e)) from None
    _checked_layout(spec, tp, pp, ep, split)
    from megatron_maspo.model.safe_load import screen_checkpoint

    screen_checkpoint(Path(ckpt))  # before any rank starts: a refusal is one line, no output folder
    try:
        return run_job(megatron_to_hf_rank, tp, pp, ep, str(ckpt), str(out), tp, pp, ep, dtype, verify, split)
    except BaseException:
        _remove_partial(out)
        raise
