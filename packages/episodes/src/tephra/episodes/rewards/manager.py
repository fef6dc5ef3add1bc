"""Scoring a batch of responses: pick each item's scorer, run the scorers in parallel, count
and log the ones that fail."""

from __future__ import annotations

import logging
import math
import multiprocessing
import pickle
import threading
import time
import traceback
from collections import Counter, defaultdict
from collections.abc import Sequence
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any, cast

from tephra.core.errors import RegistryError
from tephra.core.registry import unknown_name_message
from tephra.episodes.rewards.config import RewardConfig
from tephra.episodes.rewards.custom_function import FileRewardFunction
from tephra.episodes.rewards.judge import AsyncJudge, GenerativeJudge, JudgeStats
from tephra.episodes.rewards.results import (
    RewardError,
    RewardInput,
    RewardResult,
    RewardTimeout,
    normalize_score,
)
from tephra.episodes.rewards.scorer_registry import REWARD_SCORERS, Scorer

logger = logging.getLogger(__name__)

CUSTOM_SCORER_NAME = "custom"
PROCESS_POOL_PRELOAD = ("tephra.episodes.rewards", "math_verify", "reasoning_gym")
"""Modules the process pool's fork server imports once, before it forks workers (a module
that fails to import is skipped; the worker then imports it on first use)."""
REWARD_MODEL_SCORER_NAME = "reward_model"
JUDGE_SCORER_NAME = "judge"


class RewardScoringError(RewardError):
    """A scorer raised while `raise_on_error=True`."""


@dataclass
class RewardReport:
    """What happened while scoring one batch."""

    num_items: int = 0
    """Items scored."""
    items_by_source: dict[str, int] = field(default_factory=dict)
    """data_source -> items in the batch."""
    errors_by_source: dict[str, int] = field(default_factory=dict)
    """data_source -> items whose scorer raised (they scored 0.0); only sources with errors."""
    mean_score_by_source: dict[str, float] = field(default_factory=dict)
    """data_source -> mean score of its items (failed items count as 0.0)."""
    timeouts_by_source: dict[str, int] = field(default_factory=dict)
    """data_source -> items whose scorer did not return within `reward.timeout_s` (they
    scored 0.0 and are among the errors too); only sources with timeouts."""
    clipped: int = 0
    """Items whose score `reward.clip` moved into its range."""
    seconds: float = 0.0
    """Wall-clock time of `score_batch`."""
    judge_requests: int = 0
    """Samples the LLM judge scored (`reward.judge`)."""
    judge_timeouts: int = 0
    """Judge requests over `reward.judge.timeout_s` (they scored the fallback)."""
    judge_fallbacks: int = 0
    """Samples whose judge score is the fallback (timeouts, failed requests, unparsed
    judgements)."""

    @property
    def num_errors(self) -> int:
        return sum(self.errors_by_source.values())

    @property
    def num_timeouts(self) -> int:
        return sum(self.timeouts_by_source.values())

    def as_metrics(self, prefix: str = "reward") -> dict[str, float]:
        """Flat metrics for a tracker: `{prefix}/score/<source>`, `{prefix}/errors/<source>`,
        `{prefix}/errors`, `{prefix}/timeouts`, `{prefix}/clipped`, `{prefix}/seconds`."""
        metrics = {
            f"{prefix}/score/{source}": mean for source, mean in self.mean_score_by_source.items()
        }
        metrics.update(
            {f"{prefix}/errors/{source}": float(n) for source, n in self.errors_by_source.items()}
        )
        metrics[f"{prefix}/errors"] = float(self.num_errors)
        metrics[f"{prefix}/timeouts"] = float(self.num_timeouts)
        metrics[f"{prefix}/clipped"] = float(self.clipped)
        metrics[f"{prefix}/seconds"] = self.seconds
        if self.judge_requests:
            metrics[f"{prefix}/judge_timeouts"] = float(self.judge_timeouts)
            metrics[f"{prefix}/judge_fallbacks"] = float(self.judge_fallbacks)
        return metrics


