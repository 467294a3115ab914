"""Adam over many parameter groups in one multi-tensor pass (phase 2 has a group per quantizer range)."""

from __future__ import annotations

from collections import defaultdict

import torch


class GroupedAdam(torch.optim.Adam):
    """``torch.optim.Adam`` whose step updates every group in one multi-tensor pass, bit for bit as the single-tensor
    Adam, with Adam's state; weight decay, AMSGrad, maximize, capturable, fused or differentiable take Adam's step."""

    def _plain(self) -> bool:
        return all(
            g["weight_decay"] == 0
            and not any(g[k] for k in ("amsgrad", "maximize", "capturable", "differentiable", "fused"))
            and not isinstance(g["lr"], torch.Tensor)
            for g in self.param_groups
        )

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]  # same signature as Adam's
        if not self._plain():
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # tensors of one device and dtype go through each multi-tensor op together
        buckets: dict[tuple, tuple[list, ...]] = defaultdict(lambda: ([], [], [], [], [], []))
        stepping = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Adam does not support sparse gradients")
                state = self.state[p]
                if not state:  # as Adam creates it, so that either can resume the other's checkpoint
                    state["step"] = torch.tensor(0.0, dtype=torch.get_default_dtype())
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                stepping.append((group, p, state))
        if stepping:  # every step count at once: one op, not one per tensor
            torch._foreach_add_([state["step"] for _, _, state in stepping], 1)
        for group, p, state in stepping:
            beta1, beta2 = group["betas"]
            t = state["step"].item()
            b = buckets[(p.device, p.dtype, beta1, beta2, group["eps"])]
            for lst, item in zip(b, (p, p.grad, state["exp_avg"], state["exp_avg_sq"])):
                lst.append(item)
            b[4].append((1 - beta2**t) ** 0.5)  # bias_correction2_sqrt
            b[5].append(-(group["lr"] / (1 - beta1**t)))  # -step_size
        for (_, _, beta1, beta2, eps), (params, grads, exp_avgs, exp_avg_sqs, bc2_sqrt, neg_steps) in buckets.items():
            torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
            torch._foreach_mul_(exp_avg_sqs, beta2)
            torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
            denoms = torch._foreach_sqrt(exp_avg_sqs)
            torch._foreach_div_(denoms, bc2_sqrt)
            torch._foreach_add_(denoms, eps)
            torch._foreach_addcdiv_(params, exp_avgs, denoms, neg_steps)
        return loss
