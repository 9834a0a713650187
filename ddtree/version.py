"""The installed ddtree version, for `ddtree --version`."""
from __future__ import annotations


def package_version() -> str:
    """The version pip installed (importlib.metadata), else the source tree's `ddtree.__version__`
    (a checkout run with PYTHONPATH and never installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ddtree")
    except PackageNotFoundError:
        from ddtree import __version__

        return __version__
