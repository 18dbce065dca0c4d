"""SGLang's released sources, read without importing them: a tree given by path, or a release fetched once.

``source_tree("0.5.23")`` runs ``pip download --no-deps sglang==0.5.23`` once per machine, unpacks only
``sglang/**/*.py`` into the cache (``PIPESPEC_SGLANG_SOURCES``, default ``~/.cache/pipespec/sglang-sources``)
and returns the ``sglang`` package directory; ``source_tree(PATH)`` accepts a directory that is an
``sglang`` package (it has ``srt/models``) or holds one. The fetch (atomic, one ``UsageError`` line for bad
input) is ``pipespec.integrations.release_sources``, shared with vLLM's. Nothing here imports SGLang.
"""

from __future__ import annotations

import sys
from pathlib import Path

from pipespec.integrations.release_sources import ReleaseSources

SOURCES_ENV = "PIPESPEC_SGLANG_SOURCES"
MODELS = Path("srt") / "models"
SOURCES = ReleaseSources(engine="SGLang", dist="sglang", package="sglang", models=MODELS, env=SOURCES_ENV,
                         example="0.5.23")


def source_tree(tree_or_version: str) -> Path:
    """The ``sglang`` package directory for a tree path or a release number (fetched once into the cache)."""
    return SOURCES.source_tree(tree_or_version)


def main(argv: list[str] | None = None) -> int:
    """``python -m pipespec.integrations.sglang.sources 0.5.23``: fetch each release once (``make sources``)."""
    return SOURCES.main(argv, "pipespec.integrations.sglang.sources")


if __name__ == "__main__":
    sys.exit(main())
