"""What vLLM's V2 model runner reads on a target's decoder, given where the runner looks for it.

The runner never asks the ``*ForCausalLM`` class which module is its decoder: ``_inner_decoder(model)``
(``vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py``, the same in 0.32, 0.33 and 0.34) takes
``model.get_language_model()`` if the class has that method, else ``model.language_model``, else the model
itself, and returns that object's ``.model`` (``None`` if it has none). On that object it reads:

* ``supports_aux_hidden_states_over_pp`` (``verify_supports_aux_hidden_states_over_pp``: refused when false);
* ``_aux_slot_base_cached`` and ``AUX_HIDDEN_STATE_KEY`` (``aux_hidden_state_relay_keys`` on a middle rank,
  ``reserve_aux_intermediate_tensor_slots`` on every non-first rank);
* ``config.hidden_size`` (``reserve_aux_intermediate_tensor_slots``: the width of each reserved slot).

The EAGLE drafter's loader (``v1/worker/gpu/spec_decode/eagle/utils.py``) also reads
``get_language_model().model`` to share the target's embedding. Three shapes of adapted file miss it:

* a plain wrapper between the causal LM and the decoder (``OPTForCausalLM.model`` is ``OPTModel``, whose
  ``decoder`` is the adapted ``OPTDecoder``): the wrapper gets the flag on its class and properties that
  hand the runner the decoder's slot base, key prefix and config (``wrapper_surface``);
* a multimodal class whose ``get_language_model()`` is the decoder itself (built inside
  ``with self._mark_language_model(...)``, or returned by its own ``get_language_model``): the decoder has
  no ``.model``; it gets a ``model`` property returning itself, which is also what vLLM's own
  ``SupportsEagle3`` defaults fall back to (``decoder_surface``);
* a decoder that does not keep the config it is built from (``DbrxModel``, ``StableLMEpochModel``): it
  keeps it as ``self.config`` (``decoder_surface``).

Every edit looks before it inserts, so the output is a fixed point. Imports no vLLM.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from pipespec.codemods.vllm_forward_shape import is_docstring, self_attr
from pipespec.codemods.vllm_native_holders import Holder, has_attr
from pipespec.codemods.vllm_native_loop import methods, own_flag
from pipespec.codemods.vllm_native_names import base_name, bases_of
from pipespec.contract.names import AUX_OVER_PP_FLAG

#: What the runner reads on the decoder besides the flag, each delegated by a wrapper to the decoder.
DELEGATED = (("AUX_HIDDEN_STATE_KEY", "str"), ("_aux_slot_base_cached", "int"))
#: Every attribute vLLM's runner helpers read on ``_inner_decoder(model)`` (0.32 to 0.34).
RUNNER_READS = frozenset({AUX_OVER_PP_FLAG, "config", *(name for name, _ in DELEGATED)})
#: Bases that set no ``self.config`` of their own (vLLM's mixins and interfaces, torch's Module).
_PLAIN_BASES = ("Module", "EagleModelMixin")


def wrapper_surface(wrapper: cst.ClassDef, inner: str) -> cst.ClassDef:
    """The runner-facing surface on a wrapper whose ``self.<inner>`` is the adapted decoder: the flag on
    the class, then ``AUX_HIDDEN_STATE_KEY``, ``_aux_slot_base_cached`` and (where the wrapper keeps none)
    ``config`` as properties reading the decoder's."""
    body = list(cst.ensure_type(wrapper.body, cst.IndentedBlock).body)
    added = False
    if own_flag(wrapper) is None:
        at = 1 if body and is_docstring(body[0]) else 0
        line = cst.parse_statement(
            f"{AUX_OVER_PP_FLAG} = True  # vLLM's V2 runner reads its decoder here (model.model): this wraps it\n")
        if at:
            line = line.with_changes(leading_lines=[cst.EmptyLine(indent=False)])
        if at < len(body) and not body[at].leading_lines and not isinstance(body[at], cst.SimpleStatementLine):
            body[at] = body[at].with_changes(leading_lines=[cst.EmptyLine(indent=False)])
        body.insert(at, line)
        added = True
    wanted = [*DELEGATED, *([("config", "object")] if not has_attr(wrapper, "config") else [])]
    props = [_delegate(name, kind, inner) for name, kind in wanted if name not in methods(wrapper)]
    if props:
        at = next((i for i, s in enumerate(body) if isinstance(s, cst.FunctionDef) and s.name.value == "forward"),
                  len(body))
        body[at:at] = props
        added = True
    return wrapper.with_changes(body=wrapper.body.with_changes(body=body)) if added else wrapper


