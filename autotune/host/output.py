"""Where a command's output goes: the files it writes (`--out`, `--plot`) and standard output.

A file is written whole or not at all: into a hidden temporary file beside it, moved over it with
`os.replace` once complete (the same directory, so the move is atomic), the temporary file removed
on any failure. A place no file can go (a missing directory, a directory, a FIFO or a device, a
read-only or forbidden directory) is refused by `check_destination` before any work, and an
`OSError` while writing (a full disk, a quota, a read-only file system) becomes one `BadInput`
line naming the file and the reason: never a traceback, never half a file. No fsync: a crash of
the machine may lose the new file, but never leaves a partial one under the final name.

Standard output's faults (a reader that went away, a full device) are main()'s, in cli/app.py:
`stdout_fault` tells them from bugs.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import select
import stat
import sys
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from autotune.vocabulary.errors import BadInput

# Errors writing a stream that say nothing about the program: the place it writes to failed.
STREAM_ERRNOS = frozenset({errno.EPIPE, errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EFBIG})

_NOT_A_FILE = {
    stat.S_ISFIFO: "a FIFO (named pipe)",
    stat.S_ISCHR: "a character device",
    stat.S_ISBLK: "a block device",
    stat.S_ISSOCK: "a socket",
}


def check_destination(path: str | os.PathLike[str], flag: str) -> Path:
    """Refuse, before any work, a file to write that cannot be: its directory does not exist (none
    is made from a typo), is not writable or is on a read-only file system; it is a directory; it
    is a FIFO, a device or a socket (a FIFO would block until read: autotune writes files, not
    streams). Returns the path."""
    path = Path(path)
    try:
        return _check_destination(path, flag)
    except OSError as exc:  # the name itself cannot be looked up: too long, a loop of links, ...
        raise BadInput(cannot_write(path, flag, exc)) from None


def _check_destination(path: Path, flag: str) -> Path:
    target = _target(path)
    folder = target.parent
    if not folder.is_dir():
        what = "is not a directory" if folder.exists() else "does not exist"
        raise BadInput(f"{flag} {path}: the directory {folder} {what}; create it first, or write the file elsewhere.")
    if target.is_dir():
        raise BadInput(f"{flag} {path}: that is a directory; give a file name, e.g. {path / 'plot.png'}.")
    with contextlib.suppress(OSError):
        mode = target.stat().st_mode
        for test, what in _NOT_A_FILE.items():
            if test(mode):
                raise BadInput(f"{flag} {path}: that is {what}, not a file; give the name of a regular file.")
        if stat.S_ISREG(mode) and (not mode & 0o222 or not os.access(target, os.W_OK)):
            # (Checked by the mode too: root may write anything, but a file made read-only says to keep it.)
            raise BadInput(
                f"{flag} {path}: the file is read-only; make it writable (chmod u+w) to have it replaced, or "
                f"write elsewhere."
            )
    if not os.access(folder, os.W_OK | os.X_OK):
        code = errno.EROFS if _read_only(folder) else errno.EACCES
        raise BadInput(cannot_write(path, flag, OSError(code, os.strerror(code)), where=folder))
    return path


def cannot_write(
    path: str | os.PathLike[str], flag: str, exc: OSError, where: str | os.PathLike[str] | None = None
) -> str:
    """The one line for a file that could not be written: which, why (errno), and what to do."""
    code = exc.errno
    reason = f"{exc.strerror or exc} (errno {code})" if code is not None else str(exc)
    if code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        advice = f"free space there, or give another {flag}"
    elif code == errno.EROFS:
        advice = f"that file system is read-only: give {flag} a place on another"
    elif code in (errno.EACCES, errno.EPERM):
        advice = f"this user may not write there: give {flag} a place it may"
    else:
        advice = f"give another {flag}"
    place = f" in {where}" if where is not None else ""
    return f"{flag} {path}: cannot write it{place}: {reason}; {advice}."


class Output:
    """A file being written: a hidden temporary file beside `path` until `commit` moves it into
    place; removed when the block is left without a commit (an error, Ctrl-C). Entering the block
    creates the temporary file, so a directory that takes no new file is refused then, before the
    work that fills it.

        with Output(path, "--out") as out:
            out.fill(lambda tmp: figure.savefig(tmp))   # or out.write_text(text)
            out.commit()
    """

    def __init__(self, path: str | os.PathLike[str], flag: str = "--out") -> None:
        self.path = check_destination(path, flag)
        self.flag = flag
        self.temp: Path | None = None

    def __enter__(self) -> Output:
        target = _target(self.path)
        stem = target.stem[:100]  # (a temporary name must stay under the file system's limit too)
        for _ in range(8):
            # The suffix kept last: matplotlib chooses the format by it.
            temp = target.with_name(f".{stem}.{secrets.token_hex(4)}.partial{target.suffix}")
            try:
                os.close(os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))  # (the umask applies)
            except FileExistsError:
                continue
            except OSError as exc:
                raise BadInput(cannot_write(self.path, self.flag, exc, where=target.parent)) from None
            self.temp = temp
            return self
        raise BadInput(cannot_write(self.path, self.flag, OSError(errno.EEXIST, os.strerror(errno.EEXIST))))

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.discard()

    def fill(self, write: Callable[[Path], object]) -> None:
        """Call `write(temporary path)`; an OSError it raises is this file's, said as one line."""
        if self.temp is None:
            raise RuntimeError("Output.fill outside its `with` block")
        try:
            write(self.temp)
        except OSError as exc:
            self.discard()
            raise BadInput(cannot_write(self.path, self.flag, exc)) from None

    def write_text(self, text: str) -> None:
        self.fill(lambda temp: temp.write_text(text, encoding="utf-8"))

    def write_bytes(self, data: bytes) -> None:
        self.fill(lambda temp: temp.write_bytes(data))

    def commit(self) -> Path:
        """Move the finished file into place (over an older one, whose permissions it keeps)."""
        if self.temp is None:
            raise RuntimeError("Output.commit outside its `with` block")
        target = _target(self.path)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.chmod(self.temp, stat.S_IMODE(os.stat(target).st_mode))
            os.replace(self.temp, target)
        except OSError as exc:
            self.discard()
            raise BadInput(cannot_write(self.path, self.flag, exc)) from None
        self.temp = None
        return self.path

    def discard(self) -> None:
        if self.temp is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.temp)
            self.temp = None


