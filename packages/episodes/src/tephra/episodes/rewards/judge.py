"""A generative reward model (LLM judge): a model writes a judgement of each response from a
prompt template, and a registered parser reads a score out of it.

Requests go to a rollout backend one per sample, all in flight at once (the `hf` backend
batches concurrent requests into one `generate`; the `vllm` backend sends them to a vLLM
server, started for the judge or already running at `reward.judge.vllm.url`); each has its
own timeout. A request that
times out, fails, or whose judgement the parser cannot read scores `fallback_score`, is
counted (`JudgeStats`) and logged once per kind of failure.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import string
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, cast

from tephra.core.errors import ConfigError
from tephra.core.registry import Registry, check_registered
from tephra.episodes.rewards.results import RewardError, RewardInput
from tephra.rollout import (
    ROLLOUT_BACKENDS,
    RolloutConfig,
    SamplingParams,
    ServerLaunch,
    ServerSettings,
    get_rollout,
)
from tephra.rollout.base import DTYPES

if TYPE_CHECKING:
    from tephra.rollout.base import Rollout

logger = logging.getLogger(__name__)

Parser = Callable[[str], float]
AsyncJudge = Callable[[str], Awaitable[str]]
"""Judge prompt text -> the judge's judgement text."""

JUDGE_PARSERS: Registry[Parser] = Registry("judge score parser")
"""Parser name -> function from a judgement text to a score (raises JudgeParseError)."""

TEMPLATE_FIELDS = ("prompt", "response", "ground_truth", "data_source")
DEFAULT_TEMPLATE = (
    "Rate the answer to the question from 0 to 10.\n"
    "Question: {prompt}\nReference answer: {ground_truth}\nAnswer: {response}\n"
    "Reply with the rating as <score>N</score>."
)


class JudgeParseError(RewardError):
    """The parser found no score in a judgement."""


_NUMBER = r"-?\d+(?:\.\d+)?"


@JUDGE_PARSERS.register("score_tag")
def parse_score_tag(text: str) -> float:
    """The number in the last `<score>N</score>` of the text."""
    found = re.findall(rf"<score>\s*({_NUMBER})\s*</score>", text)
    if not found:
        raise JudgeParseError(f"no <score>N</score> in the judgement {text[-200:]!r}")
    return float(found[-1])


@JUDGE_PARSERS.register("last_number")
def parse_last_number(text: str) -> float:
    """The last number in the text."""
    found = re.findall(_NUMBER, text)
    if not found:
        raise JudgeParseError(f"no number in the judgement {text[-200:]!r}")
    return float(found[-1])


@JUDGE_PARSERS.register("yes_no")
def parse_yes_no(text: str) -> float:
    """1.0 when the first `yes` / `no` word of the text is yes, 0.0 when it is no."""
    found = re.search(r"\b(yes|no)\b", text, flags=re.IGNORECASE)
    if found is None:
        raise JudgeParseError(f"no yes / no in the judgement {text[-200:]!r}")
    return 1.0 if found.group(1).lower() == "yes" else 0.0


