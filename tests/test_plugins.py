"""Plugin loading through real installed distributions discovered by entry point."""

from __future__ import annotations

import pytest
import torch

import kvcore


def _plugin(name: str) -> kvcore.PluginInfo:
    return next(p for p in kvcore.list_plugins() if p.name == name)


def test_core_plugins_load_through_entry_points(fresh_kvcore):
    core = {p.name: p for p in kvcore.list_plugins() if p.source == "core"}
    assert {"builtin_backends", "builtin_platforms"} <= set(core)
    assert all(p.status == "loaded" and p.distribution == "kvcore" for p in core.values())
    assert "CPU_ATTN" in kvcore.backend_registry()
    assert {"cpu", "cuda", "rocm"} <= set(kvcore.platform_registry().names())


def test_installed_plugin_is_discovered_and_registers_backends(with_plugins):
    with_plugins("standin_rocm")
    info = _plugin("testfixture_standin_rocm")
    assert (info.status, info.distribution, info.version) == (
        "loaded", "kvcore-testfixture-standin-rocm", "0.0.1")
    registry = kvcore.backend_registry()
    assert registry.get("ROCM_ATTN").plugin == "testfixture_standin_rocm"
    assert registry.get("rocm_attn").target == (
        "kvcore_standin_rocm.backends:StandInRocmAttnBackend")


def test_registration_is_lazy(with_plugins):
    import sys

    with_plugins("standin_rocm")
    kvcore.backend_registry()
    assert "kvcore_standin_rocm.backends" not in sys.modules
    kvcore.resolve_backend("ROCM_ATTN")
    assert "kvcore_standin_rocm.backends" in sys.modules


def test_plugin_failing_on_import_is_isolated(with_plugins):
    with_plugins("broken_import", "standin_rocm")
    broken = _plugin("testfixture_broken_import")
    assert broken.status == "failed"
    assert broken.error == (
        "ImportError: kvcore_broken_import needs libacme.so, which is not installed")
    # everything else keeps working
    assert "ROCM_ATTN" in kvcore.backend_registry()
    assert kvcore.get_attn_backend(kvcore.AttentionSelectorConfig(head_size=64),
                                   platform="cpu").get_name() == "CPU_ATTN"


def test_plugin_failing_in_registration_hook_loses_only_its_entries(with_plugins):
    with_plugins("broken_register")
    registry = kvcore.backend_registry()
    assert "BROKEN_EARLY" not in registry  # partial registrations are dropped
    assert registry.errors == [
        ("testfixture_broken_register", "RuntimeError: acme driver handshake failed")]
    assert "CPU_ATTN" in registry


def test_a_builtin_name_registered_again_is_that_plugins_error(with_plugins):
    """Registering CPU_ATTN again does not knock the core backend out of selection: the
    later (non-core) registration is the error, reported as that plugin's."""
    with_plugins("duplicate_cpu")
    registry = kvcore.backend_registry()
    assert registry.errors == [(
        "testfixture_duplicate_cpu",
        "attention backend 'CPU_ATTN' is a built-in name of kvcore (plugin 'builtin_backends'); "
        "plugin 'testfixture_duplicate_cpu' may not register it again: register the backend "
        "under another name")]
    assert registry.get("CPU_ATTN").plugin == "builtin_backends"
    assert kvcore.resolve_backend("CPU_ATTN").get_name() == "CPU_ATTN"
    config = kvcore.AttentionSelectorConfig(head_size=64, dtype=torch.float32)
    assert kvcore.get_attn_backend(config, platform="cpu").get_name() == "CPU_ATTN"


