"""The bad-input catalogue (docs/reliability.md): each case must be refused cleanly.

Clean = the real CLI entry point returns exit code 2 for usage errors (1 otherwise), writes exactly one
`pipespec: error: ...` / `adapter-gen: error: ...` line naming the file/field/value, and no traceback.
adapter-gen's two non-error refusals are held to the same bar with their own line: a source shape it
cannot adapt is one `adapter-gen: skipped ...` line (exit 1), an already adapted class one `... nothing
to do` line (exit 0, file untouched). Cases run in-process through ``pipespec.cli.main`` (an uncaught
exception fails the test), grouped by the part of pipespec they exercise; checkpoint cases corrupt copies
of tiny real checkpoints written once per session. A few checkpoint faults can only be seen when a stage
reads its weights: those cases start real stage processes, and the one line then names the stage and
the ``CheckpointError`` (a stage prints a traceback only for exceptions that are not ``PipespecError``).

The runtime rows (missing aux key, wrong-shaped received tensor) are library-level: they drive a real
adapted Llama stage with what a broken or mismatched upstream stage would hand it, and assert the exact
error. The dead-peer rows live in tests/test_faults.py (real processes). Every case id must appear in
docs/reliability.md.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from pipespec.cli import main
from pipespec.contract.intermediate import IntermediateTensors
from pipespec.engine.tiny_checkpoints import write_tiny_draft, write_tiny_target

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "vllm_style"
GOOD_SPEC = '[adapter]\nname = "toy"\narchitectures = ["ToyForCausalLM"]\ndecoder_class = "toy.modeling:ToyModel"\n'
N = 6  # layers of the tiny target
DRAFT_IDS = (1, 3, 5)  # input-index aux ids the tiny drafts are written for

# The refusal line each kind of case must print exactly once.
LINES = {
    "error": r"^(pipespec|adapter-gen)(\s\S+)?: error: ",
    "skipped": r"^adapter-gen: skipped ",
    "noop": r"^adapter-gen: .*; nothing to do$",
    "stale": r"^adapter-gen: \S+ is not up to date",
}


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny real checkpoints, written once: every checkpoint case corrupts a copy of one of these."""
    root = tmp_path_factory.mktemp("catalogue_ckpts")
    target = write_tiny_target(root / "target", "llama", num_layers=N, seed=61)
    config = AutoConfig.from_pretrained(target)
    return {
        "target": target,
        "sharded": write_tiny_target(root / "sharded", "llama", num_layers=N, seed=61, max_shard_size="40KB"),
        "draft_b": write_tiny_draft(root / "draft_b", config, format="B", aux_layers=DRAFT_IDS, seed=62),
        "draft_a": write_tiny_draft(root / "draft_a", config, format="A", aux_layers=DRAFT_IDS, seed=63),
        "draft_wide": write_tiny_draft(root / "draft_wide", config, format="B", aux_layers=DRAFT_IDS, hidden_size=48, seed=64),
    }


@dataclass
class Env:
    """What a case's ``argv`` builder may use: a private directory, monkeypatch, the tiny checkpoints."""

    tmp: Path
    mp: pytest.MonkeyPatch
    request: pytest.FixtureRequest
    notes: dict[str, Any] = field(default_factory=dict)  # what a case's ``after`` check compares against

    @property
    def ck(self) -> dict[str, Path]:
        return self.request.getfixturevalue("ckpts")

    def copy(self, name: str, as_name: str | None = None) -> Path:
        return Path(shutil.copytree(self.ck[name], self.tmp / (as_name or name)))


@dataclass
class Case:
    id: str
    argv: Callable[[Env], list[str]]  # may prepare files first
    exit_code: int
    needle: str
    kind: str = "error"
    after: Callable[[Env], None] | None = None  # extra check once the command has run


# ------------------------------------------------------------------------------------------ helpers
def spec_case(case_id: str, text: str, needle: str) -> Case:
    def argv(env: Env) -> list[str]:
        d = env.tmp / "specs"
        d.mkdir()
        (d / "bad.toml").write_text(text)
        env.mp.setenv("PIPESPEC_ADAPTERS_PATH", str(d))
        return ["specs"]

    return Case(case_id, argv, 2, needle)


