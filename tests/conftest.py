"""Fixtures of the cross-package tests."""

from __future__ import annotations

import pytest


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


def _reference_grad_norm(
    model_path, rows, coefs, lora=None, seed: int = 0, temperature: float = 1.0
) -> float:
    """The gradient norm of sum_i coefs[i] * sum_t log pi(y_it | x_i, y_i<t) over the
    parameters of the Hugging Face model at `model_path` (fp32, plain transformers, one
    sequence at a time): for an on-policy step (ratio 1), the gradient of a loss whose
    per-sequence weight on the log-probs is `coefs[i]` (or, a list, one weight per response
    token). `rows` are dumped samples (their `prompt_ids` and `response_ids`). With `lora` (a
    `LoraConfig`), the model wrapped by peft's `get_peft_model` right after
    `torch.manual_seed(seed)` (the engines' documented adapter initialisation: A drawn, B
    zero): the norm over the adapters, the base weights frozen. log pi is at `temperature`
    (the logits divided by it, as the trainer scores a rollout sampled at it)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    if lora is not None:
        from peft import LoraConfig, get_peft_model  # only the LoRA references need peft

        peft_cfg = LoraConfig(
            r=lora.rank,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=lora.target_modules,
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = get_peft_model(model, peft_cfg)
    for row, coef in zip(rows, coefs, strict=True):
        prompt, response = row["prompt_ids"], row["response_ids"]
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
        log_probs = torch.log_softmax(logits.float() / temperature, -1)
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


def _grpo_step_reference(
    model_path, rows, eps: float = 1e-6, shaping=None, lora=None, seed: int = 0
) -> dict:
    """What a GRPO step on the dumped `rows` (one step's `train_step<N>.jsonl`, prompt-major
    groups) must log, written out per sample here (the library's is vectorised):
      - rewards: each row's score (plus `shaping[i]`, DAPO's length penalty, where given);
      - advantages: (r_i - mean_g) / (std_g + eps) within the row's group (std unbiased);
      - `reward/mean`: the rewards' mean;
      - on-policy (ratio 1, one mini-batch, token-mean, no KL or entropy term), at any step:
        `pg_loss` = -sum_i A_i |y_i| / N, where |y_i| counts the row's trained tokens (mask 1:
        a multi-turn row's tool and user tokens are context only) and N is the step's;
      - with `model_path` (the weights the step trained from), `grad_norm`, the norm of the
        gradient of that loss there (`_reference_grad_norm` with coefficient -A_i / N on each
        trained token); with `lora` (and `seed`), the adapters' gradient."""
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
    n = sum(sum(r["response_mask"]) for r in rows)
    out = {
        "advantages": advantages,
        "reward/mean": sum(rewards) / len(rewards),
        "pg_loss": -sum(a * sum(r["response_mask"]) for a, r in zip(advantages, rows)) / n,
    }
    if model_path is not None:
        coefs = [[-a * m / n for m in r["response_mask"]] for a, r in zip(advantages, rows)]
        out["grad_norm"] = _reference_grad_norm(model_path, rows, coefs, lora, seed)
    return out


def _on_policy_coefs(rows, advantages, agg: str) -> list[list[float]]:
    """Each response token's weight on its log-prob in an on-policy policy loss (ratio 1, no
    KL or entropy term): -A_i on every trained token (mask 1), aggregated by `agg`:
    `token-mean` over the N trained tokens of the batch, `seq-mean-token-mean` over each
    row's own trained tokens, then over the B rows. The loss's value is their sum."""
    if agg == "token-mean":
        n = sum(sum(r["response_mask"]) for r in rows)
        return [[-a * m / n for m in r["response_mask"]] for a, r in zip(advantages, rows)]
    if agg == "seq-mean-token-mean":
        b = len(rows)
        return [
            [-a * m / (sum(r["response_mask"]) * b) for m in r["response_mask"]]
            for a, r in zip(advantages, rows)
        ]
    raise AssertionError(f"no reference written for actor.objective.loss_agg_mode={agg!r}")


