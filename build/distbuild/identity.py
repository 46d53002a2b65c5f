"""One author and sign-off identity for a whole patch series.

A series goes upstream as the work of whoever forwards it: they export it
under their own name (``make export IDENTITY="Name <email>"``), which makes
every patch's ``From:`` and its one ``Signed-off-by:`` line (the DCO the
upstreams require) that identity. ``lint`` checks that a series carries one
identity, so no patch goes out signed by someone else, and says when that
identity is a placeholder (an address no person reads): such a series builds
byte for byte the same everywhere, but it is not DCO-ready until exported.
"""
from __future__ import annotations

import email.header
import email.utils
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import DistBuildError

if TYPE_CHECKING:
    from .series import Patch

_IDENTITY = re.compile(r"^(?P<name>[^<>\n]*[^<>\s])\s+<(?P<email>[^<>@\s]+@[^<>\s]+)>$")
_SIGNED_OFF = re.compile(r"^Signed-off-by:.*$", re.M)
_FROM = re.compile(r"^From: .*(?:\n[ \t].*)*$", re.M)
# Hosts no mail reaches (RFC 2606 and RFC 6761 names).
_PLACEHOLDER_HOST = re.compile(r"(^|\.)(localhost|localdomain|invalid|example|test|local)$|"
                               r"^example\.(com|org|net)$", re.I)


@dataclass(frozen=True)
class Identity:
    name: str
    email: str

    def __str__(self) -> str:
        return f"{self.name} <{self.email}>"



def parse_identity(text: str, source: str = "IDENTITY") -> Identity:
    match = _IDENTITY.match(text.strip())
    if match is None:
        raise DistBuildError(f"{source}: {text!r} is not an identity; write it as 'Full Name <name@host>'")
    return Identity(match["name"], match["email"])


def header_identity(header: str) -> Identity | None:
    """The author in a patch's mail header (``From:``), decoded."""
    match = _FROM.search(header)
    if match is None:
        return None
    value = re.sub(r"\n[ \t]", " ", match.group(0)[len("From: "):])
    decoded = "".join(
        part.decode(enc or "utf-8") if isinstance(part, bytes) else part
        for part, enc in email.header.decode_header(value)
    )
    name, address = email.utils.parseaddr(decoded)
    return Identity(name, address) if address else None


def sign_off_identities(header: str) -> list[Identity | None]:
    """Every ``Signed-off-by:`` of a patch's message, parsed (None: malformed)."""
    found: list[Identity | None] = []
    for line in _SIGNED_OFF.findall(header):
        match = _IDENTITY.match(line[len("Signed-off-by:"):].strip())
        found.append(Identity(match["name"], match["email"]) if match else None)
    return found


def sign_off_as(message: str, identity: Identity) -> str:
    """A commit message whose ``Signed-off-by:`` lines are replaced by one of
    ``identity``, where the first stood (or appended after the trailers)."""
    lines = message.rstrip("\n").split("\n")
    signed = [i for i, line in enumerate(lines) if _SIGNED_OFF.fullmatch(line)]
    sign_off = f"Signed-off-by: {identity}"
    if not signed:
        return "\n".join(lines) + "\n" + sign_off + "\n"
    kept = [line for i, line in enumerate(lines) if i not in signed[1:]]
    kept[signed[0]] = sign_off
    return "\n".join(kept) + "\n"


def identity_problems(patches: Sequence["Patch"]) -> list[str]:
    """Patches not authored and signed off by the one identity of their series."""
    problems = []
    authors: dict[Identity, str] = {}
    for patch in patches:
        header = patch.path.read_text(errors="replace").partition("\n---\n")[0]
        author = header_identity(header)
        sign_offs = sign_off_identities(header)
        if author is None:
            problems.append(f"{patch.path}: no From: author")
            continue
        authors.setdefault(author, patch.name)
        if sign_offs != [author]:
            shown = ", ".join(str(s) if s else "(malformed)" for s in sign_offs) or "none"
            problems.append(f"{patch.path}: signed off by {shown}, authored by {author}; "
                            "one Signed-off-by of the author (re-export with make export IDENTITY=...)")
    if len(authors) > 1:
        listed = "; ".join(f"{who} ({first})" for who, first in authors.items())
        problems.append(f"{patches[0].path.parent}/series: {len(authors)} identities in one series: {listed}; "
                        "export it under one (make export IDENTITY='Name <email>')")
    return problems


def is_placeholder(identity: Identity) -> bool:
    return bool(_PLACEHOLDER_HOST.search(identity.email.rpartition("@")[2]))


def placeholder_notice(patches: Sequence["Patch"]) -> str | None:
    """A plain statement that a series is signed off by a placeholder, or None."""
    placeholders = sorted({str(who) for patch in patches
                           if (who := header_identity(patch.path.read_text(errors="replace")
                                                      .partition("\n---\n")[0])) and is_placeholder(who)})
    if not placeholders:
        return None
    return (f"{patches[0].path.parent}/series: not DCO-ready: authored and signed off by the placeholder "
            f"{', '.join(placeholders)}; whoever forwards it exports it under their own name: "
            "make export IDENTITY='Full Name <name@host>'")
