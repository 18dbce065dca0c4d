"""Which classes a decoder builds its layers from, read from source: ``layer_classes(cls, "layers", lookup)``.

Two steps. ``find_builder`` finds the statement ``self.<attr> = ...``: in ``__init__``, in a method
``__init__`` calls (MiniCPM's ``_init_layers``), or up the chain of base classes through
``super().__init__(...)``, carrying the layer classes a subclass passes down as keyword arguments
(``super().__init__(..., layer_type=Qwen2MoeDecoderLayer)``). ``LayerResolver`` then reads that value
for the classes it calls: directly (``make_layers(n, lambda prefix: LlamaDecoderLayer(...))``), through
a parameter, its default, a local builder function, a local name (``layer_cls = A if c else B``,
``= TABLE[key]``), a class attribute (``self.layer_cls(...)``) or a module-level name the lookup finds.
Pure libcst on source; imports no vLLM.
"""

from __future__ import annotations

import builtins
from dataclasses import dataclass, field

import libcst as cst
import libcst.matchers as m

from pipespec.codemods.vllm_forward_shape import self_attr
from pipespec.codemods.vllm_native_loop import ClassLookup, methods

#: The classes looked at for ``self.<attr> = ...``: the decoder and its bases, nearest first.
MAX_CLASSES_UP = 6
#: How many names a layer class is followed through (parameter -> default -> local name -> ...).
MAX_NAME_HOPS = 4
#: Calls in a layer-building expression that build no layer (vLLM's helpers, builtins).
NOT_LAYERS = frozenset({"make_layers", "maybe_prefix", "extract_layer_index", "PPMissingLayer", *dir(builtins)})

LayerClass = tuple[cst.ClassDef, ClassLookup]  # a class and the lookup of the module it is defined in


@dataclass(frozen=True)
class Builder:
    """Where ``self.<attr>`` is assigned: the method, the value, the class defining that method (with its
    lookup) and the layer classes subclasses pass to its parameters, by parameter name."""

    owner: cst.ClassDef
    lookup: ClassLookup
    method: cst.FunctionDef
    value: cst.BaseExpression
    passed_down: dict[str, LayerClass] = field(default_factory=dict)


def layer_classes(cls: cst.ClassDef, attr: str, lookup: ClassLookup) -> list[LayerClass] | cst.CSTNode:
    """The classes ``cls`` builds into ``self.<attr>`` (each with the lookup of its own module), or the
    node to name where they cannot be found (the class, its ``__init__``, or the value assigned)."""
    builder = find_builder(cls, attr, lookup)
    if isinstance(builder, cst.CSTNode):
        return builder
    return LayerResolver(builder).classes()


def find_builder(cls: cst.ClassDef, attr: str, lookup: ClassLookup) -> Builder | cst.CSTNode:
    """The one ``self.<attr> = ...`` of ``cls`` or its bases (see the module docstring), or the node to
    name: the ``__init__`` that neither assigns it nor calls ``super().__init__``, whose bases cannot be
    found, or ``cls`` where it is assigned more than once or not within ``MAX_CLASSES_UP`` classes."""
    owner, owner_lookup = cls, lookup
    passed_down: dict[str, LayerClass] = {}
    target = self_attr(attr)
    for _ in range(MAX_CLASSES_UP):
        init = methods(owner).get("__init__")
        if init is not None:
            found = _assigning_method(owner, init, target)
            if found is not None:
                method, values = found
                if len(values) != 1:
                    return cls.name
                return Builder(owner, owner_lookup, method, values[0], passed_down)
            supers = m.findall(init, m.Call(func=m.Attribute(value=m.Call(func=m.Name("super")), attr=m.Name("__init__"))))
            if not supers:
                return init.name
            passed_down = _passed_to_super(cst.ensure_type(supers[0], cst.Call), init, passed_down, owner, owner_lookup)
        base = _first_found_base(owner, owner_lookup)
        if base is None:
            return init.name if init is not None else cls.name
        owner, owner_lookup = base
    return cls.name


