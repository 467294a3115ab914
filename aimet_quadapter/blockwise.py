"""Phase 1: block-wise calibration of the Quadapters ("Quadapter BC", Section 3.2 of the paper).

Each site is trained on its own, bottom to top, to minimise the L2 error between the FP output of its
Quadapter block and the quantized block's output, with dynamic (per-batch) quantization of weights
and activations. A block is the producer followed by its consumers, or, for a site whose producer and
consumers are not directly chained, the architecture's scope module (the attention, the MLP).

The block's input is taken from one of two places (``input_source``):

* ``"fp"``: the FP model's activations, every site calibrated in isolation (the others at alpha=1);
* ``"quantized"``: the activations of the sim in which every lower site is already calibrated and
  in effect, as AdaRound does, so a site also corrects for the error arriving from below.

The target is always the FP block on FP inputs. Measured on SmolLM2-135M (README, "Quadapter on
SmolLM2-135M"), neither source is better on all text: quantized inputs were 2.7 % worse on PTB test
and 6 % better on Austen, at more cost; "fp" is the default.

The model is walked one transformer block at a time, so each step costs a block's forward, not the
model's, and each site's FP targets are computed once, not at every step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from .models import PreparedLM, Site
from .quadapter import QuadapterSet
from .quantizers import dynamic_quantization, elementwise_fake_quant, plain_tensors, quantizers_in

Captured = tuple[tuple, dict]  # (args, kwargs) of one call


class _Stop(Exception):
    pass


def capture_inputs(model: nn.Module, path: str, batches: Sequence[torch.Tensor]) -> list[Captured]:
    """The (args, kwargs) that the module at ``path`` receives for each batch; the rest of the model is skipped."""
    module = model.get_submodule(path)
    seen: list[Captured] = []

    def hook(_module, args, kwargs):
        seen.append((args, kwargs))
        raise _Stop

    handle = module.register_forward_pre_hook(hook, with_kwargs=True)
    device = next(model.parameters()).device
    try:
        with torch.no_grad():
            for batch in batches:
                with suppress(_Stop):
                    model(batch.to(device))
    finally:
        handle.remove()
    return seen


def _hidden(output) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


def _with_hidden(call: Captured, hidden: torch.Tensor) -> Captured:
    args, kwargs = call
    if args:
        return (hidden, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": hidden}


def _run_capturing(block: nn.Module, calls: list[Captured], model: nn.Module, paths: list[str]):
    """Run ``block`` on every call; return its outputs and the inputs each module in ``paths`` received."""
    got: dict[str, list[Captured]] = {p: [] for p in paths}
    handles = [
        model.get_submodule(p).register_forward_pre_hook(lambda _m, a, k, p=p: got[p].append((a, k)), with_kwargs=True)
        for p in paths
    ]
    try:
        with torch.no_grad():
            outs = [_hidden(block(*a, **k)) for a, k in calls]
    finally:
        for h in handles:
            h.remove()
    return outs, got


@dataclass
class BlockwiseParameters:
    """Phase-1 settings; defaults are the paper's (Appendix, "Block-wise Calibration")."""

    steps: int = 500
    lr: float = 0.1
    lr_decay: float = 0.2  # multiply the learning rate by this ...
    decay_every: int = 100  # ... every this many steps
    input_source: str = "fp"  # "fp" or "quantized", see the module docstring
    sequences_per_step: int | None = None  # calibration sequences per step (None: all, the paper's)
    tokens_per_step: int | None = None  # token subsample for token-wise blocks (None: all)
    seed: int = 0

    def __post_init__(self):
        if self.input_source not in ("fp", "quantized"):
            from .errors import QuadapterError

            raise QuadapterError(f"phase1.input_source must be 'fp' or 'quantized', got {self.input_source!r}")


class _SiteProblem:
    """One site's calibration data and its FP and quantized block functions."""

    def __init__(self, site: Site, fp_model: nn.Module, sim_model: nn.Module):
        self.site = site
        self.entry = site.scope or site.producer
        self.fp_scope = fp_model.get_submodule(self.entry)
        self.q_scope = sim_model.get_submodule(self.entry)
        self.fp_modules = (fp_model.get_submodule(site.producer), [fp_model.get_submodule(c) for c in site.consumers])
        self.q_modules = (sim_model.get_submodule(site.producer), [sim_model.get_submodule(c) for c in site.consumers])
        scope_modules = [self.q_scope] if site.scope else [self.q_modules[0], *self.q_modules[1]]
        self.quantizers = quantizers_in(scope_modules)

    @contextmanager
    def quantizing(self) -> Iterator[None]:
        """The block's quantizers in the paper's dynamic mode (ranges from each batch), on the fast path."""
        with elementwise_fake_quant(self.quantizers), dynamic_quantization(self.quantizers), plain_tensors():
            yield

    def target_features(self, call: Captured) -> int:
        """Width of the block's output for one token."""
        if self.site.scope:
            return _first_input(call).shape[-1]
        return sum(c.weight.shape[0] for c in self.fp_modules[1])

    def block(self, fp: bool, call: Captured) -> torch.Tensor:
        args, kwargs = call
        if self.site.scope:
            return _hidden((self.fp_scope if fp else self.q_scope)(*args, **kwargs))
        producer, consumers = self.fp_modules if fp else self.q_modules
        mid = producer(*args, **kwargs)
        return torch.cat([c(mid) for c in consumers], dim=-1)


