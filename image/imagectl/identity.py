"""HOME and USER for a UID the image's /etc/passwd does not know (OpenShift, ``--user 1000680000:0``).

Such a process has no passwd entry: ``getpass.getuser()`` (torch's inductor cache, Triton)
raises unless USER or LOGNAME is set, and ``~`` is whatever HOME says (Docker gives ``/``
when it cannot look the UID up). The image makes its caches and /home/serve group 0 with
group rights equal to the owner's; this supplies the variables.
"""
from __future__ import annotations

import os
import pwd
from pathlib import Path
from typing import Callable

HOME_CANDIDATES = (Path("/home/serve"), Path("/cache/home"), Path("/tmp"))


def _known(uid: int, lookup: Callable[[int], object]) -> bool:
    try:
        lookup(uid)
    except KeyError:
        return False
    return True


def identity_env(environ: dict[str, str], uid: int | None = None,
                 lookup: Callable[[int], object] = pwd.getpwuid,
                 writable: Callable[[Path], bool] = lambda p: os.access(p, os.W_OK | os.X_OK),
                 homes: tuple[Path, ...] = HOME_CANDIDATES) -> dict[str, str]:
    """The variables to add: USER/LOGNAME for an unknown UID (never over set ones), and HOME
    when it is unset, ``/`` or not writable (the first writable candidate)."""
    uid = os.getuid() if uid is None else uid
    updates: dict[str, str] = {}
    if not _known(uid, lookup):
        name = f"uid{uid}"
        for var in ("USER", "LOGNAME"):
            if not environ.get(var):
                updates[var] = name
    home = environ.get("HOME", "")
    if not home or home == "/" or not writable(Path(home)):
        for candidate in homes:
            if candidate.is_dir() and writable(candidate):
                updates["HOME"] = str(candidate)
                break
    return updates
