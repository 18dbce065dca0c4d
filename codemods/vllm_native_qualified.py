"""Which names of a vLLM model file stand for vLLM's own (``IntermediateTensors``, ``get_pp_group``,
``PPMissingLayer``, ``EagleModelMixin``, ``SupportsEagle3``, ``SupportsMultiModal``): read from the qualified
names libcst's ``ScopeProvider`` gives the file's top-level imports, not from how a use is spelled.

A file's name stands for vLLM's ``N`` when it is imported as ``N`` from a vLLM module (``vllm.*``, where
vLLM defines it or re-exports it: ``from .utils import IntermediateTensors`` is vLLM's own re-export) or
from a relative module (a file of a model package, read as vLLM's models are), under any alias; and the
spelling ``N`` itself stands for it where the file imports vLLM's ``N`` under no name and binds ``N`` to
nothing at module level (a snippet without its imports, or an import inside a function). ``N`` imported
from elsewhere, or a class or function of the file named ``N``, is not vLLM's. ``mod.N`` stands for it
where ``mod`` is a vLLM module the file imports (or anything else it imports from vLLM), or a name it
binds to nothing.

The scopes are resolved on a module of the file's top-level imports only: what they bind is all that is
asked, and resolving a whole 3,000-line file is most of libcst's cost. Imports no vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import libcst as cst
import libcst.matchers as m
from libcst.helpers import get_full_name_for_node
from libcst.metadata import GlobalScope, MetadataWrapper, ScopeProvider

#: vLLM's names the codemod recognises in a model file.
VLLM_NAMES = ("IntermediateTensors", "get_pp_group", "PPMissingLayer", "EagleModelMixin", "SupportsEagle3",
              "SupportsMultiModal")


@dataclass(frozen=True)
class VllmNames:
    """The names of one file that stand for vLLM's (see the module docstring); ``of(module)`` reads them."""

    local: Mapping[str, frozenset[str]]  # vLLM's name -> the file's names that stand for it
    vllm_modules: frozenset[str]  # the file's names bound to a vLLM module (``import vllm.sequence as seq``)
    bound: frozenset[str]  # every name the file binds at module level

    @classmethod
    def of(cls, module: cst.Module) -> VllmNames:
        imports = [s for s in module.body if m.matches(s, m.SimpleStatementLine(body=[m.Import() | m.ImportFrom()]))]
        local: dict[str, set[str]] = {name: set() for name in VLLM_NAMES}
        vllm_modules: set[str] = set()
        bound = _defined(module)
        if imports:
            reduced = cst.Module(body=imports)
            scopes = MetadataWrapper(reduced, unsafe_skip_copy=True).resolve(ScopeProvider)
            scope = scopes[cst.ensure_type(imports[0], cst.SimpleStatementLine).body[0]]
            assert isinstance(scope, GlobalScope)
            for assignment in scope.assignments:
                name = assignment.name
                bound.add(name)
                for qualified in scope.get_qualified_names_for(name):
                    where, _, imported = qualified.name.rpartition(".")
                    from_vllm = qualified.name.startswith(("vllm.", ".")) or qualified.name == "vllm"
                    if from_vllm and imported in local and where:
                        local[imported].add(name)
                    elif from_vllm:  # a vLLM module, or another of its names: a root of ``mod.<name>``
                        vllm_modules.add(name)
        for name, names in local.items():
            if not names and name not in bound:  # the file does not import it: a snippet, or imported in a function
                names.add(name)
        return cls({k: frozenset(v) for k, v in local.items()}, frozenset(vllm_modules), frozenset(bound))

    def spellings(self, name: str) -> frozenset[str]:
        """The file's names for vLLM's ``name``."""
        return self.local[name]

    def ref(self, name: str) -> m.BaseExpressionMatcherNode:
        """A matcher of an expression naming vLLM's ``name``: one of its spellings, or ``mod.<name>``."""
        spellings = self.local[name]
        roots = self.vllm_modules

        def attribute(node: cst.Attribute) -> bool:
            full = get_full_name_for_node(node)
            root = full.split(".")[0] if full else ""
            return bool(root) and (root in roots or root not in self.bound)

        return (m.Name(value=m.MatchIfTrue(lambda value: value in spellings))
                | m.MatchIfTrue(lambda node: isinstance(node, cst.Attribute) and node.attr.value == name
                                and attribute(node)))

    def has_base(self, cls: cst.ClassDef, name: str) -> bool:
        """``cls`` lists vLLM's ``name`` among its bases."""
        ref = self.ref(name)
        return any(arg.keyword is None and m.matches(arg.value, ref) for arg in cls.bases)


#: The names of a file that binds nothing: every spelling is vLLM's (what a snippet without imports means).
UNBOUND = VllmNames({name: frozenset({name}) for name in VLLM_NAMES}, frozenset(), frozenset())


def _defined(module: cst.Module) -> set[str]:
    """Names the file's own top-level classes, functions and plain assignments bind."""
    out: set[str] = set()
    for stmt in module.body:
        if isinstance(stmt, (cst.ClassDef, cst.FunctionDef)):
            out.add(stmt.name.value)
        elif isinstance(stmt, cst.SimpleStatementLine):
            for small in stmt.body:
                targets = ([t.target for t in small.targets] if isinstance(small, cst.Assign)
                           else [small.target] if isinstance(small, cst.AnnAssign) else [])
                out |= {t.value for t in targets if isinstance(t, cst.Name)}
    return out


__all__ = ["UNBOUND", "VLLM_NAMES", "VllmNames"]