def test_duplicate_third_party_name_is_an_error_naming_both_plugins(fresh_kvcore):
    class _Acme:
        @kvcore.hookimpl
        def kvcore_register_backends(self, register):
            register("ACME_ATTN", "kvcore.backends.cpu_attn:CpuAttentionBackend")

    kvcore.register_plugin(_Acme(), "acme_one")
    kvcore.register_plugin(_Acme(), "acme_two")
    registry = kvcore.backend_registry()
    assert ("acme_two", "attention backend 'ACME_ATTN' is also registered by plugin 'acme_one'"
            ) in registry.errors
    with pytest.raises(kvcore.DuplicateRegistrationError, match="'acme_one', 'acme_two'"):
        kvcore.resolve_backend("ACME_ATTN")
    report = kvcore.explain_selection(kvcore.AttentionSelectorConfig(head_size=64), "cpu")
    acme = next(c for c in report.candidates if c.name == "ACME_ATTN")
    assert not acme.valid and "more than one plugin" in acme.reasons[0]


def test_allowlist_excludes_other_third_party_plugins(with_plugins):
    with_plugins("standin_rocm")
    statuses = {p.name: p.status for p in kvcore.list_plugins()}
    assert statuses["testfixture_standin_rocm"] == "loaded"
    assert statuses["testfixture_broken_import"] == "not allowed"
    assert statuses["builtin_backends"] == "loaded"  # the core is never filtered


