"""SDPA_GATHER against kvcore's conformance suite.

The same cases run with ``pytest --kvcore-backend SDPA_GATHER``; parametrising a test of our
own puts them in this package's normal ``pytest`` run. On a GPU machine the numerical cases
run on both CPU and GPU tensors, the backend declaring both platforms.
"""

import pytest

from kvcore.testing import conformance_cases


@pytest.mark.parametrize("case", conformance_cases("SDPA_GATHER"), ids=str)
def test_sdpa_gather_conforms(case):
    case.run()
