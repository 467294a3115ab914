"""The ``aimet-quadapter`` command line."""

from aimet_quadapter.cli.app import main

__all__ = ["main"]