def _grpo_steps_reference(cfg, model_path, steps: list[list[dict]], eps: float = 1e-6) -> list:
    """The GRPO steps of a text-model run with one mini-batch, from each step's dumped rows
    (`steps[k]`: `train_step<k+1>.jsonl`), in plain transformers and torch, one sequence at a
    time, each step from the weights the previous one left:
      - the advantages and reward mean of `_grpo_step_reference`;
      - the on-policy pg loss (ratio 1; `cfg.actor.objective.loss_agg_mode`, no KL or
        entropy term: `_on_policy_coefs`) and the norm of its gradient;
      - then that gradient clipped to `grad_clip` (`clip_grad_norm_`) and one
        `torch.optim.AdamW` step of `cfg.actor.optimizer` (a constant lr), which the next
        step trains from: step 2's numbers need step 1's update, written out here.
    One dict per step."""
    import torch
    from transformers import AutoModelForCausalLM

    obj, opt, sched = cfg.actor.objective, cfg.actor.optimizer, cfg.actor.scheduler
    assert cfg.batch.mini_batches == 1 and cfg.batch.epochs == 1, "one update per step"
    assert not obj.use_kl_loss and obj.entropy_coeff == 0, "the pg loss alone"
    assert sched.name == "constant" and sched.warmup_steps == 0, "a constant lr"
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay
    )
    out = []
    for rows in steps:
        step = _grpo_step_reference(None, rows, eps)
        coefs = _on_policy_coefs(rows, step["advantages"], obj.loss_agg_mode)
        for row, coef in zip(rows, coefs, strict=True):
            prompt, response = row["prompt_ids"], row["response_ids"]
            logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
            picked = torch.log_softmax(logits.float(), -1).gather(
                -1, torch.tensor(response)[:, None]
            )[:, 0]
            (torch.tensor(coef) * picked).sum().backward()
        params = [p for p in model.parameters() if p.grad is not None]
        norm = float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params)))
        out.append({**step, "pg_loss": sum(map(sum, coefs)), "grad_norm": norm})
        torch.nn.utils.clip_grad_norm_(params, opt.grad_clip)
        optimizer.step()
        optimizer.zero_grad()
    return out


@pytest.fixture
def grpo_steps_reference():
    """`_grpo_steps_reference(cfg, model_path, steps)`: a GRPO run's steps recomputed from
    their dumped samples, each from the weights the previous step's update left."""
    return _grpo_steps_reference


def _ppo_update_reference(cfg, rows, advantages, images=None) -> dict:
    """The actor's update of step 1 of a run with `cfg` (`_ppo_updates_reference` of one
    step): the means over the mini-batches, as logged, of `pg_loss`, `grad_norm` and
    `ratio_max`, and each mini-batch's."""
    return _ppo_updates_reference(cfg, [(rows, advantages, images)])[0]


