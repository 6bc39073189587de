"""How every command of the project fails, claims its output directory and writes its files.

- ``UserError``: an expected failure (bad input, a path that cannot be used, a run that diverged).
  ``@command`` turns it, any ``OSError`` (missing file, permission, full disk: the environment,
  not a bug) and every failure of input (``is_input_error``: what Python and the config libraries
  raise while reading or checking a file, a key or a value) into one line ``error: ...`` and exit
  code 1, as it does for a collective that failed because another process of the run is gone
  (``peer_lost``). ``--debug`` (or ``CT_DEBUG=1``) shows the traceback instead. Anything else is a
  bug and keeps its traceback. ``QuietInputErrors`` keeps a library's logger (detectron2's trainer)
  from printing the traceback of such a failure before that line.
- ``ensure_writable_dir`` proves an output location usable before any work starts.
- ``OutputLock`` makes a run the only one writing into its output directory.
- ``atomic_write`` is the one writer of the project's files: a temporary file it creates itself
  beside the target (never a name planted there, a link included), flushed to disk, then renamed
  over the target, so a crash never leaves a torn file and a link at the target is replaced, never
  followed; ``open_append`` is its counterpart for a log that grows line by line;
  ``remove_stale_temporaries`` clears what killed writers left behind.
- ``write_json`` is how every evaluator writes its metrics: atomically, and never a NaN or an
  infinity (JSON has none; a reader would choke on it or take it for a number).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import math
import os
import secrets
import socket
import stat
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any, Callable

__all__ = [
    "UserError",
    "INPUT_ERRORS",
    "QuietInputErrors",
    "command",
    "describe",
    "is_input_error",
    "ensure_writable_dir",
    "OutputLock",
    "atomic_write",
    "open_append",
    "remove_stale_temporaries",
    "write_json",
    "write_text",
    "write_bytes",
    "open_own",
    "NonFiniteValueError",
    "DEBUG_HELP",
]

DEBUG_HELP = "--debug (or CT_DEBUG=1) shows the traceback of an error instead of its one-line summary"
_TMP_MARK = ".tmp"
# Every file the project creates: 0644 minus the umask, as a plain open() gives.
FILE_MODE = 0o644
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


class UserError(Exception):
    """An expected failure, reported as one line: what happened, where, what to do."""


def _worker_error(error: BaseException) -> str | None:
    """The original one line of an error re-raised from a DataLoader worker: torch re-raises it in
    the main process with the worker's whole traceback as its message ("Caught OSError in DataLoader
    worker process 0. Original Traceback ...")."""
    text = str(error)
    if "in DataLoader worker process" not in text or "Original Traceback" not in text:
        return None
    last = next((line.strip() for line in reversed(text.splitlines()) if line.strip()), "")
    prefix = f"{type(error).__name__}: "
    return last[len(prefix) :] if last.startswith(prefix) else last


# What torch's process groups raise when a peer process or node is gone: gloo's transport errors
# are plain RuntimeErrors, so their text is the only sign (NCCL's and the store's have their own types).
_PEER_LOST_TYPES = ("DistError", "DistBackendError", "DistNetworkError", "DistStoreError")
_PEER_LOST_TEXTS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "NCCL communicator was aborted",
)


def peer_lost(error: BaseException) -> str | None:
    """One line for a collective that failed because another process stopped, else None."""
    if "torch.distributed" not in sys.modules or not isinstance(error, RuntimeError):
        return None
    text = str(error)
    if type(error).__name__ not in _PEER_LOST_TYPES and not any(t in text for t in _PEER_LOST_TEXTS):
        return None
    first = next((line.strip() for line in text.splitlines() if line.strip()), type(error).__name__)
    return (
        f"lost contact with another process of the run ({first[:200]}): a process or node stopped, so this one "
        "stops too; its log says why. Relaunch to continue from the last checkpoint"
    )


