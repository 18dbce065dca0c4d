"""What pipespec does for one vLLM run: nothing, adapt the model class, or refuse — decided before weights load.

``decide(architecture, cls, method, pp)`` is the verdict on a resolved vLLM model class (also what
``pipespec verify --engine vllm`` prints); ``apply_to_engine_config(vllm_config)`` is the engine-load step
the plugin's one patch calls right after vLLM builds its config, in the front-end:

* no method that reads aux hidden states (as the release decides it: ``compat``; eagle3, dflash, dspark,
  extract_hidden_states, and on 0.34 any method whose config says so) → nothing;
* the draft's aux ids outside the target's layers → ``UsageError``;
* PP > 1 on a runner that does not relay aux states (vLLM 0.32/0.33's V1 runner: the drafter on the last
  rank only, no relay; only the V2 runner relays) → ``UnsupportedModelError`` naming the runner;
* the class already supports the run (``judge_vllm_class``: decided on the class itself, not on an
  inherited flag) → nothing;
* else the class's own module is adapted with the vLLM-native codemod, the result is verified, and its
  ``module:Class`` goes into ``model_class_overrides`` (vLLM registers it in every process) — or the run
  is refused in vLLM's words plus pipespec's reason.

Imports vLLM (this is ``pipespec.integrations.vllm``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from pipespec.codemods.vllm_native_status import DecoderStatus
from pipespec.errors import PipespecError, UnsupportedModelError, UsageError
from pipespec.integrations.verdict import Verdict
from pipespec.integrations.vllm import compat
from pipespec.integrations.vllm.adapted_modules import adapted_module_name, install_finder
from pipespec.integrations.vllm.readiness import judge_vllm_class


@dataclass(frozen=True)
class Decision:
    """The plugin's verdict on one model class for one run (``pipespec verify --engine vllm --json``)."""

    architecture: str
    cls: str  # module:Class vLLM resolves the architecture to
    decision: Verdict
    reason: str
    spec: str | None = None  # the adapter spec behind "adapt": "built-in gemma2", "inferred", ...
    target: str | None = None  # module:Class of the adapted class ("adapt" only)

    def __post_init__(self) -> None:
        object.__setattr__(self, "decision", Verdict(self.decision))  # a plain "refuse" becomes Verdict.REFUSE

    def as_json(self) -> dict[str, Any]:
        """DESIGN.md's CLI contract: architecture, class, decision, reason, spec."""
        data = asdict(self)
        data["class"] = data.pop("cls")
        data.pop("target")
        return data

    def log_line(self, method: str, pp: int) -> str:
        where = f"over PP={pp}" if pp > 1 else "at PP=1"
        name = self.cls.rpartition(":")[2]
        return f"pipespec: adapted {name} for {method} {where} (spec: {self.spec})"


def _class_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__name__}"


def _needs(method: str, pp: int) -> str:
    return f"{method} with pipeline parallelism" if pp > 1 else method


