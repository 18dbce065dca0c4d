"""Does a decoder's layer read the residual it is passed? Read from the layer classes' own ``forward``
(same file, module-level tables, base classes, imports through ``ClassLookup``): where every layer rebinds
it first (post-norm, parallel blocks) the stream at a layer boundary is the hidden states alone. Pure
libcst on source; imports no vLLM."""

from __future__ import annotations

from collections.abc import Sequence

import libcst as cst
import libcst.matchers as m

from pipespec.codemods.vllm_forward_shape import is_docstring, names_in, self_attr
from pipespec.codemods.vllm_native_layers import NOT_LAYERS, layer_classes
from pipespec.codemods.vllm_native_loop import (
    ClassLookup,
    Decline,
    ForwardPlan,
    Loop,
    layer_call_at,
    methods,
    params_of,
)
from pipespec.codemods.vllm_native_names import snippet_of

# ------------------------------------------------------------------ does a layer read the residual?
WAY_OUT = ("; where you know which, state it: `adapter-gen FILE --dialect vllm --residual-rule reads` (a layer "
           "reads the residual it is given, vLLM's pre-norm convention) or `--residual-rule rebinds` (it rebinds "
           "it first), or model.residual_rule in a vllm-dialect adapter spec")


__all__ = ["WAY_OUT", "UnknownLayers", "residual_read", "unsent_stale_residual", "zero_is_none"]


class UnknownLayers(Decline):
    """The layer classes (or their ``forward``) cannot be found from the source: only a stated rule helps."""


def residual_read(cls: cst.ClassDef, plan: ForwardPlan, lookup: ClassLookup, own_classes: set[str] | None = None,
                  rule: str | None = None) -> bool | tuple[str, tuple[str, ...]]:
    """``_residual_read`` (below), with ``rule`` (one of ``RESIDUAL_RULES``) standing in where the layer
    classes cannot be found; where they are found, a rule they contradict is declined, never obeyed."""
    try:
        found = _residual_read(cls, plan, lookup, own_classes)
    except UnknownLayers:
        if rule is None:
            raise
        return rule == "reads"
    if rule is not None and found is not (rule == "reads"):
        told = ("some layer classes read it and others rebind it" if isinstance(found, tuple)
                else "its layer classes " + ("read it" if found else "rebind it before reading it"))
        raise Decline(f"residual rule {rule!r} was stated, but the source says otherwise: {told} "
                      f"(read from {cls.name.value}'s layers); drop --residual-rule (or model.residual_rule)",
                      plan.loop.node)
    return found


def _residual_read(cls: cst.ClassDef, plan: ForwardPlan, lookup: ClassLookup,
                   own_classes: set[str] | None = None) -> bool | tuple[str, tuple[str, ...]]:
    """Whether the decoder's layers read the residual the loop passes them.

    False where every layer class's ``forward`` rebinds that parameter before reading it (post-norm and
    parallel blocks: ``residual = hidden_states`` first): the ``residual`` they return is stale and the
    stream at a layer boundary is the returned hidden states alone. ``lookup(name, context)`` finds a
    class by name as the module that defines ``context`` sees it (its own classes and its imports), with
    the lookup that applies inside the class found. ``Decline`` where the layer classes or their
    ``forward`` cannot be found from the source, or where they disagree. Given ``own_classes`` (the file's
    top-level class names), disagreeing classes that ``isinstance`` on the loop's layer variable tells
    apart are answered ``(layer variable, the classes that rebind it)`` instead (Molmo)."""
    assert plan.residual is not None
    loop = plan.loop.node
    at = layer_call_at(loop, plan.loop)
    inside = list(cst.ensure_type(loop.body, cst.IndentedBlock).body)
    calls = [] if at is None else [cst.ensure_type(cst.ensure_type(a, cst.Assign).value, cst.Call)
                                   for a in m.findall(inside[at], m.Assign(value=m.Call()))]
    if not calls:
        raise Decline("cannot find the layer call in the layer loop, so whether a layer reads the residual it is "
                      "passed cannot be told", loop)
    call = calls[0]
    slot: int | str | None = None
    for i, arg in enumerate(call.args):
        if m.matches(arg.value, m.Name(plan.residual)):
            slot = arg.keyword.value if arg.keyword is not None else i
    if slot is None:  # the layers are not passed the residual: they cannot read it
        return False
    found = layer_classes(cls, plan.loop.layers_attr, lookup)
    if isinstance(found, cst.CSTNode):
        built = f"`{snippet_of(found)}`" if not isinstance(found, cst.Name) else f"{found.value} of {cls.name.value} or a base"
        raise UnknownLayers(f"the layer classes of self.{plan.loop.layers_attr} cannot be found from the source (built by "
                            f"{built}), so whether a layer reads the residual it returns cannot be told: "
                            f"the stream at a layer boundary is hidden_states + residual only if it does{WAY_OUT}", call)
    verdicts: dict[str, bool] = {}
    for layer, layer_lookup in found:
        verdicts[layer.name.value] = _forward_reads(layer, layer_lookup, slot, plan.residual, call)
    if len(set(verdicts.values())) > 1 and own_classes is not None:
        stale = tuple(n for n, v in verdicts.items() if not v)
        if _told_apart(call, found, verdicts, own_classes):
            return cst.ensure_type(call.func, cst.Name).value, stale
    if len(set(verdicts.values())) > 1:
        reads = ", ".join(n for n, v in verdicts.items() if v)
        not_reads = ", ".join(n for n, v in verdicts.items() if not v)
        raise Decline(f"the layer classes disagree on the residual: {reads} read it, {not_reads} rebind it before "
                      "reading it, so whether the stream at a layer boundary includes the residual depends on the "
                      "layer (or the config) and no one capture is right", call)
    return next(iter(verdicts.values()))