def two_specs(env: Env) -> list[str]:
    d = env.tmp / "specs"
    d.mkdir()
    (d / "a.toml").write_text(GOOD_SPEC)
    (d / "b.toml").write_text(GOOD_SPEC.replace('"toy"', '"toy_b"').replace("ToyModel", "ToyB"))
    env.mp.setenv("PIPESPEC_ADAPTERS_PATH", str(d))
    return ["specs"]


def missing_specs_dir(env: Env) -> list[str]:
    env.mp.setenv("PIPESPEC_ADAPTERS_PATH", str(env.tmp / "missing"))
    return ["specs"]


def layout(*args: str) -> Callable[[Env], list[str]]:
    return lambda env: ["layout", *args]


def generate(target: Path, draft: Path, *extra: str, prompt: tuple[str, ...] = ("--prompt-ids", "1,2")) -> list[str]:
    return ["generate", "--target", str(target), "--draft", str(draft), "--pp", "2", *prompt,
            "--max-new-tokens", "2", "--timeout", "60", *extra]


def no_cuda_here() -> None:
    """Skip a case that needs a machine without a visible CUDA device (returns None, so ``or`` chains it)."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible here: --device cuda is not refused")


def edit_tensors(directory: Path, fn: Callable[[dict[str, torch.Tensor]], None], file: str = "model.safetensors") -> None:
    tensors = load_file(str(directory / file))
    fn(tensors)
    save_file(tensors, str(directory / file), metadata={"format": "pt"})


def edit_config(directory: Path, fn: Callable[[dict[str, Any]], None]) -> None:
    config = json.loads((directory / "config.json").read_text())
    fn(config)
    (directory / "config.json").write_text(json.dumps(config))


def bad_target(name: str, corrupt: Callable[[Path], None], base: str = "target") -> Callable[[Env], list[str]]:
    """argv for ``generate`` on a corrupted copy of a good target (with the good Format B draft)."""

    def argv(env: Env) -> list[str]:
        target = env.copy(base, "bad_" + name)
        corrupt(target)
        return generate(target, env.ck["draft_b"])

    return argv


def bad_draft(name: str, corrupt: Callable[[Path], None], base: str = "draft_b") -> Callable[[Env], list[str]]:
    """argv for ``generate`` with the good target and a corrupted copy of a good draft."""

    def argv(env: Env) -> list[str]:
        draft = env.copy(base, "bad_" + name)
        corrupt(draft)
        return generate(env.ck["target"], draft)

    return argv


def truncate(file: Path) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


def set_tensor(name: str, make: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[Path], None]:
    return lambda d: edit_tensors(d, lambda t: t.__setitem__(name, make(t[name])))


def edit_d2t_out_of_vocab(d: Path) -> None:
    """Offsets of 500 (the base draft has the full vocabulary, so it is written without d2t)."""
    edit_tensors(d, lambda t: t.__setitem__("d2t", torch.full((t["lm_head.weight"].shape[0],), 500, dtype=torch.long)))


def drop_tensor(name: str) -> Callable[[Path], None]:
    return lambda d: edit_tensors(d, lambda t: t.pop(name))


def set_config(fn: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    return lambda d: edit_config(d, fn)


def only_bin_weights(d: Path) -> None:
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"not read: pipespec never unpickles")


def drop_shard(d: Path) -> None:
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[2]
    (d / shard).unlink()


def draft_index(text: str) -> Callable[[Path], None]:
    def corrupt(d: Path) -> None:
        (d / "model.safetensors").rename(d / "part-1.safetensors")
        (d / "model.safetensors.index.json").write_text(text)

    return corrupt


def adapter_gen(*args: str) -> list[str]:
    return ["adapter-gen", *args, "--dialect", "pipespec"]  # the vllm_style fixtures run on pipespec's runtime


def source(env: Env, fixture: str, edit: Callable[[str], str] = lambda s: s) -> Path:
    """A copy of a fixture source in the case's directory (so labels and writes stay there)."""
    path = env.tmp / fixture
    path.write_text(edit((FIXTURES / fixture).read_text()))
    return path


