"""Quantization on AIMET: the policy that builds a sim, quantizer helpers, AIMET's baselines."""
