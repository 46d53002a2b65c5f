"""Arch audit: which CUDA code in a folder, a file or an OCI image runs on the target GPU.

``python -m distbuild audit PATH [--target sm_103] [--allowlist FILE] [--json OUT]``
(``make audit``). PATH is a folder, one file (shared object, cubin, fatbin), an
OCI image layout folder or an ``oci-archive`` tar (``podman save --format
oci-archive``); ``docker save`` archives work too. Images are unpacked layer by
layer into a temporary folder (only the files the audit reads; whiteouts
``.wh.NAME`` and ``.wh..wh..opq`` remove what lower layers put there).

Every shared object (``*.so``, ``*.so.N``), ``*.cubin`` and ``*.fatbin`` that
carries CUDA code is listed with its SASS and PTX targets, read with
``cuobjdump`` (PyPI ``nvidia-cuda-cuobjdump``, a toolchain pin): ``--list-ptx``
for PTX, ``-xelf all`` for the embedded cubins, whose ELF we read ourselves.

Classification of one entry for the target ``sm_XZ`` (major X, minor Z):

- ``native``: SASS for exactly ``sm_XZ`` (plain, ``a`` or ``f``).
- ``family``: family-specific SASS ``sm_XYf`` of the same major with Y <= Z
  (``sm_100f`` runs on ``sm_103``).
- ``same-major``: plain SASS ``sm_XY`` of the same major with Y <= Z.
- ``ptx-only``: no runnable SASS, but PTX the driver can JIT for the target:
  plain ``compute_N`` with N <= XZ, ``compute_XYf`` with Y <= Z, or
  ``compute_XZa`` exactly.
- ``not-runnable``: anything else: architecture-specific ``a`` SASS or PTX of
  another arch (``sm_100a`` does not run on B300), another major (``sm_90a``,
  ``sm_120``), or a newer minor.

An object's verdict is its best entry (the order above). The gate fails (exit 1)
when an object is ``ptx-only`` or ``not-runnable`` and no allowlist line
covers it. Entries of one object can come from different translation units,
so a good verdict does not prove that every kernel of it has runnable code.

Sources for the rules (NVIDIA):

- Plain SASS across minors: "Each cubin file targets a specific
  compute-capability version and is forward-compatible only with GPU
  architectures of the same major version number" (Volta Compatibility Guide,
  1.2, https://docs.nvidia.com/cuda/volta-compatibility-guide/), and the CUDA
  C++ Programming Guide, "Binary Compatibility"
  (https://docs.nvidia.com/cuda/cuda-c-programming-guide/#binary-compatibility):
  binary compatibility holds from one minor revision to the next, not to the
  previous one nor across majors; a cubin for X.y runs on X.z with z >= y.
- ``a`` and ``f``: CUDA Programming Guide, 5.1.2 "Feature Availability"
  (https://docs.nvidia.com/cuda/cuda-programming-guide/05-appendices/compute-capabilities.html):
  architecture-specific features "are not guaranteed to be available or might
  change significantly on subsequent compute architectures", so ``sm_100a``
  code runs on CC 10.0 only; family-specific features are common to the
  members of a family, so ``compute_100f``/``sm_100f`` code runs on CC 10.0
  and 10.3. Background: NVIDIA's "NVIDIA Blackwell and NVIDIA CUDA 12.9
  Introduce Family-Specific Architecture Features"
  (https://developer.nvidia.com/blog/nvidia-blackwell-and-nvidia-cuda-12-9-introduce-family-specific-architecture-features/).
- PTX is JIT-compiled by the driver for the GPU it runs on when no SASS fits
  (same guides); a driver too old for the PTX ISA version is not checked here.

What the cubin ELF says (measured with nvcc 13.0.88 and cuobjdump 13.2.86,
compiling one kernel for sm_75..sm_121 with and without ``a``/``f``):

- ``e_ident[EI_OSABI]`` = 0x41, ``e_ident[EI_ABIVERSION]`` = 8, ``e_machine``
  = 190 (EM_CUDA). ``e_flags`` bits 8-15 hold the SM number (0x64 = 100,
  0x67 = 103, 0x78 = 120, 0x5a = 90); bits 0-7 are 0x04 up to sm_90 and 0x02
  from sm_100; bits 24-31 are 0x06 (0x0f with ``-G``). ``e_flags`` are
  identical for ``sm_100``, ``sm_100a`` and ``sm_100f``: they do not carry the
  suffix. (CUDA 12 cubins, ABI version 7, are read as SM in bits 0-7 and
  0x800 for ``a``: not measurable here, no CUDA 12 toolkit; so the SM number
  listed by cuobjdump wins on disagreement, with a note in the report.)
- ``.nv.compat`` (4-byte records: format, attribute, 16-bit value; format 4 is
  followed by that many bytes): attribute 0x09 is 1 for ``a`` builds, 0
  otherwise. ``--list-elf`` does show ``sm_100a``: cuobjdump knows ``a``, not ``f``.
- ``.note.nv.tkinfo`` (owner "NVIDIA Corp", type 2000) keeps the ptxas
  command line, ``-arch sm_100f -m 64``: the only place in the cubin that says
  ``f``, which is why ``--list-elf`` shows ``sm_100`` for it. The fatbin entry
  header also has it (flags 0x200000 for ``f``, 0x100000 for ``a``), but
  ``-xelf`` drops that header.

So the suffix is taken from the tkinfo note, else ``a`` from ``.nv.compat`` or
cuobjdump's name, else plain. A cubin without the note cannot tell ``sm_100``
from ``sm_100f``; both run on the same GPUs, only the label differs.

Allowlist: one ``GLOB  REASON`` per line (``#`` comments, blank lines ignored);
the reason is required. A glob matches the object's path relative to the audit
root (``*`` crosses ``/``); a glob without ``/`` also matches the file name.
"""
from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import struct
import subprocess
import tarfile
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import BinaryIO, Callable, Iterator