def _told_apart(call: cst.Call, found: Sequence[tuple[cst.ClassDef, ClassLookup]], verdicts: dict[str, bool],
                own_classes: set[str]) -> bool:
    """``isinstance(<layer>, Stale...)`` is exactly "this layer rebinds the residual": the layer is called
    through a plain name, every class is the file's own (its name is bound in the module), and no class
    that reads the residual derives from one that rebinds it."""
    if not isinstance(call.func, cst.Name) or not set(verdicts) <= own_classes:
        return False
    stale = {n for n, v in verdicts.items() if not v}
    by_name = {c.name.value: c for c, _ in found}
    for name, reads in verdicts.items():
        if reads and _ancestors(by_name[name], by_name) & stale:
            return False
    return True


def _ancestors(cls: cst.ClassDef, by_name: dict[str, cst.ClassDef]) -> set[str]:
    out: set[str] = set()
    todo = [cls]
    while todo:
        for arg in todo.pop().bases:
            if isinstance(arg.value, cst.Name) and arg.value.value not in out:
                out.add(arg.value.value)
                if arg.value.value in by_name:
                    todo.append(by_name[arg.value.value])
    return out


def _forward_reads(layer: cst.ClassDef, lookup: ClassLookup, slot: int | str, residual: str, call: cst.Call) -> bool:
    fn = _forward_of(layer, lookup, call)
    p = fn.params
    positional = [x.name.value for x in (*p.posonly_params, *p.params)][1:]  # without self
    if isinstance(slot, int):
        name = positional[slot] if slot < len(positional) else None
    else:
        name = slot if slot in params_of(fn) else None
    if name is None:
        raise Decline(f"{layer.name.value}.forward takes no parameter for the residual the loop passes "
                      f"(`{snippet_of(call)}`), so whether it reads it cannot be told", call)
    body = cst.ensure_type(fn.body, cst.IndentedBlock).body
    for stmt in body:
        if is_docstring(stmt) or name not in names_in(stmt):
            continue
        if (isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 and isinstance(stmt.body[0], cst.Assign)
                and any(m.matches(t.target, m.Name(name)) for t in stmt.body[0].targets)
                and name not in names_in(stmt.body[0].value)):
            return False  # rebound from something else before any read
        return True
    return False  # never used


def _forward_of(layer: cst.ClassDef, lookup: ClassLookup, call: cst.CSTNode) -> cst.FunctionDef:
    """The ``forward`` a layer class runs: its own, or the nearest base's found from the source."""
    seen = 0
    while "forward" not in methods(layer):
        bases = [a.value for a in layer.bases if a.keyword is None and isinstance(a.value, cst.Name)]
        nxt = None
        for base in bases:
            hits = lookup(base.value, layer)
            nxt = hits[0] if len(hits) == 1 else None
            if nxt is not None:
                break
        seen += 1
        if nxt is None or seen > 5:
            raise UnknownLayers(f"{layer.name.value} defines no forward and its bases cannot be found from the source, "
                                f"so whether a layer reads the residual cannot be told{WAY_OUT}", call)
        layer, lookup = nxt
    return methods(layer)["forward"]


