"""Phase 1, Quadapter BC (Section 3.2): each site's alpha trained alone, bottom to top, on its block's L2 error
under dynamic ranges taken over the whole calibration set, as static calibration will set them. docs/method.md
gives the design; beyond it:

* A block is the producer and its consumers, or the scope module (attention, MLP) where they are not chained.
* ``loss_tokens`` subsamples only the rows the loss is taken on, one fixed sample so that every step scores its alpha
  on the same tokens; ranges always come from every row (:meth:`DynamicRanges.pin`).
* Every stage of the schedule restarts from the best alpha so far: the large first steps may explore, the later
  ones refine, and a good start (CLE's) is never lost.
* ``input_source``: the FP model's activations, or the sim's with every lower site calibrated (as AdaRound); the
  target is always the FP block on FP inputs. Other sites sit at their current alpha because a norm's alpha is worth
  what it is next to the q/k/v rows a v->o or Q*K^T alpha scales: those rows share one per-tensor weight range.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from tqdm.auto import tqdm

from aimet_quadapter import distributed
from aimet_quadapter.atomic import write_atomic
from aimet_quadapter.errors import QuadapterError, TrainingDiverged
from aimet_quadapter.models import SITE_ROLES, FixedPrefixCache, PreparedLM, Site, device_of
from aimet_quadapter.quadapter.adapter import QuadapterSet
from aimet_quadapter.quadapter.config import Phase1Parameters
from aimet_quadapter.quant.quantizers import DynamicRanges, plain_tensors, quantizers, quantizers_in, refresh_prefix

log = logging.getLogger(__name__)

Captured = tuple[tuple, dict]  # (args, kwargs) of one call


class _Stop(Exception):
    pass


def capture_inputs(model: nn.Module, path: str, batches: Sequence[torch.Tensor]) -> list[Captured]:
    """The (args, kwargs) that the module at ``path`` receives for each batch; the rest of the model is skipped."""
    seen: list[Captured] = []

    def hook(_module, args, kwargs):
        seen.append((args, kwargs))
        raise _Stop

    handle = model.get_submodule(path).register_forward_pre_hook(hook, with_kwargs=True)
    device = device_of(model)
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


def _first_input(call: Captured) -> torch.Tensor:
    return call[0][0] if call[0] else call[1]["hidden_states"]


def _with_hidden(call: Captured, hidden: torch.Tensor) -> Captured:
    args, kwargs = call
    if args:
        return (hidden, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": hidden}


def _own_prefix(call: Captured, model: PreparedLM) -> Captured:
    """``call`` with ``model``'s prefix cache where it holds another's: a fold changes the keys and values."""

    def own(value: Any) -> Any:
        return model.prefix_cache() if isinstance(value, FixedPrefixCache) else value

    args, kwargs = call
    return tuple(own(a) for a in args), {k: own(v) for k, v in kwargs.items()}


def batched(calls: list[Captured]) -> Captured:
    """The calls of every calibration batch as one (mask and positions the first's), so a range covers all data."""
    hidden = [_first_input(c) for c in calls]
    if any(h.shape[1:] != hidden[0].shape[1:] for h in hidden):
        raise QuadapterError("phase 1 needs calibration sequences of one length")
    return _with_hidden(calls[0], torch.cat(hidden))


def run_capturing(block: nn.Module, call: Captured, model: nn.Module, paths: list[str]):
    """Run ``block`` on ``call``; return its output and the call each module in ``paths`` received."""
    got: dict[str, Captured] = {}
    handles = [
        model.get_submodule(p).register_forward_pre_hook(
            lambda _m, a, k, p=p: got.__setitem__(p, (a, k)), with_kwargs=True
        )
        for p in paths
    ]
    try:
        with torch.no_grad():
            out = _hidden(block(*call[0], **call[1]))
    finally:
        for h in handles:
            h.remove()
    return out, got


# a token-wise target larger than this is scored in row chunks of about this size: 128 MB of float32 each
CHUNK_ELEMENTS = 1 << 25


class SiteBlock:
    """One site's block on the whole calibration set: the FP target, and the quantized block's loss."""

    def __init__(
        self,
        site: Site,
        fp_model: nn.Module,
        sim_model: nn.Module,
        fp_input: Captured,
        q_input: Captured,
        params: Phase1Parameters,
    ):
        self.site = site
        entry = site.scope or site.producer
        self.q_producer = sim_model.get_submodule(site.producer)
        # AIMET quantized modules: their quantizer containers are not typed
        self.q_consumers: list[Any] = [sim_model.get_submodule(c) for c in site.consumers]
        self.q_scope = sim_model.get_submodule(entry)
        modules = [self.q_scope] if site.scope else [self.q_producer, *self.q_consumers]
        self.ranges = DynamicRanges(quantizers_in(modules), params.range_gradient)
        # the consumers' input quantizers all read the producer's output: one range, from every row
        self.shared_input = [c.input_quantizers[0] for c in self.q_consumers if c.input_quantizers[0] is not None]
        with torch.no_grad():
            if site.scope:  # the scope mixes tokens (attention): the whole batch, loss on all of it
                self.q_input = q_input
                self.rows = None
                self.target = _hidden(fp_model.get_submodule(entry)(*fp_input[0], **fp_input[1]))
            else:  # token-wise: all rows feed the ranges, a fixed sample of them the loss
                fp_rows = _rows(_first_input(fp_input))
                self.q_input = ((_rows(_first_input(q_input)),), {})
                n, take = fp_rows.shape[0], params.loss_tokens
                generator = torch.Generator().manual_seed(params.seed)  # on the CPU: the same rows on any device
                rows = torch.randperm(n, generator=generator)[:take].sort().values if take and take < n else None
                self.rows = None if rows is None else rows.to(fp_rows.device)
                picked = fp_rows if self.rows is None else fp_rows[self.rows]
                # the FP function of the sim's modules at every current alpha: the frame the other sites set (this
                # site's alpha leaves it unchanged, the others stay put while it trains: computed once)
                with self.quantizing(), self.ranges.off():
                    self.target = self._consumed(self.q_producer(picked))

    @contextmanager
    def quantizing(self) -> Iterator[None]:
        with self.ranges, plain_tensors():
            yield

    def output(self) -> torch.Tensor:
        """The quantized block's output on the loss rows (inside :meth:`quantizing`)."""
        if self.site.scope:
            args, kwargs = self.q_input
            return _hidden(self.q_scope(*args, **kwargs))
        return self._consumed(self._mid())

    def _mid(self) -> torch.Tensor:
        """The producer's output, its range pinned on every row, on the loss rows."""
        args, kwargs = self.q_input
        mid = self.q_producer(*args, **kwargs)
        self.ranges.pin(self.shared_input, mid)
        return mid if self.rows is None else mid[self.rows]

    def _consumed(self, mid: torch.Tensor) -> torch.Tensor:
        return torch.cat([c(mid) for c in self.q_consumers], dim=-1)

    def _squared_error(self, mid: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (self._consumed(mid) - target).pow(2).sum()

    def loss(self) -> torch.Tensor:
        """The mean squared error of :meth:`output`; a wide token-wise block's in row chunks recomputed backward."""
        if self.site.scope or self.target.numel() <= CHUNK_ELEMENTS:
            return (self.output() - self.target).pow(2).mean()
        mid = self._mid()
        step = max(1, CHUNK_ELEMENTS // self.target.shape[-1])
        chunks = [
            checkpoint(self._squared_error, mid[i : i + step], self.target[i : i + step], use_reentrant=False)
            for i in range(0, mid.shape[0], step)
        ]
        return torch.stack(chunks).sum() / self.target.numel()


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


@dataclass
class SiteResult:
    losses: list[float]  # the loss of every step's alpha (before its update), then of the last alpha
    best: float  # the lowest of them: the kept alpha's


def calibrate_site(block: SiteBlock, qset: QuadapterSet, params: Phase1Parameters, progress: bool = True) -> SiteResult:
    """Adam on one site's alpha in stages of falling rate, each from the best alpha so far, which it keeps."""
    theta = qset[block.site.name].theta
    losses: list[float] = []
    best, best_theta = math.inf, theta.detach().clone()
    bar = tqdm(total=params.steps, desc=f"phase 1 {block.site.name}", leave=False, disable=not progress)

    def score(value: float) -> None:
        nonlocal best, best_theta
        losses.append(value)
        if math.isfinite(value) and value < best:
            best, best_theta = value, theta.detach().clone()

    optimizer = torch.optim.Adam([theta], lr=params.first_lr)
    with block.quantizing():
        for step in range(params.steps):
            if step % params.decay_every == 0:  # a new stage
                stage = step // params.decay_every
                with torch.no_grad():
                    theta.copy_(best_theta)
                optimizer = torch.optim.Adam([theta], lr=params.first_lr * params.lr_decay**stage)
            optimizer.zero_grad(set_to_none=True)
            loss = block.loss()
            score(loss.item())
            if not math.isfinite(losses[-1]):
                if step == 0:  # at the start alpha: nothing to go back to (NaN in the model or the data)
                    raise TrainingDiverged(f"phase 1: site {block.site.name}: the loss is {losses[-1]} at step 1")
                continue  # diverged: on to the next stage, from the best alpha
            loss.backward()
            optimizer.step()
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.4g}")
        else:
            with torch.no_grad():
                score(block.loss().item())  # the alpha of the last update
    bar.close()
    with torch.no_grad():
        theta.copy_(best_theta)
    return SiteResult(losses, best)


@dataclass
class Phase1Result:
    losses: dict[str, list[float]]  # site name -> loss per step
    error_before: dict[str, float]  # the block's error at the starting alpha
    error_after: dict[str, float]  # ... and at the kept one
    # LM loss on held-out text with static ranges, of the start and of phase 1's result, and which was kept
    validation: dict | None = None


def kept_at_start(sites: Sequence[Site], patterns: Sequence[str]) -> set[str]:
    """The names of the ``sites`` that ``phase1.keep_start`` matches (a role: all its sites; a glob: at least one)."""
    names = [s.name for s in sites]
    kept: set[str] = set()
    for pattern in patterns:
        if pattern in SITE_ROLES:
            kept.update(s.name for s in sites if s.role == pattern)
            continue
        hits = fnmatch.filter(names, pattern)
        if not hits:
            example = f" (e.g. {names[0]!r})" if names else ""
            raise QuadapterError(f"phase1.keep_start: {pattern!r} matches no Quadapter site of this model{example}")
        kept.update(hits)
    return kept


@torch.no_grad()
def _input_scale(qset: QuadapterSet, scope: str) -> torch.Tensor | float:
    """The scale the sites feeding ``scope`` from outside (a norm before the attention) put on its input: a scope
    block's output does not depend on that frame, so its FP input is scaled as the norm's output would be."""
    scale: torch.Tensor | float = 1.0
    for q in qset:
        if any(c.startswith(scope + ".") for c in q.site.consumers) and not q.site.producer.startswith(scope + "."):
            scale = scale * q.site.producer_scale(q.alpha)
    return scale


_CURVES = ("losses", "error_before", "error_after")


class _Checkpoint:
    """Phase 1's alphas and curves after every finished site, keyed by all they were computed from."""

    def __init__(
        self, folder: str, params: Phase1Parameters, qset: QuadapterSet, fp_call: Captured, sim_model: nn.Module
    ):
        self.path = Path(folder) / "phase1.pt"
        # the sim's quantizers: phase 1 takes min-max ranges whatever the policy's calibration scheme
        policy = [(f"{p}.{r}", q.bitwidth, bool(q.symmetric), tuple(q.shape)) for p, r, q in quantizers(sim_model)]
        digest = hashlib.sha256(json.dumps([params.model_dump(), policy], sort_keys=True, default=str).encode())
        for q in qset:
            digest.update(q.site.name.encode())
            digest.update(q.theta.detach().cpu().numpy().tobytes())
        digest.update(_first_input(fp_call).detach().float().cpu().numpy().tobytes())
        self.key = digest.hexdigest()

    def resume(self, qset: QuadapterSet, result: Phase1Result) -> set[str]:
        """The sites already done (their alphas loaded into ``qset``, their curves into ``result``)."""
        if not self.path.is_file():
            return set()
        try:
            state = torch.load(self.path, map_location="cpu", weights_only=True)
        except Exception as error:  # written atomically, so only a foreign file gets here: start over
            log.warning(
                "phase 1: the checkpoint %s cannot be read (%s); every site is calibrated again", self.path, error
            )
            return set()
        if state.get("key") != self.key:
            return set()
        qset.load_state_dict(state["qset"])
        for name in _CURVES:
            getattr(result, name).update(state[name])
        return set(state["losses"])

    def save(self, qset: QuadapterSet, result: Phase1Result) -> None:
        state = {"key": self.key, "qset": qset.state_dict(), **{name: getattr(result, name) for name in _CURVES}}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(self.path, lambda tmp: torch.save(state, tmp))


def _kept_sites(sim_model: PreparedLM, qset: QuadapterSet, params: Phase1Parameters) -> set[str]:
    """The sites phase 1 leaves at their starting alpha; with a prefix, its cache is refreshed through them."""
    kept = kept_at_start([q.site for q in qset], params.keep_start)
    if sim_model.prefix_ids is not None:
        # their alphas change the prefix's cached keys or values: phase 2 trains them, recomputing the cache
        kept |= {q.site.name for q in qset if q.site.cached}
        refresh_prefix(sim_model)  # through the alphas the hooks apply now
    return kept


def _first_block_inputs(
    fp_model: PreparedLM,
    sim_model: PreparedLM,
    first_block: str,
    calibration_batches: Sequence[torch.Tensor],
    from_fp: bool,
) -> tuple[Captured, Captured]:
    """The FP model's and the sim's calls of the first block."""
    fp_call = batched(capture_inputs(fp_model, first_block, calibration_batches))
    if from_fp:
        return fp_call, _own_prefix(fp_call, sim_model)
    with DynamicRanges(quantizers_in([sim_model])), torch.no_grad():
        return fp_call, batched(capture_inputs(sim_model, first_block, calibration_batches))


def _sites_by_block(qset: QuadapterSet, kept: set[str], blocks: list[str]) -> tuple[dict[str, list[Site]], list[Site]]:
    """The sites to calibrate, by the block their producer is in, and those after every block (the head's)."""
    by_block: dict[str, list[Site]] = {b: [] for b in blocks}
    head_sites: list[Site] = []
    for q in qset:
        if q.site.name in kept:
            continue
        owner = next((b for b in blocks if q.site.producer.startswith(b + ".")), None)
        (by_block[owner] if owner else head_sites).append(q.site)
    return by_block, head_sites


def _calibrate_block(
    path: str,
    sites: list[Site],
    fp_model: PreparedLM,
    sim_model: PreparedLM,
    fp_call: Captured,
    q_call: Captured,
    from_fp: bool,
    calibrate: Callable[[Site, Captured, Captured], None],
) -> tuple[Captured, Captured]:
    """``calibrate`` on each of block ``path``'s sites, bottom to top; the FP and sim calls of the next block."""
    fp_block, q_block = fp_model.get_submodule(path), sim_model.get_submodule(path)
    entries = [s.scope or s.producer for s in sites]
    fp_out, fp_seen = run_capturing(fp_block, fp_call, fp_model, entries)
    for site in sites:
        entry = site.scope or site.producer
        if from_fp:
            q_in = _own_prefix(fp_seen[entry], sim_model)
        else:  # rerun the sim block: the sites below in this block changed its input
            with DynamicRanges(quantizers_in([q_block])):
                _, q_seen = run_capturing(q_block, q_call, sim_model, [entry])
            q_in = q_seen[entry]
        calibrate(site, fp_seen[entry], q_in)
    fp_call = _with_hidden(fp_call, fp_out)
    if from_fp:
        return fp_call, _own_prefix(fp_call, sim_model)
    with DynamicRanges(quantizers_in([q_block])):
        q_out, _ = run_capturing(q_block, q_call, sim_model, [])
    return fp_call, _with_hidden(q_call, q_out)


def run_phase1(
    sim_model: PreparedLM,
    fp_model: PreparedLM,
    qset: QuadapterSet,
    calibration_batches: Sequence[torch.Tensor],
    params: Phase1Parameters | None = None,
    progress: bool = True,
    on_site_done: Callable[[Site, list[float]], None] | None = None,
    checkpoint_dir: str | None = None,
) -> Phase1Result:
    """Phase 1 on every site of ``qset`` (attached to ``sim_model``); with ``checkpoint_dir``, resumable by site."""
    params = params or Phase1Parameters()
    kept = _kept_sites(sim_model, qset, params)
    from_fp = params.input_source == "fp"
    blocks = sim_model.block_paths()
    fp_call, q_call = _first_block_inputs(fp_model, sim_model, blocks[0], calibration_batches, from_fp)
    by_block, head_sites = _sites_by_block(qset, kept, blocks)

    result = Phase1Result({}, {}, {})
    checkpoint = _Checkpoint(checkpoint_dir, params, qset, fp_call, sim_model) if checkpoint_dir else None
    done = checkpoint.resume(qset, result) if checkpoint else set()
    outer = tqdm(
        total=len(qset) - len(kept),
        initial=len(done),
        desc="phase 1 (block-wise calibration)",
        unit="site",
        disable=not progress,
    )

    def calibrate(site: Site, fp_in: Captured, q_in: Captured) -> None:
        if site.name in done:  # resumed: its alpha came from the checkpoint
            return
        if from_fp and site.scope:
            q_in = _with_hidden(q_in, _first_input(q_in) * _input_scale(qset, site.scope))
        site_result = calibrate_site(SiteBlock(site, fp_model, sim_model, fp_in, q_in, params), qset, params, progress)
        result.losses[site.name] = site_result.losses
        result.error_before[site.name] = site_result.losses[0] if site_result.losses else math.nan
        result.error_after[site.name] = site_result.best
        if checkpoint is not None and distributed.is_main():
            checkpoint.save(qset, result)
        if on_site_done:
            on_site_done(site, site_result.losses)
        outer.update(1)
        outer.set_postfix(site=site.name, err=f"{result.error_before[site.name]:.3g}->{site_result.best:.3g}")

    for path, sites in by_block.items():
        fp_call, q_call = _calibrate_block(path, sites, fp_model, sim_model, fp_call, q_call, from_fp, calibrate)
    # the head site's producer (the final norm) takes the last block's output
    for site in head_sites:
        calibrate(site, ((_first_input(fp_call),), {}), ((_first_input(q_call),), {}))
    outer.close()
    return result