from ..errors import DistBuildError

CLASSES = ("native", "family", "same-major", "ptx-only", "not-runnable")
FAILING = ("ptx-only", "not-runnable")

EM_CUDA = 190
FATBIN_MAGIC = 0xBA55ED50
_ELF_HEADER = struct.Struct("<16sHHIQQQIHHHHHH")
_SECTION = struct.Struct("<IIQQQQIIQQ")
_NAME = re.compile(r"\.(so(\.\d+)*|cubin|fatbin)$")
_ARCH = re.compile(r"^(?:sm_|compute_)?(\d{2,3})([af]?)$")
_LISTED = re.compile(r"\.sm_(\d+)([af]?)\.(cubin|ptx)$")
_PTXAS_ARCH = re.compile(rb"(?:-arch|--gpu-name)[ =]sm_(\d+)([af]?)\b")
_RELEASE = re.compile(rb"release (\d+\.\d+)")
_FATBIN_SECTIONS = (".nv_fatbin", "__nv_relfatbin")
_COMPAT_ARCH_SPECIFIC = 0x09
_WORKERS = max(1, min(4, os.cpu_count() or 1))


@dataclass(frozen=True)
class Arch:
    number: int
    suffix: str = ""

    @property
    def major(self) -> int:
        return self.number // 10

    @property
    def minor(self) -> int:
        return self.number % 10

    def __str__(self) -> str:
        return f"sm_{self.number}{self.suffix}"

    def label(self, kind: str) -> str:
        """``sm_100f`` for SASS, ``compute_100f`` for PTX."""
        return f"{'compute' if kind == 'ptx' else 'sm'}_{self.number}{self.suffix}"


def parse_arch(text: str) -> Arch:
    """``sm_103``, ``sm_100a``, ``compute_100f``, ``103`` or ``10.3``."""
    value = text.strip().lower()
    dotted = re.fullmatch(r"(\d+)\.(\d)([af]?)", value)
    if dotted:
        value = f"{dotted[1]}{dotted[2]}{dotted[3]}"
    match = _ARCH.match(value)
    if not match:
        raise DistBuildError(f"{text!r}: not a CUDA architecture (expected e.g. sm_103, sm_100f, compute_90)")
    return Arch(int(match[1]), match[2])


