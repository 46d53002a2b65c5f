"""Run a command as the chart runs an engine container (``readOnlyRootFilesystem: true``).

Started inside a private mount namespace (``unshare --mount``, see :func:`command`), it makes
every folder read-only except the ones named with ``--writable``, mounts an empty tmpfs on
/tmp (the chart's emptyDir there), leaves the kernel's own mounts (/dev, /dev/shm, /proc,
/sys) as they are, and execs the command. A library that writes anywhere else gets EROFS,
as it would on the GPU node. A folder named with ``--keep`` stays visible, read-only, even
under /tmp (a checkout there: the image has its code outside /tmp, a test's checkout may not).

    python read_only_root.py [--writable DIR ...] [--keep DIR ...] -- COMMAND [ARG ...]
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys


CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))


def under_tmp(path: str) -> bool:
    return os.path.commonpath([os.path.realpath(path), "/tmp"]) == "/tmp"


def command(python: str, writable: list[str], argv: list[str], keep: list[str] = ()) -> list[str]:
    """The command line that runs ``argv`` under a read-only root. Root gets a mount namespace
    of its own; any other user a user namespace too, in which it may remount. The checkout and
    the Python's environment are kept when they lie under /tmp, which the tmpfs would hide."""
    unshare = ["unshare", "--mount", "--propagation", "private"]
    if os.geteuid() != 0:
        unshare[1:1] = ["--user", "--map-root-user"]
    kept = [*keep, CHECKOUT, os.path.dirname(os.path.dirname(os.path.abspath(python)))]
    kept = [os.path.realpath(path) for path in kept if under_tmp(path)]
    kept = [path for path in dict.fromkeys(kept)   # one mount for a folder inside another
            if not any(other != path and os.path.commonpath([path, other]) == other for other in kept)]
    options = [arg for path in writable for arg in ("--writable", path)]
    options += [arg for path in kept for arg in ("--keep", path)]
    return [*unshare, python, os.path.abspath(__file__), *options, "--", *argv]


MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 32, 4096, 16384, 1 << 18
_libc = ctypes.CDLL(None, use_errno=True)


def mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    if _libc.mount(source.encode(), target.encode(), fstype.encode() if fstype else None, flags,
                   data.encode() if data else None) != 0:
        error = ctypes.get_errno()
        sys.exit(f"read_only_root: mounting {target} (from {source}) failed: {os.strerror(error)}")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--writable", action="append", default=[], help="a folder that stays writable")
    parser.add_argument("--keep", action="append", default=[], help="a folder under /tmp that stays visible, read-only")
    parser.add_argument("argv", nargs=argparse.REMAINDER, help="-- COMMAND [ARG ...]")
    args = parser.parse_args(argv)
    command_argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not command_argv:
        parser.error("no command after --")
    writable = [os.path.realpath(path) for path in args.writable]
    kept = [os.path.realpath(path) for path in args.keep]
    for option, paths in (("--writable", writable), ("--keep", kept)):
        for path in paths:
            if not os.path.isdir(path):
                sys.exit(f"read_only_root: {option} {path}: not a folder")
    mount("none", "/", None, MS_REC | MS_PRIVATE)
    # Each folder is held open, so that one under /tmp is still reachable (through
    # /proc/self/fd) once the tmpfs covers /tmp; a bind mount of it is a mount of its own,
    # which the read-only remount of / leaves writable: a kept one is remounted read-only
    # itself. Kept folders go first, so a writable folder inside one is mounted over it.
    held = [(path, os.open(path, os.O_PATH | os.O_DIRECTORY), path in kept) for path in [*kept, *writable]]
    mount("tmpfs", "/tmp", "tmpfs", 0, "mode=1777")
    for path, fd, read_only in held:
        os.makedirs(path, exist_ok=True)   # in the new tmpfs when under /tmp; else it exists
        mount(f"/proc/self/fd/{fd}", path, None, MS_BIND)
        if read_only:
            mount("none", path, None, MS_REMOUNT | MS_BIND | MS_RDONLY)
        os.close(fd)
    mount("none", "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY)
    os.execvp(command_argv[0], command_argv)


if __name__ == "__main__":
    main(sys.argv[1:])
