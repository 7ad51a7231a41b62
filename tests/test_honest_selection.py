"""Selection, registration, allocation and metadata refuse what they cannot honour (issue 18,
items 11-15): encoder-only layers never write the cache, protected built-in names, layouts
validated on resolve, broken packages rejected, strict booleans, cross-layer per platform."""

from __future__ import annotations

import logging
import textwrap

import pytest
import torch

import kvcore
from kvcore.ops import paged_attention_ref

# -- 11: encoder-only layers -------------------------------------------------------------------


@pytest.mark.parametrize("backend_name", ["CPU_ATTN", "TRITON_ATTN"])
def test_encoder_only_layer_never_writes_the_cache(backend_name):
    gen = torch.Generator().manual_seed(11)
    backend = kvcore.resolve_backend(backend_name)
    caches = kvcore.allocate_kv_caches(backend, num_layers=2, num_blocks=8, block_size=4,
                                       num_kv_heads=2, head_size=16, dtype=torch.float32,
                                       device="cpu", cross_layer=False)
    caches.storage.normal_(generator=gen)
    before = caches.storage.clone()
    impl = backend.get_impl_cls()(num_heads=4, head_size=16, scale=0.25, num_kv_heads=2,
                                  attn_type=kvcore.AttentionType.ENCODER_ONLY)
    assert not impl.writes_kv_cache()
    q_lens = [5, 3]
    meta = kvcore.build_attention_metadata(q_lens, [0, 0], [[6, 1], [3]], 4)
    n = sum(q_lens)
    query = torch.randn(n, 4, 16, generator=gen)
    key, value = torch.randn(n, 2, 16, generator=gen), torch.randn(n, 2, 16, generator=gen)
    impl.do_kv_cache_update(kvcore.LayerScales(), key, value, caches.layers[1],
                            meta.slot_mapping)
    out = impl.forward(kvcore.LayerScales(), query, key, value, caches.layers[1], meta)
    assert torch.equal(caches.storage, before)  # nothing written, not even by forward
    # Expected: bidirectional attention over this step's own key/value.
    kc, vc = torch.zeros(8, 4, 2, 16), torch.zeros(8, 4, 2, 16)
    kvcore.ops.reshape_and_cache_ref(key, value, kc, vc, meta.slot_mapping)
    want = paged_attention_ref(query.double(), kc.double(), vc.double(),
                               query_start_loc=meta.query_start_loc, seq_lens=meta.seq_lens,
                               block_table=meta.block_table, scale=0.25, causal=False)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


def test_encoder_only_refuses_a_cached_prefix():
    backend = kvcore.resolve_backend("CPU_ATTN")
    caches = kvcore.allocate_kv_caches(backend, num_layers=1, num_blocks=4, block_size=4,
                                       num_kv_heads=1, head_size=8, dtype=torch.float32,
                                       device="cpu")
    impl = backend.get_impl_cls()(num_heads=1, head_size=8, scale=0.3,
                                  attn_type="encoder_only")
    meta = kvcore.build_attention_metadata([2], [3], [[0, 1]], 4)
    x = torch.randn(2, 1, 8)
    with pytest.raises(ValueError, match="give every request context length 0"):
        impl.forward(kvcore.LayerScales(), x, x, x, caches.layers[0], meta)


# -- 12: layouts validated when first resolved -------------------------------------------------


class _BadOrderBackend(kvcore.AttentionBackend):
    PLATFORMS = ("cpu",)
    SUPPORTED_DTYPES = (torch.float32,)

    @staticmethod
    def get_name() -> str:
        return "BAD_ORDER"

    @staticmethod
    def get_impl_cls():
        raise AssertionError("never reached")

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False):
        return (0, 1, 2, 2, 4)  # not a permutation


class _BadOrderPlugin:
    @kvcore.hookimpl
    def kvcore_register_backends(self, register):
        register("BAD_ORDER", f"{__name__}:_BadOrderBackend")


