"""Built-in agent loops: `single_turn` (one model turn), `environment` (any environment,
token-in-token-out) and `tool_agent` (the environment loop over the tool environment)."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any

from tephra.core.errors import ConfigError
from tephra.episodes.agent.base import AgentLoop, check_one_sample
from tephra.episodes.agent.chat_tokens import IMAGE_MARKER, ChatTemplateDelta
from tephra.episodes.agent.environment_guard import (
    ENVIRONMENT_ERROR,
    EnvironmentFailure,
    call_environment,
    item_name,
    limit_observation,
)
from tephra.episodes.environments.base import Environment, StepResult
from tephra.episodes.prompt import Prompt
from tephra.episodes.tools.base import Tool
from tephra.rollout.base import Rollout, SamplingParams
from tephra.rollout.multimodal import MultimodalInputs
from tephra.rollout.samples import Sample


@dataclass(frozen=True)
class _Run:
    """One run's sampling settings and what follows from them and its rollout."""

    sampling: SamplingParams
    max_model_len: int | None
    stop_ids: set[int]


class _TokenLoop(AgentLoop):
    """Shared parts: the chat-template renderer per tool set, the model-length budget."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deltas: dict[str, ChatTemplateDelta] = {}

    def delta_for(self, schemas: list[dict] | None) -> ChatTemplateDelta:
        """The chat-template renderer of a tool set (cached by its schemas)."""
        key = json.dumps(schemas, sort_keys=True)
        if key not in self._deltas:
            self._deltas[key] = ChatTemplateDelta(self.tokenizer, schemas)
        return self._deltas[key]

    def delta(self, tools: dict[str, Tool]) -> ChatTemplateDelta:
        schemas = [t.schema() for t in tools.values()] if self.config.render_tool_schemas else None
        return self.delta_for(schemas or None)

    def begin(self, rollout: Rollout, sampling: SamplingParams) -> _Run:
        """What one run needs to know of its rollout and sampling settings."""
        check_one_sample(sampling)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        return _Run(
            sampling,
            # a scripted test model may have no config: then no length limit but the budgets
            getattr(getattr(rollout, "config", None), "max_model_len", None),
            set(sampling.stop_token_ids) | ({eos} if eos is not None else set()),
        )

    def turn_budget(self, run: _Run, context_len: int, response_len: int) -> int:
        """max_tokens of the next model turn: the sampling cap, the trajectory's remaining
        response budget and the room left in the model's context."""
        budget = min(run.sampling.max_tokens, self.config.max_response_tokens - response_len)
        if run.max_model_len is not None:
            budget = min(budget, run.max_model_len - context_len)
        return budget

    def turn_sampling(self, run: _Run, sample_id: str, turn: int, budget: int) -> SamplingParams:
        """The sampling of one model turn: `max_tokens=budget`, and under a seeded sampling,
        after the first turn, a seed of its own drawn from the seed, the trajectory's sample
        id and the turn. The first turn keeps the trajectory's seed (`run_episodes` gives item
        k seed + k, as sample k of a `generate` call has), so a single-turn episode samples
        what `generate` would; a later turn re-using it would replay the first turn's random
        draws. A rerun repeats them all."""
        sampling = run.sampling.replace(max_tokens=budget)
        if sampling.seed is None or turn == 0:
            return sampling
        key = f"{sampling.seed}:{sample_id}:{turn}".encode()
        digest = hashlib.blake2b(key, digest_size=8).digest()
        return sampling.replace(seed=int.from_bytes(digest) >> 2)

    def text_of_turn(self, run: _Run, ids: list[int], finish_reason: str) -> tuple[str, str | None]:
        """(content, stop text): the decoded turn without its final stop token, and that token.

        The `Rollout` contract keeps the stop token as the last id of a 'stop' turn; it may be
        one of the model's EOS ids that the tokenizer does not call EOS (Qwen: <|endoftext|>)."""
        if ids and (finish_reason == "stop" or ids[-1] in run.stop_ids):
            return (
                self.tokenizer.decode(ids[:-1], skip_special_tokens=False),
                self.tokenizer.decode(ids[-1:], skip_special_tokens=False),
            )
        return self.tokenizer.decode(ids, skip_special_tokens=False), None