def _assigned_values(fn: cst.FunctionDef, target: m.BaseMatcherNode) -> list[cst.BaseExpression]:
    return [cst.ensure_type(a, cst.Assign).value for a in m.findall(fn, m.Assign())
            if any(m.findall(t.target, target) for t in cst.ensure_type(a, cst.Assign).targets)]


def _assigning_method(owner: cst.ClassDef, init: cst.FunctionDef, target: m.BaseMatcherNode
                      ) -> tuple[cst.FunctionDef, list[cst.BaseExpression]] | None:
    """``__init__`` with the values it assigns to the target, or the first method of the class that
    assigns it and that ``__init__`` calls as ``self.<method>(...)``; None where neither does."""
    values = _assigned_values(init, target)
    if values:
        return init, values
    for method in methods(owner).values():
        values = _assigned_values(method, target)
        if values and m.findall(init, m.Call(func=self_attr(method.name.value))):
            return method, values
    return None


def _defaults(fn: cst.FunctionDef) -> dict[str, cst.BaseExpression]:
    params = fn.params
    return {p.name.value: p.default for p in (*params.params, *params.kwonly_params) if p.default is not None}


def _passed_to_super(call: cst.Call, init: cst.FunctionDef, passed_down: dict[str, LayerClass], owner: cst.ClassDef,
                     lookup: ClassLookup) -> dict[str, LayerClass]:
    """The layer classes this ``__init__`` hands its base, by the base's parameter name: a keyword argument
    whose value is a name passed down to this class, a parameter whose default names a class, or a class."""
    defaults = _defaults(init)
    passed: dict[str, LayerClass] = {}
    for arg in call.args:
        if arg.keyword is None or not isinstance(arg.value, cst.Name):
            continue
        name = arg.value.value
        if name in passed_down:
            passed[arg.keyword.value] = passed_down[name]
            continue
        default = defaults.get(name)
        ref = default.value if isinstance(default, cst.Name) else name
        found = lookup(ref, owner)
        if len(found) == 1:
            passed[arg.keyword.value] = found[0]
    return passed


def _first_found_base(owner: cst.ClassDef, lookup: ClassLookup) -> LayerClass | None:
    """The first base class (a plain name) the lookup finds exactly one class for."""
    bases = [a.value for a in owner.bases if a.keyword is None and isinstance(a.value, cst.Name)]
    return next((found[0] for found in (lookup(b.value, owner) for b in bases) if len(found) == 1), None)