# Besides UserError and OSError, what reading or checking an input raises when the input is bad:
# Python's own refusals (an integer of over 4,300 digits or text that is not UTF-8: ValueError;
# nesting deeper than the interpreter's stack: RecursionError; a size believed: MemoryError) and the
# errors of the libraries that read configs and annotations (OmegaConf, PyYAML, yacs and fvcore under
# detectron2, detectron2's own), recognised by their module so that this module imports none of them.
INPUT_ERRORS: tuple[type[BaseException], ...] = (ValueError, RecursionError, MemoryError)
_INPUT_LIBRARIES = ("omegaconf", "yaml", "yacs", "fvcore", "detectron2")


def is_input_error(error: BaseException) -> bool:
    """Whether ``error`` is an expected failure (one line) rather than a bug (a traceback)."""
    if isinstance(error, (UserError, OSError, *INPUT_ERRORS)):
        return True
    return any(cls.__module__.split(".")[0] in _INPUT_LIBRARIES for cls in type(error).__mro__)


def describe(error: BaseException) -> str:
    """One line for an expected failure; an OSError names its path and the system's reason, a
    failure of input that does not name what it was reading says what kind of failure it is."""
    original = _worker_error(error)
    if original is not None:
        return " ".join(original.split())
    if isinstance(error, RecursionError):
        return "the input nests too deeply to be read (RecursionError); --debug shows where"
    if isinstance(error, MemoryError):
        return "out of memory while reading the input (MemoryError); --debug shows where"
    if isinstance(error, OSError) and not isinstance(error, UserError):
        where = f" {error.filename}" if error.filename else ""
        reason = error.strerror or str(error)
        hint = {PermissionError: "fix its permissions or choose another path", FileNotFoundError: "check the path"}.get(
            type(error), "check the path and the disk"
        )
        return f"{reason}:{where}; {hint}" if where else f"{reason}; {hint}"
    text = " ".join(str(error).split())[:2000]
    if isinstance(error, UserError):
        return text or type(error).__name__
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def command(main: Callable[..., object]) -> Callable[..., object]:
    """Wrap a CLI's ``main(argv)``: expected failures end as ``SystemExit("error: ...")`` (stderr, exit 1)."""

    @functools.wraps(main)
    def wrapper(argv: list[str] | None = None):
        argv = list(sys.argv[1:] if argv is None else argv)
        debug = os.environ.get("CT_DEBUG", "") not in ("", "0")
        if "--debug" in argv:
            argv.remove("--debug")
            debug = True
        try:
            return main(argv)
        except Exception as e:
            if debug:
                raise
            if is_input_error(e):
                raise SystemExit(f"error: {describe(e)}") from None
            lost = peer_lost(e)
            if lost is None:
                raise
            raise SystemExit(f"error: {lost}") from None

    return wrapper


class QuietInputErrors(logging.Filter):
    """Drops a log record carrying the traceback of a failure of input (``is_input_error``):
    detectron2's trainer logs "Exception during training:" with the traceback of whatever stops
    it, then raises it on to ``@command``, whose one line must be the only word on it. Records of
    bugs keep their traceback; ``--debug`` (CT_DEBUG=1) keeps every one."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return error is None or not is_input_error(error) or os.environ.get("CT_DEBUG", "") not in ("", "0")


def ensure_writable_dir(path: str | os.PathLike, what: str) -> Path:
    """Create ``path`` if needed and write a probe file there; ``what`` names the option (e.g. "--out")."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-probe-"):
            pass
    except OSError as e:
        raise UserError(
            f"{what} {path} is not a writable directory ({e.strerror or e}); "
            "choose another location or fix its permissions"
        ) from None
    return path