def already_adapted(env: Env) -> list[str]:
    path = source(env, "already_adapted.py")
    env.notes["snapshot"] = path.read_bytes()
    return adapter_gen(str(path), "--class", "HandAdaptedModel", "--in-place")


def file_untouched(env: Env) -> None:
    assert (env.tmp / "already_adapted.py").read_bytes() == env.notes["snapshot"], "a no-op must not rewrite the file"


def edited_generated_file(env: Env) -> list[str]:
    """Generate an adapted module, then hand-edit it (against its "do not edit" header): --check catches it."""
    src = source(env, "llama_residual.py")
    out = env.tmp / "generated.py"
    assert main(adapter_gen(str(src), "--class", "LlamaStyleModel", "--out", str(out))) == 0
    text = out.read_text()
    assert text.startswith("# Generated by pipespec adapter-gen")
    out.write_text(text.replace("remote_aux_hidden_states + aux_hidden_states", "aux_hidden_states"))
    return adapter_gen(str(src), "--class", "LlamaStyleModel", "--out", str(out), "--check")


def unwritable_directory(env: Env) -> Path:
    """A directory nobody may create files in: read-only bits, or (as root, who ignores them) sysfs."""
    for candidate in (env.tmp / "read_only", Path("/sys/kernel")):
        if candidate.parent == env.tmp:
            candidate.mkdir()
            candidate.chmod(0o555)
        try:
            probe = tempfile.NamedTemporaryFile(dir=candidate)
        except OSError:
            return candidate
        probe.close()
    pytest.skip("no unwritable directory here (root, and sysfs is writable)")


def out_to_unwritable(env: Env) -> list[str]:
    src = source(env, "llama_residual.py")
    return adapter_gen(str(src), "--class", "LlamaStyleModel", "--out", str(unwritable_directory(env) / "adapted.py"))


def write(env: Env, name: str, data: bytes) -> Path:
    path = env.tmp / name
    path.write_bytes(data)
    return path


