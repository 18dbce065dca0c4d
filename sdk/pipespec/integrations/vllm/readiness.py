"""Is a vLLM model class ready for EAGLE3 over pipeline parallelism, as it is? Decided on the class itself.

vLLM's own check (``verify_supports_aux_hidden_states_over_pp``) reads the inherited
``supports_aux_hidden_states_over_pp`` flag of the decoder instance. That lets two classes of vLLM 0.32
through that cannot work (qwen3_vl's ``Qwen3LLMModel`` and ``MossQwen3Model`` override ``forward``
without aux handling and inherit ``True`` from ``Qwen2Model``), and it cannot tell a transparent
override (``MistralModel.forward`` only returns ``super().forward(...)``) from a real one. Here support
follows pipespec's contract (DESIGN.md, "Support is not inherited blindly"):

* the class that carries the flag in its *own* ``__dict__`` decides (``False`` is an explicit opt-out);
* a subclass keeps its parent's support only if every ``forward`` between it and that parent either only
  delegates to ``super().forward`` or does the aux handling itself (collects remote and packs local
  aux states), else it is refused with vLLM's wording, the reason and the fix.

Reads source with ``inspect`` and ``ast``, following imports across files by the codemod's one
resolution rule (``pipespec.codemods.vllm_native_index.module_path``); never instantiates a model. Imports ``torch`` only through the
classes it is given, not ``vllm`` itself, so it can be tested on any class with vLLM's shape.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass
from pathlib import Path

from pipespec.codemods.vllm_native_index import module_path
from pipespec.contract.names import AUX_OVER_PP_FLAG, VLLM_AUX_CALLS, VLLM_EAGLE_MIXIN

FIX = ("adapt it with `adapter-gen {file} --dialect vllm --class {cls}` and register the result, "
       "or install pipespec's vLLM plugin (`pip install 'pipespec[vllm]'`), which adapts it at engine load")

OPTED_OUT_FIX = ("`{owner}` opts out on purpose, so neither vLLM nor pipespec's plugin adapts it; after checking "
                 "that its forward can relay aux states, drop that line and adapt it with "
                 "`adapter-gen {file} --dialect vllm --class {cls}`")


@dataclass(frozen=True)
class ClassFacts:
    """What the verdict reads of one class in a decoder's MRO: its flag and its own forward."""

    name: str
    file: str
    flag: object = None  # the value in the class's own body; None when it sets none
    sets_flag: bool = False
    defines_forward: bool = False
    forward: ast.FunctionDef | ast.AsyncFunctionDef | None = None  # None also when its source is unreadable
    forward_line: int = 0

    def forward_is_transparent(self) -> bool:
        """No own forward, or one that only delegates to super() or does the aux handling itself."""
        if not self.defines_forward:
            return True
        return self.forward is not None and (only_delegates_to_super(self.forward) or handles_aux_over_pp(self.forward))


@dataclass(frozen=True)
class Judgement:
    """The verdict on one decoder class: supported as it is, or why not and what to do."""

    name: str
    file: str
    supported: bool
    reason: str  # why (for supported classes: which class carries the support)
    supported_by: str | None = None  # the class whose own flag decides
    opted_out: bool = False  # the deciding class says False itself (MiMo): adapting is the user's call

    def message(self, method: str = "eagle3", model_name: str | None = None) -> str:
        """vLLM's wording ("X does not support eagle3 with pipeline parallelism") + reason + fix."""
        name = model_name or self.name
        if self.supported:
            return f"{name} supports {method} with pipeline parallelism ({self.reason})"
        fix = (OPTED_OUT_FIX if self.opted_out else FIX).format(file=self.file, cls=self.name,
                                                                  owner=self.supported_by or self.name)
        return f"{name} does not support {method} with pipeline parallelism: {self.reason}. Fix: {fix}"


def source_file(cls: type) -> str:
    """The file that defines ``cls`` (for messages), or its module name when there is no file."""
    try:
        return inspect.getsourcefile(cls) or cls.__module__
    except TypeError:
        return cls.__module__


def _function_node(func: object) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    try:
        source = textwrap.dedent(inspect.getsource(func))  # type: ignore[arg-type]
    except (OSError, TypeError):
        return None
    tree = ast.parse(source)
    node = tree.body[0] if tree.body else None
    return node if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) else None


def _is_docstring(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)