def test_disable_autoload_keeps_the_core(with_plugins, monkeypatch):
    monkeypatch.setenv("KVCORE_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.delenv("KVCORE_PLUGINS", raising=False)
    kvcore.reset_plugins()
    statuses = {p.name: p.status for p in kvcore.list_plugins()}
    assert statuses["testfixture_standin_rocm"] == "disabled"
    assert statuses["builtin_backends"] == "loaded"
    assert "ROCM_ATTN" not in kvcore.backend_registry()


class _RuntimePlugin:
    """A plugin registered at run time, as an engine with private backends would."""

    @kvcore.hookimpl
    def kvcore_register_backends(self, register):
        register("ENGINE_PRIVATE", "kvcore.backends.cpu_attn:CpuAttentionBackend")


def test_runtime_plugin_with_mismatched_name_is_refused_on_resolve(fresh_kvcore):
    kvcore.register_plugin(_RuntimePlugin(), "engine")
    try:
        with pytest.raises(kvcore.ResolveError,
                           match="registered as 'ENGINE_PRIVATE' reports get_name"):
            kvcore.resolve_backend("ENGINE_PRIVATE")
        with pytest.raises(ValueError, match="already registered"):
            kvcore.register_plugin(_RuntimePlugin(), "engine")
    finally:
        kvcore.unregister_plugin("engine")
    assert "ENGINE_PRIVATE" not in kvcore.backend_registry()


def test_registration_target_must_be_a_lazy_path(fresh_kvcore):
    class Eager:
        @kvcore.hookimpl
        def kvcore_register_backends(self, register):
            register("EAGER", torch.nn.Module)

    kvcore.register_plugin(Eager(), "eager")
    try:
        registry = kvcore.backend_registry()
        assert "EAGER" not in registry
        assert "must be a 'package.module:ClassName' string" in registry.errors[0][1]
    finally:
        kvcore.unregister_plugin("eager")


def test_hook_with_wrong_signature_is_rejected(fresh_kvcore):
    import pluggy

    class Wrong:
        @kvcore.hookimpl
        def kvcore_register_backends(self, register, extra):
            pass

    with pytest.raises(pluggy.PluginValidationError):
        kvcore.register_plugin(Wrong(), "wrong")
    assert "wrong" not in {p.name for p in kvcore.list_plugins()}


def test_unknown_backend_lists_valid_options(fresh_kvcore):
    with pytest.raises(kvcore.UnknownNameError,
                       match=r"unknown attention backend 'NOPE'; valid options are: .*CPU_ATTN"):
        kvcore.resolve_backend("NOPE")


def test_registry_built_while_plugins_change_is_rebuilt(fresh_kvcore, monkeypatch):
    """A plugin reset between the registry's two reads must not leave a stale registry."""
    from kvcore import plugins, registry

    class Late:
        @kvcore.hookimpl
        def kvcore_register_backends(self, register):
            register("LATE_ATTN", "kvcore.backends.cpu_attn:CpuAttentionBackend")

    kvcore.register_plugin(Late(), "late")
    real = plugins.get_plugin_manager
    raced = []

    def racing_get_plugin_manager():
        pm = real()
        if not raced:  # another thread resets the plugins right after we got the manager
            raced.append(True)
            kvcore.reset_plugins()
        return pm

    monkeypatch.setattr(registry.plugins, "get_plugin_manager", racing_get_plugin_manager)
    registry.backend_registry()  # built from the manager that was just discarded
    monkeypatch.setattr(registry.plugins, "get_plugin_manager", real)
    assert "LATE_ATTN" not in registry.backend_registry()


# -- faults of one backend stay its own ------------------------------------------------------


def test_a_plugin_module_calling_sys_exit_is_a_load_error(with_plugins):
    with_plugins("exits_on_import")
    info = _plugin("testfixture_exits_on_import")
    assert (info.status, info.error) == ("failed", "SystemExit: 3")
    assert kvcore.get_attn_backend(kvcore.AttentionSelectorConfig(head_size=64),
                                   platform="cpu").get_name() == "CPU_ATTN"


def test_bad_backends_do_not_break_selection_of_the_others(with_plugins):
    import sys

    with_plugins("bad_backends")
    config = kvcore.AttentionSelectorConfig(head_size=64, dtype=torch.float32)
    assert kvcore.get_attn_backend(config, platform="cpu").get_name() == "CPU_ATTN"
    # Registered for cuda: decided from the registration, never imported on a CPU.
    assert "kvcore_bad_backends.exit_on_cuda" not in sys.modules
    report = kvcore.explain_selection(config, platform="cpu")
    reasons = {c.name: c.reasons for c in report.candidates}
    assert reasons["EXIT_ON_CUDA"] == ["platform=cpu (supported: cuda)"]
    assert "kvcore_bad_backends.exit_on_cuda" not in sys.modules
    assert reasons["NO_PLATFORMS"] == [
        "attention backend 'NO_PLATFORMS' (plugin 'testfixture_bad_backends') declares an "
        "invalid PLATFORMS: PLATFORMS=None must be a tuple of lower-case platform names, "
        "e.g. ('cuda', 'rocm')"]
    assert "failed to import from 'kvcore_bad_backends.exit_anywhere:ExitBackend': " \
           "SystemExit: 7" in reasons["EXIT_ANYWHERE"][0]
    assert "declares PLATFORMS=('cuda',) but was registered with platforms=('cpu',)" in (
        reasons["PLATFORMS_DISAGREE"][0])
    # Each is a load error of its own plugin, as `kvcore plugins` lists them.
    errors = kvcore.backend_registry().errors
    assert {p for p, _ in errors} == {"testfixture_bad_backends"} and len(errors) == 3


def test_a_forced_backend_whose_import_probe_raises_is_refused_with_the_reason(with_plugins):
    with_plugins("bad_backends")
    config = kvcore.AttentionSelectorConfig(head_size=64, dtype=torch.float32)
    with pytest.raises(kvcore.BackendSelectionError,
                       match="RAISING_PROBE.import_reasons raised RuntimeError: acme probe "
                             "crashed.*Valid for this config on cpu: CPU_ATTN"):
        kvcore.get_attn_backend(config, backend="RAISING_PROBE", platform="cpu")


@pytest.mark.parametrize("platforms", ["cuda", (), ("CUDA",), (None,)],
                         ids=["str", "empty", "upper_case", "none"])
def test_registered_platforms_are_validated_at_registration(fresh_kvcore, platforms):
    class Plugin:
        @kvcore.hookimpl
        def kvcore_register_backends(self, register):
            register("ODD_PLATFORMS", "acme:Backend", platforms=platforms)

    kvcore.register_plugin(Plugin(), "odd")
    try:
        registry = kvcore.backend_registry()
        assert "ODD_PLATFORMS" not in registry
        assert registry.errors == [("odd", f"ValueError: attention backend 'ODD_PLATFORMS': "
                                           f"platforms={platforms!r} must be a non-empty "
                                           "tuple of lower-case platform names, e.g. "
                                           "('cuda', 'rocm')")]
    finally:
        kvcore.unregister_plugin("odd")
