"""The speculation policy's states as types: the mode a round runs in, and the phase the policy is in.

``SpecPolicy.record`` dispatches on the phase; the phases and what moves the policy between them::

    STARTING         -> MEASURING         the first round (it only starts the clock)
    MEASURING        -> MEASURING         the cycle's next block: drafting, or plain decoding while it stands;
                                          a plain block proper where plain wins on a probe's rounds alone
                     -> PROBE_LAUNCHING   a plain block while drafting stands (or before the first decision)
                     -> EXPLOITING        decided: both modes measured, or drafting beats plain's estimate
    PROBE_LAUNCHING  -> PROBE_LANDING     its plain rounds launched: drafting resumes before they land
    PROBE_LANDING    -> MEASURING         not settled by its rounds, or they never land: a plain block proper
    PROBE_*          -> as MEASURING      its block over (a plain block that already lost ends early)
    EXPLOITING       -> MEASURING         the exploit period over, or plain decoding ran slower than chosen on
    CHECKING         -> EXPLOITING        drafting's acceptance beats the carried round-cost ratio
                     -> PROBE_LAUNCHING   it falls short: plain decoding is measured at the new load
    any but ALWAYS   -> CHECKING          the load moved while drafting wins, a ratio known at or above it
                     -> MEASURING         the load moved otherwise

``ALWAYS`` (``--spec-policy always``) is its policy's only phase: every round drafts.
"""

from __future__ import annotations

import enum


class Mode(enum.Enum):
    """What a round runs: drafts verified with it, or a plain step (one token per row). The value is the
    mode's name in the decision trace."""

    SPECULATE = "speculate"
    PLAIN = "plain"

    @classmethod
    def of(cls, speculated: bool) -> Mode:
        """The mode of a round that did (True) or did not carry drafts."""
        return cls.SPECULATE if speculated else cls.PLAIN

    @property
    def other(self) -> Mode:
        return Mode.PLAIN if self is Mode.SPECULATE else Mode.SPECULATE

    @property
    def drafts(self) -> bool:
        """Whether a round of this mode carries drafts."""
        return self is Mode.SPECULATE


class Phase(enum.Enum):
    """Where the policy stands; what the next published round is used for."""

    ALWAYS = enum.auto()
    """``--spec-policy always``: every round drafts; rounds are counted and traced, nothing is decided."""
    STARTING = enum.auto()
    """No round published yet: the first one only starts the clock (its interval has no start)."""
    MEASURING = enum.auto()
    """A measuring cycle: blocks of ``window`` measured rounds of each mode in turn (the current mode, the
    other, the current again), then a decision."""
    PROBE_LAUNCHING = enum.auto()
    """A plain block begun while drafting stands (or before the first decision): ``probe_rounds`` rounds
    are still to be launched without drafts."""
    PROBE_LANDING = enum.auto()
    """The probe's plain rounds are launched and drafting has resumed; they are measured as they land.
    Ends early when drafting's window beats them, or becomes a plain block proper (``MEASURING``)."""
    CHECKING = enum.auto()
    """The load moved while drafting wins: drafting alone is measured at the new load and kept while its
    acceptance beats the round-cost ratio carried from a load measured before."""
    EXPLOITING = enum.auto()
    """The winner of the last cycle runs until its exploit period ends (drafting's rounds are pooled for
    free, plain decoding's watched)."""

    @property
    def measures(self) -> bool:
        """Whether rounds in this phase count towards a measuring block."""
        return self in (Phase.MEASURING, Phase.PROBE_LAUNCHING, Phase.PROBE_LANDING, Phase.CHECKING)

    @property
    def probing(self) -> bool:
        return self in (Phase.PROBE_LAUNCHING, Phase.PROBE_LANDING)