def decide(architecture: str, cls: type, method: str = "eagle3", pp: int = 1) -> Decision:
    """Supported as is, adapt (and to what), or refuse, for ``cls`` registered as ``architecture``.

    Builds and imports the adapted module when adaptation is needed (no weights, no model instance),
    so "adapt" is only answered for a class that passed the same check afterwards.
    """
    path = _class_path(cls)
    release = compat.current()
    if not release.method_uses_aux(method):
        return Decision(architecture, path, Verdict.SKIP, f"{method!r} reads no aux hidden states in vLLM "
                                                          f"{release.name} ({', '.join(release.AUX_METHODS)} do)")
    from pipespec.integrations.vllm import transformers_backend

    if transformers_backend.is_backend_class(cls):  # no decoder source to rewrite: pipespec's subclass instead
        tf = transformers_backend.backend_verdict(cls, method, pp)
        return Decision(architecture, path, tf.decision, tf.reason, tf.spec, tf.target)
    before = judge_vllm_class(cls, pp=pp)
    drops_aux = False  # a forward known to return no aux states: never left to vLLM's own check
    if before.supported and pp == 1:
        # vLLM checks only the interfaces at PP = 1; a forward that overrides the flag-carrying parent's
        # without aux handling (qwen3_vl's Qwen3LLMModel) returns no aux states there either.
        over_pp = judge_vllm_class(cls, pp=2)
        if not over_pp.supported and over_pp.supported_by is not None and not over_pp.opted_out:
            before, drops_aux = over_pp, True
    if before.supported:
        return Decision(architecture, path, Verdict.SUPPORTED, before.message(method, cls.__name__))
    head = f"{cls.__name__} does not support {_needs(method, pp)}: {before.reason}"
    if before.opted_out:
        return Decision(architecture, path, Verdict.REFUSE, f"{head}; the class opts out itself, so pipespec leaves it alone")
    name = adapted_module_name(cls.__module__, cls.__name__, architecture)
    try:
        built = install_finder().built(name)
    except PipespecError as exc:
        return _vllm_own_or_refuse(architecture, cls, pp, drops_aux, head, f"pipespec cannot adapt it: {exc}")
    if built.status is not DecoderStatus.ADAPTED:
        why = built.reason or "the codemod left its decoder unchanged"
        return _vllm_own_or_refuse(architecture, cls, pp, drops_aux, head,
                                   f"pipespec cannot adapt it: {built.status} ({why})", built.spec.label)
    adapted = getattr(install_finder().import_adapted(name), cls.__name__)
    # Checked at PP >= 2 even for a PP = 1 run: the adapted class must also serve plain pipelines.
    after = judge_vllm_class(adapted, pp=max(pp, 2))
    if not after.supported:
        return Decision(architecture, path, Verdict.REFUSE,
                        f"{head}; pipespec's adaptation of {built.source_file} fails the check: {after.reason}",
                        built.spec.label)
    return Decision(architecture, path, Verdict.ADAPT, f"{head}; adapted from {built.source_file}", built.spec.label,
                    f"{name}:{cls.__name__}")


def _vllm_own_or_refuse(architecture: str, cls: type, pp: int, drops_aux: bool, head: str, cannot_adapt: str,
                        spec: str | None = None) -> Decision:
    """At PP = 1 a class vLLM itself gives ``SupportsEagle3`` (e.g. the Transformers backend, which captures
    through hooks, not through an ``EagleModelMixin`` decoder) is left to vLLM when pipespec cannot adapt
    it — unless its forward is known to drop aux states (``drops_aux``), which would fail mid-run.

    ``head`` says what the class lacks, ``cannot_adapt`` why pipespec cannot adapt it."""
    from vllm.model_executor.models.interfaces import supports_eagle3

    if pp == 1 and not drops_aux and supports_eagle3(cls):
        return Decision(architecture, _class_path(cls), Verdict.SUPPORTED,
                        f"{cls.__name__} implements vLLM's SupportsEagle3 (PP = 1; pipespec leaves it to vLLM: "
                        f"{cannot_adapt})")
    return Decision(architecture, _class_path(cls), Verdict.REFUSE, f"{head}; {cannot_adapt}", spec)


def v2_runner_available(vllm_config: Any | None = None) -> bool:
    """Whether the run's model runner relays aux states over PP (the release decides: ``compat``)."""
    return compat.current().relays_aux_over_pp(vllm_config)


def runner_refusal(method: str, pp: int, vllm_config: Any | None = None) -> str:
    """The one line for an aux-state method over PP on a runner that does not relay them."""
    release = compat.current()
    return release.runner_refusal(method, pp, release.runner_for(vllm_config))


def draft_aux_ids(speculative_config: Any) -> tuple[int, ...] | None:
    """The aux ids the draft asks for, read the way vLLM reads them (None: the target's defaults)."""
    return compat.current().draft_aux_ids(speculative_config)


