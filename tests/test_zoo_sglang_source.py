"""The SGLang source zoo (`pipespec zoo --engine sglang --source`) over sglang 0.5.23's released sources.

The release is fetched once (``pipespec.integrations.sglang.sources``, pip download of the wheel, only
``sglang/**/*.py``) and never imported. The counts are the run's own: what is asserted is that nothing
crashed and that every model file with a loop over its stage's layers, found here with ``ast`` independently
of the zoo, has its rows; the goldens' families come out adapted with their capture form.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from pipespec.codegen.sglang_source_zoo import SourceZoo, run_sglang_source_zoo
from pipespec.codegen.source_zoo import Status
from pipespec.integrations.sglang.sources import source_tree

RELEASE = "0.5.23"


@pytest.fixture(scope="module")
def zoo() -> SourceZoo:
    return run_sglang_source_zoo(RELEASE, jobs=2)


def _pp_loop_files(tree: Path) -> dict[str, bool]:
    """``{file: captures aux states}`` for every model file with a ``for`` over a ``range`` bounded by
    ``*start_layer`` / ``*end_layer`` (any method), read with ``ast``."""
    found = {}
    for path in sorted((tree / "srt" / "models").rglob("*.py")):
        module = ast.parse(path.read_text(encoding="utf-8"))
        loops = [n for n in ast.walk(module) if isinstance(n, ast.For | ast.comprehension) and isinstance(n.iter, ast.Call)
                 and isinstance(n.iter.func, ast.Name) and n.iter.func.id == "range"
                 and re.search(r"\b\w*(start_layer|end_layer)\b", ast.unparse(n.iter))]
        if loops:
            found[path.relative_to(tree).as_posix()] = "layers_to_capture" in path.read_text(encoding="utf-8")
    return found


def test_no_row_crashes(zoo: SourceZoo) -> None:
    assert zoo.crashed() == [], "\n".join(f"{r.file} {r.class_name}: {r.reason}" for r in zoo.crashed())


def test_every_file_with_a_pp_layer_loop_is_accounted_for(zoo: SourceZoo) -> None:
    """Each file with a loop over its stage's layers has rows; those that capture aux states are adapted,
    unchanged or declined with a line."""
    files = _pp_loop_files(source_tree(RELEASE))
    assert len(files) >= 40  # 0.5.23: 51 files loop over range(self.start_layer, self.end_layer)
    rows = {f: [r for r in zoo.rows if r.file == f] for f in files}
    assert [f for f, found in rows.items() if not found] == []
    for f in files:
        for row in rows[f]:
            assert row.status in (Status.ADAPTED, Status.UNCHANGED, Status.DECLINED), (f, row)
            if row.status is Status.DECLINED:
                assert re.search(r"line \d+", row.reason), (f, row.reason)
    assert sum(captures for captures in files.values()) >= 20


@pytest.mark.parametrize(("file", "cls", "form"), [
    ("srt/models/llama.py", "LlamaModel", "list"), ("srt/models/qwen2.py", "Qwen2Model", "list"),
    ("srt/models/qwen3.py", "Qwen3Model", "list"), ("srt/models/qwen2_moe.py", "Qwen2MoeModel", "list"),
    ("srt/models/deepseek_v2.py", "DeepseekV2Model", "packer"),
])
def test_golden_families_are_adapted_with_their_capture_form(zoo: SourceZoo, file: str, cls: str, form: str) -> None:
    row = next(r for r in zoo.rows if r.file == file and r.class_name == cls)
    assert row.status is Status.ADAPTED and row.reason.startswith(form) and "id + 1" in row.reason


def test_cli_json_and_coverage_section(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--json prints the rows; --write-coverage writes the release's own section and keeps the rest of the file."""
    from pipespec.cli import main

    report = tmp_path / "coverage.md"
    report.write_text("# intro\n")
    code = main(["zoo", "--engine", "sglang", "--source", RELEASE, "--files", "llama.py,qwen2.py", "--json",
                 "--write-coverage", str(report)])
    out, err = capsys.readouterr()
    rows = json.loads(out)
    assert code == 0 and [(r["file"], r["class"], r["status"]) for r in rows] == [
        ("srt/models/llama.py", "LlamaModel", "adapted"), ("srt/models/qwen2.py", "Qwen2Model", "adapted")]
    text = report.read_text()
    assert text.startswith("# intro\n") and "<!-- pipespec-section sglang-source 0.5.23 -->" in text
    assert "| srt/models/llama.py | LlamaModel | adapted |" in text


@pytest.mark.parametrize(("argv", "message"), [
    (["zoo", "--engine", "sglang"], "--engine sglang needs --source"),
    (["zoo", "--engine", "sglang", "--source", "{dir}"], "no sglang/srt/models under it"),
    (["zoo", "--engine", "sglang", "--source", RELEASE, "--files", "nope.py"], "--files 'nope.py': not a model file"),
    (["zoo", "--engine", "sglang", "--source", RELEASE, "--model-types", "llama"], "--model-types is for --engine transformers"),
])
def test_cli_bad_input_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
                                          message: str) -> None:
    from pipespec.cli import main

    code = main([a.format(dir=tmp_path) for a in argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and message in err
