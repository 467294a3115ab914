"""Quantization plumbing on AIMET: the W8A8 policy that builds a sim, quantizer helpers, AIMET's baselines.

Every private AIMET call sits in :mod:`aimet_quadapter.quant.aimet_private`, so a new AIMET version is
checked in one place.
"""