def _ppo_updates_reference(cfg, steps, frozen: tuple[str, ...] = ()) -> list[dict]:
    """The actor's updates of the first steps of a run with `cfg`, in plain transformers and
    torch, one sequence at a time; `steps`: each step's `(rows, advantages, images)` in
    order, each step starting from the weights the previous one left. Per step: PPO's
    clipped surrogate (dual clip where A < 0, c = clip_ratio_c) against the log-probs of the
    weights the step started from (the step's rollout: a bypass run's old log-probs, with no
    recompute between mini-batches), over each response's trained tokens (mask 1) aggregated
    over each mini-batch (`cfg.batch.mini_batches`, rows in order) by
    `cfg.actor.objective.loss_agg_mode` (`token-mean` or `seq-mean-token-mean`), its gradient
    norm, then `clip_grad_norm_` and a `torch.optim.AdamW` step of `cfg.actor.optimizer` (one
    optimizer for all steps: its moments carry over). `advantages`: one per row (outcome
    estimators: the same on every token) or one list per row (per token, e.g. GAE's).
    `images`: each row's PIL images, for a vision-language model
    (`AutoModelForImageTextToText`, the pixels from its own image processor). With
    `cfg.actor.lora.rank > 0`, the model wrapped by peft's `get_peft_model` right after
    `torch.manual_seed(cfg.trainer.seed)` (the engines' documented adapter initialisation: A
    drawn, B zero), no adapter in the modules named in `frozen` (e.g. a vision tower), and
    only the adapters trained. Returns, per step, the means over the mini-batches, as logged:
    `pg_loss`, `grad_norm` (over the trained parameters) and `ratio_max` (each mini-batch's
    largest ratio)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    seed = cfg.trainer.seed
    # imported here: the compat step's venvs have no controller
    from tephra.controller.run.models import resolve_model_path

    path = resolve_model_path(cfg.model.path, seed)
    vision = any(images is not None for _, _, images in steps)
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    model = auto.from_pretrained(path, dtype=torch.float32)
    lora = cfg.actor.lora
    if lora.rank > 0:
        from peft import LoraConfig, get_peft_model  # only the LoRA references need peft

        peft_cfg = LoraConfig(
            r=lora.rank,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=lora.target_modules,
            exclude_modules=rf".*\b({'|'.join(frozen)})\b.*" if frozen else None,
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = get_peft_model(model, peft_cfg)
    obj, opt = cfg.actor.objective.policy, cfg.actor.optimizer
    agg = cfg.actor.objective.loss_agg_mode
    assert agg in ("token-mean", "seq-mean-token-mean"), f"no reference for {agg}"
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        trained, lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay
    )
    out = []
    for rows, advantages, images in steps:
        pixels = [{}] * len(rows)
        if images is not None:
            pixels = _pixels(path, rows, images, model.config.image_token_id)

        def log_probs(i: int, rows=rows, pixels=pixels) -> torch.Tensor:
            prompt, response = rows[i]["prompt_ids"], rows[i]["response_ids"]
            ids = torch.tensor([prompt + response])
            logits = model(ids, **pixels[i]).logits[0, len(prompt) - 1 : -1]
            picked = torch.log_softmax(logits.float(), -1).gather(
                -1, torch.tensor(response)[:, None]
            )
            return picked[:, 0]

        with torch.no_grad():
            old = [log_probs(i) for i in range(len(rows))]
        size = len(rows) // cfg.batch.mini_batches
        losses, norms, ratio_max = [], [], []
        for start in range(0, len(rows), size):
            part = range(start, start + size)
            masks = {i: torch.tensor(rows[i]["response_mask"], dtype=torch.float32) for i in part}
            tokens = sum(float(masks[i].sum()) for i in part)
            total, largest = 0.0, 0.0
            for i in part:
                a = torch.as_tensor(advantages[i], dtype=torch.float32)
                ratio = (log_probs(i) - old[i]).exp()
                per_token = torch.maximum(
                    -a * ratio, -a * ratio.clamp(1 - obj.eps_low, 1 + obj.eps_high)
                )
                if obj.clip_ratio_c is not None:
                    dual = torch.minimum(per_token, -a * obj.clip_ratio_c)
                    per_token = torch.where(a < 0, dual, per_token)
                summed = (per_token * masks[i]).sum()
                if agg == "token-mean":
                    loss = summed / tokens
                else:
                    loss = summed / masks[i].sum() / len(part)
                loss.backward()
                total += float(loss)
                largest = max(largest, float(ratio.max()))
            losses.append(total)
            ratio_max.append(largest)
            params = [p for p in model.parameters() if p.grad is not None]
            norms.append(float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params))))
            torch.nn.utils.clip_grad_norm_(params, opt.grad_clip)
            optimizer.step()
            optimizer.zero_grad()
        out.append(
            {
                "pg_loss": sum(losses) / len(losses),
                "grad_norm": sum(norms) / len(norms),
                "grad_norms": norms,
                "ratio_max": sum(ratio_max) / len(ratio_max),
                "ratio_maxes": ratio_max,
            }
        )
    return out


@pytest.fixture
def ppo_update_reference():
    """`_ppo_update_reference(cfg, rows, advantages)`: step 1's actor update (PPO clip against
    the rollout's log-probs, mini-batch by mini-batch with AdamW between) in plain torch."""
    return _ppo_update_reference


@pytest.fixture
def ppo_updates_reference():
    """`_ppo_updates_reference(cfg, [(rows, advantages, images), ...])`: the actor's updates
    of the first steps, each from the weights the previous one left, in plain torch."""
    return _ppo_updates_reference


@pytest.fixture
def grpo_step_reference():
    """`_grpo_step_reference(model_path, rows, eps, shaping)`: a GRPO step's advantages,
    reward mean, on-policy pg loss and grad norm, recomputed from its dumped samples."""
    return _grpo_step_reference


@pytest.fixture
def smoke_score():
    """`_smoke_score(response)`: the smoke runs' reward, written out again."""
    return _smoke_score