# ------------------------------------------------------------------------------------------ the cases
CASES = [
    # --- adapter specs ---
    spec_case("spec-toml-syntax", "[adapter\nname='x'", r"bad\.toml: TOML syntax error: .*line 1"),
    spec_case("spec-unknown-key", GOOD_SPEC + "colour = 'red'\n", r"bad\.toml: unknown key adapter\.colour"),
    spec_case("spec-unknown-table", GOOD_SPEC + "[extras]\nx = 1\n", r"unknown table \[extras\]"),
    spec_case("spec-wrong-type", GOOD_SPEC + "[model]\nresidual = 'yes'\n", r"model\.residual = 'yes' is invalid: expected true or false"),
    spec_case("spec-not-identifier", GOOD_SPEC + "[model]\nlayers_attr = 'layers; import os'\n",
              r"layers_attr = 'layers; import os' is invalid"),
    spec_case("spec-keyword-attr", GOOD_SPEC + "[model]\nnorm_attr = 'lambda'\n", r"norm_attr = 'lambda' is invalid.*keyword"),
    spec_case("spec-bad-decoder-class", GOOD_SPEC.replace("toy.modeling:ToyModel", "toy/modeling.py"),
              r"must be 'package\.module:ClassName'"),
    spec_case("spec-negative-id", GOOD_SPEC + "[aux]\ndefault_ids = [2, -3]\n", r"aux\.default_ids = -3 is invalid"),
    spec_case("spec-bad-boundary-rule", GOOD_SPEC + "[aux]\nboundary_rule = 'sometimes'\n", r"boundary_rule = 'sometimes'"),
    spec_case("spec-missing-required", '[adapter]\nname = "toy"\n', r"missing required key adapter\.decoder_class"),
    spec_case("spec-unsupported-without-reason", GOOD_SPEC + "supported = false\n", r"needs adapter\.reason"),
    Case("spec-duplicate-architecture", two_specs, 2, r"both claim arch 'ToyForCausalLM'"),
    Case("spec-path-not-a-directory", missing_specs_dir, 2, r"is not a directory"),
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
    Case("cli-aux-id-negative-spaced", layout("--num-layers", "8", "--pp", "2", "--aux-layers", "-1,5"), 2,
         r"aux layer id -1 is out of range: ids must satisfy 0 <= id <= num_layers \(8\)"),
    Case("cli-boundary-violation", layout("--num-layers", "8", "--pp", "2", "--aux-layers", "4", "--boundary-rule", "reject-at-stage-end"),
         2, r"aux layer id 4 ends stage 0"),
    Case("cli-conflicting-flags", lambda env: ["verify", "--architecture", "LlamaForCausalLM", "--class", "a:B", "--pp", "1"], 2,
         r"not allowed with argument"),
    Case("cli-unknown-architecture", lambda env: ["verify", "--architecture", "NopeForCausalLM", "--num-layers", "4", "--pp", "1"], 1,
         r"`NopeForCausalLM` does not support eagle3 .*adapter-gen new"),
    Case("cli-unsupported-architecture", lambda env: ["verify", "--architecture", "MiMoForCausalLM", "--num-layers", "4", "--pp", "2"], 1,
         r"`MiMoForCausalLM` does not support eagle3 with pipeline parallelism: MiMoModel\.forward"),
    Case("cli-bad-class-path", lambda env: ["verify", "--class", "transformers", "--num-layers", "4", "--pp", "1"], 2,
         r"--class 'transformers' is not 'package\.module:ClassName'"),
    Case("cli-model-impl-without-vllm-engine",
         lambda env: ["verify", "--model-impl", "transformers", "--architecture", "LlamaForCausalLM", "--num-layers", "4",
                      "--pp", "1"], 2, r"--model-impl transformers is for --engine vllm"),
    Case("cli-bad-model-impl", lambda env: ["verify", "--engine", "vllm", "--model-impl", "tf", "--architecture",
                                            "LlamaForCausalLM", "--pp", "1"], 2,
         r"--model-impl 'tf' is not one of vllm, transformers"),
    # --- generate flags (refused before any stage process starts) ---
    Case("gen-timeout-not-finite", lambda env: generate(env.ck["target"], env.ck["draft_b"], "--timeout", "nan"), 2,
         r"--timeout must be a finite number of seconds > 0, got nan"),
    Case("gen-dtype-not-float", lambda env: generate(env.ck["target"], env.ck["draft_b"], "--dtype", "int8"), 2,
         r"dtype 'int8' is not a floating-point torch dtype: use float32, bfloat16 or float16"),
    Case("gen-prompts-file-bad-line", lambda env: generate(env.ck["target"], env.ck["draft_b"], prompt=(
        "--prompts-file", str(write(env, "p.jsonl", b'{"prompt_ids": [1, 2]}\n{oops\n')))), 2, r"p\.jsonl:2: not a JSON object"),
    Case("gen-prompt-ids-negative", lambda env: generate(env.ck["target"], env.ck["draft_b"], prompt=("--prompt-ids=-1,2",)), 2,
         r"--prompt-ids: prompt_ids must be a non-empty list of non-negative integers, got \[-1, 2\]"),
    Case("gen-prompt-ids-negative-spaced", lambda env: generate(env.ck["target"], env.ck["draft_b"], prompt=("--prompt-ids", "-1,2")),
         2, r"--prompt-ids: prompt_ids must be a non-empty list of non-negative integers, got \[-1, 2\]"),
    Case("gen-device-cuda-unavailable", lambda env: no_cuda_here() or generate(env.ck["target"], env.ck["draft_b"], "--device", "cuda"),
         2, r"--device cuda: torch \S+ (is a CPU-only build|\(CUDA \S+\) sees no CUDA device); use --device cpu"),
    # --- target checkpoints ---
    Case("ckpt-target-missing-dir", lambda env: generate(env.tmp / "nope", env.ck["draft_b"]), 1,
         r"checkpoint directory \S+/nope does not exist"),
    Case("ckpt-target-not-a-directory", lambda env: generate(write(env, "weights.safetensors", b"x"), env.ck["draft_b"]), 1,
         r"weights\.safetensors is not a directory: pass the checkpoint directory"),
    Case("ckpt-target-no-config", bad_target("no_config", lambda d: (d / "config.json").unlink()), 1,
         r"bad_no_config/config\.json is missing: every checkpoint directory needs its config\.json"),
    Case("ckpt-target-config-not-json", bad_target("not_json", lambda d: (d / "config.json").write_text("{oops")), 1,
         r"bad_not_json/config\.json cannot be read as JSON \(.*line 1 column 2"),
    Case("ckpt-target-unknown-model-type", bad_target("unknown_type", set_config(lambda c: c.update(model_type="nopeformer"))), 1,
         r"bad_unknown_type/config\.json is not a transformers config this version can read: .*`nopeformer`"),
    Case("ckpt-target-no-safetensors", bad_target("bin", only_bin_weights), 1,
         r"has neither model\.safetensors nor model\.safetensors\.index\.json \(found pytorch_model\.bin; convert it"),
    Case("ckpt-target-corrupt-header", bad_target("garbage", lambda d: (d / "model.safetensors").write_bytes(
        b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage garbage")), 1, r"bad_garbage/model\.safetensors is not a readable safetensors file"),
    Case("ckpt-target-index-missing-shard", bad_target("shard", drop_shard, base="sharded"), 1,
         r"checkpoint shard \S+bad_shard/model-00003-of-\d+\.safetensors is missing"),
    # (seen only when a stage reads its weights: the line names the stage)
    Case("ckpt-target-truncated", bad_target("truncated", lambda d: truncate(d / "model.safetensors")), 1,
         r"stage \d failed: CheckpointError: cannot open \S+bad_truncated/model\.safetensors: .*incomplete metadata"),
    Case("ckpt-target-missing-tensor", bad_target("missing", drop_tensor("lm_head.weight")), 1,
         r"stage 1 failed: CheckpointError: tensor 'lm_head\.weight' is missing from the checkpoint in \S+ \(needed by stage 1 "
         r"\(layers \[3, 6\)\)\); stopped stage 0"),
    Case("ckpt-target-wrong-shape", bad_target("shape", set_tensor("model.layers.1.mlp.up_proj.weight", lambda t: t[:3, :3].clone())), 1,
         r"stage 0 failed: CheckpointError: tensor 'model\.layers\.1\.mlp\.up_proj\.weight' in \S+ has shape \[3, 3\] but the model "
         r"expects \[64, 32\]"),
    Case("ckpt-target-wrong-dtype", bad_target("dtype", set_tensor("model.layers.4.mlp.up_proj.weight", lambda t: t.to(torch.int32))), 1,
         r"stage 1 failed: CheckpointError: tensor 'model\.layers\.4\.mlp\.up_proj\.weight' in \S+ has dtype torch\.int32 but the "
         r"model expects torch\.float32: only floating-point tensors can be cast"),
    # --- draft checkpoints ---
    Case("ckpt-draft-missing-dir", lambda env: generate(env.ck["target"], env.tmp / "no_draft"), 1,
         r"no_draft: no config\.json: a draft checkpoint directory needs config\.json \+ weights"),
    Case("ckpt-draft-config-not-json", bad_draft("not_json", lambda d: (d / "config.json").write_text("nope")), 1,
         r"bad_not_json/config\.json: not valid JSON"),
    Case("ckpt-draft-config-not-object", bad_draft("list", lambda d: (d / "config.json").write_text("[1, 2]")), 1,
         r"bad_list/config\.json: expected a JSON object \(the draft's config\), got a JSON list"),
    Case("ckpt-draft-unknown-format", bad_draft("format", set_config(
        lambda c: (c.update(architectures=["MedusaModel"]), c.pop("speculators_model_type")))), 1,
        r"unknown draft checkpoint format \(architectures \['MedusaModel'\]\): pipespec reads EAGLE3 drafts in Format A"),
    Case("ckpt-draft-no-weights", bad_draft("no_weights", lambda d: (d / "model.safetensors").unlink()), 1,
         r"bad_no_weights: no draft weights: expected one of \['model\.safetensors'"),
    Case("ckpt-draft-truncated", bad_draft("truncated", lambda d: truncate(d / "model.safetensors")), 1,
         r"bad_truncated/model\.safetensors is not a readable safetensors file \(.*\): re-download or re-export the draft"),
    Case("ckpt-draft-index-not-json", bad_draft("index_json", draft_index("{oops")), 1,
         r"bad_index_json/model\.safetensors\.index\.json: not a shard index"),
    Case("ckpt-draft-index-missing-shard",
         bad_draft("index_shard", draft_index(json.dumps({"weight_map": {"fc.weight": "part-2.safetensors"}}))),
         1, r"bad_index_shard/part-2\.safetensors: weight file listed in the index is missing"),
    Case("ckpt-draft-missing-tensor", bad_draft("missing", drop_tensor("layers.0.mlp.up_proj.weight")), 1,
         r"missing tensors \['layers\.0\.mlp\.up_proj\.weight'\] for a Format B \(speculators, layers\.0\.\*\) draft"),
    Case("ckpt-draft-wrong-shape", bad_draft("shape", set_tensor("norm.weight", lambda t: t[:5].clone())), 1,
         r"tensor norm\.weight has shape \[5\], expected \[32\] from the config"),
    Case("ckpt-draft-hidden-size", lambda env: generate(env.ck["target"], env.ck["draft_wide"]), 1,
         r"ships no embed_tokens and its hidden_size 48 differs from the target's 32: it cannot share the target's input embedding"),
    Case("ckpt-draft-target-hidden-size", bad_draft("target_hidden", set_config(lambda c: c.update(target_hidden_size=64))), 1,
         r"target_hidden_size 64 does not match the target's hidden_size 32: this draft was trained for another target"),
    Case("ckpt-draft-vocab-mismatch", bad_draft("vocab", set_config(lambda c: c["transformer_layer_config"].update(vocab_size=100))), 1,
         r"vocab_size 100 does not match the target's vocabulary \(96\)"),
    Case("ckpt-draft-num-aux-mismatch", bad_draft("num_aux", set_config(lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 3]))), 1,
         r"fc\.weight takes 3 aux states \(96 = 3 x 32\) but the aux ids resolve to 2: \[1, 3\] .*fix eagle_aux_hidden_state_layer_ids"),
    Case("ckpt-draft-aux-id-above-n", bad_draft("id_big", set_config(lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 3, 9]))), 1,
         r"aux id 9 \(input-index, from \[1, 3, 9\] read as 'input'\) exceeds the target's N=6 layers"),
    Case("ckpt-draft-output-id-n", bad_draft("id_n", set_config(
        lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[0, 2, 6])), base="draft_a"), 1,
        r"aux id 7 .*read as 'output'\) exceeds the target's N=6 layers \(written in the output convention, the largest valid id is N-1\)"),
    # (seen only when the last stage reads the draft's weights)
    Case("ckpt-draft-d2t-outside-vocab", bad_draft("d2t", edit_d2t_out_of_vocab), 1,
         r"stage 1 failed: CheckpointError: \S+bad_d2t: d2t maps draft id 0 to target id 500, outside the target vocabulary \[0, 96\)"),
    Case("ckpt-draft-wrong-dtype", bad_draft("dtype", set_tensor("norm.weight", lambda t: t.to(torch.int32))), 1,
         r"stage 1 failed: CheckpointError: \S+bad_dtype: tensor norm\.weight has dtype torch\.int32, expected floating point"),
    # --- adapter-gen sources ---
    Case("src-syntax-error",
         lambda env: adapter_gen(str(write(env, "broken.py", b"class M:\n    def forward(self, x:\n        return x\n")),
                                 "--class", "M"), 2, r"broken\.py:2: syntax error: '\(' was never closed"),
    Case("src-not-utf8", lambda env: adapter_gen(str(write(env, "latin1.py", b"# caf\xe9\nclass M: pass\n")), "--class", "M"), 2,
         r"latin1\.py: not UTF-8 text \(invalid continuation byte at byte 5\)"),
    Case("src-class-not-found", lambda env: adapter_gen(str(source(env, "llama_residual.py")), "--class", "Nope"), 2,
         r"llama_residual\.py: no top-level class 'Nope' \(classes here: LlamaStyleDecoderLayer, LlamaStyleModel, LlamaStyleForCausalLM\)"),
    Case("src-unsupported-loop-shape", lambda env: adapter_gen(str(source(env, "decline_recurrent.py")), "--class", "CarryModel"), 1,
         r"CarryModel \(line \d+\): the layer call assigns `hidden_states, residual, carry`", kind="skipped"),
    Case("src-relative-layer-index", lambda env: adapter_gen(str(source(env, "decline_relative_index.py")), "--class", "ScaledModel"), 1,
         r"ScaledModel \(line \d+\): .*counts from 0 on every stage", kind="skipped"),
    Case("src-mixin-without-marker", lambda env: adapter_gen(str(source(
        env, "llama_residual.py",
        lambda s: s.replace("class LlamaStyleModel(nn.Module)", "class LlamaStyleModel(AuxHiddenStatesMixin, nn.Module)"))),
        "--class", "LlamaStyleModel"), 1,
        r"inherits AuxHiddenStatesMixin but has no `supports_aux_hidden_states_over_pp = True`: hand-adapted\?", kind="skipped"),
    Case("src-already-adapted", already_adapted, 0,
         r"HandAdaptedModel is already adapted \(supports_aux_hidden_states_over_pp = True\); nothing to do", kind="noop",
         after=file_untouched),
    Case("src-generated-file-edited", edited_generated_file, 1,
         r"generated\.py is not up to date with llama_residual\.py; regenerate it with `adapter-gen llama_residual\.py --class "
         r"LlamaStyleModel --dialect pipespec --out generated\.py`", kind="stale"),
    Case("src-out-is-a-directory", lambda env: adapter_gen(str(source(env, "llama_residual.py")), "--class", "LlamaStyleModel",
                                                           "--out", str(env.tmp)), 1, r"writing failed \(Is a directory\)"),
    Case("src-unwritable-target", out_to_unwritable, 1, r"adapted\.py: cannot write there \(Permission denied\); nothing was changed"),
]


