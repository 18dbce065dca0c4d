"""Generated reports that share one markdown file, each in its own marker-delimited section.

docs/coverage-vllm.md holds the numeric vLLM zoo (``pipespec zoo --engine vllm``) and one table per vLLM
release from the source zoo (``--source V``). Each writer replaces only its own section::

    <!-- pipespec-section vllm-source 0.34.0 -->
    ...
    <!-- /pipespec-section vllm-source 0.34.0 -->

A section not yet in the file is appended at its end; text outside the sections is kept byte for byte.
The file is written atomically (``pipespec.atomic_write.write_atomic``); broken markers (a section opened
twice or never closed) are one ``UsageError`` before anything is written.
"""

from __future__ import annotations

from pathlib import Path

from pipespec.errors import UsageError


def markers(key: str) -> tuple[str, str]:
    """The opening and closing marker lines of section ``key``."""
    return f"<!-- pipespec-section {key} -->", f"<!-- /pipespec-section {key} -->"


def replace_section(text: str, key: str, body: str, origin: str) -> str:
    """``text`` with section ``key`` holding ``body`` (replaced in place, or appended at the end).

    >>> replace_section("intro\\n", "a", "x", "f.md").splitlines()
    ['intro', '', '<!-- pipespec-section a -->', 'x', '<!-- /pipespec-section a -->']
    """
    begin, end = markers(key)
    block = f"{begin}\n{body.rstrip()}\n{end}\n"
    starts, ends = _lines_equal(text, begin), _lines_equal(text, end)
    if not starts and not ends:
        return block if not text.strip() else text.rstrip("\n") + "\n\n" + block
    if len(starts) != 1 or len(ends) != 1 or ends[0] < starts[0]:
        raise UsageError(f"{origin}: the markers of section {key!r} are broken ({len(starts)} `{begin}`, {len(ends)} "
                         f"`{end}`, in that order or not): fix them or delete the section, then rerun")
    after = ends[0] + len(end)
    if text[after:after + 1] == "\n":
        after += 1
    return text[:starts[0]] + block + text[after:]


def _lines_equal(text: str, line: str) -> list[int]:
    """Offsets where ``line`` stands as a whole line of ``text``."""
    found, at = [], 0
    for piece in text.splitlines(keepends=True):
        if piece.rstrip("\r\n") == line:
            found.append(at)
        at += len(piece)
    return found


def read_report(path: str | Path) -> str:
    """The current text of a report file ("" when it does not exist yet); one line for an unreadable one."""
    path = Path(path)
    if not path.parent.is_dir() and str(path.parent):
        raise UsageError(f"--write-coverage {path}: directory {path.parent} does not exist; create it or choose another path")
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return ""
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--write-coverage {path}: cannot read it ({exc}); fix it or choose another path") from None


def check_section(path: str | Path, key: str) -> None:
    """Fail now, before a long run, where writing section ``key`` of ``path`` later would fail."""
    replace_section(read_report(path), key, "", str(path))


def write_section(path: str | Path, key: str, body: str) -> None:
    """Replace (or append) section ``key`` of ``path`` with ``body``, atomically."""
    from pipespec.atomic_write import write_atomic

    write_atomic(path, replace_section(read_report(path), key, body, str(path)))
