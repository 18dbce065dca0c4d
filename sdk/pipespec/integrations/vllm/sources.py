"""vLLM's released sources, read without importing them: a tree given by path, or a release fetched once.

``source_tree("0.34.0")`` runs ``pip download --no-deps vllm==0.34.0`` once per machine, unpacks only
``vllm/**/*.py`` into the cache (``PIPESPEC_VLLM_SOURCES``, default ``~/.cache/pipespec/vllm-sources``)
and returns the ``vllm`` package directory; ``source_tree(PATH)`` accepts a directory that is a ``vllm``
package (it has ``model_executor/models``) or holds one. Nothing here imports vLLM, so the core venv
reads every release's source; what pipespec does with a tree is the codemod's and the contract probe's.
The fetch itself (atomic, one ``UsageError`` line for bad input) is ``pipespec.integrations.release_sources``,
shared with SGLang's.
"""

from __future__ import annotations

import sys
from pathlib import Path

from pipespec.integrations.release_sources import ReleaseSources, is_version

__all__ = ["MODELS", "SOURCES", "SOURCES_ENV", "cached_release", "fetch_release", "is_version", "main",
           "package_dir", "source_tree", "sources_cache"]

SOURCES_ENV = "PIPESPEC_VLLM_SOURCES"
MODELS = Path("model_executor") / "models"
SOURCES = ReleaseSources(engine="vLLM", dist="vllm", package="vllm", models=MODELS, env=SOURCES_ENV, example="0.34.0")


def sources_cache() -> Path:
    """Where fetched releases live (``PIPESPEC_VLLM_SOURCES``, default ``~/.cache/pipespec/vllm-sources``)."""
    return SOURCES.cache()


def package_dir(tree: Path) -> Path | None:
    """The ``vllm`` package directory of ``tree`` (the package itself, or a directory holding it), or None."""
    return SOURCES.package_dir(tree)


def source_tree(tree_or_version: str) -> Path:
    """The ``vllm`` package directory for a tree path or a release number (fetched once into the cache)."""
    return SOURCES.source_tree(tree_or_version)


def cached_release(version: str) -> Path | None:
    """The cached release's ``vllm`` directory, or None when it has not been fetched on this machine."""
    return SOURCES.cached_release(version)


def fetch_release(version: str) -> Path:
    """``vllm==version``'s Python sources, from the cache or fetched now (wheel downloaded, ``*.py`` unpacked)."""
    return SOURCES.fetch_release(version)


def main(argv: list[str] | None = None) -> int:
    """``python -m pipespec.integrations.vllm.sources 0.32.0 0.34.0 ...``: fetch each release once (``make sources``)."""
    return SOURCES.main(argv, "pipespec.integrations.vllm.sources")


if __name__ == "__main__":
    sys.exit(main())
