"""``pipespec verify``: would this architecture or class run eagle3 under this pipeline layout?

Exit 0 and a one-line verdict when supported; exit 1 with the verifier's message (what is wrong and
what to do) when not; exit 2 for bad flags or an impossible layout.

``--engine vllm`` answers what pipespec's vLLM plugin would do at engine load for ``--architecture``
(vLLM's name) at ``--pp`` — supported as it is / adapt (with which spec) / refuse (why) — without loading
weights; ``--json`` prints ``{"architecture", "class", "decision", "reason", "spec"}``; exit 0 unless
refused (2). vLLM is imported only then; without it, one line and exit 2. ``--model-impl transformers``
asks the same for vLLM's Transformers modeling backend (``model_impl="transformers"``): the backend class
vLLM resolves ``--architecture`` to, which the plugin replaces with pipespec's subclass.

``--engine sglang`` answers the same for pipespec's SGLang plugin (the class SGLang's registry names for
``--architecture``, adapted with the SGLang codemod), in the same JSON shape and exit codes; SGLang is
imported only then.
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path
from typing import Any

from pipespec.cli.args import add_layout_arguments, layout_from_args
from pipespec.contract.registry import default_registry
from pipespec.contract.verify import METHODS, verify_supports_aux_hidden_states_over_pp
from pipespec.errors import UnsupportedModelError, UsageError
from pipespec.integrations.verdict import Verdict

HELP = "check that an architecture or class supports aux hidden states over PP for a layout"
ENGINES = ("transformers", "vllm", "sglang")
MODEL_IMPLS = ("vllm", "transformers")  # vLLM's model_impl values verify answers for
NEEDS_VLLM = "pipespec verify --engine vllm needs vLLM (>= 0.32) installed: run it where vLLM is (`pip install 'pipespec[vllm]'`)"
NEEDS_SGLANG = ("pipespec verify --engine sglang needs SGLang (0.5.23) importable: run it where SGLang is "
                "(`pip install 'pipespec[sglang]'`)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--architecture", metavar="A", help="HF architectures name, e.g. LlamaForCausalLM")
    which.add_argument("--class", dest="class_path", metavar="module:Class", help="decoder class to import and check")
    parser.add_argument("--method", default="eagle3", choices=METHODS,
                        help="speculative method whose draft reads the target (default eagle3)")
    add_layout_arguments(parser, num_layers_required=False)
    parser.add_argument("--engine", choices=ENGINES, default="transformers",
                        help="transformers (default): pipespec's registry and verifier; vllm / sglang: what pipespec's plugin "
                             "for that engine would do")
    parser.add_argument("--model-impl", metavar="IMPL",
                        help="--engine vllm: vllm (default: the class vLLM's registry names) or transformers (vLLM's "
                             "Transformers modeling backend, as with LLM(model_impl='transformers'))")
    parser.add_argument("--json", action="store_true",
                        help='--engine vllm or sglang: print {"architecture", "class", "decision", "reason", "spec"}')


def run_vllm(args: argparse.Namespace) -> int:
    """``--engine vllm``: the plugin's decision for this architecture and PP size, without weights."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise UsageError(NEEDS_VLLM) from None
    from pipespec.integrations.vllm.adapt_at_load import verify_architecture

    cls = import_class(args.class_path) if args.class_path else None
    if args.model_impl == "transformers":
        if cls is not None:
            raise UsageError("--model-impl transformers picks the backend class for --architecture; --class names the "
                             "class to check itself: give one of the two")
        from pipespec.integrations.vllm.transformers_backend import resolve_backend_class

        cls = resolve_backend_class(args.architecture)
    decision = verify_architecture(args.architecture, args.method, args.pp, cls)
    return report(decision, args.json)


def run_sglang(args: argparse.Namespace) -> int:
    """``--engine sglang``: the SGLang plugin's decision for this architecture and PP size, without weights."""
    if args.class_path:
        raise UsageError("--engine sglang checks an architecture SGLang registers: give --architecture, not --class")
    try:
        import sglang  # noqa: F401
    except ImportError as exc:
        raise UsageError(f"{NEEDS_SGLANG} ({exc})") from None
    from pipespec.integrations.sglang.adapt_at_load import verify_architecture

    decision = verify_architecture(args.architecture, args.pp)
    return report(decision, args.json)


