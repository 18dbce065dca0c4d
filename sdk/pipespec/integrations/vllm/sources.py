"""vLLM's released sources, read without importing them: a tree given by path, or a release fetched once.

``source_tree("0.34.0")`` runs ``pip download --no-deps vllm==0.34.0`` once per machine, unpacks only
``vllm/**/*.py`` into the cache (``PIPESPEC_VLLM_SOURCES``, default ``~/.cache/pipespec/vllm-sources``)
and returns the ``vllm`` package directory; ``source_tree(PATH)`` accepts a directory that is a ``vllm``
package (it has ``model_executor/models``) or holds one. Nothing here imports vLLM, so the core venv
reads every release's source; what pipespec does with a tree is the codemod's and the contract probe's.

A fetch unpacks into a temporary directory beside its final place and renames it in one step, so an
interrupted fetch leaves nothing a later call would take for a release. Bad input is one ``UsageError``
line: an unknown version, a tree without ``vllm/model_executor/models``, no network.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from pipespec.errors import UsageError

SOURCES_ENV = "PIPESPEC_VLLM_SOURCES"
VERSION = re.compile(r"^\d+\.\d+(\.\d+)?([.+-]?[A-Za-z0-9.]+)?$")
FETCH_TIMEOUT_S = 600.0
MODELS = Path("model_executor") / "models"
#: What pip prints when the index cannot be reached (its retry warnings).
NETWORK_SIGNS = ("Failed to establish a new connection", "NewConnectionError", "Temporary failure in name resolution",
                 "Network is unreachable", "Max retries exceeded", "Read timed out", "ConnectTimeoutError")


def sources_cache() -> Path:
    """Where fetched releases live (``PIPESPEC_VLLM_SOURCES``, default ``~/.cache/pipespec/vllm-sources``)."""
    configured = os.environ.get(SOURCES_ENV, "").strip()
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "pipespec" / "vllm-sources"


def is_version(text: str) -> bool:
    """Whether ``text`` reads as a release number (``0.34.0``) rather than a path."""
    return bool(VERSION.match(text)) and os.sep not in text


def package_dir(tree: Path) -> Path | None:
    """The ``vllm`` package directory of ``tree`` (the package itself, or a directory holding it), or None."""
    for candidate in (tree, tree / "vllm"):
        if (candidate / MODELS).is_dir():
            return candidate
    return None


def source_tree(tree_or_version: str) -> Path:
    """The ``vllm`` package directory for a tree path or a release number (fetched once into the cache)."""
    text = tree_or_version.strip()
    if not text:
        raise UsageError("--source is empty: give a vLLM release such as 0.34.0, or a directory holding vllm/model_executor/models")
    path = Path(text).expanduser()
    if path.exists() or not is_version(text):
        if not path.is_dir():
            raise UsageError(f"--source {text}: no such directory, and not a vLLM release number (such as 0.34.0)")
        found = package_dir(path)
        if found is None:
            raise UsageError(f"--source {text}: no vllm/model_executor/models under it: give the vllm package "
                             "directory (or the directory holding it), or a release number such as 0.34.0")
        return found.resolve()
    return fetch_release(text)


def cached_release(version: str) -> Path | None:
    """The cached release's ``vllm`` directory, or None when it has not been fetched on this machine."""
    found = sources_cache() / version / "vllm"
    return found if (found / MODELS).is_dir() else None


def fetch_release(version: str) -> Path:
    """``vllm==version``'s Python sources, from the cache or fetched now (wheel downloaded, ``*.py`` unpacked)."""
    cached = cached_release(version)
    if cached is not None:
        return cached
    cache = sources_cache()
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"{SOURCES_ENV}={cache}: cannot create the sources cache ({exc.strerror}): point it at a writable directory") from None
    with tempfile.TemporaryDirectory(prefix=f".{version}-", dir=cache) as tmp:
        wheel = _download(version, Path(tmp) / "download")
        unpacked = Path(tmp) / "release"
        _unpack_python(wheel, unpacked)
        if not (unpacked / "vllm" / MODELS).is_dir():
            raise UsageError(f"vllm=={version}: the downloaded distribution has no vllm/model_executor/models")
        target = cache / version
        try:
            os.replace(unpacked, target)
        except OSError:  # another process fetched it meanwhile
            if cached_release(version) is None:
                raise
    found = cached_release(version)
    assert found is not None
    return found


def _download(version: str, into: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--disable-pip-version-check", "-d", str(into), f"vllm=={version}"]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=FETCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise UsageError(f"vllm=={version}: `pip download` did not finish in {FETCH_TIMEOUT_S:.0f} s (no network?): "
                         f"fetch it where there is one, unpack it and pass --source DIR") from None
    if proc.returncode != 0:
        text = proc.stderr + proc.stdout
        if any(s in text for s in NETWORK_SIGNS):
            why = "the package index cannot be reached (no network?)"
        elif "(from versions: none)" in text:  # an unreachable index lists nothing either (retries exhausted)
            why = "the package index lists no vllm release at all (no network, or an index without vLLM?)"
        elif "No matching distribution" in text or "Could not find a version" in text:
            why = "no such release on the package index"
        else:
            lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("WARNING")]
            why = lines[-1][:200] if lines else f"pip exited {proc.returncode}"
        raise UsageError(f"vllm=={version}: cannot fetch its sources: {why}; give a release from `pip index versions vllm`, "
                         "or --source DIR with an unpacked vllm tree")
    wheels = sorted(into.glob("*.whl"))
    if not wheels:
        raise UsageError(f"vllm=={version}: `pip download` returned no wheel")
    return wheels[0]


def _unpack_python(wheel: Path, into: Path) -> None:
    """Only ``vllm/**/*.py`` (the sources; no compiled kernels, no data)."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            for name in archive.namelist():
                if not (name.startswith("vllm/") and name.endswith(".py")) or ".." in Path(name).parts:
                    continue
                out = into / name
                out.parent.mkdir(parents=True, exist_ok=True)
                with archive.open(name) as src, open(out, "wb") as dst:
                    shutil.copyfileobj(src, dst)
    except zipfile.BadZipFile as exc:
        raise UsageError(f"{wheel.name}: not a readable wheel ({exc})") from None


def main(argv: list[str] | None = None) -> int:
    """``python -m pipespec.integrations.vllm.sources 0.32.0 0.34.0 ...``: fetch each release once (``make sources``);
    prints each release's cached directory. Bad input or no network: one line, exit 2."""
    versions = sys.argv[1:] if argv is None else argv
    if not versions:
        print("usage: python -m pipespec.integrations.vllm.sources VERSION... (such as 0.34.0)", file=sys.stderr)
        return 2
    for version in versions:
        try:
            print(f"vllm {version}: {source_tree(version)}")
        except UsageError as exc:
            print(f"pipespec: error: {exc}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
