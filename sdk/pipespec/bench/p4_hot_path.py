"""P4 — SDK hot path: µs per decode step for pack + relay + collect with 3 aux states.

A 3-stage plan (ids on every stage) exercises all three calls: stage 0 packs, stage 1 relays slot 0 and
packs its own, the last stage collects. On CUDA the same step runs under
``torch.cuda.set_sync_debug_mode("error")`` (any host-device synchronisation raises), and a last-stage
forward including ``collect`` is captured in a CUDA graph and its replay compared with eager.
Goal: ≤ 20 µs per step; zero synchronisations.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from pipespec.bench.common import Result, device_name, median_time
from pipespec.contract.intermediate import IntermediateTensors
from pipespec.contract.mixin import AuxHiddenStatesMixin

NAME = "p4"
DESCRIPTION = "SDK hot path: pack + relay + collect per step (µs), sync-free, CUDA-graph safe"
CPU_FEASIBLE = True
GOAL_US = 20.0


class _Stage(AuxHiddenStatesMixin, nn.Module):
    def __init__(self, n: int, hidden: int) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(num_hidden_layers=n, hidden_size=hidden)


def _stages(n: int, hidden: int, ids: list[int]) -> list[_Stage]:
    out = []
    for rank in range(3):
        s = _Stage(n, hidden)
        s.set_pipeline_stage(rank, 3)
        s.set_aux_hidden_state_layers(ids)
        out.append(s)
    return out


def one_step(stages: list[_Stage], h: torch.Tensor) -> list[torch.Tensor]:
    s0, s1, s2 = stages
    out0 = s0.make_stage_output(h, [h], None)
    out1 = s1.make_stage_output(h, [h], out0)
    return s2.collect_remote_aux_hidden_states(out1) + [h]


def run(quick: bool, device: str, command: str) -> list[Result]:
    n, hidden, tokens = 30, 4096, 4
    stages = _stages(n, hidden, [2, 15, 27])
    dev = torch.device(device)
    h = torch.randn(1, tokens, hidden, device=dev, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    inner = 200 if quick else 2000

    def loop() -> None:
        for _ in range(inner):
            one_step(stages, h)

    sec = median_time(loop, repeats=5 if quick else 15)
    us = sec / inner * 1e6
    results = [Result("P4.hot_path_us", us, f"<= {GOAL_US:g}", "us/step", us <= GOAL_US, device_name(device), command,
                      detail="3 stages, 3 aux ids, pack+relay+collect")]
    if device == "cuda":
        results += _cuda_checks(stages, h, command)
    return results


def _cuda_checks(stages: list[_Stage], h: torch.Tensor, command: str) -> list[Result]:
    """No host sync in the hot path, and a CUDA graph of the last stage's collect + compute replays exactly."""
    torch.cuda.synchronize()
    syncs_ok = True
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(10):
            one_step(stages, h)
    except RuntimeError:
        syncs_ok = False
    finally:
        torch.cuda.set_sync_debug_mode("default")
    last = stages[2]
    received = IntermediateTensors({k: torch.randn_like(h) for k in ("hidden_states", *last.pipespec_stage.collects)})
    w = torch.randn(h.shape[-1], h.shape[-1], device=h.device, dtype=h.dtype) / h.shape[-1] ** 0.5

    def last_forward() -> torch.Tensor:
        aux = last.collect_remote_aux_hidden_states(received)
        hidden = received["hidden_states"] @ w
        return torch.cat(aux + [hidden], dim=-1)

    eager = last_forward().clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            last_forward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = last_forward()
    graph.replay()
    torch.cuda.synchronize()
    equal = bool(torch.equal(static_out, eager))
    dev = device_name("cuda")
    return [
        Result("P4.host_syncs", 0.0 if syncs_ok else 1.0, "0", "count", syncs_ok, dev, command,
               detail="set_sync_debug_mode('error') over 10 steps"),
        Result("P4.cuda_graph_replay_equals_eager", 1.0 if equal else 0.0, "1", "bool", equal, dev, command,
               detail="last-stage forward incl. collect captured in a CUDA graph"),
    ]