def _refusal_lines(err: str, kind: str) -> list[str]:
    if kind == "error":
        return [line for line in err.splitlines() if re.match(LINES["error"], line)]
    # A skip or a no-op is the only non-warning line, and no error line may appear.
    assert not [line for line in err.splitlines() if re.match(LINES["error"], line)], err
    return [line for line in err.splitlines() if re.match(LINES[kind], line)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_input_is_refused_cleanly(case: Case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str], request: pytest.FixtureRequest) -> None:
    monkeypatch.delenv("PIPESPEC_ADAPTERS_PATH", raising=False)
    env = Env(tmp_path, monkeypatch, request)
    argv = case.argv(env)
    capsys.readouterr()  # what preparing the case printed is not part of the refusal
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse usage errors
        code = exc.code
    err = capsys.readouterr().err
    assert code == case.exit_code, err
    assert "Traceback" not in err
    lines = _refusal_lines(err, case.kind)
    assert len(lines) == 1, err
    assert re.search(case.needle, lines[0]), lines[0]
    others = [line for line in err.splitlines() if line not in lines and not re.match(r"^(adapter-gen|pipespec): warning: ", line)]
    assert not others, f"a refusal is one line (plus warnings), got also: {others}"
    if case.after is not None:
        case.after(env)


def test_case_ids_are_unique_and_enough() -> None:
    ids = [c.id for c in CASES] + [c[0] for c in RUNTIME_CASES]
    assert len(ids) == len(set(ids))
    assert len(ids) >= 40