class LayerResolver:
    """The classes the builder's value calls, each name followed as the module docstring says. Every name
    must resolve: one that does not (or needs more than ``MAX_NAME_HOPS`` hops) leaves the value as the answer."""

    def __init__(self, builder: Builder) -> None:
        self.builder = builder
        body = builder.method.body
        self.local_builders = {f.name.value: f for f in m.findall(body, m.FunctionDef()) if isinstance(f, cst.FunctionDef)}
        self.local_values = {
            cst.ensure_type(cst.ensure_type(a, cst.Assign).targets[0].target, cst.Name).value: cst.ensure_type(a, cst.Assign).value
            for a in m.findall(body, m.Assign(targets=[m.AssignTarget(m.Name())]))}
        self.defaults = _defaults(builder.method)
        self.none_defaults = {name for name, default in self.defaults.items() if m.matches(default, m.Name("None"))}
        self.found: list[LayerClass] = []

    def classes(self) -> list[LayerClass] | cst.BaseExpression:
        value = self.builder.value
        return self.found if self._calls_layers(value, 0) and self.found else value

    def _name(self, name: str, hops: int) -> bool:
        """Whether ``name`` resolves to layer classes (added to ``found``)."""
        if hops > MAX_NAME_HOPS:
            return False
        if name in self.builder.passed_down:
            self.found.append(self.builder.passed_down[name])
            return True
        if name in self.defaults:
            default = self.defaults[name]
            return isinstance(default, cst.Name) and self._name(default.value, hops + 1)
        if name in self.local_builders:
            return self._calls_layers(self.local_builders[name].body, hops + 1)
        if name in self.local_values:
            return self._local_value(name, hops)
        found = self.builder.lookup(name, self.builder.owner)
        self.found.extend(found)
        return bool(found)

    def _local_value(self, name: str, hops: int) -> bool:
        """``layer_cls = A if c else B`` / ``= TABLE[key]`` / ``= types or TABLE`` / ``= types[key]``: every
        class-like name must resolve; other names bound here (a parameter defaulting to None aside) may."""
        names = class_refs(self.local_values[name]) - {name}
        classes = [n for n in names if n[:1].isupper() and n not in ("None", "True", "False")]
        bound_here = [n for n in names - set(classes) - self.none_defaults
                      if n in self.local_values or n in self.local_builders or n in self.defaults]
        if not all(self._name(n, hops + 1) for n in classes):
            return False
        resolved = bool(classes)
        for n in bound_here:
            resolved = self._name(n, hops + 1) or resolved
        return resolved

    def _calls_layers(self, node: cst.CSTNode, hops: int) -> bool:
        """Whether every layer-building reference in ``node`` resolves, and there is at least one: a local
        builder passed by name (``make_layers(n, get_layer)``), a called name, a called ``self.<class attr>``."""
        resolved = False
        used = {n.value for n in m.findall(node, m.Name()) if isinstance(n, cst.Name)}
        for ref in used & set(self.local_builders):
            if not m.findall(node, m.Call(func=m.Name(ref))):
                if not self._name(ref, hops):
                    return False
                resolved = True
        for call in m.findall(node, m.Call()):
            func = cst.ensure_type(call, cst.Call).func
            if isinstance(func, cst.Name):
                if func.value in NOT_LAYERS:
                    continue
                if not self._name(func.value, hops):
                    return False
                resolved = True
            elif m.matches(func, m.Attribute(value=m.Name("self"))):
                value = class_attr(self.builder.owner, cst.ensure_type(func, cst.Attribute).attr.value)
                if not isinstance(value, cst.Name) or not self._name(value.value, hops + 1):
                    return False
                resolved = True
        return resolved


def class_attr(cls: cst.ClassDef, name: str) -> cst.BaseExpression | None:
    """The value of ``name = ...`` / ``name: T = ...`` in the class body itself."""
    body = cls.body.body if isinstance(cls.body, cst.IndentedBlock) else ()
    for stmt in body:
        if not isinstance(stmt, cst.SimpleStatementLine):
            continue
        for small in stmt.body:
            if isinstance(small, cst.Assign) and any(m.matches(t.target, m.Name(name)) for t in small.targets):
                return small.value
            if isinstance(small, cst.AnnAssign) and m.matches(small.target, m.Name(name)):
                return small.value
    return None


def class_refs(expr: cst.BaseExpression) -> set[str]:
    """Names in the positions where an expression's value *is* that name: ``A``, ``A if c else B``,
    ``x or A``, ``A[key]`` (a table of classes); not call arguments, annotations or attribute bases."""
    if isinstance(expr, cst.Name):
        return {expr.value}
    if isinstance(expr, cst.IfExp):
        return class_refs(expr.body) | class_refs(expr.orelse)
    if isinstance(expr, cst.BooleanOperation):
        return class_refs(expr.left) | class_refs(expr.right)
    if isinstance(expr, cst.Subscript):
        return class_refs(expr.value)
    return set()


__all__ = ["MAX_CLASSES_UP", "MAX_NAME_HOPS", "NOT_LAYERS", "Builder", "LayerClass", "LayerResolver", "class_attr",
           "class_refs", "find_builder", "layer_classes"]
