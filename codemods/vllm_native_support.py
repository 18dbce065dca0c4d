"""Is a decoder already right by vLLM's contract, before anything is rewritten? Read from the class and,
where it does not set the flag itself, from its base classes' source.

vLLM's runner reads ``supports_aux_hidden_states_over_pp`` with ``getattr`` on the decoder
(``verify_supports_aux_hidden_states_over_pp``), so a flag set by a base class counts: a decoder that
inherits ``True`` (MuseSpark's ``MuseSparkModel(LlamaModel)``) and whose own forward collects and packs aux
states is supported as it is. What the base sets is read from its source (the file, or the modules it
imports through ``ClassLookup``), never by importing it. Pure libcst; imports no vLLM."""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from pipespec.codemods.vllm_forward_shape import names_in
from pipespec.codemods.vllm_native_loop import ClassLookup, Decline, methods, own_flag
from pipespec.codemods.vllm_native_names import bases_of, snippet_of
from pipespec.codemods.vllm_native_status import DecoderStatus
from pipespec.contract.names import AUX_OVER_PP_FLAG

#: What a forward that already follows vLLM's contract calls (llama.py's LlamaModel.forward).
CONTRACT_CALLS = frozenset({"collect_remote_aux_hidden_states", "pack_local_aux_hidden_states"})
_MAX_DEPTH = 6  # base classes followed, in MRO-like order (vLLM's deepest chain is 3)


def judge(dec: cst.ClassDef, lookup: ClassLookup | None) -> tuple[DecoderStatus, str]:
    """``(UNCHANGED, why)`` when the class already follows the contract (its flag True, set on itself or
    inherited, over a forward that collects and packs); ``(ADAPTED, "")`` when it is to be rewritten;
    ``Decline`` for an explicit opt-out, or a forward that packs aux states under a flag that is not True."""
    flag = own_flag(dec)
    calls = names_in(methods(dec)["forward"])
    complete = CONTRACT_CALLS <= calls
    if flag is not None:
        value = _flag_value(flag)
        if value == "False":
            parent = ", ".join(snippet_of(b) for b in bases_of(dec)) or "object"
            captures = "captures aux states" if "_maybe_add_hidden_state" in calls else "captures no aux states"
            raise Decline(f"{dec.name.value} opts out by hand: `{snippet_of(flag)}`, over a forward that {captures} "
                          f"(it overrides {parent}.forward); remove that line to have it adapted", flag)
        if value == "True" and complete:
            return DecoderStatus.UNCHANGED, (f"already follows vLLM's contract: it sets {AUX_OVER_PP_FLAG} = True itself and its forward "
                                 "collects and packs aux states")
        return DecoderStatus.ADAPTED, ""
    if not complete:
        return DecoderStatus.ADAPTED, ""
    owner, value, unread = inherited_flag(dec, lookup)
    if value == "True":
        return DecoderStatus.UNCHANGED, (f"already follows vLLM's contract: it inherits {AUX_OVER_PP_FLAG} = True from "
                                         f"{owner} (vLLM's runner reads the flag with getattr) and its own forward "
                                         "collects and packs aux states")
    forward = methods(dec)["forward"]
    if owner is not None:
        raise Decline(f"its forward collects and packs aux states, but it inherits {AUX_OVER_PP_FLAG} = {value} from {owner}: "
                      f"review the forward and set {AUX_OVER_PP_FLAG} = True in {dec.name.value} itself", forward)
    where = (f"its bases {', '.join(unread)} cannot be read from the source" if unread
             else "no base class sets it")
    raise Decline(f"its forward collects and packs aux states, but {dec.name.value} does not set {AUX_OVER_PP_FLAG} and {where}: "
                  f"review the forward and set {AUX_OVER_PP_FLAG} = True in the class itself", forward)


def inherited_flag(cls: cst.ClassDef, lookup: ClassLookup | None) -> tuple[str | None, str | None, list[str]]:
    """(the base class that sets the flag, its value's source, the bases that could not be read), nearest
    base first, left to right (Python's MRO for the single-inheritance chains vLLM uses)."""
    unread: list[str] = []
    todo: list[tuple[cst.ClassDef, ClassLookup | None, int]] = [(cls, lookup, 0)]
    seen: set[str] = {cls.name.value}
    while todo:
        here, here_lookup, depth = todo.pop(0)
        if depth >= _MAX_DEPTH:
            continue
        for base in bases_of(here):
            name = base.value if isinstance(base, cst.Name) else base.attr.value if isinstance(base, cst.Attribute) else ""
            if not name or name in seen or name in ("object", "Module"):
                continue
            seen.add(name)
            found = here_lookup(name, here) if here_lookup is not None else []
            if len(found) != 1:
                unread.append(name)
                continue
            parent, parent_lookup = found[0]
            line = own_flag(parent)
            if line is not None:
                return parent.name.value, _flag_value(line), unread
            todo.append((parent, parent_lookup, depth + 1))
    return None, None, unread


def _flag_value(line: cst.SimpleStatementLine) -> str:
    small = line.body[0]
    value = small.value if isinstance(small, (cst.Assign, cst.AnnAssign)) else None
    if m.matches(value, m.Name("True") | m.Name("False")):
        return cst.ensure_type(value, cst.Name).value
    return snippet_of(value) if value is not None else "(no value)"


__all__ = ["CONTRACT_CALLS", "inherited_flag", "judge"]
