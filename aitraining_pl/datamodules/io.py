"""Reading and checking tabular text data before any training starts.

Every problem is raised as a ``DataValidationError`` naming the file, the row (1-based line number for
JSONL) and the field, so a user can fix it without a debugger. The CLI prints these as one message and
exits non-zero.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

#: Local file suffixes understood by ``read_records``.
SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


class DataValidationError(ValueError):
    """Bad input data: the message names the source, row and field."""

    def __init__(self, source: str, message: str, row: int | None = None, field: str | None = None):
        where = source if row is None else f"{source}, row {row}"
        if field is not None:
            where += f", field {field!r}"
        super().__init__(f"{where}: {message}")
        self.source, self.row, self.field = source, row, field


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    records = []
    with path.open(encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataValidationError(str(path), f"malformed JSON ({err.msg} at column {err.colno})", line_no) from None
            if not isinstance(record, dict):
                raise DataValidationError(str(path), f"expected a JSON object, got {type(record).__name__}", line_no)
            records.append(record)
    return records


def _read_json(path: Path) -> list[dict[str, Any]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise DataValidationError(str(path), f"malformed JSON ({err.msg} at line {err.lineno}, column {err.colno})") from None
    if isinstance(data, dict):  # {"column": [values...]} or {"data": [records...]}
        if "data" in data and isinstance(data["data"], list):
            data = data["data"]
        elif all(isinstance(v, list) for v in data.values()):
            n = {len(v) for v in data.values()}
            if len(n) != 1:
                raise DataValidationError(str(path), "columns have different lengths")
            data = [dict(zip(data, values)) for values in zip(*data.values())]
    if not isinstance(data, list):
        raise DataValidationError(str(path), "expected a list of records")
    return list(data)


def _read_table(path: Path) -> list[dict[str, Any]]:
    from datasets import load_dataset

    builder = "parquet" if path.suffix == ".parquet" else "csv"
    dataset = load_dataset(builder, data_files=str(path), split="train")
    return list(dataset)


_READERS: dict[str, Callable[[Path], list[dict[str, Any]]]] = {
    ".jsonl": _read_jsonl,
    ".json": _read_json,
    ".parquet": _read_table,
    ".csv": _read_table,
}


def read_records(source: str, split: str = "train") -> list[dict[str, Any]]:
    """Rows of a local JSONL / JSON / Parquet / CSV file, or of a ``datasets`` hub dataset ``source``
    (with ``split``) when no such local path exists.

    Raises:
        DataValidationError: missing file, unknown suffix, malformed JSON (with its line number).
    """
    path = Path(os.path.expanduser(source))
    if path.suffix in _READERS:
        if not path.is_file():
            raise DataValidationError(str(path), "file not found")
        records = _READERS[path.suffix](path)
    elif path.exists():
        raise DataValidationError(str(path), f"unsupported file type; use one of {', '.join(SUFFIXES)}")
    else:
        from datasets import load_dataset

        try:
            records = list(load_dataset(source, split=split))
        except Exception as err:  # datasets raises many types; the user needs the source named
            raise DataValidationError(source, f"not a local file and not loadable as a hub dataset: {err}") from None
    if not records:
        raise DataValidationError(str(path), "no rows")
    return records


def check_columns(records: Sequence[dict[str, Any]], columns: Iterable[str], source: str) -> None:
    """Raise if any of ``columns`` is absent from the first row, listing the columns found."""
    found = list(records[0].keys())
    missing = [c for c in columns if c not in records[0]]
    if missing:
        raise DataValidationError(
            source, f"missing column(s) {', '.join(map(repr, missing))}; columns found: {', '.join(found)}"
        )


def is_messages(value: Any) -> bool:
    """Whether ``value`` is a chat conversation: a non-empty list of message dicts."""
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) for m in value)


def check_text(value: Any, source: str, row: int, field: str, *, allow_messages: bool = True) -> None:
    """Raise unless ``value`` is a non-empty string, or (``allow_messages``) a non-empty list of
    ``{"role", "content"}`` chat messages with string contents."""
    if isinstance(value, str):
        if not value.strip():
            raise DataValidationError(source, "empty text", row, field)
        return
    if allow_messages and isinstance(value, list) and value:
        for i, message in enumerate(value):
            if not (isinstance(message, dict) and isinstance(message.get("content"), str) and "role" in message):
                raise DataValidationError(source, f"message {i} is not a {{role, content}} dict with string content", row, field)
        return
    kind = "empty list" if value == [] else type(value).__name__
    raise DataValidationError(source, f"expected a non-empty string{' or chat messages' if allow_messages else ''}, got {kind}", row, field)


def pad_sequences(sequences: Sequence[Sequence[int] | torch.Tensor], pad_value: int, side: str = "right") -> torch.Tensor:
    """Stack variable-length 1-D sequences into (N, longest), padding on ``side`` ("right" or "left")."""
    if side not in ("right", "left"):
        raise ValueError(f"side must be 'right' or 'left', got {side!r}")
    longest = max(len(s) for s in sequences)
    out = torch.full((len(sequences), longest), pad_value, dtype=torch.long)
    for i, seq in enumerate(sequences):
        seq = torch.as_tensor(seq, dtype=torch.long)
        if len(seq):
            if side == "right":
                out[i, : len(seq)] = seq
            else:
                out[i, longest - len(seq) :] = seq
    return out