# FP targets of a site are computed once and kept while they fit in this budget; above it (the head site
# with its vocabulary-wide output) each step recomputes the target of the tokens it samples.
TARGET_CACHE_BYTES = 256 * 2**20


class FPTargets:
    """The FP block's output for each captured call, or for sampled token rows.

    Within :data:`TARGET_CACHE_BYTES` all of it is computed once into one (tokens, features) buffer, which
    serves both uses without a copy; above it each request recomputes what it asks for.
    """

    @torch.no_grad()
    def __init__(self, problem: _SiteProblem, fp_inputs: list[Captured]):
        self.problem, self.fp_inputs = problem, fp_inputs
        self.rows: torch.Tensor | None = None
        self._views: list[torch.Tensor] = []
        tokens = sum(_first_input(c).shape[:-1].numel() for c in fp_inputs)
        if not fp_inputs or tokens * problem.target_features(fp_inputs[0]) * 4 > TARGET_CACHE_BYTES:
            return
        start = 0
        for call in fp_inputs:
            out = problem.block(True, call)
            if self.rows is None:
                self.rows = out.new_empty((tokens, out.shape[-1]))
            n = out.shape[:-1].numel()
            self.rows[start : start + n].copy_(out.reshape(n, -1))
            self._views.append(self.rows[start : start + n].view(out.shape))
            start += n

    @torch.no_grad()
    def of_call(self, i: int) -> torch.Tensor:
        return self._views[i] if self.rows is not None else self.problem.block(True, self.fp_inputs[i])

    @torch.no_grad()
    def of_rows(self, fp_rows: torch.Tensor, idx) -> torch.Tensor:
        """Targets of the token rows ``fp_rows[idx]`` (token-wise sites; rows in the order of the calls)."""
        return self.rows[idx] if self.rows is not None else self.problem.block(True, ((fp_rows[idx],), {}))


def _first_input(call: Captured) -> torch.Tensor:
    return call[0][0] if call[0] else call[1]["hidden_states"]


def _token_rows(call: Captured) -> torch.Tensor:
    x = _first_input(call)
    return x.reshape(-1, x.shape[-1])


def calibrate_site(
    problem: _SiteProblem,
    qset: QuadapterSet,
    fp_inputs: list[Captured],
    q_inputs: list[Captured],
    params: BlockwiseParameters,
    isolated: bool,
    progress: bool = True,
    targets: FPTargets | None = None,
) -> list[float]:
    """Adam on one site's alpha; returns the loss of every step.

    ``targets``: the FP block outputs of ``fp_inputs``, when the caller already has them.
    """
    if targets is None:
        targets = FPTargets(problem, fp_inputs)
    site = problem.site
    quadapter = qset[site.name]
    optimizer = torch.optim.Adam([quadapter.theta], lr=params.lr)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=params.decay_every, gamma=params.lr_decay)
    generator = torch.Generator().manual_seed(params.seed)
    token_wise = site.scope is None
    if token_wise:  # the block acts on each token alone: pool all tokens, sample rows
        fp_rows = torch.cat([_token_rows(c) for c in fp_inputs])
        q_rows = torch.cat([_token_rows(c) for c in q_inputs])
    losses: list[float] = []
    # Adam at the paper's lr 0.1 can end above its best point: keep the alpha of the lowest loss seen
    # (each step's loss is that of the alpha before its update).
    best_loss, best_theta = math.inf, quadapter.theta.detach().clone()
    scope = qset.only([site.name]) if isolated else nullcontext()
    bar = tqdm(range(params.steps), desc=f"phase 1 {site.name}", leave=False, disable=not progress)
    with scope, problem.quantizing():
        for _ in bar:
            if token_wise:
                n = fp_rows.shape[0]
                take = params.tokens_per_step
                idx = torch.randperm(n, generator=generator)[:take] if take and take < n else slice(None)
                pairs = [(((q_rows[idx],), {}), targets.of_rows(fp_rows, idx))]
            else:
                order = torch.randperm(len(fp_inputs), generator=generator).tolist()
                order = order[: params.sequences_per_step or len(order)]
                pairs = [(q_inputs[i], targets.of_call(i)) for i in order]
            optimizer.zero_grad(set_to_none=True)
            before_step = quadapter.theta.detach().clone()
            total = 0.0
            for q_call, target in pairs:
                out = problem.block(False, q_call)
                loss = (out - target).pow(2).mean() / len(pairs)
                loss.backward()
                total += loss.item()
            if total < best_loss:
                best_loss, best_theta = total, before_step
            optimizer.step()
            schedule.step()
            losses.append(total)
            bar.set_postfix(loss=f"{total:.4g}")
    with torch.no_grad():
        quadapter.theta.copy_(best_theta)
    return losses


