"""GroupedAdam: torch's Adam, bit for bit, over many groups at once."""

from __future__ import annotations

import torch

from aimet_quadapter.quadapter.adam import GroupedAdam


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(1,), (1,), (3, 1), (8,), (4, 5), (1,)]
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def _train(opt_cls, steps: int = 6, resume_into=None):
    params = _params(0)
    # one group per tensor with its own rate (phase 2's relative range rates), and one shared group
    groups = [{"params": [p], "lr": 0.01 * (i + 1) / 7} for i, p in enumerate(params[:4])]
    groups.append({"params": params[4:], "lr": 0.03})
    opt = opt_cls(groups)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: max(0.0, 1.0 - step / steps))
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        if step == steps // 2 and resume_into is not None:  # the other class resumes the checkpoint
            state, sched = opt.state_dict(), schedule.state_dict()
            opt = resume_into(groups)  # as run_phase2 resumes: optimizer, schedule, then their states
            schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: max(0.0, 1.0 - step / steps))
            opt.load_state_dict(state)
            schedule.load_state_dict(sched)
        opt.zero_grad(set_to_none=True)
        for i, p in enumerate(params):
            if step % 3 == 1 and i == 1:
                continue  # a tensor with no gradient this step is left alone, its step count too
            p.grad = torch.randn(p.shape, generator=g) * 10.0 ** (i - 3)
        opt.step()
        schedule.step()
    return [p.detach().clone() for p in params], opt


def test_grouped_adam_is_torch_adam_bit_for_bit():
    ref, ref_opt = _train(torch.optim.Adam)
    got, opt = _train(GroupedAdam)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    ref_state, state = ref_opt.state_dict()["state"], opt.state_dict()["state"]
    assert ref_state.keys() == state.keys()
    for k in ref_state:
        for name in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(ref_state[k][name], state[k][name]), (k, name)
    # the parameter skipped at steps 1 and 4 took fewer steps
    assert float(state[1]["step"]) < float(state[0]["step"])


def test_grouped_adam_resumes_adams_checkpoint_and_back():
    ref, _ = _train(torch.optim.Adam)
    for first, then in ((torch.optim.Adam, GroupedAdam), (GroupedAdam, torch.optim.Adam)):
        got, _ = _train(first, resume_into=then)
        assert all(torch.equal(a, b) for a, b in zip(ref, got))


def test_grouped_adam_takes_adams_own_step_for_options_it_does_not_cover():
    for options in ({"weight_decay": 0.1}, {"amsgrad": True}, {"maximize": True}):
        a, b = _params(0), _params(0)
        opts = [torch.optim.Adam(a, lr=0.1, **options), GroupedAdam(b, lr=0.1, **options)]
        for _ in range(3):
            for ps, opt in zip((a, b), opts):
                for p in ps:
                    p.grad = torch.ones_like(p)
                opt.step()
        assert all(torch.equal(x, y) for x, y in zip(a, b)), options