def classify(kind: str, arch: Arch, target: Arch) -> str:
    """The class of one SASS (``kind='sass'``) or PTX entry for the target GPU."""
    same_major = arch.major == target.major
    if kind == "sass":
        if arch.number == target.number:
            return "native"
        if arch.suffix == "a" or not same_major or arch.minor > target.minor:
            return "not-runnable"
        return "family" if arch.suffix == "f" else "same-major"
    if arch.suffix == "a":
        jit = arch.number == target.number
    elif arch.suffix == "f":
        jit = same_major and arch.minor <= target.minor
    else:
        jit = (arch.major, arch.minor) <= (target.major, target.minor)
    return "ptx-only" if jit else "not-runnable"


def best(classes: list[str]) -> str:
    return min(classes, key=CLASSES.index) if classes else "not-runnable"


# --- allowlist ---------------------------------------------------------------

@dataclass(frozen=True)
class AllowEntry:
    pattern: str
    reason: str
    where: str

    def covers(self, relpath: str) -> bool:
        if fnmatch.fnmatchcase(relpath, self.pattern):
            return True
        return "/" not in self.pattern and fnmatch.fnmatchcase(PurePosixPath(relpath).name, self.pattern)


def load_allowlist(path: Path) -> list[AllowEntry]:
    if not path.is_file():
        raise DistBuildError(f"{path}: allowlist not found")
    entries = []
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split(None, 1)
        if len(parts) < 2 or not parts[1].strip():
            raise DistBuildError(f"{path}:{number}: allowlist entry {parts[0]!r} has no reason; "
                                 "write `GLOB  REASON` (why this code may stay unrunnable)")
        entries.append(AllowEntry(parts[0].lstrip("/"), parts[1].strip(), f"{path}:{number}"))
    return entries


# --- ELF and cuobjdump -------------------------------------------------------

def _elf_sections(f: BinaryIO) -> dict[str, tuple[int, int]] | None:
    """Section name -> (offset, size) of a 64-bit little-endian ELF; None if not one."""
    f.seek(0)
    head = f.read(_ELF_HEADER.size)
    if len(head) < _ELF_HEADER.size or head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
        return None
    fields = _ELF_HEADER.unpack(head)
    shoff, shentsize, shnum, shstrndx = fields[6], fields[11], fields[12], fields[13]
    if not shoff:
        return {}
    f.seek(shoff)
    first = _SECTION.unpack(f.read(_SECTION.size))
    shnum = shnum or first[5]
    shstrndx = first[6] if shstrndx == 0xFFFF else shstrndx
    f.seek(shoff)
    table = f.read(shnum * shentsize)
    headers = [_SECTION.unpack_from(table, i * shentsize) for i in range(shnum)]
    f.seek(headers[shstrndx][4])
    names = f.read(headers[shstrndx][5])
    sections = {}
    for h in headers:
        name = names[h[0]:names.find(b"\0", h[0])].decode(errors="replace")
        sections[name] = (h[4], h[5] if h[1] != 8 else 0)  # SHT_NOBITS has no bytes in the file
    return sections


def has_cuda_code(path: Path) -> bool:
    """Cheap check before running cuobjdump: a fatbin, a CUDA ELF, or an ELF with a fatbin section."""
    try:
        with path.open("rb") as f:
            head = f.read(_ELF_HEADER.size)
            if len(head) >= 4 and struct.unpack_from("<I", head)[0] == FATBIN_MAGIC:
                return True
            if head[:4] != b"\x7fELF":
                return False
            if len(head) >= 20 and struct.unpack_from("<H", head, 18)[0] == EM_CUDA:
                return True
            sections = _elf_sections(f)
    except (OSError, struct.error, IndexError):
        return True  # unreadable headers: let cuobjdump decide
    if not sections:
        return True  # 32-bit, big-endian or stripped of section headers: let cuobjdump decide
    return any(name in sections for name in _FATBIN_SECTIONS)


