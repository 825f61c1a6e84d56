"""Output that cannot be torn: every report, plot, table and JSON file kvlab writes goes through here.

A file is written to a temporary name in the target's own folder, flushed to disk (fsync) and then
renamed over the target (os.replace, atomic on POSIX and Windows): a reader sees the old complete file
or the new complete file, never half of one, even when the run is interrupted mid-write.

`check_writable` / `check_writable_folder` are called BEFORE a long run, so a typo in `--out` fails in
a second with a one-line error instead of after an hour of work.
"""

from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from .errors import OutputError

#: file names a matplotlib figure may be saved to
PLOT_SUFFIXES = (".png", ".svg", ".pdf")


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_NEW_FILE_MODE = 0o666 & ~_current_umask()  # what open() would give a new file (mkstemp gives 0600)


def _describe(exc: OSError) -> str:
    return exc.strerror or str(exc)


def check_writable_folder(folder: str | os.PathLike, option: str) -> Path:
    """Make `folder` (and its parents) if needed and prove a file can be created in it; return it.

    Raises OutputError naming `option` (e.g. "--out") when it is a file, cannot be made or is read-only.
    """
    folder = Path(folder).expanduser()
    if folder.exists() and not folder.is_dir():
        raise OutputError(f"{option} {folder}: is a file, not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".kvlab-write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise OutputError(f"{option} {folder}: cannot write there ({_describe(exc)})") from None
    return folder


def check_writable(path: str | os.PathLike, option: str, suffixes: tuple[str, ...] = ()) -> Path:
    """Check that the file `path` can be written (its folder exists or can be made, and is writable).

    `suffixes` (e.g. (".png", ".svg", ".pdf")) restricts the file name's extension.
    """
    path = Path(path).expanduser()
    if suffixes and path.suffix.lower() not in suffixes:
        names = ", ".join(suffixes[:-1]) + (f" or {suffixes[-1]}" if len(suffixes) > 1 else suffixes[0])
        raise OutputError(f"{option} needs a {names} file name, got {path.name!r}")
    if path.is_dir():
        raise OutputError(f"{option} {path}: is a folder; give a file name")
    check_writable_folder(path.parent, option)
    return path


@contextmanager
def atomic_path(path: str | os.PathLike, durable: bool = True) -> Iterator[Path]:
    """Yield a temporary path beside `path`; when the block succeeds, fsync it and rename it over `path`.

    When the block raises (or is interrupted), the temporary file is removed and `path` is untouched.
    `durable=False` skips the fsyncs (a reader still never sees half a file; a power cut may leave a torn one,
    which a file with its own checksum refuses): for many small files where the fsyncs would cost more than the writes.
    """
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        mode = path.stat().st_mode & 0o7777 if path.exists() else _NEW_FILE_MODE
        os.chmod(tmp, mode)
        if durable:
            with open(tmp, "rb+") as fh:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        _fsync_folder(path.parent)


def _fsync_folder(folder: Path) -> None:
    """Make the rename itself durable where the platform allows it (best effort)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_bytes(path: str | os.PathLike, data: bytes, durable: bool = True) -> Path:
    with atomic_path(path, durable) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def write_text(path: str | os.PathLike, text: str) -> Path:
    return write_bytes(path, text.encode("utf-8"))


def write_json(path: str | os.PathLike, payload, indent: int | None = 2) -> Path:
    """JSON with a trailing newline, written atomically."""
    return write_text(path, json.dumps(payload, indent=indent) + "\n")


def save_figure(fig, path: str | os.PathLike, **savefig_kwargs) -> Path:
    """matplotlib `fig.savefig`, atomically (the format comes from `path`'s extension, not the temp name)."""
    path = Path(path)
    fmt = path.suffix.lstrip(".").lower() or "png"
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format=fmt, **savefig_kwargs)
    return path