class SingleTurnAgentLoop(_TokenLoop):
    """One model turn; the trajectory is the generation (mask all ones)."""

    async def run(self, rollout: Rollout, sample: Prompt, sampling: SamplingParams) -> Sample:
        run = self.begin(rollout, sampling)
        delta = self.delta({})
        prompt_ids = (
            list(sample.prompt_ids) if sample.prompt_ids else delta.prompt_ids(sample.messages)
        )
        budget = self.turn_budget(run, len(prompt_ids), 0)
        if budget < 1:
            return _empty(sample, prompt_ids)
        gen = await rollout.agenerate(
            prompt_ids,
            self.turn_sampling(run, sample.sample_id, 0, budget),
            session_id=sample.sample_id,
            **_images(sample.multimodal),
        )
        content, _ = self.text_of_turn(run, gen.response_ids, gen.finish_reason)
        return Sample(
            sample_id=sample.sample_id,
            prompt_ids=prompt_ids,
            response_ids=list(gen.response_ids),
            response_mask=[1] * len(gen.response_ids),
            log_probs=list(gen.log_probs)
            if gen.log_probs is not None
            else [0.0] * len(gen.response_ids),
            num_turns=1,
            tool_calls=0,
            tool_errors=0,
            finish_reason=gen.finish_reason,
            text=content,
            messages=[*sample.messages, {"role": "assistant", "content": content}],
            token_versions=list(gen.token_versions) if gen.token_versions is not None else None,
            multimodal=sample.multimodal,
        )


def _images(multimodal: MultimodalInputs | None) -> dict[str, Any]:
    """`agenerate`'s images argument, left out without images (so that a backend without
    image support keeps serving text)."""
    return {} if multimodal is None else {"multimodal": multimodal}


@dataclass
class _Trajectory:
    """What an episode has built so far (kept outside the awaits so that a trajectory cut by
    a deadline still returns its tokens)."""

    prompt_ids: list[int]
    messages: list[dict[str, Any]]
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] | None = field(default_factory=list)  # None once a turn is untagged
    turn_rewards: list[float] = field(default_factory=list)
    turn_ends: list[int] = field(default_factory=list)  # response index of each turn's last token
    num_turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    metrics: dict[str, dict[str, float]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(float))
    )
    info: dict[str, Any] = field(default_factory=dict)
    multimodal: MultimodalInputs | None = None
    """Every image of the context so far (the prompt's, then each observation's), in order."""

    def to_sample(
        self,
        sample: Prompt,
        finish: str,
        env_reward: float | None,
        timeout_reward: str,
        extra_info: dict[str, Any],
        **fields: Any,
    ) -> Sample:
        """The trajectory as a Sample. One cut by a deadline scores 0, and under the `drop`
        policy trains nothing (its mask all 0); so does one whose environment failed (it
        reaches here only under `environment_errors=drop`)."""
        mask, dropped = self.mask, False
        if finish == ENVIRONMENT_ERROR:
            env_reward, dropped, mask = 0.0, True, [0] * len(self.mask)
        if finish in TIMEOUTS:
            env_reward = 0.0
            if timeout_reward == "drop":
                dropped, mask = True, [0] * len(self.mask)
        return Sample(
            sample_id=sample.sample_id,
            prompt_ids=self.prompt_ids,
            response_ids=self.ids,
            response_mask=mask,
            log_probs=self.log_probs,
            num_turns=self.num_turns,
            tool_calls=self.tool_calls,
            tool_errors=self.tool_errors,
            finish_reason=finish,
            text=final_answer(self.messages),
            messages=self.messages,
            env_reward=env_reward,
            dropped=dropped,
            extra_info=extra_info,
            token_versions=self.versions if self.versions is not None and self.num_turns else None,
            multimodal=self.multimodal,
            **fields,
        )

    def add_generated(self, gen: Sample) -> None:
        self.num_turns += 1
        self.ids += gen.response_ids
        self.mask += [1] * len(gen.response_ids)
        self.log_probs += (
            list(gen.log_probs) if gen.log_probs is not None else [0.0] * len(gen.response_ids)
        )
        self.versions = (
            self.versions + list(gen.token_versions)
            if self.versions is not None and gen.token_versions is not None
            else None
        )

    def add_observation(self, ids: list[int]) -> None:
        self.ids += ids
        self.mask += [0] * len(ids)
        self.log_probs += [0.0] * len(ids)
        if self.versions is not None:  # context for the next turn: the version it answers
            self.versions += [self.versions[-1]] * len(ids)


