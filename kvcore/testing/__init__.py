"""kvcore's conformance suite for backend authors.

Run it on a backend with ``pytest --kvcore-backend NAME`` (the ``kvcore`` pytest plugin ships
with kvcore), or parametrise a test of your own::

    import pytest
    from kvcore.testing import conformance_cases

    @pytest.mark.parametrize("case", conformance_cases("ACME_ATTN"), ids=str)
    def test_acme_conforms(case):
        case.run()

Helpers for a plugin's own tests: :func:`contiguous_attention_ref` (a float64 attention
reference on contiguous K/V), :func:`random_block_tables` (shuffled block tables),
:func:`random_slot_mapping` (a cache write's slots, with padding),
:func:`run_mixed_step` (one engine step of a mixed batch through a backend),
:func:`strided_view` (a step tensor as a view of a larger buffer, as engines pass them) and
the GPU / Triton-interpreter setup of a ``conftest.py`` (:class:`GpuTestSetup`, built on
:func:`use_triton_interpreter_without_gpu` and :func:`skip_gpu_tests_without_gpu`).

Every failure is a :class:`ConformanceError` that names the rule of the contract that was
broken and the section of ``docs/conformance.md`` that documents it. See that document for the
rules, the tolerances and the options.
"""

from kvcore.testing.batch import random_block_tables, random_slot_mapping
from kvcore.testing.cases import ConformanceCase, conformance_cases, resolve_backend_spec
from kvcore.testing.compile_check import (
    CompiledLaunch,
    CompileTarget,
    KernelCase,
    compile_launches,
)
from kvcore.testing.gpu import (
    GPU_MARKER,
    GpuTestSetup,
    skip_gpu_tests_without_gpu,
    use_triton_interpreter_without_gpu,
)
from kvcore.testing.reference import contiguous_attention_ref, contiguous_mla_ref
from kvcore.testing.rules import RULES, ConformanceError, Rule
from kvcore.testing.runs import (
    DEFAULT_TOLERANCES,
    MLA_NORM_TOLERANCES,
    NORM_TOLERANCES,
    tolerance_for,
)
from kvcore.testing.steps import MixedStep, run_mixed_step
from kvcore.testing.strided_steps import strided_view

__all__ = [
    "DEFAULT_TOLERANCES",
    "GPU_MARKER",
    "GpuTestSetup",
    "MixedStep",
    "MLA_NORM_TOLERANCES",
    "NORM_TOLERANCES",
    "RULES",
    "CompiledLaunch",
    "CompileTarget",
    "ConformanceCase",
    "ConformanceError",
    "KernelCase",
    "Rule",
    "compile_launches",
    "conformance_cases",
    "contiguous_attention_ref",
    "contiguous_mla_ref",
    "random_block_tables",
    "random_slot_mapping",
    "resolve_backend_spec",
    "run_mixed_step",
    "skip_gpu_tests_without_gpu",
    "strided_view",
    "tolerance_for",
    "use_triton_interpreter_without_gpu",
]
