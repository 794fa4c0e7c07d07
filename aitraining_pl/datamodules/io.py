"""Reading and checking tabular text data before any training starts.

Every problem is raised as a ``DataValidationError`` naming the file, the row (1-based line number for
JSONL) and the field, so a user can fix it without a debugger. The CLI prints these as one message and
exits non-zero.

``DataSource`` / ``data_sources`` name where training and validation rows come from (a file, a folder or a hub
dataset with ``split``, ``name``, ``data_files``, ``revision``); ``load_source`` reads them as an Arrow-backed
``datasets.Dataset`` so that tokenisation can be cached (``aitraining_pl.datamodules.cached``).
"""

from __future__ import annotations

import codecs
import json
import logging
import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from aitraining_pl.errors import UserError
from aitraining_pl.models.tokens import padded

#: Local file suffixes understood by ``read_records``.
SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


log = logging.getLogger(__name__)


class DataValidationError(UserError):
    """Bad input data: the message names the source, row and field."""

    what = "data"

    def __init__(self, source: str, message: str, row: int | None = None, field: str | None = None):
        where = source if row is None else f"{source}, row {row}"
        if field is not None:
            where += f", field {field!r}"
        super().__init__(where, message)
        self.source, self.row, self.field = source, row, field


def _decode(raw: bytes, path: Path, line_no: int) -> str:
    """``raw`` as UTF-8, or a ``DataValidationError`` naming the row, column and byte."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        reason = f"not valid UTF-8 (byte 0x{raw[err.start]:02x} at column {err.start + 1})"
        raise DataValidationError(str(path), reason, line_no, _field_with_bad_byte(raw)) from None


def _field_with_bad_byte(raw: bytes) -> str | None:
    """The first top-level field of a JSON object line whose value holds an undecodable byte, if any."""
    try:
        record = json.loads(raw.decode("utf-8", errors="replace"))
    except json.JSONDecodeError:
        return None
    if not isinstance(record, dict):
        return None
    return next((key for key, value in record.items() if "\ufffd" in json.dumps(value, ensure_ascii=False)), None)


class _DuplicateKey(ValueError):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` of every JSON object read: a key given twice (the second would silently win) raises."""
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise _DuplicateKey(key)
        seen[key] = value
    return seen


def _loads(text: str, path: Path, line_no: int | None) -> Any:
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except _DuplicateKey as err:
        raise DataValidationError(str(path), "duplicate key: the row gives it twice", line_no, err.key) from None


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    records = []
    with path.open("rb") as handle:
        for line_no, raw in enumerate(handle, start=1):
            line = _decode(raw, path, line_no)
            if not line.strip():
                continue
            try:
                record = _loads(line, path, line_no)
            except json.JSONDecodeError as err:
                raise DataValidationError(
                    str(path), f"malformed JSON ({err.msg} at column {err.colno})", line_no
                ) from None
            if not isinstance(record, dict):
                raise DataValidationError(str(path), f"expected a JSON object, got {type(record).__name__}", line_no)
            records.append(record)
    return records


def _read_json(path: Path) -> list[dict[str, Any]]:
    raw = path.read_bytes()
    text = "\n".join(_decode(line, path, n) for n, line in enumerate(raw.split(b"\n"), start=1))
    try:
        data = _loads(text, path, None)
    except json.JSONDecodeError as err:
        raise DataValidationError(
            str(path), f"malformed JSON ({err.msg} at line {err.lineno}, column {err.colno})"
        ) from None
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