def report(decision: Any, as_json: bool) -> int:
    """An engine plugin's decision (vLLM's or SGLang's ``Decision``) as JSON or one line; exit 2 when refused."""
    if as_json:
        print(json.dumps(decision.as_json()))
    else:
        spec = f" (spec: {decision.spec})" if decision.spec else ""
        print(f"{decision.architecture}: {decision.decision}{spec}: {decision.reason}")
    return 2 if decision.decision is Verdict.REFUSE else 0


def import_class(path: str) -> type:
    module_name, sep, name = path.partition(":")
    if not sep or not module_name or not name:
        raise UsageError(f"--class {path!r} is not 'package.module:ClassName'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UsageError(f"--class {path!r}: cannot import module {module_name!r} ({exc})") from None
    cls = getattr(module, name, None)
    if not isinstance(cls, type):
        raise UsageError(f"--class {path!r}: module {module_name!r} has no class {name!r}")
    return cls


def check_model_impl(args: argparse.Namespace) -> None:
    """``--model-impl`` is one of ``MODEL_IMPLS`` and only with ``--engine vllm`` (one line, exit 2)."""
    if args.model_impl is None:
        return
    if args.engine != "vllm":
        raise UsageError(f"--model-impl {args.model_impl} is for --engine vllm (vLLM's model_impl); "
                         f"--engine {args.engine} checks pipespec's own registry: drop --model-impl or add --engine vllm")
    if args.model_impl not in MODEL_IMPLS:
        raise UsageError(f"--model-impl {args.model_impl!r} is not one of {', '.join(MODEL_IMPLS)}: vllm for vLLM's own "
                         "model classes, transformers for its Transformers modeling backend")


def run(args: argparse.Namespace) -> int:
    check_model_impl(args)
    if args.engine == "vllm":
        return run_vllm(args)
    if args.engine == "sglang":
        return run_sglang(args)
    if args.json:
        raise UsageError("--json is for --engine vllm or sglang (the transformers check prints one line)")
    registry = default_registry()
    if args.architecture:
        spec = registry.lookup(args.architecture)
        if spec is None:
            raise UnsupportedModelError(
                f"`{args.architecture}` does not support {args.method} with pipeline parallelism: no adapter spec "
                "names this architecture. Write one: `adapter-gen new <model_type>` scaffolds adapters/<model_type>.toml"
            )
        if not spec.supported:
            raise UnsupportedModelError(
                f"`{args.architecture}` does not support {args.method} with pipeline parallelism: "
                f"{spec.reason.rstrip('.')} ({spec.source}). Adapt its forward with adapter-gen and register the result"
            )
        # A class that a spec names is supported by that spec, and the boundary rule is the spec's: the
        # spec answers, and the decoder class is not imported (that would load torch and the model's
        # library). `--class` checks a class itself: its parents and its own forward.
        target: object = None
        name, rule = args.architecture, spec.boundary_rule
        entry = registry.lookup_entry(args.architecture)
        via = f" (spec {Path(spec.source).name if entry is not None and entry.origin == 'builtin' else spec.source})"
    else:
        target = import_class(args.class_path)
        spec = registry.lookup(target)
        name, rule = args.class_path, spec.boundary_rule if spec else "allow"
    if args.num_layers is None:
        raise UsageError("--num-layers is required to check a layout (the model's decoder layer count N)")
    if args.boundary_rule == "allow":
        args.boundary_rule = rule
    default_aux = spec.default_aux_ids(args.num_layers) if spec else ()
    layout = layout_from_args(args, default_aux=default_aux)
    if target is not None:
        support = verify_supports_aux_hidden_states_over_pp(target, args.method, layout, registry)
        via = "" if support.supported_by is target else f" (inherited from {support.supported_by.__name__})"
    print(
        f"{name}: supported for {args.method} with PP={layout.pp_size}, partition {list(layout.partition)}, "
        f"aux ids {list(layout.aux_layers)}, boundary rule {layout.boundary_rule}{via}"
    )
    return 0