class OutputLock:
    """An exclusive claim on a directory for the duration of a run.

    ``flock`` on ``DIR/.lock``: the kernel drops the lock when its holder exits or is killed, so a
    crashed run never blocks the next one, and no pid-liveness guesswork is needed. The file keeps
    the holder's pid, host and start time so the refusal can name them.
    """

    NAME = ".lock"
    # The descriptors this process holds locks on. A forked child (a DataLoader worker) shares
    # each one, and the kernel keeps the lock until the last copy closes: without this, a run
    # killed outright stays "in use" until its workers notice and exit.
    _held: set[int] = set()

    @classmethod
    def _drop_in_child(cls) -> None:
        for fd in cls._held:
            with contextlib.suppress(OSError):
                os.close(fd)  # the child's copy only: the parent still holds the lock
        cls._held.clear()

    def __init__(self, directory: str | os.PathLike, what: str = "output directory"):
        self.directory, self.what = Path(directory), what
        self._fd: int | None = None
        self._pid = os.getpid()

    def acquire(self) -> "OutputLock":
        import fcntl  # POSIX only; imported here so that the module imports everywhere

        ensure_writable_dir(self.directory, self.what)
        # never a link or a hard link planted at DIR/.lock: the lock file is truncated and written
        fd = open_own(self.directory / self.NAME, os.O_RDWR | os.O_CREAT, "the lock file")
        OutputLock._held.add(fd)  # before the flock: a child forked from now on drops its copy
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "unknown holder"
            OutputLock._held.discard(fd)
            os.close(fd)
            raise UserError(
                f"{self.what} {self.directory} is in use by another run ({holder}); wait for it "
                "to finish or choose another directory"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(
            fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0
        )
        self._fd, self._pid = fd, os.getpid()
        return self

    def release(self) -> None:
        # The file stays: unlinking it would let a waiting process lock a file nobody else sees.
        # Only the process that took the lock closes it: in a forked child the number may name
        # another file by now (the child's own lock, say).
        if self._fd is not None and self._pid == os.getpid():
            OutputLock._held.discard(self._fd)
            os.close(self._fd)  # closing the descriptor drops the flock
        self._fd = None

    def __enter__(self) -> "OutputLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=OutputLock._drop_in_child)


def open_own(path: str | os.PathLike, flags: int, what: str) -> int:
    """A descriptor on ``path`` for writing in place, refused (UserError, one line) unless ``path``
    is a regular file with one name: a symbolic link there is not followed (``O_NOFOLLOW``), a FIFO
    is not waited on (``O_NONBLOCK``), and a hard link to a file elsewhere (two names) is not
    written, so nothing planted in a shared folder redirects the write outside it."""
    try:
        fd = os.open(path, flags | _NOFOLLOW | os.O_NONBLOCK, FILE_MODE)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UserError(
                f"{path} is a symbolic link, expected {what} as a regular file: not followed; remove it "
                "or choose another folder"
            ) from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        why = "is not a regular file" if not stat.S_ISREG(st.st_mode) else f"has {st.st_nlink} names (a hard link)"
        raise UserError(f"{path} {why}, expected {what} as a regular file of its own: not written; remove it")
    os.set_blocking(fd, True)
    return fd


def open_append(path: str | os.PathLike, fresh: bool = False) -> IO[str]:
    """``path`` opened to append lines: a log that grows row by row, kept across a resume, by
    ``open_own``'s rules (never through a link); with ``fresh`` (a subprocess's output, whatever
    was there discarded), a new file renamed over ``path``, so that a link or a hard link planted
    there is replaced, not written through. The one way the project writes a file in place."""
    if fresh:
        tmp, fd = _create_temporary(Path(path))
        try:
            os.replace(tmp, path)
        except OSError as e:  # e.g. a folder at path
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise UserError(f"{path}: {e.strerror}, expected a log file there: not written; remove it") from None
        return os.fdopen(fd, "a", encoding="utf-8")
    return os.fdopen(open_own(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, "a log"), "a", encoding="utf-8")


def _create_temporary(path: Path) -> tuple[Path, int]:
    """A new file beside ``path`` that this call created (``O_EXCL``: a name planted there, a link
    included, is never opened; another name is drawn). The pid in the name lets
    ``remove_stale_temporaries`` tell a dead writer's leftovers from a live one's."""
    for _ in range(16):
        tmp = path.with_name(f".{path.name}{_TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}")
        try:
            return tmp, os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, FILE_MODE)
        except FileExistsError:
            continue
    raise UserError(f"cannot create a temporary file beside {path}: every name tried exists")