def read_records(source: str, split: str = "train", **hub: Any) -> list[dict[str, Any]]:
    """Rows of a local JSONL / JSON / Parquet / CSV file, or of a ``datasets`` hub dataset ``source``
    (with ``split`` and the ``load_dataset`` options ``hub``: ``name``, ``data_files``, ``revision``) when no
    such local path exists.

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
        records = list(_load_hub(DataSource(source, split, **hub)))
    if not records:
        raise DataValidationError(str(path), "no rows")
    return records


@dataclass(frozen=True)
class DataSource:
    """Where rows come from: a local file or folder, or a ``datasets`` hub name (``path``), and the
    ``load_dataset`` options of a hub dataset: ``split``, ``name`` (subset), ``data_files``, ``revision``."""

    path: str
    split: str = "train"
    name: str | None = None
    data_files: Any = None
    revision: str | None = None

    @property
    def label(self) -> str:
        """The source in messages: the path of a local file, else the name and split (``org/data [test]``)."""
        return self.path if _is_file(self.path) else f"{self.path} [{self.split}]"


def _is_local(path: str) -> bool:
    return Path(os.path.expanduser(path)).exists() or Path(path).suffix in _READERS


def _is_file(path: str) -> bool:
    return Path(os.path.expanduser(path)).is_file() or Path(path).suffix in _READERS


def data_sources(hp: Any) -> tuple[DataSource | None, DataSource | None]:
    """The training source (``None`` for in-memory rows) and the validation source (``None``: none, or a
    held-out fraction) named by a data module's hyperparameters ``data_path``, ``split``, ``name``,
    ``data_files``, ``revision``, ``val_data_path`` and ``val_split_name`` (the last five optional).

    ``val_split_name`` alone: that split of the training source (a local file has none: the held-out fraction
    ``val_split`` applies, so a hub recipe runs on a local file unchanged). ``val_data_path``: another source, read with
    ``val_split_name`` (default ``split``). ``val_data_path`` equal to a hub ``data_path`` without
    ``val_split_name`` still means its ``"test"`` split, with a deprecation warning."""
    get = hp.get if hasattr(hp, "get") else lambda key, default=None: getattr(hp, key, default)
    path, val_path, val_name = get("data_path"), get("val_data_path"), get("val_split_name")
    train = None
    if path is not None:
        train = DataSource(path, get("split", "train"), get("name"), get("data_files"), get("revision"))
    if val_path is None and val_name is None:
        return train, None
    if val_path is not None and val_path != path:
        return train, DataSource(val_path, val_name or get("split", "train"))
    if train is None:
        raise DataValidationError(str(val_path or val_name), "val_split_name needs a data_path to read it from")
    if val_path is None and Path(path).suffix in _READERS:  # one file has one split: hold out val_split instead
        log.info("%s is one file with no %r split: val_split of its rows is held out instead", path, val_name)
        return train, None
    if val_name is None:
        if not _is_local(path):
            warnings.warn(
                f"val_data_path equal to data_path ({path!r}) reads its 'test' split; this is deprecated: set "
                "val_split_name: test (and leave val_data_path unset)",
                FutureWarning,
                stacklevel=2,
            )
        val_name = "test"
    return train, replace(train, split=val_name)


@contextmanager
def quiet_datasets(progress: bool = False) -> Iterator[None]:
    """``datasets`` without its own log lines (its failures are raised, reworded, by us) and, unless
    ``progress``, without progress bars."""
    import datasets

    bars, logger = datasets.is_progress_bar_enabled(), logging.getLogger("datasets")
    level = logger.level
    if not progress:
        datasets.disable_progress_bars()
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)
        if bars:
            datasets.enable_progress_bars()


def _load_hub(source: DataSource) -> Any:
    from datasets import load_dataset

    try:
        with quiet_datasets():
            return load_dataset(
                source.path,
                name=source.name,
                data_files=source.data_files,
                revision=source.revision,
                split=source.split,
            )
    except Exception as err:  # datasets raises many types; the user needs the source named
        raise DataValidationError(source.path, f"not a local file and not loadable as a hub dataset: {err}") from None


def _starts_with(path: Path, char: str) -> bool:
    """Whether the first non-blank character of the file is ``char``."""
    with path.open(encoding="utf-8", errors="replace") as handle:
        while chunk := handle.read(4096):
            if chunk.strip():
                return chunk.lstrip().startswith(char)
    return False


def _is_utf8(path: Path) -> bool:
    """Whether the file decodes as UTF-8 (read in 1 MiB chunks)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        with path.open("rb") as handle:
            while chunk := handle.read(1 << 20):
                decoder.decode(chunk)
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        return False
    return True


