"""``pipespec.contract.names`` against the vLLM it plugs into: the names generated code and the plugin emit are vLLM's."""

from __future__ import annotations

from vllm.model_executor.models import interfaces

from pipespec.contract.names import (
    AUX_KEY_PREFIX,
    AUX_OVER_PP_FLAG,
    VLLM_AUX_CALLS,
    VLLM_EAGLE3_INTERFACE,
    VLLM_EAGLE_MIXIN,
)


def test_aux_keys_use_vllms_prefix() -> None:
    """The relay keys pipespec plans are the ones vLLM's mixin packs and collects."""
    assert getattr(interfaces, VLLM_EAGLE_MIXIN).AUX_HIDDEN_STATE_KEY == AUX_KEY_PREFIX


def test_the_over_pp_flag_is_vllms_class_flag_and_off_by_default() -> None:
    """A decoder that does not set the flag itself is refused by vLLM: the default is False on vLLM's mixin."""
    mixin = getattr(interfaces, VLLM_EAGLE_MIXIN)
    assert mixin.__dict__[AUX_OVER_PP_FLAG] is False


def test_the_relay_calls_are_vllms_mixin_methods() -> None:
    """Readiness and the source zoo look for these calls in a forward: they are the mixin's relay methods."""
    mixin = getattr(interfaces, VLLM_EAGLE_MIXIN)
    assert all(callable(mixin.__dict__.get(call)) for call in VLLM_AUX_CALLS)


def test_the_eagle3_interface_is_the_one_vllms_check_reads() -> None:
    """``supports_eagle3`` is true exactly for classes that implement the interface named here."""
    interface = getattr(interfaces, VLLM_EAGLE3_INTERFACE)

    class Holder(interface):  # type: ignore[misc, valid-type]
        pass

    assert interfaces.supports_eagle3(Holder) and not interfaces.supports_eagle3(type("Plain", (), {}))
