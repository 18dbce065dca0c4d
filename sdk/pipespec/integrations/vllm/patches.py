"""Every vLLM symbol pipespec patches or touches privately, with the releases tested, why, how, and the way out.

The vllm-ascend discipline: one list, read before anything else changes. The plugin applies its patches
through ``apply_patches()`` only, in every process that loads it (applying twice is a no-op); the vLLM zoo's
harness makes its own (``scope = Scope.ZOO``) through ``compat``. Release-dependent reads (which runner a
run uses, which methods use aux states) are listed with the releases whose rules read them
(``compat/v0_XX.py``). ``compat.gate`` requires every symbol listed for the newest tested release of a newer
vLLM, so a newer release that dropped one is refused before it is used.

Imports vLLM lazily, inside ``apply_patches``; importing this module needs no vLLM.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipespec.integrations.vllm.compat.releases import TESTED_RELEASES, Scope

ALL = TESTED_RELEASES
V032, V033, V034 = TESTED_RELEASES


@dataclass(frozen=True)
class Patch:
    """One vLLM symbol pipespec changes at run time, or reads / calls although vLLM does not publish it."""

    symbol: str  # dotted path of what is replaced or touched
    where: str  # the processes it runs in
    tested: tuple[str, ...]  # the releases it is used on and checked in (docs/vllm.md "Versions tested": how)
    why: str
    how: str
    upstream: str  # the upstream change that would make it unnecessary
    removal: str  # when and how it goes away
    scope: Scope = Scope.PLUGIN  # the plugin (every vLLM run) or the vLLM zoo's harness only


PATCHES = (
    Patch(
        symbol="vllm.engine.arg_utils.EngineArgs.create_engine_config",
        where="front-end (LLM(...), vllm serve): where the VllmConfig is built, before any process is spawned",
        tested=ALL,
        why=(
            "a general plugin is called without arguments before the run's config exists, and no vLLM hook "
            "sees the model architecture, the speculative method and the PP size together before weights "
            "load; create_engine_config is the first place that has all three, in the front-end, before the "
            "engine core and workers are spawned (so a refusal costs no process start)"
        ),
        how=(
            "wraps the method: after vLLM builds the VllmConfig, pipespec.integrations.vllm.adapt_at_load."
            "apply_to_engine_config decides (supported / adapt / refuse), and for 'adapt' sets "
            "model_config.model_class_overrides[arch] to the adapted module, which every process then registers"
        ),
        upstream="a config-time plugin hook in vLLM (a callback that receives the VllmConfig); none exists in 0.32-0.34",
        removal="move the call into that hook when vLLM has one; until then re-test on every vLLM minor release",
    ),
    Patch(
        symbol="vllm.model_executor.model_loader.utils._MODEL_ARCH_BY_HASH",
        where="the process that built the config (front-end; also the engine when it runs in-process)",
        tested=ALL,
        why=(
            "get_model_architecture caches the resolved class per model path; an entry made before pipespec "
            "registered the adapted class would keep serving the unadapted one in that process"
        ),
        how="cleared (it is a cache) right after the adapted class is registered; nothing is replaced",
        upstream="ModelRegistry.register_model invalidating that cache itself",
        removal="drop the clear when register_model invalidates the cache upstream",
    ),
    Patch(
        symbol="vllm.config.model.ModelConfig.model_class_overrides",
        where="front-end (written); every process (vLLM registers the overrides when it resolves a model class)",
        tested=ALL,
        why="the one per-run mechanism vLLM applies in every process, spawned workers included",
        how="public field: apply_to_engine_config sets model_class_overrides[arch] = the adapted module:Class",
        upstream="none needed (public API); listed because the plugin depends on its semantics",
        removal="none planned: re-test its semantics on every vLLM minor release",
    ),
    Patch(
        symbol="vllm.model_executor.models.registry._ModelRegistry.register_model",
        where="front-end, right after the decision",
        tested=ALL,
        why="so later lookups in the front-end process (and get_model_architecture) resolve the adapted class",
        how="public API (ModelRegistry.register_model(arch, 'module:Class')); an existing name may be re-registered",
        upstream="none needed (public API); listed because the plugin depends on re-registration being allowed",
        removal="none planned: re-test on every vLLM minor release",
    ),
    Patch(
        symbol="vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils.get_eagle3_aux_layers_from_config",
        where="front-end, at engine load (compat: draft_aux_ids)",
        tested=ALL,
        why="the draft's aux ids must be read exactly as vLLM reads them (eagle, dflash, dspark config fields)",
        how="called (a module of the V2 runner, not a published API); the ids are checked against 0..N",
        upstream="a public reader of a draft's aux ids",
        removal="call the public reader when there is one",
    ),
    Patch(
        symbol="vllm.config.vllm.VllmConfig.use_v2_model_runner",
        where="front-end, at engine load (compat.v0_32 runner_for)",
        tested=(V032, V033),
        why="only the V2 model runner relays aux states between PP ranks; this property says which one a run uses",
        how="read; EAGLE3-family methods over PP on the V1 runner are refused in one line",
        upstream="gone in 0.34 with the V1 runner (compat.v0_34 reads nothing of it)",
        removal="delete with compat/v0_32.py and v0_33.py",
    ),
    Patch(
        symbol="vllm.envs.VLLM_USE_V2_MODEL_RUNNER",
        where="`pipespec verify --engine vllm` (no config: the build's default runner)",
        tested=(V032, V033),
        why="without a VllmConfig the default runner is this variable, else Triton's presence",
        how="read, with vllm.triton_utils.HAS_TRITON",
        upstream="gone in 0.34 (setting it to anything but 1 is an error there)",
        removal="delete with compat/v0_32.py and v0_33.py",
    ),
    Patch(
        symbol="vllm.triton_utils.HAS_TRITON",
        where="`pipespec verify --engine vllm` (no config)",
        tested=(V032, V033),
        why="the V2 runner needs Triton: without it vLLM picks the V1 runner by default",
        how="read",
        upstream="none (it is vLLM's own switch); unused from 0.34",
        removal="delete with compat/v0_32.py and v0_33.py",
    ),
    Patch(
        symbol="vllm.platforms.interface.Platform.is_unspecified",
        where="`pipespec verify --engine vllm` (no config; compat.v0_33)",
        tested=(V033,),
        why="0.33's default runner is V2 without Triton on an unspecified platform",
        how="called on current_platform",
        upstream="none; unused from 0.34",
        removal="delete with compat/v0_33.py",
    ),
    Patch(
        symbol="vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils.requires_aux_hidden_states",
        where="front-end, at engine load (compat.v0_33 aux_method)",
        tested=(V033,),
        why="0.33's V2 runner decides with it whether a method needs aux states (eagle3 unless its draft opts out)",
        how="called (a module of the V2 runner)",
        upstream="0.34's SpeculativeConfig.uses_aux_hidden_states replaces it",
        removal="delete with compat/v0_33.py",
    ),
    Patch(
        symbol="vllm.config.speculative.SpeculativeConfig.uses_aux_hidden_states",
        where="front-end, at engine load (compat.v0_34 aux_method)",
        tested=(V034,),
        why="0.34 decides per method config: eagle3, dflash and its subclasses, extract_hidden_states, registered methods",
        how="read (public property)",
        upstream="none needed",
        removal="none planned",
    ),
    Patch(
        symbol="vllm.v1.worker.gpu.spec_decode.speculator_config.get_custom_speculator_config_class",
        where="`pipespec verify --engine vllm` with a method name only (compat.v0_34 method_uses_aux)",
        tested=(V034,),
        why="a method registered with register_speculative_method may use aux states; only its config class says",
        how="called; its base_method or its own uses_aux_hidden_states decides",
        upstream="a public lookup of registered speculative methods (vLLM calls the interface experimental)",
        removal="call the public lookup when there is one",
    ),
    Patch(
        symbol="vllm.v1.worker.gpu.spec_decode.speculator_config.SpeculatorConfig",
        where="`pipespec verify --engine vllm` with a method name only (compat.v0_34 method_uses_aux)",
        tested=(V034,),
        why="a registered method's config that keeps the base class's uses_aux_hidden_states (False) uses none",
        how="read: its uses_aux_hidden_states property is compared with the registered class's",
        upstream="a public lookup of registered speculative methods",
        removal="call the public lookup when there is one",
    ),
    Patch(
        symbol="vllm.config.speculative.SpeculativeConfig.custom_method",
        where="front-end, at engine load (compat.v0_34 aux_method)",
        tested=(V034,),
        why="a registered method's name moves to custom_method (method becomes its built-in base): messages name it",
        how="read (public field)",
        upstream="none needed",
        removal="none planned",
    ),
    Patch(
        symbol="vllm.platforms.interface.Platform.uses_standalone_cpu_model_runner",
        where="front-end and `pipespec verify` (compat.v0_34 runner_for)",
        tested=(V034,),
        why="0.34's only runner without the aux relay is the standalone CPU runner (non-x86, no Triton)",
        how="called on current_platform",
        upstream="none needed (vLLM refuses speculative decoding on that runner itself)",
        removal="none planned",
    ),
    Patch(
        symbol="vllm.transformers_utils.config._CONFIG_REGISTRY",
        where="vLLM zoo workers (tiny.py, through compat.config_registry)",
        tested=ALL,
        why="the zoo's tiny configs for model types only vLLM knows need vLLM's own config classes",
        how="read (private module attribute)",
        upstream="a public map of vLLM's config classes",
        removal="read the public map when there is one",
        scope=Scope.ZOO,
    ),
    Patch(
        symbol="vllm.model_executor.custom_op.op_registry",
        where="vLLM zoo workers, while an adapted copy of a model module executes (harness._reregistration)",
        tested=ALL,
        why="re-executing a model module registers its CustomOp names again, which vLLM asserts against",
        how="the installed module's entries are set aside while the copy executes and put back after",
        upstream="none: the zoo re-executes vLLM's modules, which vLLM never does",
        removal="when the zoo builds adapted classes in a process of their own",
        scope=Scope.ZOO,
    ),
    Patch(
        symbol="vllm.utils.torch_utils.direct_register_custom_op",
        where="vLLM zoo workers, while an adapted copy of a model module executes (compat.custom_op_registration)",
        tested=ALL,
        why="an adapted copy defines the same torch.ops.vllm custom ops again (same source), which torch refuses",
        how="replaced by a wrapper that skips ops already defined, and restored after the copy executes",
        upstream="none: the zoo re-executes vLLM's modules, which vLLM never does",
        removal="when the zoo builds adapted classes in a process of their own",
        scope=Scope.ZOO,
    ),
    Patch(
        symbol="vllm.v1.worker.gpu.pp_utils.PPHandler.configure_aux_hidden_state_relay",
        where="vLLM zoo workers, the ranks of a PP = 2 / 3 check (pp_ranks.py)",
        tested=ALL,
        why="the zoo drives each rank as the V2 runner does, so the relay keys must come from vLLM's own code",
        how="called unbound on a stand-in holding the one attribute it sets (aux_hidden_state_relay_keys)",
        upstream="none: the zoo runs ranks without a runner, which vLLM never does",
        removal="when the zoo runs decoders inside vLLM's V2 runner (needs Triton)",
        scope=Scope.ZOO,
    ),
    Patch(
        symbol="vllm.v1.worker.gpu.pp_utils.PPHandler.relay_aux_hidden_states",
        where="vLLM zoo workers, the ranks of a PP = 2 / 3 check (pp_ranks.py)",
        tested=ALL,
        why="a middle rank must forward what earlier ranks packed exactly as the V2 runner merges it",
        how="called unbound on the same stand-in",
        upstream="none: the zoo runs ranks without a runner",
        removal="when the zoo runs decoders inside vLLM's V2 runner",
        scope=Scope.ZOO,
    ),
    Patch(
        symbol="vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils.set_eagle3_aux_hidden_state_layers",
        where="vLLM zoo workers (pp_ranks.py)",
        tested=ALL,
        why="the aux ids reach the model the way the V2 runner sets them (0.33 adds use_pp, defaulted)",
        how="called with a stand-in speculative config carrying the ids",
        upstream="none needed (the V2 runner's own load step)",
        removal="none planned",
        scope=Scope.ZOO,
    ),
    Patch(
        symbol="vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils.verify_supports_aux_hidden_states_over_pp",
        where="vLLM zoo workers (pp_ranks.py)",
        tested=ALL,
        why="a decoder vLLM's own check would refuse over PP is reported with vLLM's words",
        how="called",
        upstream="none needed",
        removal="none planned",
        scope=Scope.ZOO,
    ),
    Patch(
        symbol="vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils._inner_decoder",
        where="vLLM zoo workers (pp_ranks.py), in a failure message only",
        tested=ALL,
        why="says which module vLLM's V2 helpers took for the decoder when its check refuses",
        how="called (private)",
        upstream="a public accessor of the decoder the runner's helpers read",
        removal="call the public accessor when there is one",
        scope=Scope.ZOO,
    ),
    Patch(
        symbol="vllm.model_executor.layers.attention_layer_base.AttentionLayerBase",
        where="vLLM zoo workers (harness._silence_attention), on the zoo's own model instances",
        tested=ALL,
        why="the zoo runs decoders without a runner's attention metadata; aux states need only the residual stream",
        how="each instance's output zeroed by a forward hook, or its forward replaced on the instance (Mamba-1)",
        upstream="none: the zoo checks aux-state plumbing, not attention",
        removal="when the zoo drives decoders with real attention metadata",
        scope=Scope.ZOO,
    ),
    Patch(
        symbol="vllm.model_executor.layers.mamba.mamba_mixer2.MambaMixer2.forward",
        where="vLLM zoo workers (harness._silence_attention), on the zoo's own model instances",
        tested=ALL,
        why="without metadata vLLM warms up its SSD kernels, which fails on CPU",
        how="replaced on the instance by one returning zeros of the stream's shape",
        upstream="none: the zoo checks aux-state plumbing, not the mixer",
        removal="when the zoo drives decoders with real metadata",
        scope=Scope.ZOO,
    ),
    Patch(
        symbol="vllm.model_executor.models.transformers.base.Base",
        where="every process that builds a model of vLLM's Transformers modeling backend for an aux-state method "
              "(registered through model_class_overrides, like an adapted module)",
        tested=ALL,
        why=(
            "the backend's EAGLE3 path records aux states with transformers' OutputRecorder at "
            "`_layer_names[id - 1]` (id 0 raises KeyError: -1 at load), its first rank of a pipeline records "
            "nothing (the recorders target the layer list's last entry's class, a PPMissingLayer there: IndexError "
            "at the first forward), a non-last rank's forward returns hidden_states only, and its decoder has no "
            "supports_aux_hidden_states_over_pp: no aux state crosses a PP boundary. Its decoder is transformers' "
            "own model, so there is no source for the codemod to adapt"
        ),
        how=(
            "subclassed, not replaced: transformers_backend.Pipespec<Class> (TransformersAuxOverPP before each text "
            "causal-LM class of the backend) overrides set_aux_hidden_state_layers (ids per plan_layout; layer outputs "
            "recorded by OutputRecorder at the private _layer_names, id 0 through a parameter-free input tap) and "
            "forward (Base.forward's input handling through compat, the same in 0.32-0.34, then pack / collect per "
            "stage); it sets "
            "supports_aux_hidden_states_over_pp, AUX_HIDDEN_STATE_KEY and _aux_slot_base_cached on the wrapped "
            "transformers model, where the V2 runner's helpers read them"
        ),
        upstream=(
            "the backend capturing id 0 (the input of layer 0), packing its recorded states into the non-last rank's "
            "IntermediateTensors and collecting them on the last, with supports_aux_hidden_states_over_pp on its "
            "decoder, as vLLM's own decoders do"
        ),
        removal=(
            "drop the subclass and its decide() hook for the releases whose backend does that (the per-stage and "
            "end-to-end tests in tests/vllm/test_transformers_backend.py say when it does)"
        ),
    ),
)

_APPLIED = False


def _wrap_create_engine_config(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        from pipespec.integrations.vllm.adapt_at_load import apply_to_engine_config

        vllm_config = original(self, *args, **kwargs)
        apply_to_engine_config(vllm_config)
        return vllm_config

    create_engine_config.__pipespec_original__ = original  # type: ignore[attr-defined]
    return create_engine_config


def apply_patches() -> None:
    """Apply ``PATCHES`` (idempotent: a process that loads the plugin twice patches once)."""
    global _APPLIED
    if _APPLIED:
        return
    from vllm.engine.arg_utils import EngineArgs

    current = EngineArgs.create_engine_config
    if not hasattr(current, "__pipespec_original__"):
        EngineArgs.create_engine_config = _wrap_create_engine_config(current)  # type: ignore[method-assign]
    _APPLIED = True


def forget_cached_architectures() -> None:
    """The ``_MODEL_ARCH_BY_HASH`` entry of ``PATCHES``: drop classes resolved before a registration."""
    from pipespec.integrations.vllm.compat import current

    current().forget_cached_architectures()
