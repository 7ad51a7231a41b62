"""pluggy hook specifications of the ``kvcore`` project.

A plugin is a module (or object) with functions marked ``@kvcore.hookimpl`` named after the
hooks below, published through the ``kvcore.plugins`` entry-point group::

    # pyproject.toml of a vendor package
    [project.entry-points."kvcore.plugins"]
    acme = "acme_kvcore.plugin"

    # acme_kvcore/plugin.py
    import kvcore

    @kvcore.hookimpl
    def kvcore_register_backends(register):
        register("ACME_ATTN", "acme_kvcore.backend:AcmeBackend")

Registration is by lazy ``"module:Class"`` path: nothing is imported until the backend,
platform or connector is actually chosen, so registering never loads a kernel library.
"""

from __future__ import annotations

from typing import Protocol

import pluggy

__all__ = ["PROJECT_NAME", "hookimpl", "hookspec", "RegisterFn"]

PROJECT_NAME = "kvcore"
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


class RegisterFn(Protocol):
    """The ``register`` callback a registration hook receives."""

    def __call__(self, name: str, target: str, *,
                 platforms: tuple[str, ...] | None = None) -> None:
        """Register ``name`` as the class at ``target`` (``"package.module:ClassName"``).

        ``platforms`` (backends only): the platform names the class declares in ``PLATFORMS``.
        The selector then decides platform fit without importing ``target``, so selection on
        another platform never imports the module; the class's ``PLATFORMS`` must agree (a
        mismatch is the backend's load error). Without it, the module is imported to read them.
        """


@hookspec
def kvcore_register_backends(register: RegisterFn) -> None:
    """Register attention backends.

    Call ``register(NAME, "module:Class", platforms=("cuda", ...))`` once per backend.
    ``NAME`` is the upper-case name engines and ``KVCORE_ATTENTION_BACKEND`` use and must equal
    the class's ``get_name()``; the class must subclass :class:`kvcore.AttentionBackend`;
    ``platforms`` repeats its ``PLATFORMS`` so that selection elsewhere never imports it.
    """


@hookspec
def kvcore_register_platforms(register: RegisterFn) -> None:
    """Register platforms.

    Call ``register(name, "module:Class")`` once per platform; ``name`` is lower case (the
    value of ``KVCORE_PLATFORM``) and must equal the class's ``name``; the class must subclass
    :class:`kvcore.Platform`.
    """


@hookspec
def kvcore_register_connectors(register: RegisterFn) -> None:
    """Register KV connectors.

    Call ``register(name, "module:Class")`` once per connector; ``name`` is lower case (what
    ``kvcore.connectors.get_connector`` takes).
    """


@hookspec
def kvcore_register_block_copiers(register: RegisterFn) -> None:
    """Register block copiers (vendor ways to move many blocks between device and host).

    Call ``register(name, "module:Class")`` once per copier; ``name`` is lower case (what the
    ``offload`` connector's ``block_copier`` option takes) and must equal the class's
    ``name``; the class must subclass :class:`kvcore.connectors.BlockCopier`.
    """


@hookspec
def kvcore_register_kernel_compile_cases(register: RegisterFn) -> None:
    """Register the cases that compile a plugin's Triton kernels for real GPUs.

    Call ``register(name, "module:function")`` once per owner (``name`` lower case, e.g. the
    package name). The function takes a :class:`kvcore.testing.CompileTarget` and returns
    :class:`kvcore.testing.KernelCase` objects; ``kvcore kernels`` compiles what they launch
    (see :mod:`kvcore.testing.compile_check`).
    """


@hookspec
def kvcore_register_status_reports(register: RegisterFn) -> None:
    """Register what a plugin reports about its own state in ``kvcore plugins`` and
    ``kvcore collect-env`` (whether its compiled extension is built, which kernel a path uses
    and why).

    Call ``register(name, "module:function")`` once (``name`` lower case, usually the plugin's
    name). The function takes no argument and returns ``{fact: one-line value}``; it must be
    cheap: it builds nothing and imports no kernel library. A function that raises is shown as
    an error of that plugin; the others still report.
    """