# ------------------------------------------------------------------------------------------ runtime
@pytest.fixture(scope="module")
def stages(ckpts: dict[str, Path]) -> dict[str, Any]:
    """Stage 1 (middle, relays) and stage 2 (last, collects) of a real adapted Llama split 2/2/2, ids 1, 3, 5."""
    from pipespec.engine.target import build_target_stage

    return {name: build_target_stage(str(ckpts["target"]), rank, 3, partition=(2, 2, 2), aux_layers=DRAFT_IDS)
            for name, rank in (("middle", 1), ("last", 2))}


def _received(stage: Any, tokens: int = 2, **override: torch.Tensor) -> IntermediateTensors:
    """What the previous stage would send ``stage`` for ``tokens`` positions (random, right shapes), with overrides."""
    gen = torch.Generator().manual_seed(7)
    tensors = {k: torch.randn(1, tokens, stage.hidden_size, generator=gen) for k in stage.receive_keys()}
    tensors.update(override)
    return IntermediateTensors(tensors)


def _forward(stage: Any, received: IntermediateTensors | None, tokens: int = 2) -> Any:
    return stage.forward(stage.new_cache(), torch.arange(tokens).unsqueeze(0), received=received)


def _without(stage: Any, key: str) -> IntermediateTensors:
    return IntermediateTensors({k: v for k, v in _received(stage).items() if k != key})


