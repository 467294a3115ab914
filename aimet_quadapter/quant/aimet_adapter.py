"""Every call into AIMET's private API, in one place (checked against aimet-torch 2.42).

Nothing else in the package names an underscored AIMET symbol: when AIMET changes one of these, this
module is the one to fix, and its tests (tests/test_methods.py, tests/test_quadapter.py) say which.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

from aimet_torch.quantization.affine import QuantizeDequantize
from aimet_torch.utils import _enable_qtensor_casting


def qtensor_casting(enabled: bool) -> AbstractContextManager:
    """Whether quantizers return AIMET's ``DequantizedTensor`` (True) or plain tensors (False)."""
    return _enable_qtensor_casting(enabled)


def precomputed_encodings(q: QuantizeDequantize) -> AbstractContextManager:
    """Build ``q``'s scale and offset once instead of at every call, while nothing trains its range."""
    return q._precompute_encodings(dtype=q.min.dtype)


def seq_mse_weight_bitwidth_limit() -> int:
    """The weight bit-width above which AIMET's SeqMSE leaves a layer alone (4 in aimet-torch 2.42)."""
    import aimet_torch._base.seq_mse as seq_mse_base

    return seq_mse_base.SUPPORTED_PARAM_BW


@contextmanager
def seq_mse_bitwidth_limit(limit: int) -> Iterator[None]:
    """Temporarily raise that limit (SeqMSE's search is bit-width agnostic; the limit is a policy of AIMET's)."""
    import aimet_torch._base.seq_mse as seq_mse_base

    before = seq_mse_base.SUPPORTED_PARAM_BW
    seq_mse_base.SUPPORTED_PARAM_BW = limit
    try:
        yield
    finally:
        seq_mse_base.SUPPORTED_PARAM_BW = before
