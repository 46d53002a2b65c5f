"""Read the package index the way pip does, and list a project's files.

The index URLs come from pip's own configuration (files and ``PIP_*``
environment variables) through pip's configuration loader, falling back to
pip's built-in default index; this repository names no host. Both the JSON
(PEP 691) and HTML (PEP 503) simple APIs are read, as are ``find-links``
folders.
"""
from __future__ import annotations

import html.parser
import json
import os
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from .errors import DistBuildError
from .pins import normalize_name

JSON_ACCEPT = "application/vnd.pypi.simple.v1+json, text/html;q=0.1"


@dataclass(frozen=True)
class IndexFile:
    filename: str
    url: str
    sha256: str | None
    size: int | None = None


@dataclass
class IndexConfig:
    index_urls: list[str]
    find_links: list[str] = field(default_factory=list)
    timeout_s: float = 60.0

    @classmethod
    def from_pip(cls) -> "IndexConfig":
        """index-url, extra-index-url and find-links, resolved with pip's precedence."""
        values = _pip_config_values()

        def get(key: str) -> list[str]:
            env = os.environ.get("PIP_" + key.upper().replace("-", "_"))
            if env is not None:
                return env.split()
            for section in ("download", "install", "global"):
                if f"{section}.{key}" in values:
                    return values[f"{section}.{key}"].split()
            return []

        primary = get("index-url") or [_pip_default_index()]
        timeout = float((get("timeout") or get("default-timeout") or ["60"])[0])
        return cls(index_urls=primary + get("extra-index-url"), find_links=get("find-links"), timeout_s=timeout)


def _pip_config_values() -> dict[str, str]:
    try:
        from pip._internal.configuration import Configuration
    except ImportError as exc:  # pragma: no cover - pip ships with every CPython we support
        raise DistBuildError(f"cannot read pip's configuration: {exc}") from None
    config = Configuration(isolated=False)
    config.load()
    return {key: str(value) for key, value in config.items() if not key.startswith(":env:")}


def _pip_default_index() -> str:
    from pip._internal.models.index import PyPI

    return PyPI.simple_url


class _LinkParser(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            href = dict(attrs).get("href")
            if href:
                self.links.append(href)


def _file_from_href(base: str, href: str, size: int | None = None) -> IndexFile:
    url = urllib.parse.urljoin(base, href)
    parsed = urllib.parse.urlsplit(url)
    fragment = urllib.parse.parse_qs(parsed.fragment) if parsed.fragment else {}
    sha = fragment.get("sha256", [None])[0]
    clean = urllib.parse.urlunsplit(parsed._replace(fragment=""))
    filename = urllib.parse.unquote(parsed.path.rsplit("/", 1)[-1])
    return IndexFile(filename=filename, url=clean, sha256=sha, size=size)


class IndexClient:
    def __init__(self, config: IndexConfig) -> None:
        self.config = config

    def project_files(self, project: str) -> list[IndexFile]:
        """Every file of ``project`` on every configured index and find-links folder."""
        name = normalize_name(project)
        found: dict[str, IndexFile] = {}
        errors: list[str] = []
        for base in self.config.index_urls:
            try:
                for f in self._simple_page(base.rstrip("/") + f"/{name}/"):
                    found.setdefault(f.filename, f)
            except DistBuildError as exc:
                errors.append(str(exc))
        for link in self.config.find_links:
            for f in self._find_links(link):
                if normalize_name(f.filename.split("-", 1)[0]) == name:
                    found.setdefault(f.filename, f)
        if not found and errors:
            raise DistBuildError(
                f"cannot list {project!r} on the package index: " + "; ".join(errors)
            )
        return list(found.values())

    def find(self, project: str, filename: str) -> IndexFile:
        for f in self.project_files(project):
            if f.filename == filename:
                return f
        raise DistBuildError(f"{filename}: not found on the configured package index for {project!r}")

    def _simple_page(self, url: str) -> list[IndexFile]:
        if url.startswith("file:"):
            path = Path(urllib.request.url2pathname(urllib.parse.urlsplit(url).path))
            page = path / "index.html"
            if not page.is_file():
                return []
            return self._parse_html(page.as_uri(), page.read_text())
        request = urllib.request.Request(url, headers={"Accept": JSON_ACCEPT})
        try:
            with urllib.request.urlopen(request, timeout=self.config.timeout_s) as response:
                body = response.read()
                ctype = response.headers.get("Content-Type", "")
                final_url = response.geturl()
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return []
            raise DistBuildError(f"package index answered {exc.code} for {url}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise DistBuildError(f"cannot reach the package index at {url}: {exc}") from None
        if "json" in ctype:
            data = json.loads(body)
            return [
                IndexFile(
                    filename=f["filename"],
                    url=urllib.parse.urljoin(final_url, f["url"]),
                    sha256=f.get("hashes", {}).get("sha256"),
                    size=f.get("size"),
                )
                for f in data.get("files", [])
            ]
        return self._parse_html(final_url, body.decode("utf-8", "replace"))

    @staticmethod
    def _parse_html(base: str, text: str) -> list[IndexFile]:
        parser = _LinkParser()
        parser.feed(text)
        return [_file_from_href(base, href) for href in parser.links]

    @staticmethod
    def _find_links(link: str) -> list[IndexFile]:
        path = (Path(urllib.request.url2pathname(urllib.parse.urlsplit(link).path)) if link.startswith("file:")
                else Path(link))
        if not path.is_dir():
            return []
        return [IndexFile(filename=p.name, url=p.as_uri(), sha256=None, size=p.stat().st_size)
                for p in sorted(path.iterdir()) if p.is_file()]
