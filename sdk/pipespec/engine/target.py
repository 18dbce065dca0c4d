"""One pipeline stage of the target model: resolve, verify, plan, then load only this stage's weights.

``build_target_stage`` runs the load-time sequence of DESIGN.md in this order, so an unsupported model or
an impossible layout is refused before a single weight byte is read:

1. read ``config.json`` and the safetensors headers (``pipespec.pp.loading.open_checkpoint``);
2. registry lookup (architecture, then model type) → decoder class → ``pipespec.integrations.transformers.adapt.adapt``;
3. ``verify_supports_aux_hidden_states_over_pp`` on the adapted class, plan the layout with the spec's
   boundary rule, verify again against the layout;
4. build the causal LM on the meta device with the adapted decoder in place of its own, configure the
   stage (``set_pipeline_stage`` + ``set_aux_hidden_state_layers``: relay keys and receive slots follow);
5. materialise and read only this stage's modules: its layers; the embedding on the first stage (and on
   the last when the draft needs the target's embedding or the head is tied to it); the final norm and
   ``lm_head`` on the last. Everything else stays on meta.

``TargetStage.forward`` is the stage's share of one target forward, with the calling convention of
``pipespec.adapt`` (stage 0 gets ``input_ids``, later stages ``intermediate_tensors``).
"""

from __future__ import annotations

import importlib
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pipespec.contract.intermediate import IntermediateTensors
from pipespec.contract.layout import LayoutPlan, StagePlan, plan_layout
from pipespec.contract.mixin import hop_keys
from pipespec.contract.registry import default_registry
from pipespec.contract.spec import AdapterSpec
from pipespec.contract.verify import verify_supports_aux_hidden_states_over_pp
from pipespec.errors import CheckpointError, UnsupportedModelError
from pipespec.pp.loading import Checkpoint, LoadReport, TensorReader, materialize, open_checkpoint


@dataclass
class ResolvedTarget:
    """Everything known about the target before any weight is read."""

    checkpoint: Checkpoint
    config: Any
    spec: AdapterSpec
    decoder_cls: type
    causal_cls: type
    num_layers: int


@dataclass
class LoadStats:
    """Per-stage loading numbers (printed, and returned in the JSON)."""

    bytes_read: int
    checkpoint_bytes: int
    tensors_read: int
    seconds: float

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "bytes_read": self.bytes_read, "checkpoint_bytes": self.checkpoint_bytes,
            "tensors_read": self.tensors_read, "load_s": round(self.seconds, 4),
        }


def _import_class(path: str) -> type:
    module_name, _, name = path.partition(":")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise UnsupportedModelError(f"the adapter spec names {path}, which cannot be imported ({exc})") from None


