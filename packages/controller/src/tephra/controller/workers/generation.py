"""Generation on a worker: the rollout engine driven by the configured episode, and the
background scoring of what it generated.

Both the training worker (`RLWorker`, colocated) and a rollout replica hold one `Generator`.
Without `rollout.agent_loop` a step's prompts go through the backend's batched `generate`
(the batched form of the `single_turn` episode: the same samples, one call); with one, each
prompt x sample runs the episode registered under that name (`tephra.episodes.registry`).
Scoring starts in a background thread right after generation, so the log-prob passes that
follow run while the scorer works (`collect_scores` waits for it). With a reward pool
(`resources.reward`) that thread sends the samples to one rank of the pool (`reward_actor`),
which scores them with its own scorer (`score_inputs`): each sample is scored once, and the
reward models live in the pool's processes only.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any, cast

import ray
from transformers import AutoConfig, AutoTokenizer

from tephra.controller.config.tree import PPOConfig
from tephra.controller.samples import Prompt, RewardResult, Sample, Scores
from tephra.controller.step.scoring import Scorer, reward_inputs
from tephra.engine_api.multimodal import image_token_id, is_vision_config, video_token_id
from tephra.episodes.episode import Episode, by_agent_name, run_episodes, run_to_completion
from tephra.episodes.registry import EPISODES
from tephra.episodes.rewards import RewardInput
from tephra.episodes.tools import close_tools, load_tools
from tephra.rollout.base import Rollout, RolloutConfig, SamplingParams, ServerSettings
from tephra.rollout.multimodal import VisionProcessor
from tephra.rollout.registry import get_rollout


def run_items(
    episode: Episode,
    rollout: Rollout,
    items: list[Prompt],
    sampling: SamplingParams,
    max_in_flight: int | None = None,
) -> list[Sample]:
    """Run `episode` on every item concurrently; its samples, in the order of `items`."""
    # The hf backend generates on its own thread, so a fresh event loop per call is fine; a
    # thread still blocked past its deadline (a tool, a sync agent) is not waited for.
    return run_to_completion(run_episodes(episode, rollout, items, sampling, max_in_flight))


def tokens(prompt: Prompt) -> list[int]:
    """The prompt's token ids (the trainer tokenises every prompt it sends)."""
    if prompt.prompt_ids is None:
        raise ValueError(f"prompt {prompt.sample_id!r} was sent untokenised; set prompt_ids")
    return prompt.prompt_ids


def end_before_token(sample: Sample, token: int, tokenizer: Any) -> Sample:
    """`sample` with its response ended before the first `token` it sampled (unchanged
    without one), finish reason `image_token`. For an image placeholder (`<|image_pad|>`, `<image>`): a
    sampled one has no image behind it, and the training forward would take it for one more
    image slot and fail (image tokens != image features); the tokens before it keep their
    log-probs (causal), those from it on are dropped."""
    if token not in sample.response_ids:
        return sample
    n = sample.response_ids.index(token)
    ids = sample.response_ids[:n]
    return replace(
        sample,
        response_ids=ids,
        response_mask=cast(list[int], sample.response_mask)[:n],  # filled by __post_init__
        log_probs=sample.log_probs[:n] if sample.log_probs is not None else None,
        token_versions=(sample.token_versions[:n] if sample.token_versions is not None else None),
        finish_reason="image_token",
        text=tokenizer.decode(ids, skip_special_tokens=True),
    )


