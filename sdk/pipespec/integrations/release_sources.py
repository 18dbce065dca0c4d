"""An engine's released sources, read without importing them: a tree given by path, or a release fetched once.

``ReleaseSources`` describes one engine's wheel (``vllm``, ``sglang``): its distribution name, the package
directory inside it, the path that marks a real tree (``model_executor/models``, ``srt/models``) and the
cache. ``source_tree("0.34.0")`` runs ``pip download --no-deps <dist>==0.34.0`` once per machine, unpacks
only ``<package>/**/*.py`` into the cache (the engine's ``PIPESPEC_<ENGINE>_SOURCES``, default
``~/.cache/pipespec/<engine>-sources``) and returns the package directory; ``source_tree(PATH)`` accepts a
directory that is the package or holds it. Nothing here imports an engine.

A fetch unpacks into a temporary directory beside its final place and renames it in one step, so an
interrupted fetch leaves nothing a later call would take for a release. Bad input is one ``UsageError``
line: an unknown version, a tree without the marker path, no network.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from pipespec.errors import UsageError

VERSION = re.compile(r"^\d+\.\d+(\.\d+)?([.+-]?[A-Za-z0-9.]+)?$")
FETCH_TIMEOUT_S = 600.0
#: What pip prints when the index cannot be reached (its retry warnings).
NETWORK_SIGNS = ("Failed to establish a new connection", "NewConnectionError", "Temporary failure in name resolution",
                 "Network is unreachable", "Max retries exceeded", "Read timed out", "ConnectTimeoutError")


def is_version(text: str) -> bool:
    """Whether ``text`` reads as a release number (``0.34.0``) rather than a path."""
    return bool(VERSION.match(text)) and os.sep not in text


@dataclass(frozen=True)
class ReleaseSources:
    """One engine's released Python sources: where they are cached and what marks a real tree."""

    engine: str  # the name users read ("vLLM", "SGLang")
    dist: str  # the distribution on the package index
    package: str  # the import package inside the wheel
    models: Path  # the models directory, relative to the package: it marks a real tree
    env: str  # the cache's environment variable
    example: str  # a release number for messages

    def cache(self) -> Path:
        """Where fetched releases live (``env``, default ``~/.cache/pipespec/<package>-sources``)."""
        configured = os.environ.get(self.env, "").strip()
        return (Path(configured).expanduser() if configured
                else Path.home() / ".cache" / "pipespec" / f"{self.package}-sources")

    def package_dir(self, tree: Path) -> Path | None:
        """The package directory of ``tree`` (the package itself, or a directory holding it), or None."""
        for candidate in (tree, tree / self.package):
            if (candidate / self.models).is_dir():
                return candidate
        return None

    def source_tree(self, tree_or_version: str) -> Path:
        """The package directory for a tree path or a release number (fetched once into the cache)."""
        text = tree_or_version.strip()
        marker = f"{self.package}/{self.models.as_posix()}"
        if not text:
            raise UsageError(f"--source is empty: give a {self.engine} release such as {self.example}, "
                             f"or a directory holding {marker}")
        path = Path(text).expanduser()
        if path.exists() or not is_version(text):
            if not path.is_dir():
                raise UsageError(f"--source {text}: no such directory, and not a {self.engine} release number "
                                 f"(such as {self.example})")
            found = self.package_dir(path)
            if found is None:
                raise UsageError(f"--source {text}: no {marker} under it: give the {self.package} package "
                                 f"directory (or the directory holding it), or a release number such as {self.example}")
            return found.resolve()
        return self.fetch_release(text)

    def cached_release(self, version: str) -> Path | None:
        """The cached release's package directory, or None when it has not been fetched on this machine."""
        found = self.cache() / version / self.package
        return found if (found / self.models).is_dir() else None

    def fetch_release(self, version: str) -> Path:
        """``<dist>==version``'s Python sources, from the cache or fetched now (wheel downloaded, ``*.py`` unpacked)."""
        cached = self.cached_release(version)
        if cached is not None:
            return cached
        cache = self.cache()
        try:
            cache.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"{self.env}={cache}: cannot create the sources cache ({exc.strerror}): "
                             "point it at a writable directory") from None
        with tempfile.TemporaryDirectory(prefix=f".{version}-", dir=cache) as tmp:
            wheel = self._download(version, Path(tmp) / "download")
            unpacked = Path(tmp) / "release"
            self._unpack_python(wheel, unpacked)
            if not (unpacked / self.package / self.models).is_dir():
                raise UsageError(f"{self.dist}=={version}: the downloaded distribution has no "
                                 f"{self.package}/{self.models.as_posix()}")
            try:
                os.replace(unpacked, cache / version)
            except OSError:  # another process fetched it meanwhile
                if self.cached_release(version) is None:
                    raise
        found = self.cached_release(version)
        assert found is not None
        return found

    def _download(self, version: str, into: Path) -> Path:
        spec = f"{self.dist}=={version}"
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                   "--disable-pip-version-check", "-d", str(into), spec]
        try:
            proc = subprocess.run(command, capture_output=True, text=True, timeout=FETCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise UsageError(f"{spec}: `pip download` did not finish in {FETCH_TIMEOUT_S:.0f} s (no network?): "
                             "fetch it where there is one, unpack it and pass --source DIR") from None
        if proc.returncode != 0:
            text = proc.stderr + proc.stdout
            if any(s in text for s in NETWORK_SIGNS):
                why = "the package index cannot be reached (no network?)"
            elif "(from versions: none)" in text:  # an unreachable index lists nothing either (retries exhausted)
                why = f"the package index lists no {self.dist} release at all (no network, or an index without it?)"
            elif "No matching distribution" in text or "Could not find a version" in text:
                why = "no such release on the package index"
            else:
                lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("WARNING")]
                why = lines[-1][:200] if lines else f"pip exited {proc.returncode}"
            raise UsageError(f"{spec}: cannot fetch its sources: {why}; give a release from "
                             f"`pip index versions {self.dist}`, or --source DIR with an unpacked {self.package} tree")
        wheels = sorted(into.glob("*.whl"))
        if not wheels:
            raise UsageError(f"{spec}: `pip download` returned no wheel")
        return wheels[0]

    def _unpack_python(self, wheel: Path, into: Path) -> None:
        """Only ``<package>/**/*.py`` (the sources; no compiled kernels, no data)."""
        try:
            with zipfile.ZipFile(wheel) as archive:
                for name in archive.namelist():
                    if not (name.startswith(f"{self.package}/") and name.endswith(".py")) or ".." in Path(name).parts:
                        continue
                    out = into / name
                    out.parent.mkdir(parents=True, exist_ok=True)
                    with archive.open(name) as src, open(out, "wb") as dst:
                        shutil.copyfileobj(src, dst)
        except zipfile.BadZipFile as exc:
            raise UsageError(f"{wheel.name}: not a readable wheel ({exc})") from None

    def main(self, argv: list[str] | None, module: str) -> int:
        """``python -m <module> V...``: fetch each release once (``make sources``); prints each release's
        cached directory. Bad input or no network: one line, exit 2."""
        versions = sys.argv[1:] if argv is None else argv
        if not versions:
            print(f"usage: python -m {module} VERSION... (such as {self.example})", file=sys.stderr)
            return 2
        for version in versions:
            try:
                print(f"{self.package} {version}: {self.source_tree(version)}")
            except UsageError as exc:
                print(f"pipespec: error: {exc}", file=sys.stderr)
                return 2
        return 0