@dataclass(frozen=True)
class Cubin:
    number: int  # from e_flags
    ptxas: Arch | None  # ptxas -arch from the tkinfo note
    arch_specific: bool  # .nv.compat attribute 0x09
    abi: int
    flags: int
    toolkit: str | None


def _compat_arch_specific(data: bytes) -> bool:
    pos = 0
    while pos + 4 <= len(data):
        fmt, attr, value = struct.unpack_from("<BBH", data, pos)
        if attr == _COMPAT_ARCH_SPECIFIC and fmt == 2:
            return (value & 0xFF) == 1
        pos += 4 + (value if fmt == 4 else 0)
    return False


def read_cubin(path: Path) -> Cubin:
    """What one cubin's ELF says about its target (layout: module docstring)."""
    with path.open("rb") as f:
        head = f.read(_ELF_HEADER.size)
        sections = _elf_sections(f)
        if sections is None or struct.unpack_from("<H", head, 18)[0] != EM_CUDA:
            raise DistBuildError(f"{path.name}: cuobjdump extracted something that is not a CUDA ELF")

        def section(name: str) -> bytes:
            offset, size = sections.get(name, (0, 0))
            f.seek(offset)
            return f.read(size) if size else b""

        tkinfo, compat = section(".note.nv.tkinfo"), section(".nv.compat")
    abi, flags = head[8], _ELF_HEADER.unpack(head)[7]
    release, ptxas = _RELEASE.search(tkinfo), _PTXAS_ARCH.search(tkinfo)
    return Cubin(
        number=(flags >> 8) & 0xFF if abi >= 8 else flags & 0xFF,
        ptxas=Arch(int(ptxas[1]), ptxas[2].decode()) if ptxas else None,
        arch_specific=_compat_arch_specific(compat) or bool(abi < 8 and flags & 0x800),
        abi=abi,
        flags=flags,
        toolkit=release[1].decode() if release else None,
    )


def _run(tool: Path, args: list[str], target: Path, cwd: Path | None = None) -> str | None:
    """cuobjdump's stdout, or None when the file holds no device code."""
    result = subprocess.run([str(tool), *args, str(target)], cwd=cwd, capture_output=True, text=True)
    if result.returncode != 0:
        if "does not contain device code" in result.stderr:
            return None
        raise DistBuildError(f"{target}: cuobjdump {' '.join(args)} failed (exit {result.returncode}): "
                             f"{result.stderr.strip()[-500:]}")
    return result.stdout


def _listed(name: str) -> Arch | None:
    match = _LISTED.search(name)
    return Arch(int(match[1]), match[2]) if match else None


@dataclass
class Entry:
    kind: str  # "sass" or "ptx"
    arch: str
    count: int
    verdict: str
    source: str  # of the suffix: tkinfo, nv.compat, cuobjdump (its listed name) or none (no marker)
    toolkit: str | None = None
    note: str | None = None


def _sass_arch(cubin: Cubin, listed: Arch | None) -> tuple[Arch, str, str | None]:
    """The cubin's arch, where its suffix came from, and a note when e_flags and cuobjdump disagree."""
    number, note = cubin.number, None
    if listed and listed.number != number:
        note = f"e_flags {cubin.flags:#x} (ABI {cubin.abi}) say sm_{number}; cuobjdump lists {listed}"
        number = listed.number
    if cubin.ptxas and cubin.ptxas.number == number:
        return Arch(number, cubin.ptxas.suffix), "tkinfo", note
    if cubin.arch_specific:
        return Arch(number, "a"), "nv.compat", note
    if listed and listed.suffix == "a":
        return Arch(number, "a"), "cuobjdump", note
    return Arch(number), "none", note