TIMEOUTS = ("tool_timeout", "turn_timeout", "trajectory_timeout")
"""Finish reasons of a trajectory cut by a deadline."""


class EnvironmentLoop(_TokenLoop):
    """The `environment` episode: any `Environment` (`config.environment`, a registered name
    or `file.py:Class`), token-in-token-out. reset -> generate -> step(decoded turn) -> append
    the observation as the chat template's token delta -> generate ..., until the environment
    says done, `max_turns`, the token budget or a deadline (`tool_timeout_s`,
    `turn_timeout_s`, `trajectory_timeout_s`: the trajectory ends with that finish reason and
    scores by `timeout_reward`). A turn cut by the per-turn cap (`sampling.max_tokens`) still
    goes to the environment (the trajectory's budget has room); one cut by the trajectory's
    budget or the model length ends the episode with `length`."""

    step_after_turn_cap = True
    """Whether a turn cut by `sampling.max_tokens` is stepped (True) or ends the episode."""

    def make_environment(self) -> Environment:
        from tephra.episodes.environments.registry import get_environment  # registry imports us

        return get_environment(self.config.environment)(
            self.tools, self.config, **self.config.environment_kwargs
        )

    async def run(self, rollout: Rollout, sample: Prompt, sampling: SamplingParams) -> Sample:
        run = self.begin(rollout, sampling)
        cfg = self.config
        env = self.make_environment()
        traj = _Trajectory(
            list(sample.prompt_ids or []), list(sample.messages), multimodal=sample.multimodal
        )
        finish = "max_turns"
        deadline = (
            asyncio.get_running_loop().time() + cfg.trajectory_timeout_s
            if cfg.trajectory_timeout_s
            else None
        )
        tool_rewards: dict[str, float] = {}
        try:
            try:
                async with asyncio.timeout_at(deadline):
                    finish = await self._turns(run, rollout, sample, env, traj)
                    if finish not in TIMEOUTS:
                        tool_rewards = await call_environment(
                            cfg.environment or type(env).__name__,
                            item_name(sample.origin, sample.sample_id),
                            "tool_rewards",
                            traj.num_turns,
                            env.tool_rewards(),
                        )
            except TimeoutError:
                finish = "trajectory_timeout"
            except EnvironmentFailure as exc:
                if cfg.environment_errors == "stop":
                    raise
                finish, traj.info["environment_error"] = ENVIRONMENT_ERROR, str(exc)
        finally:
            grace = cfg.tool_timeout_s or cfg.turn_timeout_s or cfg.trajectory_timeout_s
            try:
                await asyncio.wait_for(env.close(), grace)
            except TimeoutError:
                traj.info["close_timeout"] = grace
        return traj.to_sample(
            sample,
            finish,
            sum(traj.turn_rewards) if env.owns_reward else None,
            cfg.timeout_reward,
            {
                "tool_metrics": {k: dict(v) for k, v in traj.metrics.items()},
                **(
                    {"turn_rewards": list(traj.turn_rewards), "turn_ends": list(traj.turn_ends)}
                    if env.owns_reward
                    else {}
                ),
                **traj.info,
            },
            tool_rewards=tool_rewards,
        )

    async def _turns(  # noqa: C901 (older than the limit; to split)
        self,
        run: _Run,
        rollout: Rollout,
        sample: Prompt,
        env: Environment,
        traj: _Trajectory,
    ) -> str:
        """The episode's turns; returns its finish reason (`traj` holds what they built)."""
        cfg = self.config
        name, item = (
            cfg.environment or type(env).__name__,
            item_name(sample.origin, sample.sample_id),
        )
        observation = await call_environment(name, item, "reset", 0, env.reset(sample))
        delta = self.delta_for(env.tool_schemas())
        if not traj.prompt_ids or observation != list(sample.messages):
            if sample.multimodal is not None:
                raise ConfigError(
                    f"environment {cfg.environment or type(env).__name__}: reset returned other "
                    "messages than the item's, which has images (its prompt_ids hold them); "
                    "return the item's messages from reset and show new images from step"
                )
            traj.prompt_ids = delta.prompt_ids(observation)
        traj.messages = list(observation)
        for _ in range(cfg.max_turns):
            context = len(traj.prompt_ids) + len(traj.ids)
            budget = self.turn_budget(run, context, len(traj.ids))
            if budget < 1:
                return "length"
            try:
                async with asyncio.timeout(cfg.turn_timeout_s):
                    gen = await rollout.agenerate(
                        traj.prompt_ids + traj.ids,
                        self.turn_sampling(run, sample.sample_id, traj.num_turns, budget),
                        session_id=sample.sample_id,
                        **_images(traj.multimodal),
                    )
                    gen, sampled_slot = self.before_image_slot(gen)
                    traj.add_generated(gen)
                    content, stop_text = self.text_of_turn(run, gen.response_ids, gen.finish_reason)
                    traj.messages.append({"role": "assistant", "content": content})
                    if sampled_slot:
                        return "image_token"
                    if gen.finish_reason == "length" and not (
                        self.step_after_turn_cap and budget == run.sampling.max_tokens
                    ):
                        return "length"
                    result = await call_environment(
                        name, item, "step", traj.num_turns, env.step(content)
                    )
            except TimeoutError:
                return "turn_timeout"
            traj.turn_rewards.append(float(result.reward))
            traj.turn_ends.append(len(traj.ids) - 1)
            traj.tool_calls += int(result.info.get("tool_calls", 0))
            traj.tool_errors += int(result.info.get("tool_errors", 0))
            for tool, values in result.info.get("metrics", {}).items():
                for key, value in values.items():
                    traj.metrics[tool][key] += value
            if "timeout" in result.info:
                traj.info["timeout"] = result.info["timeout"]
            if result.done:
                return str(result.info.get("finish_reason", "done"))
            if not result.observation:
                raise ConfigError(
                    f"environment {cfg.environment or type(env).__name__}: step returned no "
                    "observation and done=False; return the messages the model answers next, "
                    "or done=True"
                )
            observation, cut = limit_observation(
                result.observation,
                cfg.max_observation_chars,
                cfg.oversize_observation,
                name,
                item,
                traj.num_turns,
            )
            if cut:
                result = replace(result, observation=observation)
                traj.info["observations_truncated"] = traj.info.get("observations_truncated", 0) + 1
            traj.messages.extend(result.observation)
            obs_ids, shown = self.observation_ids(env, delta, result, stop_text, traj.num_turns)
            room = cfg.max_response_tokens - len(traj.ids)
            if run.max_model_len is not None:
                room = min(room, run.max_model_len - len(traj.prompt_ids) - len(traj.ids))
            if shown is not None:
                if len(obs_ids) >= room:  # a cut image would leave its tokens without pixels
                    return "length"
                traj.multimodal = (
                    shown
                    if traj.multimodal is None
                    else MultimodalInputs.concat([traj.multimodal, shown])
                )
            traj.add_observation(obs_ids[: max(room, 0)])
            if len(obs_ids) >= room:  # no room left for a model token after it
                return "length"
        return "max_turns"

    def before_image_slot(self, gen: Sample) -> tuple[Sample, bool]:
        """(`gen` ended before the first image or video placeholder token it sampled, whether
        it sampled one). A sampled placeholder has no image behind it: the next turn's context
        and the training forward would count one image slot too many."""
        if self.processor is None:
            return gen, False
        slots = {self.processor.image_token_id, self.processor.video_token_id} - {None}
        n = next((i for i, t in enumerate(gen.response_ids) if t in slots), None)
        if n is None:
            return gen, False
        return replace(
            gen,
            response_ids=gen.response_ids[:n],
            response_mask=gen.response_mask[:n] if gen.response_mask is not None else None,
            log_probs=gen.log_probs[:n] if gen.log_probs is not None else None,
            token_versions=gen.token_versions[:n] if gen.token_versions is not None else None,
            finish_reason="image_token",
        ), True

    def observation_ids(
        self,
        env: Environment,
        delta: ChatTemplateDelta,
        result: StepResult,
        stop_text: str | None,
        turn: int,
    ) -> tuple[list[int], MultimodalInputs | None]:
        """(token ids, images) of the observation after model turn `turn`: each image it shows
        expanded by the processor where its `<image>` marker is. Refused, naming the turn,
        when the markers and the images differ in number or the tokens hold another number
        of image tokens than the processor's expansion (a chat template that writes its own
        image tokens, say)."""
        name = f"environment {self.config.environment or type(env).__name__}"
        where = f"{name}: the observation after model turn {turn}"
        marked = sum(
            m["content"].count(IMAGE_MARKER)
            for m in result.observation
            if isinstance(m.get("content"), str)
        )
        if marked != len(result.images):
            raise ConfigError(
                f"{where} marks {marked} image(s) with {IMAGE_MARKER} but step returned "
                f"{len(result.images)} in StepResult.images; put one {IMAGE_MARKER} in the "
                "messages' text for each image, in order"
            )
        processor = self.processor
        if processor is None:
            if result.images:
                raise ConfigError(
                    f"{where} shows {len(result.images)} image(s), but the episode has no "
                    "vision processor (the model is text-only?); use a vision-language model"
                )
            return delta.append_ids(result.observation, stop_text), None
        shown = processor.images(result.images) if result.images else None
        counts = processor.image_token_counts(shown) if shown is not None else []
        ids = delta.append_ids(
            result.observation, stop_text, [processor.image_span(n) for n in counts]
        )
        processor.check(ids, shown, where)
        return ids, shown


