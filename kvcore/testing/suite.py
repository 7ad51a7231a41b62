"""The conformance suite's test module.

Not named ``test_*.py``, so no ordinary run collects it: the ``kvcore`` pytest plugin adds it
to the run when ``--kvcore-backend`` is given, and parametrises it with every case of every
named backend.
"""

import pytest

from kvcore.testing.cases import ConformanceCase


@pytest.mark.kvcore_conformance
def test_conformance(kvcore_conformance_case: ConformanceCase) -> None:
    kvcore_conformance_case.run()