@torch.no_grad()
def site_error(
    problem: _SiteProblem,
    qset: QuadapterSet,
    fp_inputs,
    q_inputs,
    isolated: bool,
    targets: FPTargets | None = None,
) -> float:
    """The block's L2 error under dynamic quantization with the current alphas (all calibration data)."""
    if targets is None:
        targets = FPTargets(problem, fp_inputs)
    scope = qset.only([problem.site.name]) if isolated else nullcontext()
    total = 0.0
    with scope, problem.quantizing():
        for i, q_call in enumerate(q_inputs):
            total += (problem.block(False, q_call) - targets.of_call(i)).pow(2).mean().item()
    return total / max(len(fp_inputs), 1)


@dataclass
class BlockwiseResult:
    losses: dict[str, list[float]]  # site name -> loss per step
    error_before: dict[str, float]  # L2 error at alpha = 1 (or the initial alpha)
    error_after: dict[str, float]


def apply_blockwise_calibration(
    sim_model: PreparedLM,
    fp_model: PreparedLM,
    qset: QuadapterSet,
    calibration_batches: Sequence[torch.Tensor],
    params: BlockwiseParameters | None = None,
    progress: bool = True,
    on_site_done: Callable[[Site, list[float]], None] | None = None,
) -> BlockwiseResult:
    """Phase 1 on every site of ``qset`` (attached to ``sim_model``), bottom to top."""
    params = params or BlockwiseParameters()
    isolated = params.input_source == "fp"
    blocks = sim_model.block_paths()
    fp_calls = capture_inputs(fp_model, blocks[0], calibration_batches)
    with dynamic_quantization(quantizers_in([sim_model])):
        q_calls = fp_calls if isolated else capture_inputs(sim_model, blocks[0], calibration_batches)
    by_block: dict[str, list[Site]] = {b: [] for b in blocks}
    head_sites: list[Site] = []
    for q in qset:
        owner = next((b for b in blocks if q.site.producer.startswith(b + ".")), None)
        (by_block[owner] if owner else head_sites).append(q.site)

    result = BlockwiseResult({}, {}, {})
    outer = tqdm(total=len(qset), desc="phase 1 (block-wise calibration)", unit="site", disable=not progress)

    def calibrate(site: Site, fp_in: list[Captured], q_in: list[Captured]) -> None:
        problem = _SiteProblem(site, fp_model, sim_model)
        theta = qset[site.name].theta
        start = theta.detach().clone()
        targets = FPTargets(problem, fp_in)
        before = result.error_before[site.name] = site_error(problem, qset, fp_in, q_in, isolated, targets)
        result.losses[site.name] = calibrate_site(problem, qset, fp_in, q_in, params, isolated, progress, targets)
        after = site_error(problem, qset, fp_in, q_in, isolated, targets)
        if after > before:  # sampled steps found nothing better on the whole data: keep the start
            with torch.no_grad():
                theta.copy_(start)
            after = before
        result.error_after[site.name] = after
        if on_site_done:
            on_site_done(site, result.losses[site.name])
        outer.update(1)
        outer.set_postfix(
            site=site.name, err=f"{result.error_before[site.name]:.3g}->{result.error_after[site.name]:.3g}"
        )

    for path in blocks:
        fp_block, q_block = fp_model.get_submodule(path), sim_model.get_submodule(path)
        sites = by_block[path]
        entries = [s.scope or s.producer for s in sites]
        fp_out, fp_seen = _run_capturing(fp_block, fp_calls, fp_model, entries)
        for site in sites:
            entry = site.scope or site.producer
            if isolated:
                q_in = fp_seen[entry]
            else:  # rerun the sim block: the sites below in this block changed its input
                with dynamic_quantization(quantizers_in([q_block])):
                    _, q_seen = _run_capturing(q_block, q_calls, sim_model, [entry])
                q_in = q_seen[entry]
            calibrate(site, fp_seen[entry], q_in)
        fp_calls = [_with_hidden(c, h) for c, h in zip(fp_calls, fp_out)]
        if isolated:
            q_calls = fp_calls
        else:
            with dynamic_quantization(quantizers_in([q_block])):
                q_out, _ = _run_capturing(q_block, q_calls, sim_model, [])
            q_calls = [_with_hidden(c, h) for c, h in zip(q_calls, q_out)]

    # The head site's producer (the final norm) takes the last block's output.
    for site in head_sites:
        calibrate(site, [((_first_input(c),), {}) for c in fp_calls], [((_first_input(c),), {}) for c in q_calls])
    outer.close()
    return result
