"""What the SGLang dialect says about each decoder it met: the verdict types shared by its commands.

``SglangStatus`` is the verdict (adapted / unchanged / declined), ``CaptureForm`` how the decoder collects
its aux states (SGLang's ``AuxHiddenStateList`` or the packed ``AuxHiddenStatePacker`` buffer), and
``DecoderOutcome`` one decoder's row: class, verdict, the reason (construct and line for a decline), the
id convention read from the model's own ``set_eagle3_layers_to_capture`` and the capture form.
Pure data; imports nothing but the standard library and pipespec's ``StrEnum``.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipespec.str_enum import StrEnum


class SglangStatus(StrEnum):
    """A decoder's verdict, in the order a reader acts on them."""

    ADAPTED = "adapted"  # the codemod rewrote it: every rank captures, the hand-off carries the states
    UNCHANGED = "unchanged"  # already carries the adaptation: nothing to do
    DECLINED = "declined"  # a construct the dialect cannot rewrite (named with its line)


class CaptureForm(StrEnum):
    """How a decoder's forward collects the aux states it hands to the logits processor."""

    LIST = "list"  # AuxHiddenStateList: one tensor per id
    PACKER = "packer"  # AuxHiddenStatePacker: one preallocated [tokens, K * hidden] buffer
    NONE = "none"  # no collector in forward: the model captures no aux states


@dataclass(frozen=True)
class DecoderOutcome:
    """One decoder class with a pipeline layer loop, and what the dialect did with it."""

    cls: str
    status: SglangStatus
    reason: str
    capture_form: CaptureForm
    #: How ``set_eagle3_layers_to_capture`` turns the ids it is given into capture points (pipespec ids),
    #: as read from the model's own code; names the class it was read from.
    id_convention: str = ""
    line: int = 0

    def with_convention(self, convention: str) -> DecoderOutcome:
        return DecoderOutcome(cls=self.cls, status=self.status, reason=self.reason, capture_form=self.capture_form,
                              id_convention=convention, line=self.line)