def check_draft_aux_ids(speculative_config: Any, num_layers: int) -> None:
    """Aux ids must be layer ids 0..N of the target (id N: the last layer's output before the norm)."""
    ids = draft_aux_ids(speculative_config)
    if not ids:
        return
    bad = [i for i in ids if not isinstance(i, int) or i < 0 or i > num_layers]
    if bad:
        raise UsageError(
            f"draft {speculative_config.model}: aux hidden-state ids {list(ids)} include {bad}, outside the "
            f"target's layers (ids 0..{num_layers} for {num_layers} decoder layers): use a draft trained for "
            "this target, or fix eagle_aux_hidden_state_layer_ids in its config.json"
        )


def apply_to_engine_config(vllm_config: Any) -> Decision | None:
    """The engine-load step: decide for this run and register the adapted class, or raise. Idempotent."""
    from vllm.model_executor.models import ModelRegistry

    from pipespec.integrations.vllm.patches import forget_cached_architectures

    speculative = vllm_config.speculative_config
    method = compat.current().aux_method(speculative)
    if method is None:
        return None
    model_config = vllm_config.model_config
    pp = vllm_config.parallel_config.pipeline_parallel_size
    num_layers = getattr(model_config.hf_text_config, "num_hidden_layers", None)
    if isinstance(num_layers, int):
        check_draft_aux_ids(speculative, num_layers)
    if pp > 1 and not v2_runner_available(vllm_config):
        raise UnsupportedModelError(runner_refusal(method, pp, vllm_config))
    cls, architecture = model_config.registry.resolve_model_cls(model_config.architectures, model_config=model_config)
    if parse_target(model_config.model_class_overrides.get(architecture)):
        return None  # already applied to this config (create_engine_config called twice)
    decision = decide(architecture, cls, method, pp)
    if decision.decision is Verdict.REFUSE:
        raise UnsupportedModelError(decision.reason)
    if decision.decision is not Verdict.ADAPT or decision.target is None:
        return decision
    model_config.model_class_overrides[architecture] = decision.target
    ModelRegistry.register_model(architecture, decision.target)
    forget_cached_architectures()
    from vllm.logger import init_logger

    init_logger("vllm.plugins.pipespec").info(decision.log_line(method, pp))
    return decision


def parse_target(target: str | None) -> bool:
    """Whether an override target is one of pipespec's adapted modules."""
    from pipespec.integrations.vllm.adapted_modules import parse_adapted_module_name

    return bool(target) and parse_adapted_module_name(str(target).partition(":")[0]) is not None


def verify_architecture(architecture: str | None, method: str, pp: int, cls: type | None = None) -> Decision:
    """``pipespec verify --engine vllm``: what the plugin would do for this architecture (no weights, no config).

    Loads vLLM's general plugins first, so architectures other plugins register are known.
    """
    from vllm.model_executor.models import ModelRegistry
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    if pp < 1:
        raise UsageError(f"--pp {pp}: pipeline size must be >= 1")
    if cls is None:
        assert architecture is not None
        entry = ModelRegistry.models.get(architecture)
        if entry is None:
            return Decision(architecture, "", Verdict.REFUSE,
                            f"{architecture} is not an architecture of vLLM {_vllm_version()} (nor of any loaded vLLM "
                            "plugin): check the spelling (config.json's `architectures`), or register the model with "
                            "ModelRegistry.register_model")
        try:
            cls = entry.load_model_cls()
        except Exception as exc:  # e.g. a multimodal model whose processor needs torchvision
            where = f"{getattr(entry, 'module_name', '?')}:{getattr(entry, 'class_name', architecture)}"
            return Decision(architecture, where, Verdict.REFUSE,
                            f"{architecture}: vLLM's class {where} cannot be imported here ({type(exc).__name__}: "
                            f"{exc}), so pipespec can neither check nor adapt it; install what it needs and retry")
    name = architecture or cls.__name__
    if compat.current().method_uses_aux(method) and pp > 1 and not v2_runner_available():
        return Decision(name, _class_path(cls), Verdict.REFUSE, runner_refusal(method, pp))
    return decide(name, cls, method, pp)


def _vllm_version() -> str:
    import vllm

    return str(vllm.__version__)