class Generator:
    """A worker's generation part (module docstring). `rollout` is None on a rank that
    generates nothing (a rollout tensor-parallel peer, a reference or critic pool)."""

    def __init__(
        self,
        cfg: PPOConfig,
        model_path: str,
        tools_file: str | None,
        rollout: Rollout | None,
        reward_actor: Any = None,
    ) -> None:
        """`reward_actor`: the Ray actor of the reward-pool rank that scores this part's
        samples (`resources.reward`); None: they are scored here."""
        self.cfg, self.model_path, self.tools_file, self.rollout = (
            cfg,
            model_path,
            tools_file,
            rollout,
        )
        self.reward_actor = reward_actor
        self._tokenizer: Any = None
        self._model_config: Any = None
        self._tools: dict | None = None
        self._episode: Episode | None = None
        self._scoring: Future | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward")
        self._scorer: Scorer | None = None

    @classmethod
    def build(
        cls,
        cfg: PPOConfig,
        model_path: str,
        tools_file: str | None,
        device: str,
        with_rollout: bool,
        reward_actor: Any = None,
        server: ServerSettings | None = None,
    ) -> Generator:
        """The part with a rollout engine of `rollout.backend` on `device` when
        `with_rollout` (this process generates), else without one; `reward_actor` as in
        `__init__`; `server`: a server backend's settings resolved for where it runs (a
        colocated GPU server's: `colocated_server`), else the config's."""
        rollout = None
        if with_rollout:
            r = cfg.rollout
            rollout = get_rollout(
                r.backend,
                RolloutConfig(
                    model_path=model_path,
                    dtype=r.dtype,
                    max_model_len=cfg.data.max_prompt_tokens + r.response_budget + 8,
                    seed=cfg.trainer.seed,
                    hf=replace(r.hf, device=device),
                    vllm=server if server is not None and r.backend == "vllm" else r.vllm,
                    sglang=server if server is not None and r.backend == "sglang" else r.sglang,
                    # routing replay: the rollout records each token's experts (an agent
                    # loop's episodes are recorded whole, once they end: `_record_routes`)
                    record_routes=cfg.actor.moe.replays and not cfg.rollout.uses_agent_loop,
                    # adapter-only syncs (actor.lora_sync): a server starts with LoRA on
                    max_lora_rank=cfg.actor.lora.rank if cfg.adapter_sync else 0,
                ),
            )
        return cls(cfg, model_path, tools_file, rollout, reward_actor)

    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            tok = AutoTokenizer.from_pretrained(self.model_path)
            if tok.pad_token_id is None:
                tok.pad_token = tok.eos_token
            self._tokenizer = tok
        return self._tokenizer

    def model_config(self) -> Any:
        """The model folder's transformers config, read once (its image and video token ids)."""
        if self._model_config is None:
            self._model_config = AutoConfig.from_pretrained(self.model_path)
        return self._model_config

    def generate(self, items: list[Prompt], sampling: Any, score: bool = True) -> list[Sample]:
        """`sampling.n` samples of each prompt (prompt-major), through the episode when one
        is configured. Scoring starts in the background (`collect_scores` returns the scores);
        `score=False` skips it. Without a rollout engine or prompts: no samples."""
        if self.rollout is None or not items:
            self._scoring = self._pool.submit(lambda: Scores([], 0.0)) if score else None
            return []
        self.rollout.wake_up()
        samples = (
            self._generate_episodes(items, sampling)
            if self.cfg.rollout.uses_agent_loop
            else self._generate_plain(items, sampling)
        )
        if self.cfg.rollout.sleep_when_training and self.cfg.resources.rollout.replicas == 0:
            self.rollout.sleep()  # a replica's pool trains nothing: it stays awake
        if score:
            prompts = [items[i // sampling.n] for i in range(len(samples))]
            self._scoring = self._pool.submit(self._score, samples, prompts)
        return samples

    def _generate_plain(self, items: list[Prompt], sampling: Any) -> list[Sample]:
        assert self.rollout is not None  # `generate` returned early without one
        images = [i.multimodal for i in items]
        # text prompts keep the backends' plain signature (SGLang takes no images)
        extra = {"multimodal": images} if any(m is not None for m in images) else {}
        out = self.rollout.generate([list(tokens(i)) for i in items], sampling, **extra)
        tok = self.tokenizer()
        samples = out.samples
        for k, sample in enumerate(samples):
            sample.text = tok.decode(sample.response_ids, skip_special_tokens=True)
            sample.sample_id = items[k // sampling.n].sample_id
            sample.multimodal = images[k // sampling.n]
        if extra:  # a vision-language model (hf or vllm): its config has the ids
            config = self.model_config()
            samples = [end_before_token(s, image_token_id(config), tok) for s in samples]
            video_token = video_token_id(config)  # a sampled video slot fails the same way
            if video_token is not None:
                samples = [end_before_token(s, video_token, tok) for s in samples]
        return samples

    def _generate_episodes(self, items: list[Prompt], sampling: Any) -> list[Sample]:
        if self._tools is None:
            self._tools = load_tools(self.tools_file) if self.tools_file else {}
        r = self.cfg.rollout
        assert self.rollout is not None and r.agent_loop is not None  # `generate` checked both
        if self._episode is None:
            tok, tools = self.tokenizer(), self._tools
            # a vision-language model's episodes expand the images environments show
            vision = (
                {
                    "processor": VisionProcessor.from_pretrained(
                        self.model_path, self.cfg.data.max_frames
                    )
                }
                if is_vision_config(self.model_config())
                else {}
            )
            self._episode = by_agent_name(
                r.agent_loop, lambda name: EPISODES.get(name)(tok, r.agent, tools, **vision)
            )
        episode = self._episode
        # each trajectory gets its own id and its own copies of what an episode may write to
        expanded = [
            replace(
                i,
                sample_id=f"{i.sample_id}-{k}",
                messages=list(i.messages),
                prompt_ids=list(tokens(i)),
                extra_info=dict(i.extra_info),
                tool_kwargs=dict(i.tool_kwargs),
                interaction_kwargs=dict(i.interaction_kwargs),
            )
            for i in items
            for k in range(sampling.n)
        ]
        samples = run_items(episode, self.rollout, expanded, sampling.replace(n=1), r.max_in_flight)
        if self.cfg.actor.moe.replays:
            self._record_routes(samples)
        return samples

    def _record_routes(self, samples: list[Sample]) -> None:
        """Routing replay with an agent loop: each episode's experts per token, prompt, every
        turn and the tool outputs between them, from one forward of the rollout's model over
        the whole sequence (as the hf backend records a single turn), so the trainer sees
        routes for exactly the tokens of its batch row."""
        assert self.rollout is not None
        routes = self.rollout.record_routes([s.prompt_ids + s.response_ids for s in samples])
        for sample, r in zip(samples, routes):
            sample.routed_experts = r

    def _score(self, samples: list[Sample], prompts: list[Prompt]) -> Scores:
        """Scores of `samples`: an environment's own reward (`Sample.env_reward`) where the
        episode set one, the reward scorer on the others."""
        start = time.perf_counter()
        todo = [i for i, s in enumerate(samples) if s.env_reward is None]
        rewards = [
            RewardResult(float(s.env_reward if s.env_reward is not None else 0.0)) for s in samples
        ]
        if todo:
            prompt_texts = None
            if self.cfg.reward.reward_model_path or self.cfg.reward.judge.enabled:
                tok = self.tokenizer()  # a reward model and a judge read the prompt too
                prompt_texts = [
                    tok.decode(samples[i].prompt_ids, skip_special_tokens=True) for i in todo
                ]
            inputs = reward_inputs(
                [samples[i].text for i in todo], [prompts[i] for i in todo], prompt_texts
            )
            if self.reward_actor is not None:  # the reward pool's rank scores them
                scored = ray.get(self.reward_actor.execute.remote("score_inputs", inputs))
            else:
                scored = self.score_inputs(inputs)
            for i, reward in zip(todo, scored, strict=True):
                rewards[i] = reward
        return Scores(rewards, time.perf_counter() - start)

    def score_inputs(self, inputs: list[RewardInput]) -> list[RewardResult]:
        """The reward of each input with this process's scorer (built on first use: the
        reward model or judge loads here)."""
        if self._scorer is None:
            self._scorer = Scorer(self.cfg.reward)
        return self._scorer.manager.score_batch(inputs)

    def collect_scores(self) -> Scores:
        """The reward of each sample of the last `generate`, in order, and the seconds
        scoring took; waits for the background scorer."""
        if self._scoring is None:
            raise RuntimeError("collect_scores called without a scored generate before it")
        scores = self._scoring.result()
        self._scoring = None
        return scores

    def close(self) -> None:
        """Stop the rollout engine, the scorer thread, the scorer and the episode's tools (MCP servers and
        their processes, sandbox folders)."""
        try:
            if self.rollout is not None:
                self.rollout.close()
            self._pool.shutdown(wait=False, cancel_futures=True)
            if self._scorer is not None:  # its worker pool and judge backend
                self._scorer.manager.close()
        finally:
            if self._tools:
                tools, self._tools = self._tools, {}
                close_tools(tools.values())
