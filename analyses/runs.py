"""Run folders: one claim rule, one slug, part folders and cached tables, all written atomically.

Every analysis that writes a run folder (``nopelens sweep`` and ``probe``, ``intervene``,
``lengthgen``) goes through this module, so a folder behaves the same whichever command made it:

- :func:`claim` (or :func:`claimed`, which also holds the folder against a second run while it
  runs, and takes the stamp back from a run that fails before it writes anything) stamps the folder
  with its analysis (the *kind*) and the digest of its settings (``<kind>.json``), and refuses, with
  one message, a folder made with other settings or by another analysis: a rerun resumes only what
  the same settings measured, and never overwrites another command's tables;
- :func:`slug` turns a model spec into a file name;
- :func:`part_dir`, :func:`write_part` and :func:`read_part` keep one finished unit of work (a
  model and training seed of a sweep) per folder under ``parts/``; its ``done.json`` is written
  last, so a part without it is unfinished, and a part whose table cannot be read is measured
  again (the warning names the file);
- :func:`cached_tables` computes tables once and reads them back on a rerun.

Files are written with :mod:`nopelens.models.io` (temp file, then rename): an interrupted run
leaves the old file or the new one, never half of one.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import uuid
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import pandas as pd

try:
    import fcntl
except ImportError:  # Windows: no flock; a folder is then not held (everything else works)
    fcntl = None

from nopelens.models.io import file_sha256, read_json, write_csv_atomic, write_json_atomic

KINDS = ("sweep", "intervene", "lengthgen", "dynamics", "haviv")
"""The analyses that write run folders; each stamps its folder with ``<kind>.json``."""

LEGACY_STAMPS = {"intervene": "run.json", "lengthgen": "settings.json"}
"""Stamps of folders made before this module (the settings themselves, no digest); still honoured."""

DONE = "done.json"
"""Written last into a part folder: the part is complete."""


def settings_digest(settings: dict[str, Any], ignore: Sequence[str] = ()) -> str:
    """A 12-hex-digit digest of ``settings`` without the keys in ``ignore``.

    The digest is of the JSON text with sorted keys, so a tuple and the list JSON reads back give
    the same digest.

    >>> settings_digest({"seed": 0, "models": ("a", "b")}) == settings_digest({"models": ["a", "b"], "seed": 0})
    True
    >>> settings_digest({"seed": 0, "train_seeds": [0]}, ignore=("train_seeds",)) == settings_digest({"seed": 0})
    True
    """
    measured = {key: value for key, value in settings.items() if key not in ignore}
    return hashlib.sha256(json.dumps(measured, sort_keys=True).encode()).hexdigest()[:12]


OUTPUT_SUFFIXES = (".csv", ".md", ".png", ".svg", ".json")
"""The kinds of file a run writes at the top of its folder: an unstamped folder holding one is not
claimed (the run could overwrite someone's table or notes of that name)."""


def claim(
    folder: str | Path,
    kind: str,
    settings: dict[str, Any],
    ignore: Sequence[str] = (),
    command: str | None = None,
    unset: dict[str, Any] | None = None,
    run: str | None = None,
) -> Path:
    """Make ``folder`` the run folder of a ``kind`` analysis with ``settings``, or refuse it.

    Writes ``<kind>.json`` (``digest``, ``settings`` and the ``command``) into ``folder``, creating
    it. A folder already stamped with the same digest is resumed: its stamp is left as it is when
    ``settings`` are the same (a re-read rewrites nothing), else rewritten with ``settings``, which
    may differ in the ``ignore`` keys (a sweep records its latest list of training seeds).

    Args:
        folder: the run folder.
        kind: one of :data:`KINDS`.
        settings: JSON-ready settings (a dataclass's ``asdict``).
        ignore: keys that do not change what a part of the run measures.
        command: the ``nopelens`` subcommand running (default ``kind``; ``probe`` writes a sweep
            folder); messages name it, and the command that made a refused folder.
        unset: what a key means when one side's settings lack it (settings written only when not
            at their default): words, e.g. ``{"layers": "every block"}`` (default "the default"), or
            for a record its default record, whose fields are then compared one by one.
        run: an id of the run writing the stamp (so that it removes only a stamp it wrote last).

    Returns:
        ``folder`` as a ``Path``.

    Raises:
        ValueError: if ``folder`` holds a ``kind`` run made with other settings (the message names
            the keys that differ), a run of another analysis, or, unstamped and with no ``parts``
            folder (a run whose stamp was lost), files of the kinds runs write (:data:`OUTPUT_SUFFIXES`).
    """
    folder = Path(folder)
    command = command or kind
    if kind not in KINDS:
        raise ValueError(f"unknown run kind {kind!r}; known: {', '.join(KINDS)}")
    refuse_other_runs(folder, command, kind)
    digest = settings_digest(settings, ignore)
    previous = stamped_settings(folder, kind)
    foreign = (
        sorted(path.name for path in folder.iterdir() if path.is_file() and path.suffix in OUTPUT_SUFFIXES)
        if previous is None and folder.is_dir() and not (folder / "parts").is_dir()
        else []
    )
    if foreign:
        raise ValueError(
            f"{folder} holds tables or figures no nopelens {command} run wrote ({', '.join(foreign[:3])}"
            f"{f' and {len(foreign) - 3} more' if len(foreign) > 3 else ''}), which it could overwrite; "
            "use a new or empty --out folder"
        )
    if previous is not None and settings_digest(previous, ignore) != digest:
        changes = "; ".join(setting_changes(previous, settings, ignore, unset))
        raise ValueError(
            f"{folder} holds a run of nopelens {_made_by(folder, kind)} made with other settings "
            f"({changes}); use another --out folder, or delete it to start over"
        )
    if previous is not None and _json(previous) == _json(settings) and (folder / f"{kind}.json").is_file():
        return folder  # resumed or re-read as it was: the stamp, and the command that made the run, stay
    write_json_atomic({"digest": digest, "settings": settings, "command": command, "run": run}, folder / f"{kind}.json")
    return folder


def refuse_other_runs(folder: str | Path, command: str, kind: str | None = None) -> None:
    """Refuse ``folder`` when it holds the run of an analysis other than ``kind`` (None: any), so that
    ``command`` writes nothing into another command's run folder.

    Raises:
        ValueError: naming the command that made the folder.
    """
    folder = Path(folder)
    for other in KINDS:
        if other != kind and ((folder / f"{other}.json").is_file() or _legacy(folder, other).is_file()):
            raise ValueError(
                f"{folder} holds a run of nopelens {_made_by(folder, other)}; use another --out folder "
                f"for this {command} run"
            )


def _made_by(folder: Path, kind: str) -> str:
    """The command that made ``folder``'s ``kind`` run, as its stamp records it (else ``kind``)."""
    try:
        record = read_json(folder / f"{kind}.json")
    except (OSError, ValueError):
        return kind
    command = record.get("command") if isinstance(record, dict) else None
    return command if isinstance(command, str) and command else kind


def setting_changes(
    previous: dict[str, Any], settings: dict[str, Any], ignore: Sequence[str] = (), unset: dict[str, Any] | None = None
) -> list[str]:
    """Each setting that differs, as ``key: old there, new now``; a record (a dict) as each of its
    fields that differs, ``key.field: ...``, a missing record read as its default in ``unset``.

    >>> setting_changes({"hf": {"input": "text", "device": "cpu"}, "n": 8}, {"n": 9}, (),
    ...                 {"hf": {"input": "random", "device": "cpu"}})
    ['hf.input: text there, random now', 'n: 8 there, 9 now']
    """
    changes, unset = [], unset or {}
    for key in sorted(set(previous) | set(settings)):
        if key in ignore or _json(previous.get(key)) == _json(settings.get(key)):
            continue
        default = unset.get(key)
        old, new = (
            (side.get(key, default) if isinstance(default, dict) else side.get(key)) for side in (previous, settings)
        )
        if isinstance(old, dict) and isinstance(new, dict):
            changes += [
                f"{key}.{field}: {_plain(old.get(field))} there, {_plain(new.get(field))} now"
                for field in sorted(set(old) | set(new))
                if _json(old.get(field)) != _json(new.get(field))
            ]
        else:
            changes.append(f"{key}: {_shown(previous, key, unset)} there, {_shown(settings, key, unset)} now")
    return changes


def _plain(value: Any) -> str:
    """A setting's value in plain words: lists comma-joined, records as ``key value``, ``none`` for null."""
    if value is None:
        return "none"
    if isinstance(value, dict):
        return ", ".join(f"{k} {_plain(v)}" for k, v in value.items() if v is not None) or "none"
    if isinstance(value, (list, tuple)):
        return ",".join(_plain(v) for v in value)
    return value if isinstance(value, str) else _json(value)


def _shown(settings: dict[str, Any], key: str, unset: dict[str, Any]) -> str:
    """A setting as a reader takes it in: plain words for lists and records, ``none`` for null, and
    what a missing key means.

    >>> _shown({"models": ["a", "b"], "hf": {"input": "text", "dtype": None}}, "hf", {})
    'input text'
    >>> _shown({}, "hf", {"hf": "random ids"}), _shown({"models": ["a", "b"]}, "models", {})
    ('not set (random ids)', 'a,b')
    """
    if key not in settings:
        meaning = unset.get(key, "the default")
        return f"not set ({meaning if isinstance(meaning, str) else _plain(meaning)})"
    return _plain(settings[key])


@contextmanager
def claimed(
    folder: str | Path,
    kind: str,
    settings: dict[str, Any],
    ignore: Sequence[str] = (),
    command: str | None = None,
    unset: dict[str, Any] | None = None,
) -> Iterator[Path]:
    """:func:`claim` ``folder`` for the run inside the ``with`` block; a run that fails (is refused,
    raises, is interrupted) before it writes anything there leaves nothing behind.

    A stamp this run wrote into a folder that had none is removed again when nothing else was
    written beside it, and so is the folder when this run made it; a stamp a run resumed from, or
    one next to finished parts, stays (a later run resumes from them). A refused run must not leave
    a stamp: it would refuse the corrected rerun as "made with other settings".

    Raises:
        ValueError: as :func:`claim` and :func:`held`; and whatever the block raises.
    """
    folder = Path(folder)
    stamped = folder.is_dir() and stamped_settings(folder, kind) is not None
    before = set(folder.rglob("*")) if folder.is_dir() else None
    run = uuid.uuid4().hex
    with ExitStack() as hold:
        existed = folder.is_dir()
        if existed:  # held before the stamp is rewritten, so a running run's stamp stays its own
            hold.enter_context(held(folder, command or kind))
        claim(folder, kind, settings, ignore, command, unset, run)
        try:
            if not existed:
                hold.enter_context(held(folder, command or kind))
            yield folder
        except BaseException:
            if not stamped:
                _unclaim(folder, kind, before, run)
            raise


@contextmanager
def held(folder: Path, command: str) -> Iterator[None]:
    """Hold ``folder`` for one run: a second run started in it meanwhile (a rerun while an
    interrupted run still waits for its workers, say) is refused instead of training the same
    models beside it and writing its tables over the first's. The hold is an advisory ``flock`` on
    the folder itself (no file is written); the kernel releases it when the run ends, however it
    ends. Worker processes are spawned, so they do not inherit it. (Where there is no ``fcntl``,
    Windows, the folder is not held.)

    Raises:
        ValueError: if another process holds ``folder``.
    """
    if fcntl is None:
        yield
        return
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(
                f"{folder} is in use by another nopelens run; wait for it to end, or use another --out folder "
                f"for this {command} run"
            ) from None
        yield
    finally:
        os.close(descriptor)  # releases the lock


def _unclaim(folder: Path, kind: str, before: set[Path] | None, run: str) -> None:
    """Remove ``folder``'s fresh ``<kind>.json`` when the run wrote no other file there and no other
    run (``run`` is this one's id) claimed the folder since, with the folders it made (``folder``
    itself when ``before`` is None: it did not exist)."""
    stamp = folder / f"{kind}.json"
    old = before or set()
    if any(path.is_file() and path != stamp and path not in old for path in folder.rglob("*")):
        return
    try:
        if read_json(stamp).get("run") != run:
            return  # another run uses the folder now
    except (OSError, ValueError, AttributeError):
        return
    stamp.unlink(missing_ok=True)
    made = [path for path in folder.rglob("*") if path.is_dir() and path not in old]
    for sub in sorted(made, key=lambda path: len(path.parts), reverse=True):
        sub.rmdir()
    if before is None:
        folder.rmdir()


def _legacy(folder: Path, kind: str) -> Path:
    return folder / LEGACY_STAMPS.get(kind, f"{kind}.json")


def stamped_settings(folder: Path, kind: str) -> dict[str, Any] | None:
    """The settings ``folder``'s ``kind`` stamp holds (a legacy stamp's whole record), else None.

    Raises:
        ValueError: if the stamp is not one nopelens wrote.
    """
    stamp = folder / f"{kind}.json"
    if stamp.is_file():
        record = read_json(stamp)
        if not isinstance(record, dict) or not isinstance(record.get("settings"), dict):
            raise ValueError(f"{stamp} is not a nopelens {kind} stamp; use another --out folder")
        return record["settings"]
    legacy = _legacy(folder, kind)
    if legacy.is_file():
        record = read_json(legacy)
        if not isinstance(record, dict):
            raise ValueError(f"{legacy} is not a nopelens {kind} stamp; use another --out folder")
        return record
    return None


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def slug(spec: str) -> str:
    """A file name for ``spec``: letters, digits, ``-``, ``_`` and ``.`` kept, anything else ``_``;
    a leading dot too, so no slug is ``.``, ``..`` or a hidden file.

    >>> slug("text-nope-4l"), slug("hf:/models/tiny"), slug("../ckpt.v2")
    ('text-nope-4l', 'hf__models_tiny', '___ckpt.v2')
    """
    text = "".join(c if c.isalnum() or c in "-_." else "_" for c in spec)
    stripped = text.lstrip(".")
    return "_" * (len(text) - len(stripped)) + stripped if text else "_"


def part_dir(folder: str | Path, spec: str, train_seed: int = 0) -> Path:
    """``parts/<slug>`` for training seed 0 (where runs from before training seeds keep theirs),
    else ``parts/<slug>-seed<n>``."""
    name = slug(spec) if train_seed == 0 else f"{slug(spec)}-seed{train_seed}"
    return Path(folder) / "parts" / name


TABLE_DIGESTS = "table_sha256"
"""The ``done.json`` key of a part's table checksums (each ``<name>.csv``'s sha256 as written)."""


def write_part(part: Path, tables: dict[str, pd.DataFrame], meta: dict[str, Any]) -> None:
    """Write a finished part: each table as ``<name>.csv``, then ``done.json`` (``meta`` and each
    table's sha256, :data:`TABLE_DIGESTS`) last."""
    digests = {name: file_sha256(write_csv_atomic(table, part / f"{name}.csv")) for name, table in tables.items()}
    write_json_atomic({**meta, TABLE_DIGESTS: digests}, part / DONE)


def read_part(part: Path, names: Sequence[str]) -> tuple[dict[str, pd.DataFrame], dict[str, Any]] | None:
    """The tables ``names`` and the ``done.json`` of a finished part (without its checksums), or
    None to measure it (again).

    None when the part is unfinished (no ``done.json`` or a table missing), and when a file of it
    cannot be read or is not what was written (emptied, truncated, edited: its sha256 differs from
    the one ``done.json`` records; not CSV / JSON): then a line on stderr names the file and says
    the part is measured again. Parts written before checksums were recorded are read unchecked.
    """
    if not (part / DONE).is_file():
        return None  # unfinished: measured (again) without a word
    missing = [name for name in names if not (part / f"{name}.csv").is_file()]
    if missing:
        _measure_again(part / f"{missing[0]}.csv", "is missing from a finished part")
        return None
    try:
        meta = read_json(part / DONE)
    except ValueError as error:
        _unreadable(part / DONE, error)
        return None
    if not isinstance(meta, dict):
        _unreadable(part / DONE, ValueError("it holds no JSON object"))
        return None
    digests = meta.pop(TABLE_DIGESTS, None) or {}
    if not isinstance(digests, dict):
        _unreadable(part / DONE, ValueError(f"its {TABLE_DIGESTS} is not a record of checksums"))
        return None
    tables = {}
    for name in names:
        path = part / f"{name}.csv"
        if name in digests and file_sha256(path) != digests[name]:
            _measure_again(
                path,
                "is not what was written when the part was finished (its sha256 differs: "
                "emptied, truncated or edited since)",
            )
            return None
        try:
            tables[name] = pd.read_csv(path)
        except (pd.errors.EmptyDataError, pd.errors.ParserError, UnicodeDecodeError) as error:
            _unreadable(path, error)
            return None
    return tables, meta


def _unreadable(path: Path, error: Exception) -> None:
    _measure_again(path, f"cannot be read ({' '.join(str(error).split()) or type(error).__name__})")


def _measure_again(path: Path, why: str) -> None:
    print(f"nopelens: {path} {why}; measuring that part again", file=sys.stderr)


def cached_tables(
    folder: Path,
    names: Sequence[str],
    compute: Callable[[], Sequence[pd.DataFrame]],
    say: Callable[[str], None],
    label: str,
) -> dict[str, pd.DataFrame]:
    """Tables ``names`` read from ``folder`` when all are there and readable, else ``compute()``d
    and written (one ``<name>.csv`` each)."""
    paths = [folder / f"{name}.csv" for name in names]
    if all(path.is_file() for path in paths):
        try:
            tables = {name: pd.read_csv(path) for name, path in zip(names, paths)}
        except (pd.errors.EmptyDataError, pd.errors.ParserError, UnicodeDecodeError) as error:
            say(f"{label}: a table in {folder} cannot be read ({' '.join(str(error).split())}); measuring again")
        else:
            say(f"{label}: already in {folder}, reusing")
            return tables
    say(label)
    frames = compute()
    for frame, path in zip(frames, paths):
        write_csv_atomic(frame, path)
    return dict(zip(names, frames))