@dataclass
class JudgeConfig:
    """The LLM judge of `reward.judge`: which model, how it is asked, how its answer is read,
    and how its score mixes with the rule scorer's."""

    model_path: str | None = None
    """Local Hugging Face folder of the judge model; None (default): no judge."""
    backend: str = "hf"
    """Rollout backend that serves the judge: `hf` (in the process that scores), `vllm` (a
    vLLM server: started by the process that scores, or the running one(s) at
    `reward.judge.vllm.url`, shared by every rank; the PPO trainer starts one for the run and
    hands its URL to every scoring rank)."""
    dtype: str = "float32"
    """The judge's generation dtype (`float32`, `bfloat16`, `float16`): float32 keeps greedy
    judgements equal across backends on CPU; bfloat16 halves a GPU judge's memory."""
    vllm: ServerLaunch = field(default_factory=ServerLaunch)
    """The judge's vLLM server (backend `vllm`): `url` to use a running one, else `python`
    (the vLLM environment), `startup_timeout_s`, ... as `rollout.vllm`, less the weight-update
    and sleep settings (the judge's weights never change)."""
    prompt_template: str = DEFAULT_TEMPLATE
    """str.format template of the judge's prompt; fields {prompt}, {response},
    {ground_truth}, {data_source}; must hold {response}."""
    chat_template: bool = True
    """Wrap the prompt as one user turn with the judge tokenizer's chat template (when it
    has one)."""
    parser: str = "score_tag"
    """Name in `JUDGE_PARSERS` that reads the score out of the judgement."""
    score_scale: float = 1.0
    """The parsed number is multiplied by this (e.g. 0.1 maps a 0-10 rating to 0-1)."""
    max_new_tokens: int = 64
    """Tokens the judge may write per judgement."""
    temperature: float = 0.0
    """Sampling temperature of the judge; 0: greedy, so a judgement is reproducible."""
    timeout_s: float = 60.0
    """Seconds one judgement request may take; a later one scores `fallback_score` and is
    counted as a timeout (`reward/judge_timeouts`)."""
    fallback_score: float = 0.0
    """Judge score of a sample whose request timed out or failed, or whose judgement the
    parser could not read (counted: `reward/judge_fallbacks`)."""
    max_model_len: int = 4096
    """Tokens of prompt + judgement the judge backend accepts; longer prompts are cut from
    the left."""
    data_sources: list[str] | None = None
    """data_sources the judge scores; None: every one. Others keep their rule score."""
    judge_weight: float = 1.0
    """Weight of the judge's score in a judged sample's reward."""
    rule_weight: float = 0.0
    """Weight of the rule scorer's score in a judged sample's reward; 0 (default): the judge
    alone, and the rule scorer is not called (a data_source then needs no rule scorer)."""
    source_weights: dict[str, list[float]] = field(default_factory=dict)
    """data_source -> [rule_weight, judge_weight], overriding the two above per source, e.g.
    {gsm8k: [1.0, 0.2]}: reward = 1.0 * rule + 0.2 * judge."""

    @property
    def enabled(self) -> bool:
        return self.model_path is not None

    def judges(self, data_source: str) -> bool:
        """Whether samples of `data_source` are judged (where there is a judge)."""
        return self.data_sources is None or data_source in self.data_sources

    def weights(self, data_source: str) -> tuple[float, float]:
        """(rule weight, judge weight) of `data_source`."""
        w = self.source_weights.get(data_source)
        return (self.rule_weight, self.judge_weight) if w is None else (float(w[0]), float(w[1]))

    def _check_server(self) -> None:
        """`reward.judge.vllm` as a `ServerLaunch` (YAML gives a dict), and the backend's own
        check of its settings."""
        if isinstance(self.vllm, dict):
            known = {f.name for f in fields(ServerLaunch)}
            unknown = sorted(set(self.vllm) - known)
            if unknown:
                raise ConfigError(
                    f"reward.judge.vllm: unknown fields {unknown}; the judge's weights never "
                    "change, so its server takes no weight-update or sleep settings (valid: "
                    f"{sorted(known)})"
                )
            self.vllm = ServerLaunch(**self.vllm)
        check_registered("reward.judge.backend", self.backend, ROLLOUT_BACKENDS)
        protocol = getattr(ROLLOUT_BACKENDS.get(self.backend), "protocol_class", None)
        if protocol is not None:
            settings = getattr(self, self.backend, None)
            if not isinstance(settings, ServerLaunch):
                raise ConfigError(
                    f"reward.judge.backend={self.backend!r}: the judge has settings for the "
                    "hf and vllm backends only; choose one of them"
                )
            try:
                protocol().check_settings(ServerSettings.of_launch(settings))
            except ConfigError as exc:
                raise ConfigError(f"reward.judge.{exc}") from None

    def __post_init__(self) -> None:
        self._check_server()
        if self.dtype not in DTYPES:
            raise ConfigError(
                f"reward.judge.dtype={self.dtype!r} is not allowed; choose one of {list(DTYPES)}"
            )
        if not self.parser:
            raise ConfigError(
                f"reward.judge.parser={self.parser!r}: a judge needs a parser to read its "
                f"score; choose one of {JUDGE_PARSERS.names()}"
            )
        if self.parser not in JUDGE_PARSERS:
            raise ConfigError(
                f"reward.judge.parser={self.parser!r} is not registered; choose one of "
                f"{JUDGE_PARSERS.names()} or register one with JUDGE_PARSERS.register(name, fn)"
            )
        names = {f for _, f, _, _ in string.Formatter().parse(self.prompt_template) if f}
        unknown = sorted(names - set(TEMPLATE_FIELDS))
        if unknown or "response" not in names:
            raise ConfigError(
                "reward.judge.prompt_template: "
                + (f"unknown fields {unknown}; " if unknown else "")
                + ("it must hold {response}; " if "response" not in names else "")
                + f"the fields are {list(TEMPLATE_FIELDS)}"
            )
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ConfigError(
                f"reward.judge.timeout_s={self.timeout_s} must be a finite number > 0"
            )
        if self.max_new_tokens < 1 or self.max_model_len <= self.max_new_tokens:
            raise ConfigError(
                f"reward.judge.max_new_tokens={self.max_new_tokens} must be >= 1 and below "
                f"reward.judge.max_model_len={self.max_model_len}"
            )
        if self.temperature < 0:
            raise ConfigError(f"reward.judge.temperature={self.temperature} must be >= 0")
        for source, w in self.source_weights.items():
            if not (isinstance(w, (list, tuple)) and len(w) == 2):
                raise ConfigError(
                    f"reward.judge.source_weights[{source!r}]={w!r} must be two numbers "
                    "[rule_weight, judge_weight]"
                )
        if self.data_sources is not None and not self.data_sources:
            raise ConfigError(
                "reward.judge.data_sources=[] judges nothing; give the data_sources to judge, "
                "or null for all"
            )