RUNTIME_CASES: list[tuple[str, Callable[[dict[str, Any]], Any], type[BaseException], str]] = [
    ("rt-missing-aux-key", lambda s: _forward(s["last"], _without(s["last"], "aux_hidden_states_0")), RuntimeError,
     r"missing aux hidden state 'aux_hidden_states_0' in the tensors from the previous stage; keys present: "
     r"\['aux_hidden_states_1', 'hidden_states'\]"),
    ("rt-relay-missing-key", lambda s: _forward(s["middle"], _without(s["middle"], "aux_hidden_states_0")), RuntimeError,
     r"cannot relay aux hidden state 'aux_hidden_states_0': keys present are \['hidden_states'\]"),
    ("rt-no-received-tensors", lambda s: _forward(s["last"], None), ValueError,
     r"is pipeline stage 2: pass the previous stage's intermediate_tensors"),
    ("rt-aux-wrong-shape", lambda s: _forward(s["last"], _received(s["last"], aux_hidden_states_1=torch.zeros(1, 3, 32))), RuntimeError,
     r"aux hidden state 'aux_hidden_states_1' from the previous stage has shape \[1, 3, 32\] but its hidden_states has \[1, 2, 32\]"),
    ("rt-relayed-aux-wrong-width", lambda s: _forward(s["middle"], _received(s["middle"], aux_hidden_states_0=torch.zeros(1, 2, 16))),
     RuntimeError, r"aux hidden state 'aux_hidden_states_0' from the previous stage has shape \[1, 2, 16\] but its hidden_states has "
     r"\[1, 2, 32\]: the stages disagree on the hop layout"),
]


