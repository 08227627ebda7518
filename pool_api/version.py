"""pdserve's installed version: one answer for the CLI, `/version`, the OpenAPI document and
`GetServerInfo`."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

UNKNOWN_VERSION = "0+unknown"  # a checkout that was never installed (still PEP 440)


def package_version() -> str:
    try:
        return version("pdserve")
    except PackageNotFoundError:
        return UNKNOWN_VERSION
