"""Inference forwards replayed as CUDA graphs: a fake-quantized forward's time is its many small launches."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)


class GraphedForward:
    """``forward(ids) -> tensor`` under ``no_grad``, replayed from a CUDA graph captured per input shape: use it only
    while the weights and encodings stay where they were. On a CPU, with gradients on, beyond ``max_shapes`` shapes
    or where capture fails, it calls ``forward``."""

    def __init__(self, forward: Callable[[torch.Tensor], torch.Tensor], max_shapes: int = 2):
        self.forward = forward
        self.max_shapes = max_shapes
        self._graphs: dict[tuple, tuple[torch.Tensor, torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._eager: set[tuple] = set()

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.device.type != "cuda" or torch.is_grad_enabled():
            return self.forward(ids)
        key = (tuple(ids.shape), ids.dtype, ids.device)
        capturable = key not in self._eager and len(self._graphs) < self.max_shapes
        if key not in self._graphs and not (capturable and self._capture(key, ids)):
            self._eager.add(key)
            return self.forward(ids)
        static_in, graph, static_out = self._graphs[key]
        static_in.copy_(ids)
        graph.replay()
        return static_out.clone()  # the next replay writes the same memory

    def _capture(self, key: tuple, ids: torch.Tensor) -> bool:
        static_in = ids.clone()
        side = torch.cuda.Stream(device=ids.device)
        side.wait_stream(torch.cuda.current_stream(ids.device))
        try:
            with torch.cuda.stream(side):  # warm-up off the default stream, as capture requires
                for _ in range(2):
                    self.forward(static_in)
            torch.cuda.current_stream(ids.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = self.forward(static_in)
            if not isinstance(static_out, torch.Tensor):
                raise TypeError(f"the forward returns {type(static_out).__name__}, not a tensor")
        except Exception as exc:  # whatever stops the capture, the eager forward still gives the answer
            torch.cuda.synchronize(ids.device)
            log.warning("forward of shape %s not captured as a CUDA graph (%s); it runs eagerly", key[0], exc)
            return False
        self._graphs[key] = static_in, graph, static_out
        return True
