"""kvcore-vllm's tests run in the virtualenv that has vLLM (``.ci/vllm`` makes it); every test
here is marked ``vllm`` and is skipped, with the reason, where vLLM is not installed."""

from __future__ import annotations

import importlib.util

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "vllm: needs vLLM installed (the .ci/vllm job's "
                                       "virtualenv); the plugin inside vLLM's own engine")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    missing = importlib.util.find_spec("vllm") is None
    for item in items:
        item.add_marker(pytest.mark.vllm)
        if missing:
            item.add_marker(pytest.mark.skip(reason="vLLM is not installed: run .ci/vllm"))
