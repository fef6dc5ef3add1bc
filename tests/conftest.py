"""Fixtures of the cross-package tests."""

from __future__ import annotations

import pytest

from tephra.controller.run.models import resolve_model_path


@pytest.fixture(scope="module")
def ray_session():
    """One local Ray session for a test module (a fresh one: a session another module left
    behind in this process could still hold its resources)."""
    import ray

    from tephra.controller.cluster.worker_group import ray_init

    if ray.is_initialized():
        ray.shutdown()
    ray_init(num_cpus=2)
    yield
    ray.shutdown()


def _reference_lrs(cfg, peak_lr: float, steps: int) -> list[float]:
    """The lr of optimizer steps 0..steps-1 under `cfg` (a `SchedulerConfig`), from
    transformers' own schedulers (`get_scheduler`), an implementation independent of tephra's:
      - warmup s < W: `cosine_warmup_with_min_lr`'s, (s + 1) / W (the first step moves);
        the others of transformers warm up from 0 (s / W), one step behind;
      - constant: `constant`; cosine: `cosine_with_min_lr` (min_lr_rate = min_lr_ratio);
      - wsd: `warmup_stable_decay`, linear decay over the last max(decay_ratio * T, 1) steps
        (not before the warmup ends), to min_lr_ratio.
    After total_steps tephra's cosine stays at the floor (transformers' would rise again on
    the next half period): that tail is the hand value peak * min_lr_ratio."""
    import torch
    from transformers import get_scheduler

    def run(name: str, **kwargs) -> list[float]:
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=peak_lr)
        sched = get_scheduler(name, opt, **kwargs)
        out = []
        for _ in range(steps):
            out.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return out

    w, t, m = cfg.warmup_steps, cfg.total_steps, cfg.min_lr_ratio
    if cfg.name == "constant":
        after = run("constant")
    elif cfg.name == "cosine":
        after = run(
            "cosine_with_min_lr",
            num_warmup_steps=w,
            num_training_steps=t,
            scheduler_specific_kwargs={"min_lr_rate": m},
        )
        after = [lr if s <= t else peak_lr * m for s, lr in enumerate(after)]
    elif cfg.name == "wsd":
        start = max(t - max(cfg.decay_ratio * t, 1.0), float(w))
        after = run(
            "warmup_stable_decay",
            num_warmup_steps=w,
            scheduler_specific_kwargs={
                "num_stable_steps": start - w,
                "num_decay_steps": t - start,
                "min_lr_ratio": m,
                "decay_type": "linear",
            },
        )
    else:
        raise AssertionError(f"no transformers reference for schedule {cfg.name!r}: add one")
    if not w:
        return after
    warm = run(
        "cosine_warmup_with_min_lr",
        num_warmup_steps=w,
        num_training_steps=w + 1,
        scheduler_specific_kwargs={"min_lr_rate": 0.0},
    )
    return [warm[s] if s < w else after[s] for s in range(steps)]


@pytest.fixture
def reference_lrs():
    """`_reference_lrs(cfg, peak_lr, steps)`: transformers' lr schedule of that shape."""
    return _reference_lrs


def _reference_grad_norm(model_path, rows, coefs) -> float:
    """The gradient norm of sum_i coefs[i] * sum_t log pi(y_it | x_i, y_i<t) over the
    parameters of the Hugging Face model at `model_path` (fp32, plain transformers, one
    sequence at a time): for an on-policy step (ratio 1), the gradient of a loss whose
    per-sequence weight on the log-probs is `coefs[i]` (or, a list, one weight per response
    token). `rows` are dumped samples (their `prompt_ids` and `response_ids`)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    for row, coef in zip(rows, coefs, strict=True):
        prompt, response = row["prompt_ids"], row["response_ids"]
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
        log_probs = torch.log_softmax(logits.float(), -1)
        picked = log_probs.gather(-1, torch.tensor(response)[:, None])[:, 0]
        (torch.as_tensor(coef, dtype=picked.dtype) * picked).sum().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads)))


@pytest.fixture
def reference_grad_norm():
    """`_reference_grad_norm(model_path, rows, coefs)`: a gradient norm in plain transformers."""
    return _reference_grad_norm


def _smoke_score(response: str) -> float:
    """`SMOKE_REWARD` written out again: the score the smoke runs' reward gives a response."""
    return (sum(map(ord, response)) % 5) / 4.0


def _grpo_step_reference(model_path, rows, eps: float = 1e-6, shaping=None) -> dict:
    """What a GRPO step on the dumped `rows` (one step's `train_step<N>.jsonl`, single-turn,
    prompt-major groups) must log, written out per sample here (the library's is vectorised):
      - rewards: each row's score (plus `shaping[i]`, DAPO's length penalty, where given);
      - advantages: (r_i - mean_g) / (std_g + eps) within the row's group (std unbiased);
      - `reward/mean`: the rewards' mean;
      - with `model_path`, on-policy (ratio 1, one mini-batch, token-mean, no KL or entropy term): `pg_loss` =
        -sum_i A_i |y_i| / N and `grad_norm`, the norm of the gradient of that loss at the
        weights of `model_path` (`_reference_grad_norm` with coefficients -A_i / N), where
        N = sum_i |y_i| is the step's response tokens."""
    rewards = [r["score"] + (0.0 if shaping is None else shaping[i]) for i, r in enumerate(rows)]
    groups: dict[int, list[float]] = {}
    for r, x in zip(rows, rewards, strict=True):
        groups.setdefault(r["prompt_index"], []).append(x)
    advantages = []
    for r, x in zip(rows, rewards, strict=True):
        g = groups[r["prompt_index"]]
        mean = sum(g) / len(g)
        std = (sum((y - mean) ** 2 for y in g) / (len(g) - 1)) ** 0.5
        advantages.append((x - mean) / (std + eps))
    out = {"advantages": advantages, "reward/mean": sum(rewards) / len(rewards)}
    if model_path is not None:
        assert all(all(m == 1 for m in r["response_mask"]) for r in rows)  # single-turn
        n = sum(len(r["response_ids"]) for r in rows)
        out["pg_loss"] = -sum(a * len(r["response_ids"]) for a, r in zip(advantages, rows)) / n
        out["grad_norm"] = _reference_grad_norm(model_path, rows, [-a / n for a in advantages])
    return out