#: ``datasets`` builder of each local suffix.
_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def load_source(source: DataSource) -> Any:
    """The rows of ``source`` as an Arrow-backed ``datasets.Dataset`` (cached on disk by ``datasets``, so a
    ``map`` over it is cached too), or as a list of dicts where ``datasets`` cannot read a local file (JSON
    objects of columns, malformed or mixed rows: our reader then names the bad line, or the rows are checked
    later like in-memory ones).

    Raises:
        DataValidationError: missing file, unknown suffix, malformed JSON (with its line number), no rows.
    """
    from datasets import load_dataset

    path = Path(os.path.expanduser(source.path))
    if path.suffix in _READERS:
        if not path.is_file():
            raise DataValidationError(str(path), "file not found")
        if path.suffix == ".json" and not _starts_with(path, "["):
            return read_records(str(path))  # {"column": [...]} / {"data": [...]} layouts
        if path.suffix in (".json", ".jsonl") and not _is_utf8(path):
            return read_records(str(path))  # Arrow would read the bad bytes; our reader names their row
        try:
            with quiet_datasets():
                rows = load_dataset(_BUILDERS[path.suffix], data_files=str(path), split="train")
        except Exception as err:
            if path.suffix in (".parquet", ".csv"):
                raise DataValidationError(str(path), f"unreadable: {err}") from None
            return read_records(str(path))  # names the malformed line, or reads what Arrow cannot type
    elif path.is_dir():
        rows = _load_hub(replace(source, path=str(path)))
    elif path.exists():
        raise DataValidationError(str(path), f"unsupported file type; use one of {', '.join(SUFFIXES)}")
    else:
        rows = _load_hub(source)
    if len(rows) == 0:
        raise DataValidationError(source.path, "no rows")
    return rows


def check_columns(records: Sequence[dict[str, Any]], columns: Iterable[str], source: str) -> None:
    """Raise if any of ``columns`` is absent from the first row, listing the columns found."""
    found = list(records[0].keys())
    missing = [c for c in columns if c not in records[0]]
    if missing:
        raise DataValidationError(
            source, f"missing column(s) {', '.join(map(repr, missing))}; columns found: {', '.join(found)}"
        )


#: the roles a chat message may have (those of the common chat templates).
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function", "ipython")


def check_text(value: Any, source: str, row: int, field: str, *, allow_messages: bool = True) -> None:
    """Raise unless ``value`` is a non-empty string, or (``allow_messages``) a non-empty list of
    ``{"role", "content"}`` chat messages with string contents and a role in ``CHAT_ROLES``."""
    if isinstance(value, str):
        if not value.strip():
            raise DataValidationError(source, "empty text", row, field)
        return
    if allow_messages and isinstance(value, list) and value:
        for i, message in enumerate(value):
            if not (isinstance(message, dict) and isinstance(message.get("content"), str) and "role" in message):
                raise DataValidationError(
                    source, f"message {i} is not a {{role, content}} dict with string content", row, field
                )
            if message["role"] not in CHAT_ROLES:
                raise DataValidationError(
                    source,
                    f"message {i} has role {message['role']!r}; must be one of {', '.join(CHAT_ROLES)}",
                    row,
                    field,
                )
        return
    kind = "empty list" if value == [] else type(value).__name__
    raise DataValidationError(
        source, f"expected a non-empty string{' or chat messages' if allow_messages else ''}, got {kind}", row, field
    )


def pad_sequences(
    sequences: Sequence[Sequence[int] | torch.Tensor], pad_value: int, side: str = "right"
) -> torch.Tensor:
    """Stack variable-length 1-D sequences into (N, longest) on the CPU, padding on ``side`` ("right" or "left"):
    ``models.tokens.padded``'s values."""
    return padded(sequences, pad_value, side, device="cpu")[0]


class PaddingCollator:
    """Base of the collators that pad a list of examples into a batch (``__call__``, in each subclass).

    Args:
        pad_token_id: id used for padding (masked out everywhere).
    """

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id