def inventory(tool: Path, path: Path, target: Arch, scratch: Path) -> list[Entry]:
    """Every SASS and PTX target in one file, counted and classified."""
    found: dict[tuple[str, str], Entry] = {}

    def add(kind: str, arch: Arch, source: str, toolkit: str | None = None, note: str | None = None) -> None:
        key = (kind, arch.label(kind))
        if key in found:
            found[key].count += 1
            return
        found[key] = Entry(kind, arch.label(kind), 1, classify(kind, arch, target), source, toolkit, note)

    path = path.resolve()
    listing = _run(tool, ["--list-ptx"], path)
    for line in (listing or "").splitlines():
        match = re.match(r"^PTX file\s+\d+:\s+(.*\S)", line)
        arch = _listed(match[1]) if match else None
        if arch:
            add("ptx", arch, "cuobjdump")
    with tempfile.TemporaryDirectory(dir=scratch) as tmp:
        if listing is not None and _run(tool, ["-xelf", "all"], path, cwd=Path(tmp)) is not None:
            for cubin_path in sorted(Path(tmp).glob("*.cubin")):
                cubin = read_cubin(cubin_path)
                arch, source, note = _sass_arch(cubin, _listed(cubin_path.name))
                add("sass", arch, source, cubin.toolkit, note)
    return sorted(found.values(), key=lambda e: (CLASSES.index(e.verdict), e.kind, e.arch))


# --- scanning ----------------------------------------------------------------

@dataclass
class ObjectReport:
    path: str
    verdict: str
    entries: list[Entry]
    allowed: str | None = None  # the allowlist line that covers it
    reason: str | None = None

    @property
    def failing(self) -> bool:
        return self.verdict in FAILING and self.allowed is None


@dataclass
class Report:
    path: str
    input: str  # folder, file, oci-layout, oci-archive, docker-archive
    target: str
    cuobjdump: str
    scanned: int
    objects: list[ObjectReport] = field(default_factory=list)
    unused_allowlist: list[str] = field(default_factory=list)

    @property
    def failing(self) -> list[ObjectReport]:
        return [o for o in self.objects if o.failing]

    @property
    def passed(self) -> bool:
        return not self.failing

    def counts(self) -> dict[str, int]:
        return {c: sum(o.verdict == c for o in self.objects) for c in CLASSES}


def candidates(root: Path) -> Iterator[Path]:
    """Shared objects, cubins and fatbins under root; symbolic links are not followed or counted."""
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files):
            path = Path(folder, name)
            if _NAME.search(name) and not path.is_symlink() and path.is_file():
                yield path


def _audit_files(files: list[tuple[Path, str]], target: Arch, tool: Path, scratch: Path) -> list[ObjectReport]:
    def one(item: tuple[Path, str]) -> ObjectReport | None:
        path, rel = item
        if not has_cuda_code(path):
            return None
        entries = inventory(tool, path, target, scratch)
        if not entries:
            return None
        return ObjectReport(rel, best([e.verdict for e in entries]), entries)

    with ThreadPoolExecutor(_WORKERS) as pool:
        return [r for r in pool.map(one, files) if r is not None]


def _apply_allowlist(report: Report, allow: list[AllowEntry]) -> None:
    used = set()
    for obj in report.objects:
        if obj.verdict not in FAILING:
            continue
        for entry in allow:
            if entry.covers(obj.path):
                obj.allowed, obj.reason = entry.where, entry.reason
                used.add(entry.where)
                break
    report.unused_allowlist = [f"{e.where}: {e.pattern}" for e in allow if e.where not in used]


def audit(path: Path, target: str, tool: Path, allow: list[AllowEntry] | None = None) -> Report:
    """Audit a folder, one CUDA file, an OCI layout folder or an image archive."""
    goal = parse_arch(target)
    goal = Arch(goal.number)  # a GPU is sm_103; the suffix only names code
    if not path.exists():
        raise DistBuildError(f"{path}: no such file or folder")
    with tempfile.TemporaryDirectory(prefix="dist-audit-") as tmp:
        scratch = Path(tmp)
        kind, root = _input_root(path, scratch)
        if root.is_file():
            files = [(root, root.name)]
        else:
            files = [(p, p.relative_to(root).as_posix()) for p in candidates(root)]
        report = Report(str(path), kind, str(goal), cuobjdump_version(tool), len(files))
        report.objects = sorted(_audit_files(files, goal, tool, scratch), key=lambda o: o.path)
    _apply_allowlist(report, allow or [])
    return report