def _pixels(path, rows, images, image_token_id: int) -> list[dict]:
    """Each row's model inputs beside its token ids for a vision-language model: its images
    through the model's own image processor (`pixel_values`, and `image_grid_thw` for the
    Qwen2-VL family), and for that family `mm_token_type_ids` (1 on the image tokens of its
    prompt + response, else 0), which transformers' mRoPE reads."""
    import torch
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(path)
    out = []
    for row, row_images in zip(rows, images, strict=True):
        ids = torch.tensor([row["prompt_ids"] + row["response_ids"]])
        kwargs = dict(processor(images=row_images, return_tensors="pt"))
        if "image_grid_thw" in kwargs:  # the Qwen2-VL family's mRoPE (LLaVA: plain positions)
            kwargs["mm_token_type_ids"] = (ids == image_token_id).long()
        out.append(kwargs)
    return out


def _critic_step_reference(cfg, rows, images=None) -> dict:
    """Step 1 of `_critic_steps_reference`."""
    return _critic_steps_reference(cfg, [(rows, images)])[0]


def _critic_steps_reference(cfg, steps) -> list[dict]:
    """What the first steps of a PPO run with a critic (`algorithm.adv_estimator=gae`, outcome
    rewards, no KL in the reward) must log, from their dumped rows (`steps`: each step's
    `(rows, images)` in order, `rows` from `train_step<N>.jsonl`), written out in plain
    transformers and torch, one sequence at a time, each step from the critic the previous
    step's update left:
      - the critic: `AutoModelForTokenClassification` (one label, no classifier dropout) of
        the run's model, its new value head drawn right after `torch.manual_seed(seed)` (the
        engines' documented initialisation); with `images` (each row's PIL images) the
        vision-language model's backbone under a value head drawn as the engine documents it
        (`nn.Linear(hidden, 1)` made after loading, then N(0, initializer_range), bias 0),
        the pixels from the model's own image processor. The value of response token k is
        read at the position that predicts it (prompt length - 1 + k);
      - GAE by its recursion, token by token: delta_t = r_t + gamma V_{t+1} - V_t (r: the score
        on the last token; V after the last token 0), A_t = delta_t + gamma lam A_{t+1},
        returns R = A + V, advantages A whitened over the step's tokens (unbiased variance);
        `advantages` holds each row's token mean (what the dump logs) and
        `token_advantages` each token's (what the actor trains on); VAPO's lambdas where
        set (`lam_critic` for the returns, 1 - 1 / (alpha |y_i|) for the advantages);
      - the critic's update, mini-batch by mini-batch (rows in order): loss = token mean of
        0.5 max((V - R)^2, (V_clip - R)^2) with V_clip = V_old + clip(V - V_old, +-eps_v),
        its gradient norm, then `clip_grad_norm_` and a `torch.optim.AdamW` step;
        `vf_loss` and `grad_norm` are their means over the mini-batches (as logged).
    One dict per step."""
    import torch
    from transformers import (
        AutoConfig,
        AutoModelForImageTextToText,
        AutoModelForTokenClassification,
    )

    seed = cfg.trainer.seed
    # imported here: the compat step's venvs have no controller
    from tephra.controller.run.models import resolve_model_path

    path = resolve_model_path(cfg.model.path, seed)
    if all(images is None for _, images in steps):
        config = AutoConfig.from_pretrained(path, num_labels=1)
        config.classifier_dropout = 0.0
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            critic = AutoModelForTokenClassification.from_pretrained(
                path, config=config, dtype=torch.float32
            )
        params = list(critic.parameters())
        image_token_id = None

        def forward(ids, kwargs) -> torch.Tensor:
            return critic(ids).logits[0, :, 0]

    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            vlm = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
            text = vlm.config.get_text_config()
            head = torch.nn.Linear(text.hidden_size, 1)
            with torch.no_grad():
                head.weight.normal_(0.0, text.initializer_range)
                head.bias.zero_()
        params = list(vlm.model.parameters()) + list(head.parameters())
        image_token_id = vlm.config.image_token_id

        def forward(ids, kwargs) -> torch.Tensor:
            return head(vlm.model(input_ids=ids, **kwargs).last_hidden_state[0])[:, 0]

    adv_cfg = cfg.algorithm.advantage
    gamma = adv_cfg.gamma

    def gae(row, v, lam) -> list[float]:
        n = len(row["response_ids"])
        a, nxt_v, nxt_a = [0.0] * n, 0.0, 0.0
        for t in reversed(range(n)):
            reward = row["score"] if t == n - 1 else 0.0
            delta = reward + gamma * nxt_v - float(v[t])
            nxt_a = a[t] = delta + gamma * lam * nxt_a
            nxt_v = float(v[t])
        return a

    opt_cfg, eps_v = cfg.critic.optimizer, cfg.critic.objective.cliprange_value
    optimizer = torch.optim.AdamW(
        params,
        lr=opt_cfg.lr,
        betas=opt_cfg.betas,
        eps=opt_cfg.eps,
        weight_decay=opt_cfg.weight_decay,
    )
    out = []
    for rows, images in steps:
        pixels = [{}] * len(rows)
        if images is not None:
            pixels = _pixels(path, rows, images, image_token_id)

        def values(i: int, rows=rows, pixels=pixels) -> torch.Tensor:
            prompt, response = rows[i]["prompt_ids"], rows[i]["response_ids"]
            out = forward(torch.tensor([prompt + response]), pixels[i])
            return out[len(prompt) - 1 : len(prompt) - 1 + len(response)]

        with torch.no_grad():
            old = [values(i).double() for i in range(len(rows))]
        raw, returns = [], []
        for row, v in zip(rows, old, strict=True):
            lam = adv_cfg.actor_lam
            if adv_cfg.lam_length_alpha is not None:  # VAPO: 1 - 1 / (alpha * length), in [0, 1]
                lam = min(max(1 - 1 / (adv_cfg.lam_length_alpha * len(row["response_ids"])), 0), 1)
            raw.append(gae(row, v, lam))
            returns.append(torch.tensor(gae(row, v, adv_cfg.critic_lam), dtype=torch.float64) + v)
        flat = [x for a in raw for x in a]
        mean = sum(flat) / len(flat)
        var = sum((x - mean) ** 2 for x in flat) / (len(flat) - 1)
        token_advantages = [[(x - mean) / (var + 1e-8) ** 0.5 for x in a] for a in raw]
        size = len(rows) // cfg.batch.mini_batches
        losses, norms = [], []
        for start in range(0, len(rows), size):
            part = range(start, start + size)
            tokens = sum(len(rows[i]["response_ids"]) for i in part)
            total = 0.0
            for i in part:
                v = values(i).double()
                clipped = old[i] + (v - old[i]).clamp(-eps_v, eps_v)
                per_token = 0.5 * torch.maximum((v - returns[i]) ** 2, (clipped - returns[i]) ** 2)
                loss = per_token.sum() / tokens
                loss.backward()
                total += float(loss)
            losses.append(total)
            grads = [p for p in params if p.grad is not None]
            norms.append(float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in grads))))
            torch.nn.utils.clip_grad_norm_(grads, opt_cfg.grad_clip)
            optimizer.step()
            optimizer.zero_grad()
        out.append(
            {
                "advantages": [sum(a) / len(a) for a in token_advantages],
                "token_advantages": token_advantages,
                "vf_loss": sum(losses) / len(losses),
                "grad_norm": sum(norms) / len(norms),
                "vf_losses": losses,
                "grad_norms": norms,
            }
        )
    return out