def write_file(path: str | os.PathLike[str], data: str | bytes, flag: str = "--out") -> Path:
    """Write `data` to `path` whole or not at all (see Output); returns the path."""
    with Output(path, flag) as out:
        out.write_text(data) if isinstance(data, str) else out.write_bytes(data)
        return out.commit()


class FileSnapshot:
    """A file's content (or its absence) now, to put back should what follows fail: for what a
    command writes on the way to an output that then cannot be written (plan's estimate cache,
    written by its traces, before its --plot). Best effort: a file that cannot be put back is left
    as it is (what another process wrote to it meanwhile goes with the rest)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.known = True
        self.content: bytes | None = None
        try:
            self.content = self.path.read_bytes()
        except FileNotFoundError:
            pass
        except OSError:
            self.known = False  # unreadable: nothing known to put back

    def restore(self) -> None:
        if not self.known:
            return
        with contextlib.suppress(OSError):
            if self.content is None:
                self.path.unlink(missing_ok=True)
            elif self.path.read_bytes() != self.content:
                temp = self.path.with_name(f".{self.path.name}.{secrets.token_hex(4)}.partial")
                try:
                    temp.write_bytes(self.content)
                    os.replace(temp, self.path)
                finally:
                    temp.unlink(missing_ok=True)


def stdout_fault(exc: OSError) -> bool:
    """Whether `exc` is standard output's fault, not a bug: a stream error (no file named) raised
    with stdout in hand (click.echo's `file`, a command's `out`), or a broken pipe on stdout."""
    if exc.errno not in STREAM_ERRNOS or exc.filename is not None:
        return False
    streams = {id(sys.stdout), id(sys.__stdout__)}
    tb = exc.__traceback__
    while tb is not None:
        if any(id(value) in streams for value in tb.tb_frame.f_locals.values()):
            return True
        tb = tb.tb_next
    return exc.errno == errno.EPIPE and stdout_reader_gone()


def stdout_reader_gone() -> bool:
    """Whether stdout is a pipe (or socket) whose reading end is closed: poll says POLLERR."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), 0)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def silence_stdout() -> None:
    """Point stdout's descriptor at /dev/null, so that the interpreter's last flush of what is
    still buffered cannot fail again ("Exception ignored ... BrokenPipeError") as it exits."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def _target(path: Path) -> Path:
    """The file a write to `path` lands in: a symbolic link's target, deliberately (replacing the
    link itself would cut it: the file it points to would keep the old text); `through_link` says
    so to the user."""
    return Path(os.path.realpath(path)) if path.is_symlink() else path


def through_link(path: str | os.PathLike[str]) -> str:
    """How a write to `path` is said: `path`, or `path (-> the file its link points to)`."""
    path = Path(path)
    return f"{path} (-> {_target(path)})" if path.is_symlink() else str(path)


def _read_only(folder: Path) -> bool:
    try:
        return bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        return False