def _input_root(path: Path, scratch: Path) -> tuple[str, Path]:
    """What PATH is, and the folder or file to scan (an image is unpacked into scratch)."""
    rootfs = scratch / "rootfs"
    if path.is_dir():
        if (path / "oci-layout").is_file() and (path / "index.json").is_file():
            return unpack_image(_dir_opener(path), rootfs, str(path)) + "-layout", rootfs
        return "folder", path
    with path.open("rb") as f:
        magic = f.read(4)
    if magic == b"\x7fELF" or magic == struct.pack("<I", FATBIN_MAGIC) or not tarfile.is_tarfile(path):
        return "file", path
    with tarfile.open(path) as archive:
        return unpack_image(_tar_opener(archive), rootfs, str(path)) + "-archive", rootfs


# --- images ------------------------------------------------------------------

Opener = Callable[[str], BinaryIO | None]


def _dir_opener(root: Path) -> Opener:
    def open_(name: str) -> BinaryIO | None:
        path = root / name
        return path.open("rb") if path.is_file() else None
    return open_


def _tar_opener(archive: tarfile.TarFile) -> Opener:
    members = {m.name.removeprefix("./"): m for m in archive.getmembers() if m.isfile()}

    def open_(name: str) -> BinaryIO | None:
        member = members.get(name)
        return archive.extractfile(member) if member else None
    return open_


def _json(opener: Opener, name: str, where: str, required: bool = True) -> object:
    f = opener(name)
    if f is None:
        if required:
            raise DistBuildError(f"{where}: {name} is missing")
        return None
    with f:
        try:
            return json.load(f)
        except ValueError as exc:
            raise DistBuildError(f"{where}: {name} is not JSON: {exc}") from None


def _blob_name(digest: str) -> str:
    algorithm, _, value = digest.partition(":")
    if not value or "/" in digest:
        raise DistBuildError(f"{digest!r}: not an OCI digest")
    return f"blobs/{algorithm}/{value}"


def _pick_manifest(opener: Opener, index: dict, where: str) -> dict:
    manifests = index.get("manifests") or []
    if not manifests:
        raise DistBuildError(f"{where}: the image index lists no manifest")
    amd64 = [m for m in manifests if m.get("platform", {}).get("architecture") in (None, "amd64")]
    chosen = (amd64 or manifests)[0]
    data = _json(opener, _blob_name(chosen["digest"]), where)
    if "manifests" in data:  # a nested image index
        return _pick_manifest(opener, data, where)
    return data


def unpack_image(opener: Opener, dest: Path, where: str) -> str:
    """Apply an image's layers in order into dest; returns its format, ``oci`` or ``docker``."""
    index = _json(opener, "index.json", where, required=False)
    if index is not None:
        manifest = _pick_manifest(opener, index, where)
        layers, kind = [_blob_name(layer["digest"]) for layer in manifest.get("layers", [])], "oci"
    else:
        docker = _json(opener, "manifest.json", where, required=False)
        if not isinstance(docker, list):
            raise DistBuildError(f"{where}: neither an OCI image (index.json) nor a docker archive (manifest.json)")
        layers, kind = (docker[0].get("Layers", []) if docker else []), "docker"
    dest.mkdir(parents=True, exist_ok=True)
    for name in layers:
        blob = opener(name)
        if blob is None:
            raise DistBuildError(f"{where}: layer {name} is missing")
        with blob:
            apply_layer(blob, dest, f"{where}: layer {name}")
    return kind