class ToolAgentLoop(EnvironmentLoop):
    """The `tool_agent` episode: the environment loop over the tool environment (generate ->
    parse tool calls -> run them concurrently -> append their results as tokens -> generate
    ..., until a turn has no tool call, `max_turns`, the token budget or a deadline). A turn
    cut by `sampling.max_tokens` ends it (`length`): a cut tool call cannot run."""

    step_after_turn_cap = False

    def make_environment(self) -> Environment:
        # imported here: tool_env imports `tephra.episodes.agent` (its config), whose package
        # imports this module; `import tephra.episodes.environments` first would find
        # tool_env half-initialised
        from tephra.episodes.environments.tool_env import ToolEnvironment

        return ToolEnvironment(self.tools, self.config)


def _empty(sample: Prompt, prompt_ids: list[int]) -> Sample:
    return Sample(
        sample_id=sample.sample_id,
        prompt_ids=prompt_ids,
        response_ids=[],
        response_mask=[],
        log_probs=[],
        num_turns=0,
        finish_reason="length",
        messages=list(sample.messages),
    )


def final_answer(messages: list[dict[str, Any]]) -> str:
    """The last assistant message of a transcript: what the reward scores (earlier turns are
    tool calls)."""
    return next((m["content"] for m in reversed(messages) if m.get("role") == "assistant"), "")
