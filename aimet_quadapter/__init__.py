"""Quadapter (Park et al., EMNLP 2022 Findings) as an AIMET quantization technique.

The entry points a user meets first: :func:`aimet_quadapter.quadapter.apply_quadapter` (next to AIMET's
``apply_adaround`` and ``apply_seq_mse``), :func:`aimet_quadapter.quant.policy.build_sim`, and
:func:`aimet_quadapter.models.load_model`. Nothing heavy is imported here: ``import aimet_torch``
alone takes seconds, and the command line validates its arguments first.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("aimet-quadapter")
except PackageNotFoundError:  # run from a source tree that was not installed
    __version__ = "0+unknown"