def resolve_scorer(
    data_source: str,
    scorer_overrides: dict[str, str] | None = None,
    prefix_scorers: dict[str, str] | None = None,
) -> tuple[str, Scorer]:
    """(scorer name, scorer) for `data_source`: an override, else the registered name, else
    the longest matching prefix; otherwise RegistryError listing the registered scorers."""
    overrides = scorer_overrides or {}
    prefixes = {"reasoning_gym/": "reasoning_gym"} if prefix_scorers is None else prefix_scorers
    if data_source in overrides:
        name = overrides[data_source]
    elif data_source in REWARD_SCORERS:
        name = data_source
    else:
        matching = [prefix for prefix in prefixes if data_source.startswith(prefix)]
        if not matching:
            known = REWARD_SCORERS.names() + [f"{prefix}<anything>" for prefix in prefixes]
            raise RegistryError(
                unknown_name_message("reward data_source", data_source, known)
                + ". Register a scorer with REWARD_SCORERS.register(name, fn), map the data_source "
                "with reward.scorer_overrides, or set reward.custom_function_path"
            )
        name = prefixes[max(matching, key=len)]
    return name, REWARD_SCORERS.get(name)


def compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> Any:
    """verl's `default_compute_score`: the registered scorer of `data_source`, called once."""
    _, scorer = resolve_scorer(data_source)
    return scorer(data_source, solution_str, ground_truth, extra_info)


def is_timeout(error: str | None) -> bool:
    """Whether a `RewardResult.error` (`Type: message`) is a `RewardTimeout`."""
    return error is not None and error.startswith(f"{RewardTimeout.__name__}:")


def clip_scores(results: list[RewardResult], clip: tuple[float, float] | None) -> int:
    """Clip each result's score into `clip` ([low, high]) in place; returns how many moved."""
    if clip is None:
        return 0
    low, high = clip
    moved = 0
    for result in results:
        clipped = min(max(result.score, low), high)
        if clipped != result.score:
            result.score, result.clipped, moved = clipped, True, moved + 1
    return moved


@dataclass(frozen=True)
class Deadline:
    """A batch's limit for its scoring as a whole: `at` is a `time.time()` instant (wall
    clock, so that process-pool workers read the same instant), `step_timeout_s` the
    configured length it came from (for the message)."""

    at: float
    step_timeout_s: float

    def left(self) -> float:
        return self.at - time.time()


def _call_scorer(
    scorer: Scorer,
    scorer_name: str,
    item: RewardInput,
    timeout_s: float | None,
    deadline: Deadline | None = None,
) -> Any:
    """`scorer(item)`, bounded by `timeout_s` and by what is left of the batch's `deadline`
    when set: the call runs on a daemon thread that is abandoned when late (Python cannot
    stop a thread; it ends with the process). Past the deadline the scorer is not called."""
    args = (item.data_source, item.solution_str, item.ground_truth, item.extra_info)
    step_late = RewardTimeout(
        f"scorer {scorer_name!r} on data_source {item.data_source!r}: not scored before the "
        f"batch's deadline reward.step_timeout_s="
        f"{deadline.step_timeout_s if deadline else 0:g} s; fix the scorer's loop, or raise "
        "reward.step_timeout_s (null: no deadline for the batch)"
    )
    if deadline is not None and deadline.left() <= 0:
        raise step_late
    if timeout_s is None and deadline is None:
        return scorer(*args)
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = scorer(*args)
        except BaseException as exc:  # noqa: BLE001  (re-raised in the caller's thread)
            outcome["error"] = exc

    thread = threading.Thread(target=target, name="reward-call", daemon=True)
    thread.start()
    left = deadline.left() if deadline is not None else math.inf
    thread.join(left if timeout_s is None else min(left, timeout_s))  # one of them is finite
    if thread.is_alive():
        if timeout_s is None or left < timeout_s:
            raise step_late
        raise RewardTimeout(
            f"scorer {scorer_name!r} did not return within reward.timeout_s={timeout_s:g} s on "
            f"data_source {item.data_source!r}; fix the scorer's loop, or raise reward.timeout_s"
        )
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _score_one(
    scorer: Scorer,
    scorer_name: str,
    item: RewardInput,
    timeout_s: float | None = None,
    deadline: Deadline | None = None,
) -> tuple[RewardResult, str | None]:
    """Score one item, turning an exception into (0.0 with its message, formatted traceback).

    Module-level so that process-pool workers can run it; the traceback travels as text
    because exceptions of user code are not always picklable.
    """
    try:
        value = _call_scorer(scorer, scorer_name, item, timeout_s, deadline)
        return normalize_score(value, scorer_name), None
    except Exception as exc:
        return RewardResult(score=0.0, error=f"{type(exc).__name__}: {exc}"), traceback.format_exc()