def _inside(dest: Path, name: str) -> Path | None:
    parts = PurePosixPath(name.lstrip("/")).parts
    parts = tuple(p for p in parts if p != ".")
    if not parts or ".." in parts:
        return None
    return dest.joinpath(*parts)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def apply_layer(blob: BinaryIO, dest: Path, where: str) -> None:
    """Whiteouts first (they hide lower layers only), then the files the audit reads."""
    try:
        archive = tarfile.open(fileobj=blob, mode="r:*")
    except tarfile.ReadError as exc:
        raise DistBuildError(f"{where}: not a tar layer ({exc}; zstd layers are not supported)") from None
    with archive:
        members = archive.getmembers()
        for member in members:
            path = _inside(dest, member.name)
            if path is None:
                continue
            if path.name == ".wh..wh..opq":
                if path.parent.is_dir():
                    for child in path.parent.iterdir():
                        _remove(child)
            elif path.name.startswith(".wh."):
                _remove(path.with_name(path.name[4:]))
        for member in members:
            path = _inside(dest, member.name)
            if path is None or path.name.startswith(".wh.") or not _NAME.search(path.name):
                continue
            if member.isfile() or member.islnk():
                _remove(path)
                archive.extract(member, dest, set_attrs=False, filter="tar")
            elif path.exists() or path.is_symlink():
                _remove(path)  # replaced by a link or something else: not a file of this image


# --- tool and output ---------------------------------------------------------

def find_cuobjdump(explicit: str | None, cuda_home: Callable[[], Path]) -> Path:
    """``--cuobjdump``, else ``$DIST_CUDA_HOME/bin``, else the pinned toolchain's ``bin``."""
    if explicit:
        tool = Path(explicit)
    elif os.environ.get("DIST_CUDA_HOME"):
        tool = Path(os.environ["DIST_CUDA_HOME"]) / "bin" / "cuobjdump"
    else:
        tool = cuda_home() / "bin" / "cuobjdump"
    if not (tool.is_file() and os.access(tool, os.X_OK)):
        raise DistBuildError(f"{tool}: no cuobjdump there; pin nvidia-cuda-cuobjdump (role toolchain) and "
                             "run `python -m distbuild toolchain`, or pass --cuobjdump")
    return tool


def cuobjdump_version(tool: Path) -> str:
    result = subprocess.run([str(tool), "--version"], capture_output=True, text=True)
    match = re.search(r"V(\d+\.\d+\.\d+)", result.stdout)
    if result.returncode != 0 or not match:
        raise DistBuildError(f"{tool}: not a working cuobjdump: {(result.stdout + result.stderr).strip()[-300:]}")
    return match[1]


def _archs(obj: ObjectReport, kind: str) -> str:
    items = [f"{e.arch}({e.count})" if e.count > 1 else e.arch for e in obj.entries if e.kind == kind]
    return " ".join(items) or "-"


def format_report(report: Report) -> str:
    rows = [("VERDICT", "SASS", "PTX", "OBJECT")]
    for obj in report.objects:
        name = obj.path + (f"  [allowed, {obj.allowed}: {obj.reason}]" if obj.allowed else "")
        rows.append((obj.verdict, _archs(obj, "sass"), _archs(obj, "ptx"), name))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"arch audit of {report.path} ({report.input}) for {report.target}, cuobjdump {report.cuobjdump}"]
    if report.objects:
        lines += ["  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3] for r in rows]
    counts = ", ".join(f"{c} {n}" for c, n in report.counts().items())
    allowed = sum(o.allowed is not None for o in report.objects)
    lines.append(f"summary: {len(report.objects)} object(s) with CUDA code among {report.scanned} file(s) "
                 f"scanned: {counts}; {allowed} allowed, {len(report.failing)} failing")
    for unused in report.unused_allowlist:
        lines.append(f"note: allowlist entry covers nothing that needs it: {unused}")
    if report.failing:
        lines.append(f"FAIL: {len(report.failing)} object(s) are ptx-only or not runnable on {report.target} "
                     "and no allowlist entry covers them:")
        lines += [f"  {o.verdict:12}  {o.path}" for o in report.failing]
    else:
        lines.append(f"PASS: every object with CUDA code has code that runs on {report.target} (or is allowed)")
    return "\n".join(lines)


def to_json(report: Report) -> dict:
    data = asdict(report)
    data.update(passed=report.passed, summary=report.counts(), failing=[o.path for o in report.failing])
    return data


def write_json(report: Report, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_json(report), indent=2, sort_keys=True) + "\n")
