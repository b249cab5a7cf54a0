"""Atomic file writing: a reader (or an interrupted run) sees the old file or the new one, never half.

Every writer goes through :func:`write_atomic`: write a temporary file in the target's folder,
flush it to disk, then ``os.replace`` it over the target (atomic on POSIX within one file system).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

import pandas as pd


def check_writable(path: str | Path) -> Path:
    """Refuse a target file that cannot be written, before any work goes into it.

    Raises:
        IsADirectoryError: if ``path`` is a folder (an empty path is the current folder).
        FileExistsError: if a file stands where one of its parent folders should be.
    """
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"cannot write {path}: it is a folder; give a file path")
    if any(parent.exists() and not parent.is_dir() for parent in path.parents):
        raise FileExistsError(f"cannot write {path}: {path.parent} or a folder above it is a file, not a folder")
    return path


def write_atomic(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Call ``write(temp_path)``, then move the temporary file onto ``path``.

    Creates missing parent folders. On any error the temporary file is removed and ``path`` is
    left as it was.

    Args:
        path: the target file.
        write: writes the content to the path it is given (e.g. ``lambda p: fig.savefig(p)``).

    Returns:
        ``path`` as a ``Path``.

    Raises:
        IsADirectoryError, FileExistsError: as :func:`check_writable`.
    """
    path = check_writable(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=path.suffix)
    os.close(handle)
    try:
        write(Path(temp))
        with open(temp, "rb+") as stream:
            os.fsync(stream.fileno())
        os.chmod(temp, 0o666 & ~umask())  # mkstemp makes 0o600; give what a plain open would
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    return path


def umask() -> int:
    """The process umask (read without changing it for more than an instant)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write UTF-8 text atomically."""
    return write_atomic(path, lambda temp: temp.write_text(text, encoding="utf-8"))


def file_sha256(path: str | Path) -> str:
    """The sha256 of a file's bytes, hex, read a MiB at a time.

    Raises:
        OSError: if the file cannot be read.
    """
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_csv_atomic(frame: pd.DataFrame, path: str | Path) -> Path:
    """Write a DataFrame as CSV (no index) atomically."""
    return write_atomic(path, lambda temp: frame.to_csv(temp, index=False))


def write_json_atomic(data: Any, path: str | Path) -> Path:
    """Write JSON (sorted keys, indented, NaN refused) atomically.

    Raises:
        ValueError: if ``data`` holds NaN or Inf (not valid JSON).
    """
    text = json.dumps(data, indent=2, sort_keys=True, allow_nan=False, default=str)
    return write_text_atomic(path, text + "\n")


def read_json(path: str | Path) -> Any:
    """Read a JSON file, naming the file in the error if it is not valid JSON.

    Raises:
        FileNotFoundError: if it does not exist.
        ValueError: if it is not valid JSON (or not UTF-8 text).
    """
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON ({error}); it may be corrupted") from None
