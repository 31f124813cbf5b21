"""Every benchmark module imports: a service refactor cannot leave bench/ behind unnoticed."""

import importlib
import pkgutil

import pytest

import bench

MODULES = sorted(info.name for info in pkgutil.iter_modules(bench.__path__))


@pytest.mark.parametrize("name", MODULES)
def test_bench_module_imports(name):
    try:
        importlib.import_module(f"bench.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != "matplotlib":  # the bench extra's; the test extra does not install it
            raise
        pytest.skip("matplotlib is not installed (pip install -e '.[bench]')")