@pytest.mark.parametrize(("case_id", "call", "error", "needle"), RUNTIME_CASES, ids=[c[0] for c in RUNTIME_CASES])
def test_runtime_bad_input_is_refused_with_the_exact_error(
    stages: dict[str, Any], case_id: str, call: Callable[[dict[str, Any]], Any], error: type[BaseException], needle: str,
) -> None:
    with pytest.raises(error, match=needle):
        call(stages)


def test_runtime_oracle_a_well_formed_hop_is_accepted(stages: dict[str, Any]) -> None:
    """The runtime rows fail for the reason they name: the same call with well-formed tensors succeeds."""
    out = _forward(stages["middle"], _received(stages["middle"]))
    assert sorted(out.keys()) == sorted(stages["middle"].send_keys())
    logits, aux = _forward(stages["last"], _received(stages["last"]))
    assert logits.shape == (1, 2, 96) and len(aux) == len(DRAFT_IDS)


def test_every_case_is_documented() -> None:
    doc = (ROOT / "docs" / "reliability.md").read_text()
    ids = [c.id for c in CASES] + [c[0] for c in RUNTIME_CASES]
    missing = [i for i in ids if f"`{i}`" not in doc]
    assert not missing, f"add these catalogue ids to docs/reliability.md: {missing}"