@dataclass
class JudgeStats:
    """What happened to the judge's requests of one batch."""

    requests: int = 0
    """Samples sent to the judge."""
    timeouts: int = 0
    """Requests that did not finish within `timeout_s`."""
    errors: int = 0
    """Requests that raised (backend failure)."""
    parse_failures: int = 0
    """Judgements in which the parser found no score."""

    @property
    def fallbacks(self) -> int:
        """Samples that scored `fallback_score`."""
        return self.timeouts + self.errors + self.parse_failures


class GenerativeJudge:
    """Scores `RewardInput`s with an LLM judge; `ask` (judge prompt -> judgement) is the
    configured backend's, or any async function given (a scripted judge, a remote API)."""

    def __init__(self, config: JudgeConfig, ask: AsyncJudge | None = None) -> None:
        if not config.enabled and ask is None:
            raise ConfigError("reward.judge.model_path is not set; there is no judge to build")
        self.config = config
        self._parser = JUDGE_PARSERS.get(config.parser)
        self._rollout: Rollout | None = None
        self._tokenizer: Any = None  # a transformers tokenizer, loaded with the judge model
        self._given = ask
        self._ask: AsyncJudge | None = ask if ask is not None else self._build_backend()
        self._logged: set[str] = set()
        self.last_stats = JudgeStats()
        """Stats of the latest `score` call."""
        self.last_status: list[str] = []
        """Of each item of the latest `score` call: `ok`, `timeout`, `error` or `unparsed`
        (all but `ok` scored the fallback)."""

    def _build_backend(self) -> AsyncJudge:
        # transformers only where a judge model is used (the reward package works without)
        from transformers import AutoTokenizer

        cfg = self.config
        self._tokenizer = AutoTokenizer.from_pretrained(cfg.model_path)
        self._rollout = get_rollout(
            cfg.backend,
            RolloutConfig(
                model_path=cast(str, cfg.model_path),  # validated: set when no `ask` is given
                dtype=cfg.dtype,
                max_model_len=cfg.max_model_len,
                vllm=ServerSettings.of_launch(cfg.vllm),
            ),
        )
        eos = self._tokenizer.eos_token_id
        sampling = SamplingParams(
            temperature=cfg.temperature,
            max_tokens=cfg.max_new_tokens,
            stop_token_ids=() if eos is None else (int(eos),),
            logprobs=False,
            seed=0,
        )
        budget = cfg.max_model_len - cfg.max_new_tokens

        async def ask(text: str) -> str:
            tok = self._tokenizer
            if cfg.chat_template and tok.chat_template:
                ids = tok.apply_chat_template(
                    [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
                )
            else:
                ids = tok(text)["input_ids"]
            sample = await cast("Rollout", self._rollout).agenerate(list(ids)[-budget:], sampling)
            return tok.decode(sample.response_ids, skip_special_tokens=True)

        return ask

    def prompt(self, item: RewardInput) -> str:
        """The judge's prompt for `item`."""
        return self.config.prompt_template.format(
            prompt=item.prompt_str,
            response=item.solution_str,
            ground_truth="" if item.ground_truth is None else item.ground_truth,
            data_source=item.data_source,
        )

    def score(self, items: Sequence[RewardInput]) -> list[float]:
        """One judge score per item (scaled; `fallback_score` where the judge failed);
        `last_stats` then counts the failures."""
        if self._ask is None:  # closed: the backend starts again
            self._ask = self._build_backend()
        stats = JudgeStats(requests=len(items))
        status = ["ok"] * len(items)
        outcome: dict[str, Any] = {}

        # a thread of its own: the caller may already run an event loop
        def run() -> None:
            try:
                outcome["scores"] = asyncio.run(self._score_all(list(items), stats, status))
            except BaseException as exc:  # noqa: BLE001  (re-raised below)
                outcome["error"] = exc

        thread = threading.Thread(target=run, name="reward-judge", daemon=True)
        thread.start()
        thread.join()
        if "error" in outcome:
            raise outcome["error"]
        self.last_stats, self.last_status = stats, status
        if stats.fallbacks:
            logger.warning(
                "reward judge: %d of %d samples scored the fallback %g (timeouts %d, errors "
                "%d, unparsed %d)",
                stats.fallbacks,
                stats.requests,
                self.config.fallback_score,
                stats.timeouts,
                stats.errors,
                stats.parse_failures,
            )
        return outcome["scores"]

    async def _score_all(
        self, items: list[RewardInput], stats: JudgeStats, status: list[str]
    ) -> list[float]:
        return list(
            await asyncio.gather(
                *(self._score_one(k, i, stats, status) for k, i in enumerate(items))
            )
        )

    async def _score_one(
        self, k: int, item: RewardInput, stats: JudgeStats, status: list[str]
    ) -> float:
        cfg = self.config
        try:
            text = await asyncio.wait_for(
                cast(AsyncJudge, self._ask)(self.prompt(item)),
                cfg.timeout_s,  # set by `score`
            )
        except TimeoutError:
            stats.timeouts += 1
            status[k] = "timeout"
            self._log_once(
                "timeout",
                f"a judge request took over reward.judge.timeout_s="
                f"{cfg.timeout_s:g} s (data_source {item.data_source!r})",
            )
            return cfg.fallback_score
        except Exception as exc:  # noqa: BLE001  (a failed request scores the fallback)
            stats.errors += 1
            status[k] = "error"
            self._log_once("error", f"a judge request raised {type(exc).__name__}: {exc}")
            return cfg.fallback_score
        try:
            return self._parser(text) * cfg.score_scale
        except Exception as exc:  # noqa: BLE001  (an unreadable judgement scores the fallback)
            stats.parse_failures += 1
            status[k] = "unparsed"
            self._log_once("parse", f"parser {cfg.parser!r} failed: {exc}")
            return cfg.fallback_score

    def _log_once(self, kind: str, message: str) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            logger.error(
                "reward judge: %s; it scores the fallback, later ones are counted", message
            )

    def close(self) -> None:
        """Release the judge's backend (a later `score` starts it again)."""
        if self._rollout is not None:
            self._rollout.close()
            self._rollout = None
            self._ask = self._given
