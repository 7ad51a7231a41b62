"""The backend contract: capabilities declared once, reasons derived from them."""

from __future__ import annotations

import pytest
import torch

import kvcore
from kvcore import AttentionBackend, DeviceCapability, MultipleOf

pytestmark = pytest.mark.platform_matrix


class Declared(AttentionBackend):
    """A backend with narrow declarations, to check every derived reason."""

    SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
    SUPPORTED_KV_CACHE_DTYPES = ("auto",)
    SUPPORTED_HEAD_SIZES = (64, 96, 128, 256)
    SUPPORTED_BLOCK_SIZES = (MultipleOf(16),)
    MIN_DEVICE_CAPABILITY = DeviceCapability(8, 0)
    PLATFORMS = ("cuda",)
    REQUIRED_PACKAGES = (("kvcore_no_such_kernels", "acme-kernels"),)

    @staticmethod
    def get_name():
        return "DECLARED"

    @staticmethod
    def get_impl_cls():
        raise NotImplementedError

    @classmethod
    def check_combination(cls, config, device_capability):
        if config.kv_cache_dtype != "auto" and config.block_size > 64:
            return ["fp8 KV cache needs block_size <= 64 on DECLARED"]
        return []


def validate(**overrides):
    args = dict(head_size=128, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=32,
                use_mla=False, has_sink=False, use_sparse=False, use_mm_prefix=False,
                use_per_head_quant_scales=False, device_capability=DeviceCapability(9, 0),
                attn_type="decoder")
    args.update(overrides)
    return Declared.validate_configuration(**args)


MISSING = "acme-kernels not installed (pip install acme-kernels)"


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [({"head_size": 80}, "head_size=80 (supported: 64, 96, 128, 256)"),
     ({"dtype": torch.float32}, "dtype=float32 (supported: float16, bfloat16)"),
     ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype=fp8 (supported: auto)"),
     ({"block_size": 24}, "block_size=24 (supported: multiples of 16)"),
     ({"use_mla": True}, "use_mla=True but DECLARED is not an MLA backend (choose an MLA backend)"),
     ({"has_sink": True}, "has_sink=True: DECLARED does not support attention sinks"),
     ({"use_sparse": True}, "use_sparse=True: DECLARED does not support sparse attention"),
     ({"attn_type": "encoder_only"}, "attn_type=encoder_only (supported: decoder)"),
     ({"device_capability": DeviceCapability(7, 5)}, "device capability 7.5 (supported: >= 8.0)"),
     ({"use_non_causal": True}, "use_non_causal=True: DECLARED does not support non-causal "
                                "attention")],
    ids=["head_size", "dtype", "kv_cache_dtype", "block_size", "mla", "sink", "sparse",
         "attn_type", "capability", "non_causal"],
)
def test_each_capability_yields_one_self_contained_reason(overrides, reason):
    assert validate(**overrides) == [reason, MISSING]


def test_valid_config_has_only_the_missing_package_reason():
    assert validate() == [MISSING]


def test_uses_triton_adds_the_triton_reasons_after_the_packages(monkeypatch):
    class OnTriton(Declared):
        USES_TRITON = True

    too_old = "triton 3.0 is too old (need >= 3.6; pip install -U triton)"
    monkeypatch.setattr(kvcore.backend, "triton_unavailable_reasons", lambda: [too_old])
    assert OnTriton.unavailable_reasons() == [MISSING, too_old]
    assert Declared.unavailable_reasons() == [MISSING]


def test_cross_field_rule_comes_from_check_combination():
    reasons = validate(kv_cache_dtype="fp8", block_size=128)
    assert "fp8 KV cache needs block_size <= 64 on DECLARED" in reasons


def test_kv_connector_reason_uses_the_backend_explanation():
    class Legacy(Declared):
        @classmethod
        def supports_kv_connector(cls):
            return False

        @classmethod
        def kv_connector_unsupported_reason(cls):
            return "DECLARED keeps (2, num_blocks, ...); use OTHER"

    reasons = Legacy.validate_configuration(
        128, torch.bfloat16, "auto", 32, False, False, False, False, False,
        DeviceCapability(9, 0), "decoder", use_kv_connector=True)
    assert "KV connector not supported: DECLARED keeps (2, num_blocks, ...); use OTHER" in reasons


def test_capabilities_are_plain_data_for_listing():
    caps = Declared.capabilities()
    assert caps["head_sizes"] == "64, 96, 128, 256" and caps["block_sizes"] == "multiples of 16"
    assert caps["min_device_capability"] == "8.0" and caps["cross_layer"] is False
    assert kvcore.resolve_backend("CPU_ATTN").capabilities()["cross_layer"] is True


