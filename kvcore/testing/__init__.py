"""kvcore's conformance suite for backend authors.

Run it on a backend with ``pytest --kvcore-backend NAME`` (the ``kvcore`` pytest plugin ships
with kvcore), or parametrise a test of your own::

    import pytest
    from kvcore.testing import conformance_cases

    @pytest.mark.parametrize("case", conformance_cases("ACME_ATTN"), ids=str)
    def test_acme_conforms(case):
        case.run()

Every failure is a :class:`ConformanceError` that names the rule of the contract that was
broken and the section of ``docs/conformance.md`` that documents it. See that document for the
rules, the tolerances and the options.
"""

from kvcore.testing.cases import ConformanceCase, conformance_cases, resolve_backend_spec
from kvcore.testing.checks import DEFAULT_TOLERANCES, tolerance_for
from kvcore.testing.compile_check import CompileTarget, KernelCase
from kvcore.testing.rules import RULES, ConformanceError, Rule

__all__ = [
    "DEFAULT_TOLERANCES",
    "RULES",
    "CompileTarget",
    "ConformanceCase",
    "ConformanceError",
    "KernelCase",
    "Rule",
    "conformance_cases",
    "resolve_backend_spec",
    "tolerance_for",
]