def atomic_write(
    path: str | os.PathLike,
    write: Callable[[IO[bytes]], object],
    check: Callable[[Path], object] | None = None,
    durable: bool = True,
    within: str | os.PathLike | None = None,
) -> Path:
    """The one writer of the project's files: ``write(f)`` into a new temporary file beside
    ``path`` (``f`` a binary file object), flushed to disk, ``check(tmp)`` (a read-back, if given),
    then renamed over ``path``. The rename replaces whatever was at ``path``, a link included,
    without following it: nothing outside the folder is written. On any failure the temporary
    file is removed and ``path`` is untouched. ``durable=False`` skips the flush to disk (the
    ``fsync``), for the many files of a generated dataset whose completeness a last, durable file
    marks (the synthetic datasets' manifest): a crash before it means the whole set is made again.
    ``within``: the folder the caller was given, for a file in a subfolder it made there (a feature
    cache's key folder): the file's folder must resolve inside it, so a link planted in place of
    the subfolder cannot send the file elsewhere (one line, nothing written)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if within is not None:
        root, folder = os.path.realpath(within), os.path.realpath(path.parent)
        if os.path.commonpath([root, folder]) != root:
            raise UserError(
                f"{path}: its folder resolves to {folder}, outside {within} (a link in the way): not written; "
                "remove the link"
            )
    tmp, fd = _create_temporary(path)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        if check is not None:
            check(tmp)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return path


def write_bytes(path: str | os.PathLike, data: bytes, durable: bool = True) -> Path:
    """``data`` through ``atomic_write``."""
    return atomic_write(path, lambda f: f.write(data), durable=durable)


def write_text(path: str | os.PathLike, text: str, durable: bool = True) -> Path:
    """``text`` as UTF-8 through ``atomic_write``."""
    return write_bytes(path, text.encode("utf-8"), durable)


class NonFiniteValueError(UserError, ValueError):
    """A NaN or an infinity on its way into a JSON file: nothing was written."""


def _first_non_finite(obj: Any, where: str) -> tuple[str, float] | None:
    """(dotted key, value) of the first non-finite float in nested dicts and lists, else None."""
    if isinstance(obj, float):
        return None if math.isfinite(obj) else (where, obj)
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    for key, value in items:
        found = _first_non_finite(value, f"{where}[{key}]" if isinstance(key, int) else f"{where}.{key}".lstrip("."))
        if found is not None:
            return found
    return None


def finite_or_null(value: Any) -> Any:
    """``value`` with every NaN or infinity, nested in dicts, lists and tuples, replaced by None:
    for outputs where an undefined number is a result (a log row, a diagnostic's estimate), not a
    fault. Their readers, this project's own included (``json_limits``), take standard JSON only."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(v) for v in value]
    return value


def json_line(row: dict) -> str:
    """``row`` as one line of a JSON-lines log, a NaN or infinity written as null: a log keeps
    every row (an fp16 overflow's infinite gradient norm is worth a row)."""
    return json.dumps(finite_or_null(row), allow_nan=False) + "\n"


def write_json(path: str | os.PathLike, obj: Any, indent: int | None = 1) -> Path:
    """``obj`` as JSON through ``atomic_write``. A NaN or infinity anywhere in it raises
    NonFiniteValueError, one line naming the file and the key, before anything is written: an
    earlier file at ``path`` stays as it was. An undefined value is written as null by its producer."""
    bad = _first_non_finite(obj, "")
    if bad is not None:
        raise NonFiniteValueError(f"{path}: {bad[0] or 'the value'}={bad[1]}: not a finite number; nothing written")
    return write_text(path, json.dumps(obj, indent=indent, allow_nan=False))


def remove_stale_temporaries(directory: str | os.PathLike) -> list[Path]:
    """Delete the temporary files of ``atomic_write`` that a killed writer left in ``directory``.

    Call it while holding the directory's ``OutputLock``: then no other writer can be alive there,
    and every temporary file that is not this process's own is a leftover."""
    directory = Path(directory)
    removed = []
    for tmp in directory.glob(f".*{_TMP_MARK}*"):
        pid = tmp.name.rsplit(_TMP_MARK, 1)[1].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and (tmp.is_file() or tmp.is_symlink()):
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
    return removed