@pytest.fixture
def critic_step_reference():
    """`_critic_step_reference(cfg, rows, images)`: step 1 of a PPO run with a critic (GAE advantages,
    the critic's value loss and grad norm), recomputed from its dumped samples."""
    return _critic_step_reference


@pytest.fixture
def critic_steps_reference():
    """`_critic_steps_reference(cfg, [(rows, images), ...])`: a PPO run's critic steps (GAE
    advantages per token and per row, value loss, gradient norm), each from the critic the
    previous step's update left."""
    return _critic_steps_reference


def _step_images(cfg, steps: int, rows: list[dict] | None = None) -> list[list]:
    """The images of each prompt of each of the first `steps` steps of a run on the colour
    squares (by the dumped rows' `prompt_index`), drawn again: the dataset's rows
    (`colour_square_rows`, by the data seed; or `rows`, the training file's, each with its
    `images`) in the order the seeded `PromptLoader` serves them, the next prompts each
    step."""
    from tephra.controller.data.colour_squares import colour_square_rows
    from tephra.controller.data.prompts import PromptLoader

    if rows is None:
        rows = colour_square_rows(cfg.data.train_size, cfg.data.train_seed)
    loader = PromptLoader(len(rows), cfg.batch.prompts_per_step, cfg.trainer.seed)
    return [[rows[i]["images"] for i in loader.next_indices()] for _ in range(steps)]


@pytest.fixture
def step_images():
    """`_step_images(cfg, steps, rows=None)`: each step's images of a colour-squares run, per
    prompt."""
    return _step_images
