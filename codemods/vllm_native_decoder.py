"""The decoder class's rewrite: ``EagleModelMixin`` and the flag on the class itself, the new
``forward`` (vllm_native_forward), the input embedding also built where a drafter needs it, and the
``embed_tokens`` alias vLLM's drafter reads. Imports no vLLM."""

from __future__ import annotations

import json

import libcst as cst
import libcst.matchers as m

from pipespec.codemods.vllm_forward_shape import is_docstring, names_in, self_attr
from pipespec.codemods.vllm_native_branches import Branches
from pipespec.codemods.vllm_native_forward import RewriteForward
from pipespec.codemods.vllm_native_helpers import Helpers
from pipespec.codemods.vllm_native_loop import Decline, ForwardPlan, methods, own_flag, params_of
from pipespec.codemods.vllm_native_names import (
    DRAFTER_EMBEDS,
    GENERATOR,
    GENERATOR_VERSION,
    TARGET_EMBED,
    module_names,
    nn_module_type,
)
from pipespec.codemods.vllm_native_qualified import UNBOUND, VllmNames
from pipespec.contract.names import AUX_OVER_PP_FLAG, GENERATED_BY_ATTR, VLLM_EAGLE_MIXIN
from pipespec.contract.spec import AdapterSpec


def adapt_decoder(dec: cst.ClassDef, plan: ForwardPlan | Branches | Helpers, spec: AdapterSpec | None, label: str,
                   module: cst.Module, names: VllmNames = UNBOUND) -> tuple[cst.ClassDef, set[str]]:
    imports: set[str] = set()
    if spec is not None and plan.loop.layers_attr != spec.layers_attr:
        raise Decline(f"the loop runs self.{plan.loop.layers_attr} but spec {spec.name} ({spec.source}) says "
                      f"model.layers_attr = {spec.layers_attr!r}: fix the spec", plan.loop.node)
    own = methods(dec)
    top_names = module_names(module)
    forward = own["forward"]
    new_forward = cst.ensure_type(forward.visit(RewriteForward(plan, "torch" in top_names)), cst.FunctionDef)
    if not plan.has_rank_check and "get_pp_group" not in top_names:
        imports.add("get_pp_group")
    init = own.get("__init__")
    new_init, embed = (init, None)
    if init is not None:
        new_init, embed, needs = _target_embed(init, spec, names)
        if needs:
            imports.add(TARGET_EMBED)
    alias = None
    if embed is not None and embed not in DRAFTER_EMBEDS and not (set(own) & set(DRAFTER_EMBEDS)):
        alias = cst.parse_statement(
            "@property\n"
            f"def embed_tokens(self) -> {nn_module_type(top_names)}:\n"
            "    # vLLM's EAGLE drafter shares the target's input embedding as .model.embed_tokens\n"
            f"    return self.{embed}\n")
    body: list[cst.BaseStatement] = []
    flag = own_flag(dec)
    for stmt in cst.ensure_type(dec.body, cst.IndentedBlock).body:
        if stmt is flag:
            continue
        if stmt is forward:
            stmt = new_forward
        elif init is not None and stmt is init and new_init is not None:
            stmt = new_init
        body.append(stmt)
    if alias is not None:
        at = next(i for i, s in enumerate(body) if s is new_forward)
        body.insert(at, alias.with_changes(leading_lines=[cst.EmptyLine(indent=False)]))
    marker = json.dumps(f"{GENERATOR} v{GENERATOR_VERSION} from {label.split(' ')[0]}")
    lines = [cst.parse_statement(f"{AUX_OVER_PP_FLAG} = True\n"), cst.parse_statement(f"{GENERATED_BY_ATTR} = {marker}\n")]
    at = 1 if body and is_docstring(body[0]) else 0
    if at:
        lines[0] = lines[0].with_changes(leading_lines=[cst.EmptyLine(indent=False)])
    if at < len(body) and not body[at].leading_lines and not isinstance(body[at], cst.SimpleStatementLine):
        body[at] = body[at].with_changes(leading_lines=[cst.EmptyLine(indent=False)])
    body[at:at] = lines
    bases = list(dec.bases)
    if not names.has_base(dec, VLLM_EAGLE_MIXIN):
        imports.add(VLLM_EAGLE_MIXIN)
        if bases:
            bases[-1] = bases[-1].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
        bases.append(cst.Arg(cst.Name(VLLM_EAGLE_MIXIN)))
    return dec.with_changes(bases=bases, lpar=cst.LeftParen(), rpar=cst.RightParen(),
                            body=dec.body.with_changes(body=body)), imports



def _target_embed(init: cst.FunctionDef, spec: AdapterSpec | None, names: VllmNames) -> tuple[cst.FunctionDef, str | None, bool]:
    """Build the embedding on the last rank too when a drafter needs it (vLLM's llama.py condition).

    Returns the new ``__init__``, the embedding's attribute name (None when not found) and whether the
    condition was added.
    """
    first = m.Attribute(value=m.Call(func=names.ref("get_pp_group")), attr=m.Name("is_first_rank"))
    missing = m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(self_attr())],
                                                   value=m.Call(func=names.ref("PPMissingLayer")))])
    found = None
    for node in m.findall(init, m.If(test=m.MatchIfTrue(lambda t: bool(m.findall(t, first))),
                                     orelse=m.Else(body=m.IndentedBlock(body=[missing])))):
        branch = cst.ensure_type(node, cst.If)
        attr = cst.ensure_type(cst.ensure_type(cst.ensure_type(cst.ensure_type(branch.orelse, cst.Else).body,
                               cst.IndentedBlock).body[0], cst.SimpleStatementLine).body[0], cst.Assign).targets[0].target
        name = cst.ensure_type(attr, cst.Attribute).attr.value
        if name in DRAFTER_EMBEDS or "embed" in name or name in ("wte", "word_embeddings", "tok_embeddings"):
            found = (branch, name)
            break
    if found is None:
        built = m.findall(init, m.Assign(targets=[m.AssignTarget(self_attr())],
                                         value=m.Call(func=m.Name("VocabParallelEmbedding"))))
        name = cst.ensure_type(cst.ensure_type(built[0], cst.Assign).targets[0].target, cst.Attribute).attr.value if built else None
        _check_embed_spec(spec, name, init)
        return init, name, False
    branch, name = found
    _check_embed_spec(spec, name, branch)
    if TARGET_EMBED in names_in(branch.test):
        return init, name, False
    if "vllm_config" not in params_of(init) and "vllm_config" not in names_in(init):
        raise Decline(f"the embedding self.{name} is built on the first rank only and __init__ has no vllm_config "
                      f"to ask {TARGET_EMBED}(vllm_config) whether the last rank needs it", branch)
    test = branch.test
    if isinstance(test, (cst.IfExp, cst.Lambda, cst.NamedExpr)):
        test = test.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
    new_test = cst.BooleanOperation(test, cst.Or(), cst.parse_expression(f"{TARGET_EMBED}(vllm_config)"))
    new_branch = branch.with_changes(test=new_test)
    return cst.ensure_type(init.deep_replace(branch, new_branch), cst.FunctionDef), name, True


def _check_embed_spec(spec: AdapterSpec | None, name: str | None, node: cst.CSTNode) -> None:
    if spec is None or name is None or spec.embed_attr == name:
        return
    raise Decline(f"the decoder's input embedding is self.{name} but spec {spec.name} ({spec.source}) says "
                  f"embed_attr = {spec.embed_attr!r}: fix the spec", node)
