"""The bad-input catalogue (docs/reliability.md): each case must be refused cleanly.

Clean = the real CLI entry point returns exit code 2 for usage errors (1 otherwise), writes exactly one
`pipespec: error: ...` / `adapter-gen: error: ...` line naming the file/field/value, and no traceback.
Cases run in-process through ``pipespec.cli.main`` (an uncaught exception fails the test), grouped by
the part of pipespec they exercise. Every case id must appear in docs/reliability.md.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipespec.cli import main

ROOT = Path(__file__).resolve().parents[1]
GOOD_SPEC = '[adapter]\nname = "toy"\narchitectures = ["ToyForCausalLM"]\ndecoder_class = "toy.modeling:ToyModel"\n'


@dataclass
class Case:
    id: str
    argv: Callable[[Path], list[str]]
    exit_code: int
    needle: str
    setup: Callable[[Path, pytest.MonkeyPatch], None] | None = None


def spec_case(case_id: str, text: str, needle: str) -> Case:
    def setup(tmp: Path, mp: pytest.MonkeyPatch) -> None:
        d = tmp / "specs"
        d.mkdir()
        (d / "bad.toml").write_text(text)
        mp.setenv("PIPESPEC_ADAPTERS_PATH", str(d))

    return Case(case_id, lambda tmp: ["specs"], 2, needle, setup)


def two_specs(tmp: Path, mp: pytest.MonkeyPatch) -> None:
    d = tmp / "specs"
    d.mkdir()
    (d / "a.toml").write_text(GOOD_SPEC)
    (d / "b.toml").write_text(GOOD_SPEC.replace('"toy"', '"toy_b"').replace("ToyModel", "ToyB"))
    mp.setenv("PIPESPEC_ADAPTERS_PATH", str(d))


def layout(*args: str) -> Callable[[Path], list[str]]:
    return lambda tmp: ["layout", *args]


CASES = [
    # --- adapter specs ---
    spec_case("spec-toml-syntax", "[adapter\nname='x'", r"bad\.toml: TOML syntax error: .*line 1"),
    spec_case("spec-unknown-key", GOOD_SPEC + "colour = 'red'\n", r"bad\.toml: unknown key adapter\.colour"),
    spec_case("spec-unknown-table", GOOD_SPEC + "[extras]\nx = 1\n", r"unknown table \[extras\]"),
    spec_case("spec-wrong-type", GOOD_SPEC + "[model]\nresidual = 'yes'\n", r"model\.residual = 'yes' is invalid: expected true or false"),
    spec_case("spec-not-identifier", GOOD_SPEC + "[model]\nlayers_attr = 'layers; import os'\n", r"layers_attr = 'layers; import os' is invalid"),
    spec_case("spec-keyword-attr", GOOD_SPEC + "[model]\nnorm_attr = 'lambda'\n", r"norm_attr = 'lambda' is invalid.*keyword"),
    spec_case("spec-bad-decoder-class", GOOD_SPEC.replace("toy.modeling:ToyModel", "toy/modeling.py"), r"must be 'package\.module:ClassName'"),
    spec_case("spec-negative-id", GOOD_SPEC + "[aux]\ndefault_ids = [2, -3]\n", r"aux\.default_ids = -3 is invalid"),
    spec_case("spec-bad-boundary-rule", GOOD_SPEC + "[aux]\nboundary_rule = 'sometimes'\n", r"boundary_rule = 'sometimes'"),
    spec_case("spec-missing-required", '[adapter]\nname = "toy"\n', r"missing required key adapter\.decoder_class"),
    spec_case("spec-unsupported-without-reason", GOOD_SPEC + "supported = false\n", r"needs adapter\.reason"),
    Case("spec-duplicate-architecture", lambda tmp: ["specs"], 2, r"both claim arch 'ToyForCausalLM'", two_specs),
    Case("spec-path-not-a-directory", lambda tmp: ["specs"], 2, r"is not a directory",
         lambda tmp, mp: mp.setenv("PIPESPEC_ADAPTERS_PATH", str(tmp / "missing"))),
    # --- layout / verify flags ---
    Case("cli-pp-zero", layout("--num-layers", "8", "--pp", "0"), 2, r"pipeline size 0 is invalid"),
    Case("cli-pp-above-layers", layout("--num-layers", "4", "--pp", "6"), 2, r"pipeline size 6 is larger than num_layers 4"),
    Case("cli-partition-count", layout("--num-layers", "8", "--pp", "3", "--partition", "4,4"), 2, r"has 2 entries but the pipeline has 3"),
    Case("cli-partition-sum", layout("--num-layers", "8", "--pp", "2", "--partition", "4,5"), 2, r"sums to 9 but the model has 8"),
    Case("cli-partition-zero", layout("--num-layers", "8", "--pp", "2", "--partition", "8,0"), 2, r"contains 0"),
    Case("cli-non-numeric-ids", layout("--num-layers", "8", "--pp", "2", "--aux-layers", "2,mid"), 2, r"'mid' is not an integer"),
    Case("cli-non-numeric-layers", layout("--num-layers", "lots", "--pp", "2"), 2, r"invalid int value: 'lots'"),
    Case("cli-aux-id-above-n", layout("--num-layers", "8", "--pp", "2", "--aux-layers", "2,9"), 2, r"aux layer id 9 is out of range"),
    Case("cli-aux-id-negative", layout("--num-layers", "8", "--pp", "2", "--aux-layers=-1,2"), 2, r"aux layer id -1 is out of range"),
    Case("cli-boundary-violation", layout("--num-layers", "8", "--pp", "2", "--aux-layers", "4", "--boundary-rule", "reject-at-stage-end"),
         2, r"aux layer id 4 ends stage 0"),
    Case("cli-conflicting-flags", lambda tmp: ["verify", "--architecture", "LlamaForCausalLM", "--class", "a:B", "--pp", "1"], 2,
         r"not allowed with argument"),
    Case("cli-unknown-architecture", lambda tmp: ["verify", "--architecture", "NopeForCausalLM", "--num-layers", "4", "--pp", "1"], 1,
         r"`NopeForCausalLM` does not support eagle3 .*adapter-gen new"),
    Case("cli-unsupported-architecture", lambda tmp: ["verify", "--architecture", "MiMoForCausalLM", "--num-layers", "4", "--pp", "2"], 1,
         r"`MiMoForCausalLM` does not support eagle3 with pipeline parallelism: MiMoModel\.forward"),
    Case("cli-bad-class-path", lambda tmp: ["verify", "--class", "transformers", "--num-layers", "4", "--pp", "1"], 2,
         r"--class 'transformers' is not 'package\.module:ClassName'"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_input_is_refused_cleanly(case: Case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    monkeypatch.delenv("PIPESPEC_ADAPTERS_PATH", raising=False)
    if case.setup:
        case.setup(tmp_path, monkeypatch)
    try:
        code = main(case.argv(tmp_path))
    except SystemExit as exc:  # argparse usage errors
        code = exc.code
    err = capsys.readouterr().err
    assert code == case.exit_code, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if re.match(r"^(pipespec|adapter-gen)(\s\S+)?: error: ", line)]
    assert len(lines) == 1, err
    assert re.search(case.needle, lines[0]), lines[0]


def test_every_case_is_documented():
    doc = (ROOT / "docs" / "reliability.md").read_text()
    missing = [c.id for c in CASES if f"`{c.id}`" not in doc]
    assert not missing, f"add these catalogue ids to docs/reliability.md: {missing}"