def test_default_layout_is_blocks_first_and_not_cross_layer():
    assert Declared.get_kv_cache_shape(10, 16, 8, 128) == (10, 2, 16, 8, 128)
    assert Declared.get_kv_cache_stride_order() == (0, 1, 2, 3, 4)
    assert Declared.get_kv_cache_stride_order(True) == (0, 1, 2, 3, 4, 5)
    assert not Declared.supports_cross_layer() and Declared.supports_kv_connector()


def test_impl_rejects_bad_head_counts():
    impl_cls = kvcore.resolve_backend("CPU_ATTN").get_impl_cls()
    with pytest.raises(ValueError, match="num_heads=6 must be a positive multiple of "
                                         "num_kv_heads=4"):
        impl_cls(6, 64, 0.125, 4)
    with pytest.raises(ValueError, match="sliding_window=0 must be None or an int >= 1"):
        impl_cls(4, 64, 0.125, 4, sliding_window=0)


@pytest.mark.parametrize(("text", "expected"),
                         [("9.0", (9, 0)), ("90", (9, 0)), ("sm_100", (10, 0)), ("8.9", (8, 9)),
                          ("gfx942", (9, 4))])
def test_device_capability_parse(text, expected):
    cap = DeviceCapability.parse(text)
    assert (cap.major, cap.minor) == expected


def test_device_capability_parse_rejects_nonsense():
    with pytest.raises(ValueError, match="'ampere' is not of the form"):
        DeviceCapability.parse("ampere")
    with pytest.raises(ValueError, match="'gfx123' is not a known gfx name"):
        DeviceCapability.parse("gfx123")


def test_build_attention_metadata_accepts_tensor_block_table_rows():
    rows = torch.tensor([[3, 4], [5, 6]], dtype=torch.int32)
    meta = kvcore.build_attention_metadata([2, 1], [1, 0], list(rows), block_size=2)
    assert meta.block_table.tolist() == [[3, 4], [5, 6]]
    assert meta.slot_mapping.tolist() == [7, 8, 10]


# -- NAME / IMPL_CLS / BUILDER_CLS: the methods derived from class attributes ----------------


class _NamedImpl(kvcore.PagedAttentionImpl):
    reshape_and_cache = staticmethod(kvcore.ops.reshape_and_cache_ref)
    paged_attention = staticmethod(kvcore.ops.paged_attention_torch)


class _Named(AttentionBackend):
    NAME = "NAMED"
    IMPL_CLS = _NamedImpl


class _NamedPersistent(_Named):
    """Inherits IMPL_CLS, declares its own builder."""

    NAME = "NAMED_PERSISTENT"
    BUILDER_CLS = kvcore.PersistentMetadataBuilder


def test_get_methods_return_the_declared_attributes():
    assert _Named.get_name() == "NAMED" and _Named.get_impl_cls() is _NamedImpl
    assert _Named.get_builder_cls() is kvcore.AttentionMetadataBuilder  # the default
    assert _NamedPersistent.get_name() == "NAMED_PERSISTENT"
    assert _NamedPersistent.get_impl_cls() is _NamedImpl
    assert _NamedPersistent.get_builder_cls() is kvcore.PersistentMetadataBuilder
    # A backend that overrides the methods keeps its own: the methods stay the public API.
    assert Declared.get_name() == "DECLARED" and Declared.NAME is None


def test_missing_or_wrong_declarations_say_what_to_set():
    class Bare(AttentionBackend):
        pass

    with pytest.raises(NotImplementedError, match="Bare declares no NAME; set the class "
                                                  r"attribute NAME \(or override get_name"):
        Bare.get_name()
    with pytest.raises(TypeError, match=r"Bare.IMPL_CLS=None is not a class; set it to the "
                                        "AttentionImpl subclass itself"):
        Bare.get_impl_cls()


@pytest.mark.parametrize("attr", ["IMPL_CLS", "BUILDER_CLS"])
def test_class_names_are_refused_clearly(attr):
    # The classes themselves, never names resolved later.
    Wrong = type("Wrong", (_Named,), {attr: "_NamedImpl"})

    with pytest.raises(TypeError, match=f"Wrong.{attr}='_NamedImpl' is not a class; set it"):
        getattr(Wrong, "get_impl_cls" if attr == "IMPL_CLS" else "get_builder_cls")()