def resolve_target(target_dir: str, *, registry: Any = None) -> ResolvedTarget:
    """Config, spec and classes of a target checkpoint (reads JSON only)."""
    from transformers import AutoConfig

    checkpoint = open_checkpoint(target_dir)
    try:
        config = AutoConfig.from_pretrained(str(checkpoint.directory), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - transformers raises ValueError/OSError/KeyError variants
        # transformers' messages run over several lines (upgrade advice ...): keep the first, the error is one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{checkpoint.directory}/config.json is not a transformers config this version can read: {first}") from None
    registry = registry or default_registry()
    spec = None
    for arch in list(getattr(config, "architectures", None) or []):
        spec = registry.lookup(arch)
        if spec is not None:
            break
    if spec is None:
        spec = registry.lookup(str(config.model_type))
    if spec is not None:
        decoder_cls = _import_class(spec.decoder_class)
    else:
        from pipespec.integrations.transformers.infer import decoder_class_for_model_type, infer_spec

        decoder_cls = decoder_class_for_model_type(str(config.model_type))
        spec = infer_spec(decoder_cls, model_type=str(config.model_type))
    causal_cls = _causal_class(config)
    num_layers = getattr(config, spec.num_layers_key, None)
    if num_layers is None:
        raise CheckpointError(f"{checkpoint.directory}/config.json has no {spec.num_layers_key}: cannot tell the layer count")
    return ResolvedTarget(checkpoint, config, spec, decoder_cls, causal_cls, int(num_layers))


def _causal_class(config: Any) -> type:
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    for arch in list(getattr(config, "architectures", None) or []):
        cls = getattr(transformers, arch, None)
        if isinstance(cls, type) and "CausalLM" in arch:
            return cls
    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        raise UnsupportedModelError(
            f"{type(config).__name__} (model_type {config.model_type!r}) has no causal-LM class in transformers: "
            "pipespec generate needs a decoder with an lm_head"
        ) from None


def plan_target(resolved: ResolvedTarget, adapted_cls: type, pp_size: int, partition: Sequence[int] | None,
                aux_layers: Sequence[int], method: str = "eagle3") -> LayoutPlan:
    """Verify the adapted class, then plan and verify the layout (no weights involved)."""
    verify_supports_aux_hidden_states_over_pp(adapted_cls, method)
    plan = plan_layout(resolved.num_layers, pp_size, aux_layers=aux_layers, partition=partition,
                       boundary_rule=resolved.spec.boundary_rule)
    verify_supports_aux_hidden_states_over_pp(adapted_cls, method, layout=plan)
    return plan


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


@dataclass
class TargetStage:
    """This process's slice of the target, ready to run its share of each forward."""

    resolved: ResolvedTarget
    plan: LayoutPlan
    stage: StagePlan
    decoder: nn.Module
    lm_head: nn.Module | None
    embed: nn.Module | None
    cache_kwarg: str
    device: torch.device
    dtype: torch.dtype
    load: LoadStats
    report: LoadReport = field(repr=False, default_factory=LoadReport)

    @property
    def hidden_size(self) -> int:
        return int(self.resolved.config.hidden_size)

    @property
    def has_residual(self) -> bool:
        return bool(self.resolved.spec.residual)

    def send_keys(self) -> tuple[str, ...]:
        """Keys this stage sends to the next one (empty on the last stage)."""
        return () if self.stage.is_last else hop_keys(self.stage, self.has_residual)

    def receive_keys(self) -> tuple[str, ...]:
        """Keys this stage receives: what the previous stage sends, checked against the model's own slots."""
        if self.stage.is_first:
            return ()
        keys = hop_keys(self.plan.stage(self.stage.rank - 1), self.has_residual)
        slots = self.decoder.make_empty_intermediate_tensors((1, 1), self.dtype, "meta", self.hidden_size)
        if set(slots.keys()) != set(keys):
            raise RuntimeError(
                f"stage {self.stage.rank} reserves receive slots {sorted(slots.keys())} but stage "
                f"{self.stage.rank - 1} sends {list(keys)}: the layout plans disagree"
            )
        return keys

    def new_cache(self, record_past: bool = False) -> Any:
        """A fresh ``StageCache`` for this stage; ``record_past`` keeps sliding-window layers able to roll
        back past their window (speculative decoding crops rejected positions after every step)."""
        from pipespec.integrations.transformers.stage_cache import new_stage_cache

        return new_stage_cache(self.decoder, record_past=record_past)

    @torch.no_grad()
    def forward(
        self, cache: Any, position_ids: torch.Tensor, input_ids: torch.Tensor | None = None,
        received: IntermediateTensors | None = None, attention_mask: torch.Tensor | None = None,
    ) -> IntermediateTensors | tuple[torch.Tensor, list[torch.Tensor]]:
        """Run this stage's layers on one forward's tokens (``attention_mask [B, cached + T]``: which
        cache slots and new tokens are real, for a batch with holes; see ``pipespec.engine.row_batch``).

        Non-last stages return what to send on; the last stage returns ``(logits [B, T, V], aux)`` where
        ``aux`` lists the aux states ``[B, T, H]`` in id order (empty when no aux ids are set).
        """
        kwargs = {self.cache_kwarg: cache, "use_cache": True, "position_ids": position_ids}
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        if self.stage.is_first:
            out = self.decoder(input_ids=input_ids, intermediate_tensors=None, **kwargs)
        else:
            out = self.decoder(input_ids=None, intermediate_tensors=received, **kwargs)
        if not self.stage.is_last:
            if not isinstance(out, IntermediateTensors):
                raise RuntimeError(f"stage {self.stage.rank} forward returned {type(out).__name__}, not IntermediateTensors")
            return out
        aux: list[torch.Tensor] = []
        if self.plan.aux_layers:
            out, aux = out
            if len(aux) != len(self.plan.aux_layers):
                raise RuntimeError(
                    f"the last stage returned {len(aux)} aux hidden states for aux ids {list(self.plan.aux_layers)}"
                )
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        assert self.lm_head is not None
        return self.lm_head(hidden), list(aux)


def _meta_model(resolved: ResolvedTarget, adapted_cls: type, dtype: torch.dtype) -> tuple[nn.Module, Any, str]:
    """The causal LM on the meta device with the adapted decoder in place of its own: (causal LM, decoder,
    the attribute that holds it)."""
    config = resolved.config
    previous = torch.get_default_dtype()
    try:
        torch.set_default_dtype(dtype)
        with torch.device("meta"):
            causal = resolved.causal_cls(config)
            decoder = adapted_cls(config)
    finally:
        torch.set_default_dtype(previous)
    prefix = getattr(causal, "base_model_prefix", "model") or "model"
    if not isinstance(getattr(causal, prefix, None), nn.Module):
        raise UnsupportedModelError(f"{resolved.causal_cls.__name__} has no base model at .{prefix}")
    setattr(causal, prefix, decoder)
    return causal, decoder, prefix


def build_target_stage(
    target_dir: str,
    rank: int,
    pp_size: int,
    *,
    partition: Sequence[int] | None = None,
    aux_layers: Sequence[int] = (),
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    embed_on_last: bool = False,
    method: str = "eagle3",
    resolved: ResolvedTarget | None = None,
) -> TargetStage:
    """Resolve, verify, plan and load stage ``rank`` of a ``pp_size``-stage pipeline (see module doc)."""
    from pipespec.integrations.transformers.adapt import adapt, cache_kwarg_name

    device = torch.device(device)
    resolved = resolved or resolve_target(target_dir)
    adapted_cls = adapt(resolved.decoder_cls, resolved.spec)
    plan = plan_target(resolved, adapted_cls, pp_size, partition, aux_layers, method)
    stage = plan.stage(rank)
    config = resolved.config
    spec = resolved.spec

    started = time.perf_counter()
    causal, decoder, prefix = _meta_model(resolved, adapted_cls, dtype)
    decoder.set_pipeline_stage(rank, pp_size, plan.partition, spec.boundary_rule)
    decoder.set_aux_hidden_state_layers(plan.aux_layers)

    head = causal.get_output_embeddings() if stage.is_last else None
    head_name = next((n for n, m in causal.named_modules() if m is head), None) if head is not None else None
    if stage.is_last and head_name is None:
        raise UnsupportedModelError(f"{resolved.causal_cls.__name__} has no output embedding (lm_head)")
    tied = bool(getattr(config.get_text_config() if hasattr(config, "get_text_config") else config, "tie_word_embeddings", False))
    needs_embed = stage.is_first or (stage.is_last and (embed_on_last or tied))

    layers = f"{prefix}.{spec.layers_attr}"
    layer_re = re.compile(rf"^{re.escape(layers)}\.(\d+)(\.|$)")
    embed_name, norm_name = f"{prefix}.{spec.embed_attr}", f"{prefix}.{spec.norm_attr}"

    def keep(name: str) -> bool:
        match = layer_re.match(name)
        if match:
            return stage.start_layer <= int(match.group(1)) < stage.end_layer
        if _under(name, embed_name):
            return needs_embed
        if _under(name, norm_name):
            return stage.is_last
        if head_name is not None and _under(name, head_name):
            return not tied
        return _under(name, prefix)

    reader = TensorReader(resolved.checkpoint)
    report = materialize(
        causal, keep, lambda n: n, reader, device,
        init_buffers=decoder._init_weights, needed_by=f"stage {rank} (layers [{stage.start_layer}, {stage.end_layer}))",
    )
    embed = _get(causal, embed_name) if needs_embed else None
    if stage.is_last and tied:
        assert head is not None and embed is not None
        head.weight = embed.weight
    causal.eval()
    stats = LoadStats(reader.bytes_read, resolved.checkpoint.total_bytes, reader.tensors_read, time.perf_counter() - started)
    reader.close()
    return TargetStage(
        resolved=resolved, plan=plan, stage=stage, decoder=decoder, lm_head=head, embed=embed,
        cache_kwarg=cache_kwarg_name(adapted_cls), device=device, dtype=dtype, load=stats, report=report,
    )


def _get(root: nn.Module, dotted: str) -> nn.Module:
    module = root
    for part in dotted.split("."):
        module = getattr(module, part)
    return module