@pytest.fixture
def grpo_step_reference():
    """`_grpo_step_reference(model_path, rows, eps, shaping)`: a GRPO step's advantages,
    reward mean, on-policy pg loss and grad norm, recomputed from its dumped samples."""
    return _grpo_step_reference


@pytest.fixture
def smoke_score():
    """`_smoke_score(response)`: the smoke runs' reward, written out again."""
    return _smoke_score


def _critic_step_reference(cfg, rows) -> dict:
    """What the first step of a PPO run with a critic (`algorithm.adv_estimator=gae`, outcome
    rewards, no KL in the reward) must log, from its dumped `rows` (`train_step1.jsonl`),
    written out in plain transformers and torch, one sequence at a time:
      - the critic: `AutoModelForTokenClassification` (one label, no classifier dropout) of
        the run's model, its new value head drawn right after `torch.manual_seed(seed)` (the
        engines' documented initialisation); the value of response token k is read at the
        position that predicts it (prompt length - 1 + k);
      - GAE by its recursion, token by token: delta_t = r_t + gamma V_{t+1} - V_t (r: the score
        on the last token; V after the last token 0), A_t = delta_t + gamma lam A_{t+1},
        returns R = A + V, advantages A whitened over the step's tokens (unbiased variance);
        `advantages` holds each row's token mean (what the dump logs);
      - the critic's update, mini-batch by mini-batch (rows in order): loss = token mean of
        0.5 max((V - R)^2, (V_clip - R)^2) with V_clip = V_old + clip(V - V_old, +-eps_v),
        its gradient norm, then `clip_grad_norm_` and a `torch.optim.AdamW` step;
        `vf_loss` and `grad_norm` are their means over the mini-batches (as logged)."""
    import torch
    from transformers import AutoConfig, AutoModelForTokenClassification

    seed = cfg.trainer.seed
    path = resolve_model_path(cfg.model.path, seed)
    config = AutoConfig.from_pretrained(path, num_labels=1)
    config.classifier_dropout = 0.0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        critic = AutoModelForTokenClassification.from_pretrained(
            path, config=config, dtype=torch.float32
        )

    def values(row) -> torch.Tensor:
        prompt, response = row["prompt_ids"], row["response_ids"]
        logits = critic(torch.tensor([prompt + response])).logits[0, :, 0]
        return logits[len(prompt) - 1 : len(prompt) - 1 + len(response)]

    adv_cfg = cfg.algorithm.advantage
    gamma, lam = adv_cfg.gamma, adv_cfg.lam
    with torch.no_grad():
        old = [values(r).double() for r in rows]
    raw, returns = [], []
    for row, v in zip(rows, old, strict=True):
        n = len(row["response_ids"])
        a, nxt_v, nxt_a = [0.0] * n, 0.0, 0.0
        for t in reversed(range(n)):
            reward = row["score"] if t == n - 1 else 0.0
            delta = reward + gamma * nxt_v - float(v[t])
            nxt_a = a[t] = delta + gamma * lam * nxt_a
            nxt_v = float(v[t])
        raw.append(a)
        returns.append(torch.tensor(a, dtype=torch.float64) + v)
    flat = [x for a in raw for x in a]
    mean = sum(flat) / len(flat)
    var = sum((x - mean) ** 2 for x in flat) / (len(flat) - 1)
    advantages = [sum((x - mean) / (var + 1e-8) ** 0.5 for x in a) / len(a) for a in raw]

    opt_cfg, eps_v = cfg.critic.optimizer, cfg.critic.objective.cliprange_value
    optimizer = torch.optim.AdamW(
        critic.parameters(),
        lr=opt_cfg.lr,
        betas=opt_cfg.betas,
        eps=opt_cfg.eps,
        weight_decay=opt_cfg.weight_decay,
    )
    size = len(rows) // cfg.batch.mini_batches
    losses, norms = [], []
    for start in range(0, len(rows), size):
        part = range(start, start + size)
        tokens = sum(len(rows[i]["response_ids"]) for i in part)
        total = 0.0
        for i in part:
            v = values(rows[i]).double()
            clipped = old[i] + (v - old[i]).clamp(-eps_v, eps_v)
            per_token = 0.5 * torch.maximum((v - returns[i]) ** 2, (clipped - returns[i]) ** 2)
            loss = per_token.sum() / tokens
            loss.backward()
            total += float(loss)
        losses.append(total)
        params = [p for p in critic.parameters() if p.grad is not None]
        norms.append(float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params))))
        torch.nn.utils.clip_grad_norm_(params, opt_cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad()
    return {
        "advantages": advantages,
        "vf_loss": sum(losses) / len(losses),
        "grad_norm": sum(norms) / len(norms),
        "vf_losses": losses,
        "grad_norms": norms,
    }


@pytest.fixture
def critic_step_reference():
    """`_critic_step_reference(cfg, rows)`: step 1 of a PPO run with a critic (GAE advantages,
    the critic's value loss and grad norm), recomputed from its dumped samples."""
    return _critic_step_reference