def unsent_stale_residual(cls: cst.ClassDef, fn: cst.FunctionDef, loop: cst.For, parsed: Loop, hidden: str,
                           residual: str | None, lookup: ClassLookup | None) -> str | None:
    """The name the layer call binds after ``hidden`` when the next stage is sent no residual and every
    layer class rebinds that parameter before reading it (``residual = hidden_states`` first; Gemma4's
    layers return ``(hidden_states, None)``): nothing is carried in it, so the stream is ``hidden`` alone."""
    if residual is not None or lookup is None:
        return None
    at = layer_call_at(loop, parsed)
    inside = list(cst.ensure_type(loop.body, cst.IndentedBlock).body)
    if at is None:
        return None
    for assign in m.findall(inside[at], m.Assign(targets=[m.AssignTarget(m.Tuple())], value=m.Call())):
        names = [e.value for e in cst.ensure_type(cst.ensure_type(assign, cst.Assign).targets[0].target, cst.Tuple).elements]
        if len(names) == 2 and m.matches(names[0], m.Name(hidden)) and isinstance(names[1], cst.Name):
            carried = names[1].value
            plan = ForwardPlan(parsed, hidden, carried, False, (), (), (), "", False)
            try:
                return None if residual_read(cls, plan, lookup) is True else carried
            except Decline:  # the layer classes cannot be read: `carried` may carry state (declined below)
                return None
    return None




def zero_is_none(cls: cst.ClassDef, plan: ForwardPlan, lookup: ClassLookup) -> bool:
    """Whether the non-last hand-off may send zeros where the residual is None, exactly: some layer class
    returns None for it (``return hidden_states, None``; ``residual = None`` then returned) and, whenever
    that reaches the hand-off, the next stage's first layer rebinds the residual it is given before any
    read (so it treats zeros exactly as None): every layer class rebinds it (``plan.stale_residual``), or
    the classes disagree but the stack is one class chosen once (``one_class_per_stack``) and the
    hand-off asks, of the layer that ran last, whether it is one that rebinds it. The next stage's own
    captures never read what it is sent (its id ``start_layer`` is captured by this stage)."""
    if plan.residual is None or not (plan.stale_residual or plan.stale_for is not None):
        return False
    if plan.stale_for is not None and not one_class_per_stack(cls, plan.loop.layers_attr):
        return False
    found = layer_classes(cls, plan.loop.layers_attr, lookup)
    if isinstance(found, cst.CSTNode):
        return False
    try:
        forwards = [_forward_of(layer, layer_lookup, plan.loop.node) for layer, layer_lookup in found]
    except Decline:
        return False
    return any(_returns_none_second(fn) for fn in forwards)


def _returns_none_second(fn: cst.FunctionDef) -> bool:
    """A ``return a, b`` of ``fn`` whose ``b`` is None or a name ``fn`` binds to None."""
    nones = {cst.ensure_type(cst.ensure_type(a, cst.Assign).targets[0].target, cst.Name).value
             for a in m.findall(fn, m.Assign(targets=[m.AssignTarget(m.Name())], value=m.Name("None")))}
    for ret in m.findall(fn, m.Return(value=m.Tuple())):
        elements = cst.ensure_type(cst.ensure_type(ret, cst.Return).value, cst.Tuple).elements
        if len(elements) >= 2 and (m.matches(elements[1].value, m.Name("None"))
                                   or (isinstance(elements[1].value, cst.Name) and elements[1].value.value in nones)):
            return True
    return False


def one_class_per_stack(cls: cst.ClassDef, attr: str) -> bool:
    """Whether every layer of ``self.<attr>`` is built by one class object, chosen once: the method of
    ``cls`` that assigns ``self.<attr>`` calls (besides ``make_layers`` and the like) a single name, bound
    by exactly one plain assignment among that method's own statements and by no parameter of the builder
    (Molmo: ``decoder_layer = A if config.norm_after else B``, then ``make_layers(n, lambda prefix:
    decoder_layer(...))``). Then the class of one stage's last layer is the class of the next stage's first."""
    target = self_attr(attr)
    for fn in methods(cls).values():
        values = [cst.ensure_type(a, cst.Assign).value for a in m.findall(fn, m.Assign())
                  if any(m.findall(t.target, target) for t in cst.ensure_type(a, cst.Assign).targets)]
        if not values:
            continue
        if len(values) != 1:
            return False
        called = {cst.ensure_type(cst.ensure_type(c, cst.Call).func, cst.Name).value
                  for c in m.findall(values[0], m.Call(func=m.Name()))} - NOT_LAYERS
        if len(called) != 1:
            return False
        name = next(iter(called))
        shadowed = {cst.ensure_type(p, cst.Param).name.value for p in m.findall(values[0], m.Param())}
        body = cst.ensure_type(fn.body, cst.IndentedBlock).body
        own = [s for s in body if m.matches(s, m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(m.Name(name))])]))]
        bound = m.findall(fn, m.AssignTarget(m.Name(name)) | m.AnnAssign(target=m.Name(name))
                          | m.AugAssign(target=m.Name(name)) | m.For(target=m.Name(name)) | m.Param(name=m.Name(name)))
        return len(own) == 1 and len(bound) == 1 and name not in shadowed
    return False
