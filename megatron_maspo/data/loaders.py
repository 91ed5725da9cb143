"""Load prompt/answer files: DAPO-Math-17k, plain question/answer jsonl, and evaluation benchmarks.

Readers (by extension, or forced by ``DataConfig.format``): ``.parquet`` (pyarrow, the ``data`` extra),
``.jsonl`` (one object per line) and ``.json`` (a list of objects, or ``{"data"|"examples"|"problems":
[...]}``). Schemas, detected per row:

- DAPO-Math-17k: ``prompt`` (chat list or string), ``reward_model.ground_truth``, ``data_source``.
- Question/answer and benchmark files (AIME 2024/2025, AMC23, MATH500, Minerva, OlympiadBench): the
  question is the first of ``problem, question, prompt, input, query``; the answer the first of ``answer,
  final_answer, ground_truth, expected_answer, target``, else the last ``\\boxed{}`` of ``solution``.
  Lists (OlympiadBench ``final_answer``) are joined with ``", "``; numbers become strings; surrounding
  ``$`` are stripped.

Rows without an answer, with an empty prompt, with undecodable text or malformed JSON are skipped and
counted in a :class:`SkipLog` (the first of each kind is logged); a bad row never stops a run.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from megatron_maspo.data.example import Example, SkipLog
from megatron_maspo.reward.extract import last_boxed

logger = logging.getLogger(__name__)

QUESTION_FIELDS = ("problem", "question", "prompt", "input", "query")
ANSWER_FIELDS = ("answer", "final_answer", "ground_truth", "expected_answer", "target")


class Located(NamedTuple):
    """A row with its location: jsonl rows carry their line number (``path:line``)."""

    where: str
    row: Any


def _read_jsonl(path: Path, skips: SkipLog) -> Iterator[Located]:
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                yield Located(f"{path}:{lineno}", json.loads(raw.decode("utf-8")))
            except UnicodeDecodeError:
                skips.skip("undecodable", f"{path}:{lineno}")
            except json.JSONDecodeError:
                skips.skip("bad_json", f"{path}:{lineno}")


def _read_json(path: Path) -> Iterator[Any]:
    data = json.loads(path.read_text(encoding="utf-8"))
    if isinstance(data, dict):
        data = next(
            (data[k] for k in ("data", "examples", "problems") if isinstance(data.get(k), list)),
            None,
        )
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of rows or {{'data': [...]}}")
    for i, row in enumerate(data):
        yield Located(f"{path}[{i}]", row)


def _read_parquet(path: Path) -> Iterator[Any]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError(f"reading {path} needs pyarrow: pip install megatron-maspo[data]") from e
    i = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        for row in batch.to_pylist():
            yield Located(f"{path}[{i}]", row)
            i += 1


def _clean_text(value: Any) -> str | None:
    """``value`` as a stripped string; None when missing, empty or not valid Unicode."""
    if value is None:
        return None
    if isinstance(value, list | tuple):
        # OlympiadBench: ["$\\frac{1}{2}$", "$3$"] -> "\\frac{1}{2}, 3"
        parts = [_clean_text(v) for v in value]
        value = ", ".join(p.strip("$ ") for p in parts if p)
    elif isinstance(value, bytes):
        value = value.decode("utf-8")  # UnicodeDecodeError is handled by the caller
    elif isinstance(value, bool) or not isinstance(value, str | int | float):
        return None
    text = str(value).strip()
    text.encode("utf-8")  # lone surrogates from JSON escapes raise UnicodeEncodeError here
    return text or None


def _answer_of(row: dict, schema: str) -> str | None:
    if schema == "dapo":
        rm = row.get("reward_model")
        answer = _clean_text(rm.get("ground_truth")) if isinstance(rm, dict) else None
    else:
        answer = next(
            (a for f in ANSWER_FIELDS if (a := _clean_text(row.get(f))) is not None), None
        )
        if answer is None and (solution := _clean_text(row.get("solution"))) is not None:
            answer = last_boxed(solution, max_chars=1024)
    if answer is not None:
        answer = answer.strip("$ ").strip() or None
    return answer


def _prompt_of(row: dict, schema: str) -> str | list[dict[str, str]] | None:
    if schema == "dapo" or isinstance(row.get("prompt"), list):
        prompt = row.get("prompt")
        if isinstance(prompt, list):
            chat = []
            for m in prompt:
                if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                    return None
                content = _clean_text(m.get("content"))
                if content is None:
                    return None
                chat.append({"role": m["role"], "content": content})
            return chat or None
        return _clean_text(prompt)
    return next((q for f in QUESTION_FIELDS if (q := _clean_text(row.get(f))) is not None), None)


def rows_to_examples(
    rows: Iterator[Any], *, schema: str, source: str, skips: SkipLog, limit: int | None = None
) -> list[Example]:
    """Normalise raw rows into :class:`Example` s, skipping and counting bad rows.

    Args:
        rows: decoded rows (dicts; anything else is skipped as ``bad_row``).
        schema: ``"dapo"`` or ``"auto"`` (DAPO when a row has ``reward_model``, else field detection).
        source: fallback ``Example.source`` (DAPO rows use their ``data_source``).
        skips: receives the skip counts.
        limit: stop after this many valid examples.
    """
    out: list[Example] = []
    for i, row in enumerate(rows):
        where = f"{source}[{i}]"
        if isinstance(row, Located):  # one kind of location per file: its line numbers
            where, row = row
        if not isinstance(row, dict):
            skips.skip("bad_row", where)
            continue
        row_schema = "dapo" if schema == "dapo" or "reward_model" in row else "qa"
        try:
            prompt, answer = _prompt_of(row, row_schema), _answer_of(row, row_schema)
        except (UnicodeDecodeError, UnicodeEncodeError):
            skips.skip("undecodable", where)
            continue
        if prompt is None:
            skips.skip("empty_prompt", where)
        elif answer is None:
            skips.skip("no_answer", where)
        else:
            src = _clean_text(row.get("data_source")) if row_schema == "dapo" else None
            out.append(Example(prompt=prompt, answer=answer, source=src or source, origin=where))
            if limit is not None and len(out) >= limit:
                break
    return out


def load_file(
    path: str | Path,
    *,
    format: str = "auto",
    skips: SkipLog | None = None,
    limit: int | None = None,
) -> list[Example]:
    """Load a prompt file into examples (see the module docstring for readers and schemas).

    Args:
        path: ``.parquet``, ``.jsonl`` or ``.json`` file.
        format: a ``DataConfig.format`` value.
        skips: receives skip counts (a fresh one is used and logged when None).
        limit: keep only the first ``limit`` valid examples.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: unknown extension or format.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} does not exist")
    skips = skips if skips is not None else SkipLog()
    suffix = path.suffix.lower()
    if format == "parquet" or (format != "jsonl" and suffix == ".parquet"):
        rows = _read_parquet(path)
    elif format == "jsonl" or suffix == ".jsonl":
        rows = _read_jsonl(path, skips)
    elif suffix == ".json":
        rows = _read_json(path)
    else:
        raise ValueError(
            f"cannot read {path}: extension must be .parquet, .jsonl or .json (format={format!r})"
        )
    if format not in ("auto", "dapo", "jsonl", "parquet", "eval"):
        raise ValueError(f"format must be auto|dapo|jsonl|parquet|eval, got {format!r}")
    examples = rows_to_examples(
        rows,
        schema="dapo" if format == "dapo" else "auto",
        source=path.stem,
        skips=skips,
        limit=limit,
    )
    logger.info(
        "loaded %d examples from %s (skipped %d: %s)",
        len(examples),
        path,
        skips.total,
        dict(skips.counts),
    )
    return examples