def decoder_surface(decoder: cst.ClassDef, held: list[Holder], module_type: str) -> cst.ClassDef:
    """The adapted decoder as the runner reads it: ``self.config`` kept where its own ``__init__`` drops it,
    and a ``model`` property returning itself where a multimodal holder's language model is the decoder."""
    decoder = _keep_config(decoder)
    if any(_language_model_is_decoder(h) for h in held) and not has_attr(decoder, "model"):
        prop = cst.parse_statement(
            "@property\n"
            f"def model(self) -> {module_type}:\n"
            "    # The language model is this decoder; vLLM's V2 runner and EAGLE loader read\n"
            "    # get_language_model().model (its _inner_decoder)\n"
            "    return self\n").with_changes(leading_lines=[cst.EmptyLine(indent=False)])
        body = list(cst.ensure_type(decoder.body, cst.IndentedBlock).body)
        at = next((i for i, s in enumerate(body) if isinstance(s, cst.FunctionDef) and s.name.value == "forward"),
                  len(body))
        body.insert(at, prop)
        decoder = decoder.with_changes(body=decoder.body.with_changes(body=body))
    return decoder


def _delegate(name: str, kind: str, inner: str) -> cst.BaseStatement:
    return cst.parse_statement(
        "@property\n"
        f"def {name}(self) -> {kind}:\n"
        f"    return self.{inner}.{name}\n").with_changes(leading_lines=[cst.EmptyLine(indent=False)])


def _language_model_is_decoder(holder: Holder) -> bool:
    """``holder.cls.get_language_model()`` is the decoder at ``self.<holder.attr>``: its own method returns
    it, or (vLLM's ``SupportsMultiModal`` default) the decoder is built inside ``_mark_language_model``."""
    if holder.multimodal or holder.wrapper is not None or "." in holder.attr or not holder.supports_multimodal:
        return False
    own = methods(holder.cls).get("get_language_model")
    if own is not None:
        returned = m.Return(self_attr(holder.attr))
        return bool(m.findall(own, returned)) and len(m.findall(own, m.Return())) == 1
    marked = m.With(items=[m.WithItem(m.Call(func=self_attr("_mark_language_model")))])
    built = m.Assign(targets=[m.AssignTarget(self_attr(holder.attr))])
    return any(m.findall(block, built) for block in m.findall(holder.cls, marked))


def _keep_config(decoder: cst.ClassDef) -> cst.ClassDef:
    """``self.config = config`` after the statement of ``__init__`` that binds ``config`` (or after
    ``super().__init__()`` when it is a parameter); nothing where the class or a base may already keep it."""
    init = methods(decoder).get("__init__")
    if init is None or has_attr(decoder, "config") or not isinstance(init.body, cst.IndentedBlock):
        return decoder
    if any(base_name(b) not in _PLAIN_BASES and not base_name(b).startswith("Supports") for b in bases_of(decoder)):
        return decoder
    stmts = list(init.body.body)
    binds = m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(m.Name("config"))])])
    at = next((i + 1 for i, s in enumerate(stmts) if m.matches(s, binds)), None)
    if at is None:
        p = init.params
        if not any(x.name.value == "config" for x in (*p.params, *p.kwonly_params)):
            return decoder
        super_init = m.SimpleStatementLine(body=[m.Expr(m.Call(func=m.Attribute(
            value=m.Call(func=m.Name("super")), attr=m.Name("__init__"))))])
        at = next((i + 1 for i, s in enumerate(stmts) if m.matches(s, super_init)), 0)
    keep = cst.parse_statement(
        "self.config = config  # vLLM's V2 runner reads config.hidden_size here for its receive buffers\n")
    stmts.insert(at, keep)
    new_init = init.with_changes(body=init.body.with_changes(body=stmts))
    body = [new_init if s is init else s for s in cst.ensure_type(decoder.body, cst.IndentedBlock).body]
    return decoder.with_changes(body=decoder.body.with_changes(body=body))


__all__ = ["DELEGATED", "RUNNER_READS", "decoder_surface", "wrapper_surface"]