def only_delegates_to_super(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """True when the body is (a docstring and) ``return super().<same method>(...)`` and nothing else."""
    body = [s for s in node.body if not _is_docstring(s)]
    if len(body) != 1 or not isinstance(body[0], ast.Return) or not isinstance(body[0].value, ast.Call):
        return False
    target = body[0].value.func
    return (isinstance(target, ast.Attribute) and target.attr == node.name and isinstance(target.value, ast.Call)
            and isinstance(target.value.func, ast.Name) and target.value.func.id == "super")


def handles_aux_over_pp(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """True when the function itself calls both halves of vLLM's aux-over-PP contract."""
    called = {n.func.attr for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
    return all(name in called for name in VLLM_AUX_CALLS)


def class_facts(cls: type) -> list[ClassFacts]:
    """``ClassFacts`` for each class of ``cls.__mro__`` (an imported class)."""
    facts = []
    for klass in cls.__mro__:
        forward = klass.__dict__.get("forward")
        line = 0
        if forward is not None:
            try:
                line = inspect.getsourcelines(forward)[1]
            except (OSError, TypeError):
                line = 0
        own = klass.__dict__
        facts.append(ClassFacts(klass.__name__, source_file(klass), own.get(AUX_OVER_PP_FLAG), AUX_OVER_PP_FLAG in own,
                                forward is not None, _function_node(forward) if forward is not None else None, line))
    return facts


def judge_facts(facts: list[ClassFacts]) -> Judgement:
    """The verdict from a decoder's MRO facts (the class first): the class carrying its own flag decides."""
    this = facts[0]
    owner_at = next((i for i, k in enumerate(facts) if k.sets_flag), None)
    if owner_at is None:
        return Judgement(this.name, this.file, False, f"`{this.name}` does not set {AUX_OVER_PP_FLAG}: its forward does not "
                                                       "collect, capture and pack aux hidden states per stage")
    owner = facts[owner_at]
    if owner.flag is not True:
        where = "" if owner_at == 0 else f" (inherited from `{owner.name}`)"
        return Judgement(this.name, this.file, False, f"`{owner.name}` sets {AUX_OVER_PP_FLAG} = {owner.flag!r} itself{where}",
                         supported_by=owner.name, opted_out=True)
    for klass in facts[:owner_at]:
        if klass.forward_is_transparent():
            continue
        return Judgement(
            this.name, this.file, False,
            f"`{klass.name}.forward` ({klass.file}:{klass.forward_line}) overrides `{owner.name}.forward` without "
            f"aux handling (no {' / '.join(VLLM_AUX_CALLS)}); {AUX_OVER_PP_FLAG} = True is only inherited from `{owner.name}`",
            supported_by=owner.name)
    delegating = [k.name for k in facts[:owner_at] if k.defines_forward]
    if owner_at == 0:
        via = "its own flag"
    elif delegating:
        via = (f"inherited from `{owner.name}`; `{'`, `'.join(delegating)}.forward` only delegates to super() "
               "or does the aux handling itself")
    else:
        via = f"inherited from `{owner.name}`, forward not overridden"
    return Judgement(this.name, this.file, True, f"{AUX_OVER_PP_FLAG} = True ({via})", supported_by=owner.name)


def judge_decoder_class(cls: type) -> Judgement:
    """Whether the decoder class ``cls`` (vLLM's ``EagleModelMixin`` side) relays aux states over PP."""
    return judge_facts(class_facts(cls))


def decoder_class_of(model_cls: type) -> tuple[str, type] | None:
    """``(attribute, decoder class)`` that a vLLM ``*ForCausalLM`` builds, read from its source.

    Looks at ``__init__`` and ``_init_model`` along the MRO (the first class defining each) for
    ``self.<attr> = Name(...)`` / ``return Name(...)`` where ``Name`` is, in the defining module, a class
    whose ``forward`` takes ``intermediate_tensors``. Prefers the attribute vLLM's drafter and interfaces
    look at (``model``). None when no such assignment is found.
    """
    found: list[tuple[str, type]] = []
    for method in ("_init_model", "__init__"):
        owner = next((k for k in model_cls.__mro__ if method in k.__dict__), None)
        if owner is None:
            continue
        node = _function_node(owner.__dict__[method])
        if node is None:
            continue
        namespace = vars(inspect.getmodule(owner)) if inspect.getmodule(owner) else {}
        for stmt in ast.walk(node):
            call, attr = None, None
            if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Call) and len(stmt.targets) == 1:
                target = stmt.targets[0]
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                    call, attr = stmt.value, target.attr
            elif isinstance(stmt, ast.Return) and isinstance(stmt.value, ast.Call) and method == "_init_model":
                call, attr = stmt.value, "model"
            if call is None or not isinstance(call.func, ast.Name):
                continue
            candidate = namespace.get(call.func.id)
            if isinstance(candidate, type) and _takes_intermediate_tensors(candidate):
                found.append((attr or "model", candidate))
    if not found:
        return None
    return next((f for f in found if f[0] == "model"), found[0])


def _takes_intermediate_tensors(cls: type) -> bool:
    forward = getattr(cls, "forward", None)
    try:
        return forward is not None and "intermediate_tensors" in inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return False


def is_model_class(cls: type) -> bool:
    """A vLLM top-level model (``*ForCausalLM``: it computes logits) rather than its decoder stack."""
    return callable(getattr(cls, "compute_logits", None))


def judge_vllm_class(cls: type, pp: int = 2) -> Judgement:
    """The verdict for a vLLM model or decoder class at pipeline size ``pp``.

    PP = 1 needs what vLLM itself checks there: ``SupportsEagle3`` on the model class and a decoder that is
    an ``EagleModelMixin`` (``set_aux_hidden_state_layers`` asserts it). PP > 1 also needs the decoder to
    relay aux states (``judge_decoder_class``).
    """
    decoder: type = cls
    if is_model_class(cls):
        held = decoder_class_of(cls)
        if held is None:
            return Judgement(cls.__name__, source_file(cls), False,
                             f"no decoder stack found in `{cls.__name__}.__init__` (a `self.<attr> = <Model>(...)` "
                             "whose forward takes intermediate_tensors)")
        decoder = held[1]
        if getattr(cls, "supports_eagle3", False) is not True:
            return Judgement(decoder.__name__, source_file(decoder), False,
                             f"`{cls.__name__}` does not implement SupportsEagle3")
    if VLLM_EAGLE_MIXIN not in {k.__name__ for k in decoder.__mro__}:
        return Judgement(decoder.__name__, source_file(decoder), False,
                         f"`{decoder.__name__}` does not inherit EagleModelMixin")
    if pp == 1:
        return Judgement(decoder.__name__, source_file(decoder), True, "SupportsEagle3 and EagleModelMixin (PP = 1)")
    return judge_decoder_class(decoder)


def source_class_facts(path: str | Path, class_name: str, package_root: str | Path | None = None) -> list[ClassFacts]:
    """``ClassFacts`` read from source alone, for classes whose module cannot be imported here.

    Bases are followed through the file's own classes and its ``from ... import`` statements into other
    files under ``package_root`` (default: the ``vllm`` directory above ``path``), depth first, left to
    right (vLLM's decoders use single inheritance plus interface mixins, where this equals the MRO).
    Bases outside the package (``nn.Module``) end the walk.
    """
    path = Path(path)
    root = Path(package_root) if package_root else next((p for p in path.parents if p.name == "vllm"), path.parent)
    facts: list[ClassFacts] = []
    seen: set[tuple[Path, str]] = set()

    def visit(file: Path, name: str) -> None:
        if (file, name) in seen:
            return
        seen.add((file, name))
        tree = ast.parse(file.read_text(encoding="utf-8"))
        classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
        node = classes.get(name)
        if node is None:
            imported = _imported_from(tree, name)
            target = module_path(imported[0], imported[1], file, root, packages=True) if imported else None
            if target is not None:
                visit(target, imported[2] if imported else name)
            return
        flag_value: object = None
        sets_flag = False
        forward = None
        for stmt in node.body:
            if isinstance(stmt, ast.Assign | ast.AnnAssign):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                if any(isinstance(t, ast.Name) and t.id == AUX_OVER_PP_FLAG for t in targets) and stmt.value is not None:
                    sets_flag = True
                    flag_value = ast.literal_eval(stmt.value) if isinstance(stmt.value, ast.Constant) else stmt.value
            elif isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef) and stmt.name == "forward":
                forward = stmt
        facts.append(ClassFacts(name, str(file), flag_value, sets_flag, forward is not None, forward,
                                forward.lineno if forward else 0))
        for base in node.bases:
            if isinstance(base, ast.Name):
                visit(file, base.id)

    visit(path, class_name)
    if not facts:
        raise LookupError(f"class `{class_name}` not found in {path}")
    return facts


def _imported_from(tree: ast.Module, name: str) -> tuple[str, int, str] | None:
    """``(module, level, original name)`` of a top-level ``from module import name [as alias]``."""
    for stmt in tree.body:
        if isinstance(stmt, ast.ImportFrom):
            for alias in stmt.names:
                if (alias.asname or alias.name) == name:
                    return stmt.module or "", stmt.level, alias.name
    return None


def judge_decoder_source(path: str | Path, class_name: str, package_root: str | Path | None = None) -> Judgement:
    """``judge_decoder_class`` for a class read from source (e.g. qwen3_vl, which needs torchvision)."""
    return judge_facts(source_class_facts(path, class_name, package_root))