def test_a_backend_with_an_invalid_layout_is_rejected_with_its_reason(fresh_kvcore):
    kvcore.register_plugin(_BadOrderPlugin(), "bad_order")
    with pytest.raises(kvcore.ResolveError,
                       match=r"'BAD_ORDER' \(plugin 'bad_order'\) declares an invalid KV cache "
                             r"layout: ValueError: .*permutation"):
        kvcore.resolve_backend("BAD_ORDER")
    config = kvcore.AttentionSelectorConfig(head_size=64, dtype=torch.float32)
    report = kvcore.explain_selection(config, "cpu")
    bad = next(c for c in report.candidates if c.name == "BAD_ORDER")
    assert not bad.valid and "invalid KV cache layout" in bad.reasons[0]
    assert kvcore.get_attn_backend(config, platform="cpu").get_name() == "CPU_ATTN"


# -- 13: a required package that fails to import -----------------------------------------------


def test_a_backend_whose_package_fails_to_import_is_rejected(fresh_kvcore, tmp_path,
                                                             monkeypatch):
    (tmp_path / "kvcore_test_brokenlib.py").write_text(
        'raise ImportError("libbroken.so: cannot open shared object file")\n')
    (tmp_path / "kvcore_test_brokenbackend.py").write_text(textwrap.dedent('''
        import torch
        import kvcore

        class BrokenLibBackend(kvcore.AttentionBackend):
            PLATFORMS = ("cpu",)
            SUPPORTED_DTYPES = (torch.float32,)
            REQUIRED_PACKAGES = (("kvcore_test_brokenlib", "brokenlib"),)

            @staticmethod
            def get_name():
                return "BROKEN_LIB"

            @staticmethod
            def get_impl_cls():
                import kvcore_test_brokenlib  # noqa: F401

        class Plugin:
            @kvcore.hookimpl
            def kvcore_register_backends(self, register):
                register("BROKEN_LIB", "kvcore_test_brokenbackend:BrokenLibBackend")
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    import kvcore_test_brokenbackend

    kvcore.register_plugin(kvcore_test_brokenbackend.Plugin(), "brokenlib")
    config = kvcore.AttentionSelectorConfig(head_size=64, dtype=torch.float32)
    with pytest.raises(kvcore.BackendSelectionError,
                       match=r"brokenlib is installed but importing kvcore_test_brokenlib "
                             r"fails: ImportError: libbroken.so"):
        kvcore.get_attn_backend(config, backend="BROKEN_LIB", platform="cpu")
    # Unforced, it would come first (a platform's extra backends follow its list; put it first).
    monkeypatch.setattr(type(kvcore.get_platform("cpu")), "get_backend_priorities",
                        lambda self, config, cap: ["BROKEN_LIB", "CPU_ATTN"])
    report = kvcore.explain_selection(config, "cpu")
    assert report.selected.name == "CPU_ATTN"
    broken = next(c for c in report.candidates if c.name == "BROKEN_LIB")
    assert "importing kvcore_test_brokenlib fails" in broken.reasons[0]


# -- 14: misspelled allowlist, strict booleans, declared capabilities, metadata ----------------


def test_a_misspelled_allowlist_warns_naming_the_installed_plugins(with_plugins, monkeypatch,
                                                                  caplog):
    with_plugins("standin_rocm")
    monkeypatch.setenv("KVCORE_PLUGINS", "standin_rcom")
    kvcore.reset_plugins()
    with caplog.at_level(logging.WARNING, logger="kvcore.plugins"):
        kvcore.list_plugins()
    assert ("KVCORE_PLUGINS names 'standin_rcom', which no installed plugin matches"
            in caplog.text)
    assert "testfixture_standin_rocm" in caplog.text


@pytest.mark.parametrize("field", ["use_mla", "use_kv_connector", "has_sink"])
@pytest.mark.parametrize("value", ["no", 0, None], ids=["str", "int", "none"])
def test_selector_config_booleans_must_be_bool(field, value):
    with pytest.raises(TypeError, match=f"{field}={value!r} must be a bool"):
        kvcore.AttentionSelectorConfig(head_size=64, **{field: value})


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [(dict(dtype=torch.float16), TypeError, r"dtype=float16: TRITON_MLA_TEST supports"),
     (dict(head_size=48), ValueError, r"head_size=48: TRITON_MLA_TEST supports 64, 128"),
     (dict(block_size=7), ValueError, r"block_size=7: TRITON_MLA_TEST supports 16"),
     (dict(kv_cache_dtype="fp8"), ValueError, r"kv_cache_dtype='fp8': TRITON_MLA_TEST")],
    ids=["dtype", "head_size", "block_size", "kv_cache_dtype"],
)
def test_allocate_validates_the_backends_declared_capabilities(kwargs, error, message):
    class Declared(kvcore.AttentionBackend):
        SUPPORTED_DTYPES = (torch.float32,)
        SUPPORTED_HEAD_SIZES = (64, 128)
        SUPPORTED_BLOCK_SIZES = (16,)

        @staticmethod
        def get_name():
            return "TRITON_MLA_TEST"

        @staticmethod
        def get_impl_cls():
            raise AssertionError

    args = dict(num_layers=1, num_blocks=2, block_size=16, num_kv_heads=1, head_size=64,
                dtype=torch.float32, device="cpu")
    with pytest.raises(error, match=message):
        kvcore.allocate_kv_caches(Declared, **{**args, **kwargs})


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [(([2.0], [0], [[0]]), TypeError, r"query_lens\[0\]=2.0 must be an int"),
     (([1], [0.5], [[0]]), TypeError, r"context_lens\[0\]=0.5 must be an int"),
     (([1], [0], [[1.0]]), TypeError, r"block_tables\[0\] contains 1.0 \(float\)"),
     (([1], [0], [[2**31]]), ValueError,
      r"block_tables\[0\] contains block id 2147483648, above 2147483647: the block table is "
      r"int32"),
     (([1], [0], [torch.tensor([0.0])]), TypeError, r"block_tables\[0\] has dtype torch.float32")],
    ids=["float-query-len", "float-context-len", "float-block-id", "block-id-2**31",
         "float-tensor-row"],
)
def test_build_attention_metadata_gives_clear_messages(args, error, message):
    with pytest.raises(error, match=message):
        kvcore.build_attention_metadata(*args, block_size=16)


# -- 15: cross-layer per platform --------------------------------------------------------------


def test_triton_attn_is_cross_layer_on_cuda_only():
    for name in ("TRITON_ATTN", "TRITON_ATTN_HND"):
        backend = kvcore.resolve_backend(name)
        assert backend.supports_cross_layer() and backend.supports_cross_layer("cuda")
        assert not backend.supports_cross_layer("rocm")
        assert "verified on cuda only" in backend.cross_layer_note("rocm")
    args = dict(num_layers=2, num_blocks=4, block_size=16, num_kv_heads=1, head_size=64,
                dtype=torch.float16, device="cpu")
    assert kvcore.allocate_kv_caches("TRITON_ATTN", platform="cuda", **args).is_cross_layer
    assert not kvcore.allocate_kv_caches("TRITON_ATTN", platform="rocm", **args).is_cross_layer
    with pytest.raises(ValueError, match="cross_layer=True: TRITON_ATTN's cross-layer layout is "
                                         "verified on cuda only; on rocm"):
        kvcore.allocate_kv_caches("TRITON_ATTN", platform="rocm", cross_layer=True, **args)


def test_explain_says_when_a_backend_is_per_layer_on_this_platform(monkeypatch):
    monkeypatch.setenv("KVCORE_DEVICE_CAPABILITY", "gfx942")
    config = kvcore.AttentionSelectorConfig(head_size=64)
    report = kvcore.explain_selection(config, "rocm")
    triton = next(c for c in report.candidates if c.name == "TRITON_ATTN")
    assert triton.notes == [kvcore.resolve_backend("TRITON_ATTN").cross_layer_note("rocm")]
    assert "note: TRITON_ATTN's cross-layer layout is verified on cuda only" in report.format()
    monkeypatch.setenv("KVCORE_DEVICE_CAPABILITY", "9.0")
    cuda = kvcore.explain_selection(config, "cuda")
    assert not next(c for c in cuda.candidates if c.name == "TRITON_ATTN").notes
