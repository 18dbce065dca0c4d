"""What the SGLang tests share: tiny checkpoints, one engine per process, and transformers' reference.

Every engine runs ``engine_run.py`` in a process of its own, with the stand-ins and the test recorder
(``standins/``) on ``PYTHONPATH`` for it and every process SGLang spawns, and a timeout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
STANDINS = HERE / "standins"
PROMPT = (1, 5, 9, 13, 17)
NEW_TOKENS = 4
ENGINE_TIMEOUT_S = 480

#: Tiny configs (float32, 3 layers: every layer is a stage of its own at PP = 3, and the default EAGLE3 ids
#: (2, N // 2, N - 3) = (2, 1, 0) include id 0 and both stage boundaries of PP = 2 and 3).
TINY: dict[str, dict[str, object]] = {
    "llama": {},
    "qwen3": {},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 1,
                  "mlp_only_layers": []},
}


def standin_env(**extra: str) -> dict[str, str]:
    """The environment of an SGLang process: stand-ins first on PYTHONPATH, CPU engine, one thread."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(STANDINS), *filter(None, [env.get("PYTHONPATH")])])
    env.update({"SGLANG_USE_CPU_ENGINE": "1", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    env.update(extra)
    return env


def write_tiny(model_type: str, directory: Path, seed: int = 0) -> Path:
    """A random tiny checkpoint (config.json + model.safetensors) of ``model_type`` in ``directory``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
                                  max_position_embeddings=256, **TINY[model_type])
    AutoModelForCausalLM.from_config(config).to(torch.float32).save_pretrained(directory)
    return directory


@dataclass
class EngineRun:
    returncode: int
    stderr: str
    output_ids: list[int] = field(default_factory=list)
    hidden_states: torch.Tensor | None = None  # what SGLang returned (pp_size 1 only)
    recorded: torch.Tensor | None = None  # what the last rank's logits processor received, every forward


def run_engine(model: Path, pp: int, work: Path, *, plugin: bool | str = True, aux_ids: str = "") -> EngineRun:
    """Start ``sglang.Engine`` on ``model`` at ``pp`` in its own process, generate greedily, shut it down.

    ``plugin``: on / off, or the literal value to give ``PIPESPEC_SGLANG``."""
    work.mkdir(parents=True, exist_ok=True)
    record = work / "aux"
    record.mkdir(exist_ok=True)
    switch = plugin if isinstance(plugin, str) else ("on" if plugin else "off")
    extra = {"PIPESPEC_SGLANG": switch, "PIPESPEC_TEST_AUX_DIR": str(record)}
    if pp > 1:  # SGLang's CPU engine binds each rank's OpenMP threads to the cores named here, one group a rank
        extra["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(str(rank % (os.cpu_count() or 1)) for rank in range(pp))
    env = standin_env(**extra)
    command = [sys.executable, str(HERE / "engine_run.py"), "--model", str(model), "--pp", str(pp), "--out", str(work),
               "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", str(NEW_TOKENS)]
    if aux_ids:
        command += ["--aux-ids", aux_ids]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=ENGINE_TIMEOUT_S)
    run = EngineRun(done.returncode, done.stderr)
    result = work / "result.json"
    if done.returncode == 0 and result.exists():
        data = json.loads(result.read_text())
        run.output_ids = list(data["output_ids"])
        if "hidden_states" in data:
            run.hidden_states = torch.tensor(data["hidden_states"])
        files = sorted(record.glob("*.pt"))
        if files:
            run.recorded = torch.cat([torch.load(f) for f in files])
    return run


def hf_reference(model: Path, ids: list[int], output_ids: list[int]) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens for PROMPT, and the aux states at pipespec ``ids`` for every position SGLang
    runs forward (the prompt and every generated token but the last), concatenated in id order.

    Id L < N is ``output_hidden_states[L]``; id N is the last layer's output before the final norm (a hook).
    """
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    prompt = torch.tensor([list(PROMPT)])
    with torch.no_grad():
        tokens = m.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(PROMPT):].tolist()
        last: list[torch.Tensor] = []
        layers = m.model.layers
        handle = layers[-1].register_forward_hook(lambda _m, _i, out: last.append(out[0] if isinstance(out, tuple)
                                                                                  else out))
        try:
            sequence = torch.tensor([list(PROMPT) + list(output_ids[:-1])])
            hidden = m(sequence, output_hidden_states=True).hidden_states
        finally:
            handle.remove()
    n = len(layers)
    states = [hidden[i][0] if i < n else last[-1].reshape(sequence.shape[1], -1) for i in ids]
    return tokens, torch.cat(states, dim=-1)