def _score_chunk(
    scorer_names: list[str],
    scorers: list[Scorer],
    items: list[RewardInput],
    timeout_s: float | None = None,
    deadline: Deadline | None = None,
) -> list[tuple[RewardResult, str | None]]:
    return [
        _score_one(s, n, i, timeout_s, deadline)
        for s, n, i in zip(scorers, scorer_names, items, strict=True)
    ]


class RewardManager:
    """Scores batches of `RewardInput` as the config says; holds the worker pool.

    Use as a context manager (or call `close()`) to shut the pool down.
    """

    def __init__(
        self, config: RewardConfig | None = None, judge_ask: AsyncJudge | None = None
    ) -> None:
        """`judge_ask`: the judge as an async function (judge prompt -> judgement), in place
        of the model `reward.judge.model_path` names (a scripted or remote judge)."""
        self.config = config or RewardConfig()
        self._judge: GenerativeJudge | None = None
        if self.config.judge.enabled or judge_ask is not None:
            self._judge = GenerativeJudge(self.config.judge, judge_ask)
        self._custom: FileRewardFunction | None = None
        self._reward_model = None
        if self.config.custom_function_path is not None:
            self._custom = FileRewardFunction(
                self.config.custom_function_path,
                self.config.custom_function_name,
                self.config.custom_function_kwargs,
            )
        if self.config.reward_model_path is not None:
            # imports torch, which the rule scorers' process-pool workers need not load
            from tephra.episodes.rewards.reward_model import RewardModelScorer

            self._reward_model = RewardModelScorer(
                self.config.reward_model_path,
                batch_size=self.config.reward_model_batch_size,
                max_length=self.config.reward_model_max_length,
                device=self.config.reward_model_device,
                dtype=self.config.reward_model_dtype,
                use_chat_template=self.config.reward_model_chat_template,
            )
        for where, names in (
            ("scorer_overrides", self.config.scorer_overrides),
            ("prefix_scorers", self.config.prefix_scorers),
        ):
            for key, name in names.items():
                if name not in REWARD_SCORERS:
                    raise RegistryError(
                        f"reward.{where}[{key!r}]: "
                        + unknown_name_message("reward scorer", name, REWARD_SCORERS.names())
                    )
        self._pool: Executor | None = None
        self._traceback_logged: set[str] = set()
        self.last_report = RewardReport()
        """Report of the latest `score_batch` call."""
        self.total_errors: Counter[str] = Counter()
        """data_source -> scorer errors over the manager's life."""

    def scorer_for(self, data_source: str) -> tuple[str, Scorer]:
        """(name, scorer) that scores items of `data_source` under this config."""
        if self._custom is not None:
            return CUSTOM_SCORER_NAME, self._custom
        return resolve_scorer(data_source, self.config.scorer_overrides, self.config.prefix_scorers)

    def score_batch(self, items: Sequence[RewardInput]) -> list[RewardResult]:
        """One RewardResult per item, in order. `last_report` then describes the batch.

        An unknown data_source raises RegistryError before anything is scored; a scorer that
        raises gives its item 0.0 (or raises RewardScoringError with `raise_on_error`).
        """
        start = time.perf_counter()
        items = list(items)
        if self._reward_model is not None:
            scores = self._reward_model.score(
                [i.prompt_str for i in items], [i.solution_str for i in items]
            )
            outcomes: list[tuple[RewardResult, str | None]] = [
                (RewardResult(score=s), None) for s in scores
            ]
            names = [REWARD_MODEL_SCORER_NAME] * len(items)
        else:
            outcomes, names = self._rule_and_judge(items)
        results = [result for result, _ in outcomes]
        clipped = clip_scores(results, self.config.clip)
        self._account(items, names, outcomes, time.perf_counter() - start, clipped)
        if self._judge is not None:
            stats = self._judge.last_stats
            self.last_report.judge_requests = stats.requests
            self.last_report.judge_timeouts = stats.timeouts
            self.last_report.judge_fallbacks = stats.fallbacks
        return results

    def _rule_and_judge(
        self, items: list[RewardInput]
    ) -> tuple[list[tuple[RewardResult, str | None]], list[str]]:
        """Rule scores where a rule weight is used, judge scores of judged sources, mixed
        as rule_weight * rule + judge_weight * judge."""
        judge_cfg = self.config.judge
        judged = [self._judge is not None and judge_cfg.judges(i.data_source) for i in items]
        rule_rows = [
            k for k, i in enumerate(items) if not judged[k] or judge_cfg.weights(i.data_source)[0]
        ]
        outcomes: list[tuple[RewardResult, str | None]] = [
            (RewardResult(score=0.0), None) for _ in items
        ]
        names = [JUDGE_SCORER_NAME] * len(items)
        if rule_rows:
            rule_items = [items[k] for k in rule_rows]
            resolved = {ds: self.scorer_for(ds) for ds in {i.data_source for i in rule_items}}
            rule_names = [resolved[i.data_source][0] for i in rule_items]
            scorers = [resolved[i.data_source][1] for i in rule_items]
            for k, name, outcome in zip(
                rule_rows, rule_names, self._run(rule_names, scorers, rule_items), strict=True
            ):
                outcomes[k], names[k] = outcome, name
        judge_rows = [k for k in range(len(items)) if judged[k]]
        if judge_rows:
            assert self._judge is not None
            scores = self._judge.score([items[k] for k in judge_rows])
            status = self._judge.last_status
            for k, judge_score, how in zip(judge_rows, scores, status, strict=True):
                rule_w, judge_w = judge_cfg.weights(items[k].data_source)
                result, tb = outcomes[k]
                rule = result.score if rule_w else 0.0
                result.score = rule_w * rule + judge_w * judge_score
                result.extras["judge"] = judge_score
                # per sample, so a trainer can count them over its ranks
                result.extras["judge_fallback"] = float(how != "ok")
                result.extras["judge_timeout"] = float(how == "timeout")
                outcomes[k] = (result, tb)
        else:
            self._judge_idle()
        return outcomes, names

    def _judge_idle(self) -> None:
        if self._judge is not None:
            self._judge.last_stats = JudgeStats()

    def _run(
        self, names: list[str], scorers: list[Scorer], items: list[RewardInput]
    ) -> list[tuple[RewardResult, str | None]]:
        timeout = self.config.timeout_s
        step = self.config.step_timeout_s
        deadline = None if step is None else Deadline(time.time() + step, step)
        if self.config.executor == "serial" or len(items) <= 1:
            return _score_chunk(names, scorers, items, timeout, deadline)
        pool = self._get_pool()
        if self.config.executor == "thread":
            n = len(items)
            return list(pool.map(_score_one, scorers, names, items, [timeout] * n, [deadline] * n))
        for name, scorer in {n: s for n, s in zip(names, scorers, strict=True)}.items():
            try:
                pickle.dumps(scorer)
            except Exception as exc:
                raise RewardError(
                    f"reward.executor='process' needs picklable scorers, but scorer {name!r} "
                    f"({scorer!r}) is not ({exc}); define it at module level or use executor='thread'"
                ) from exc
        # Chunks amortise the pickling round trip; 4 chunks per worker balance uneven items.
        size = max(1, -(-len(items) // (4 * self.config.num_workers)))
        chunks = [slice(i, i + size) for i in range(0, len(items), size)]
        futures = [
            pool.submit(_score_chunk, names[c], scorers[c], items[c], timeout, deadline)
            for c in chunks
        ]
        try:
            return [outcome for future in futures for outcome in future.result()]
        except BrokenProcessPool as exc:
            # A worker died (segfault, out of memory): this batch cannot be scored, but the
            # next one gets a fresh pool instead of failing forever.
            self._pool = None
            pool.shutdown(wait=False, cancel_futures=True)
            raise RewardError(
                f"a reward worker process died while scoring {len(items)} items ({exc}); "
                "the pool restarts on the next batch. Look for a scorer that crashes the "
                "interpreter or exhausts memory, or use reward.executor='thread'"
            ) from exc

    def _get_pool(self) -> Executor:
        if self._pool is None:
            if self.config.executor == "thread":
                self._pool = ThreadPoolExecutor(
                    self.config.num_workers, thread_name_prefix="reward"
                )
            else:
                # forkserver, not fork: the trainer process holds threads (torch, Ray) that
                # fork would copy in an arbitrary state. Not spawn either: every spawned worker
                # re-imports torch through tephra.engine_api (measured 4-30 s and ~850 MB each
                # on a 2-core machine); the fork server imports the scorer modules once and
                # forks workers that share them.
                context = multiprocessing.get_context("forkserver")
                context.set_forkserver_preload(list(PROCESS_POOL_PRELOAD))
                self._pool = ProcessPoolExecutor(self.config.num_workers, mp_context=context)
        return self._pool

    def _account(
        self,
        items: list[RewardInput],
        names: list[str],
        outcomes: list[tuple[RewardResult, str | None]],
        seconds: float,
        clipped: int = 0,
    ) -> None:
        counts: Counter[str] = Counter()
        errors: Counter[str] = Counter()
        timeouts: Counter[str] = Counter()
        sums: defaultdict[str, float] = defaultdict(float)
        first_failure: tuple[int, str] | None = None
        for index, (item, name, (result, tb)) in enumerate(
            zip(items, names, outcomes, strict=True)
        ):
            counts[item.data_source] += 1
            sums[item.data_source] += result.score
            if result.error is None:
                continue
            errors[item.data_source] += 1
            if is_timeout(result.error):
                timeouts[item.data_source] += 1
            if first_failure is None:
                first_failure = (index, tb or "")
            if item.data_source not in self._traceback_logged:
                self._traceback_logged.add(item.data_source)
                logger.error(
                    "reward scorer %r raised on data_source %r (item %d); it scores 0.0 and later "
                    "errors of this data_source are only counted:\n%s",
                    name,
                    item.data_source,
                    index,
                    tb,
                )
        self.total_errors.update(errors)
        self.last_report = RewardReport(
            num_items=len(items),
            items_by_source=dict(counts),
            errors_by_source=dict(errors),
            mean_score_by_source={source: sums[source] / counts[source] for source in counts},
            timeouts_by_source=dict(timeouts),
            clipped=clipped,
            seconds=seconds,
        )
        if clipped:
            logger.warning(
                "reward scoring: %d of %d scores clipped into reward.clip=%s",
                clipped,
                len(items),
                list(cast(tuple[float, float], self.config.clip)),  # set: scores were clipped
            )
        if errors:
            logger.warning(
                "reward scoring: %d of %d items failed and scored 0.0 (by data_source: %s)",
                sum(errors.values()),
                len(items),
                dict(errors),
            )
        if errors and self.config.raise_on_error:
            index, tb = cast(tuple[int, str], first_failure)  # set: an item failed
            raise RewardScoringError(
                f"reward scorer {names[index]!r} raised on item {index} (data_source "
                f"{items[index].data_source!r}): {outcomes[index][0].error}. Set "
                f"reward.raise_on_error=False to score such items 0.0 instead.\n{tb}"
            )

    def close(self) -> None:
        """Shut the worker pool down (a later batch starts a new one) and the judge's
        backend."""
        if self._judge is not None:
            self._judge.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> RewardManager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
