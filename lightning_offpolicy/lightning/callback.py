"""``RolloutCallback``: turns the run's prompts into scored rollouts for ``training_step``.

* **Synchronous** (``asynchrony.max_staleness=0``, the default): in ``on_train_batch_start``, after
  the previous optimizer step, it pushes the weights to the engine and attaches the step's
  :class:`~lightning_offpolicy.batch.RolloutBatch` to its :class:`~lightning_offpolicy.batch.PromptBatch`
  (not in the DataLoader: Lightning reads it one batch ahead, which would train one version stale).
* **Asynchronous** (``max_staleness=k > 0``): a
  :class:`~lightning_offpolicy.rollout.producer.RolloutProducer` thread generates from its own copy
  of the train prompts, at most ``k`` versions ahead, and each step trains the next batch it finished.
* **Held-out evaluation**: in ``on_validation_batch_start`` it attaches an
  :class:`~lightning_offpolicy.batch.EvaluationBatch` (greedy and sampled completions,
  scored) without moving anything of the training stream.

How each mode works and what it needs of the LightningModule (``policy``, ``tokenizer``,
``policy_version``, optionally ``optimizer_steps_per_batch``): docs/async.md and docs/training.md.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from lightning_offpolicy.argcheck import is_number, is_real
from lightning_offpolicy.batch import EvaluationBatch, PromptBatch, RolloutBatch
from lightning_offpolicy.data.rewards import DEFAULT_REWARD_TIMEOUT_S, RewardSpec, resolve_reward
from lightning_offpolicy.lightning.log_steps import is_logging_step
from lightning_offpolicy.lightning.preemption import on_any_rank
from lightning_offpolicy.lightning.prompt_loader import train_prompt_loader
from lightning_offpolicy.lightning.rollout_logs import (
    log_reward_components,
    log_staleness_histogram,
    log_timing,
    steps_per_batch,
)
from lightning_offpolicy.preflight import check_context, check_group_size, check_vocab, context_limit
from lightning_offpolicy.rollout.advantages import ADVANTAGE_ESTIMATORS
from lightning_offpolicy.rollout.asynchrony import AsyncSettings
from lightning_offpolicy.rollout.dapo import DAPOSettings
from lightning_offpolicy.rollout.engine import InterruptibleEngine, RolloutEngine, SamplingConfig, fill_special_tokens
from lightning_offpolicy.rollout.hf.engine import HFEngine
from lightning_offpolicy.rollout.multi_turn import EpisodeRunner, EpisodeSettings
from lightning_offpolicy.rollout.partial import RolloutStopped
from lightning_offpolicy.rollout.producer import RolloutProducer
from lightning_offpolicy.rollout.prompt_source import prompt_batches
from lightning_offpolicy.rollout.rollouter import RolloutControls, Rollouter
from lightning_offpolicy.seeding import run_seed

_T = TypeVar("_T")
_PRODUCER_STOPPED = "the rollout producer was stopped (a preemption)"


class RolloutCallback(Callback):
    """Generate, score and attach rollouts for every training batch, synchronously or in the background.

    Args:
        engine: The rollout engine; ``None``: an :class:`HFEngine` sharing the module's weights.
        reward_fn: ``(prompts, completions, metadata) -> rewards``: a callable, an import path or a
            weighted list (docs/training.md); ``None`` takes the datamodule's ``reward_fn``.
        reward_timeout_s: Longest one reward call on a batch may take (seconds); ``None``: no limit.
        sampling: How completions are sampled.
        advantage_estimator: ``"grpo"``, ``"dr_grpo"``, ``"rloo"`` or ``"reinforce"``.
        seed: Sampler seed (None: the run's).
        asynchrony: Background generation with bounded staleness; default: synchronous.
        dapo: DAPO's dynamic sampling and overlong handling.
        episodes: Multi-turn episodes: the tools or the environment the model talks to, and the
            limits of an episode (docs/multi_turn.md); default: one turn per rollout.
        success_threshold: The reward a held-out sample needs for its prompt to pass (``val/pass@k``).

    Raises:
        ValueError: A setting is out of range or settings contradict each other; the message names
            the setting.
    """

    def __init__(
        self,
        engine: RolloutEngine | None = None,
        reward_fn: RewardSpec = None,
        reward_timeout_s: float | None = DEFAULT_REWARD_TIMEOUT_S,
        sampling: SamplingConfig = SamplingConfig(),  # noqa: B008 (read-only, copied)
        advantage_estimator: str = "grpo",
        seed: int | None = None,
        asynchrony: AsyncSettings = AsyncSettings(),  # noqa: B008 (frozen)
        dapo: DAPOSettings = DAPOSettings(),  # noqa: B008 (frozen)
        episodes: EpisodeSettings = EpisodeSettings(),  # noqa: B008 (read-only)
        success_threshold: float = 1.0,
    ) -> None:
        if advantage_estimator not in ADVANTAGE_ESTIMATORS:
            raise ValueError(
                f"RolloutCallback.advantage_estimator={advantage_estimator!r} is not known; allowed: "
                f"{', '.join(ADVANTAGE_ESTIMATORS)}."
            )
        if not is_real(success_threshold):
            raise ValueError(
                f"RolloutCallback.success_threshold={success_threshold!r} must be a number (the reward a sample "
                "needs for its prompt to count in val/pass@k)."
            )
        if reward_timeout_s is not None and not (is_number(reward_timeout_s) and reward_timeout_s > 0):
            raise ValueError(
                f"RolloutCallback.reward_timeout_s={reward_timeout_s!r} must be > 0 (seconds per reward call) or "
                "None (no limit)."
            )
        for name, value, kind in (
            ("sampling", sampling, SamplingConfig),
            ("asynchrony", asynchrony, AsyncSettings),
            ("dapo", dapo, DAPOSettings),
            ("episodes", episodes, EpisodeSettings),
        ):
            if not isinstance(value, kind):
                raise TypeError(f"RolloutCallback.{name} must be a {kind.__name__}; got {type(value).__name__}.")
        if sampling.greedy:
            raise ValueError(
                "RolloutCallback.sampling.greedy=True: training needs the logprobs of a sampling distribution; "
                "greedy decoding is for evaluation only (the callback's held-out evaluation adds it itself)."
            )
        if sampling.top_k == 1:
            raise ValueError(
                "RolloutCallback.sampling.top_k=1 keeps one token: the samples are greedy and, under the sampling "
                "mask, every kept token's logprob is 0, so nothing trains. Use top_k >= 2, or 0 (off)."
            )
        check_group_size(sampling.samples_per_prompt, advantage_estimator)
        dapo.check(sampling.max_new_tokens, sampling.samples_per_prompt)
        self.engine = engine
        self.reward_fn = resolve_reward(reward_fn, "RolloutCallback.reward_fn")
        self.sampling = dataclasses.replace(sampling)
        self.advantage_estimator = advantage_estimator
        self.seed = run_seed(seed, "RolloutCallback.seed")
        self.asynchrony = asynchrony
        self.dapo = dapo
        self.episodes = episodes
        self._episode_runner: EpisodeRunner | None = None
        # Built at its first use in a fit, once the fit's tokenizer, context limit and seed are known.
        self._rollouter: Rollouter | None = None
        self.success_threshold = float(success_threshold)
        self.reward_timeout_s = None if reward_timeout_s is None else float(reward_timeout_s)
        # Policy version whose weights the current validation epoch pushed (None: not pushed yet).
        self._evaluated_version: int | None = None
        #: Batches handed to training so far (restored from checkpoints; numbers the seeds).
        self.generated_batches = 0
        #: Samples generated but too stale to train (regenerated; docs/async.md).
        self.dropped_samples = 0
        self.last_timing: dict[str, float] = {}
        self.producer: RolloutProducer | None = None
        self._preempted = False  # preempt() was called: the next batch start stops the fit
        self._background = asynchrony.background
        self._tokenizer: Any = None
        self._rank = 0
        self._version_at_batch_start = 0
        self._context_limit: tuple[int, str] | None = None
        # Dynamic sampling's refill prompts (a second pass); each batch's counts until it is trained.
        self._refill_prompts: Any = None
        self._sampling_stats: dict[int, dict[str, float]] = {}

    @property
    def asynchronous(self) -> bool:
        """Whether rollouts are generated by the background producer."""
        return self._background

    # ------------------------------------------------------------------------------ set-up
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        for name in ("policy_version", "tokenizer"):
            if not hasattr(pl_module, name):
                raise TypeError(
                    f"RolloutCallback needs the LightningModule to expose `{name}` (see "
                    "lightning_offpolicy.lightning.callback's docstring); OffPolicyRLModule does."
                )
        if self.reward_fn is None:
            datamodule = trainer.datamodule
            self.reward_fn = resolve_reward(getattr(datamodule, "reward_fn", None), "datamodule.reward_fn")
            if self.reward_fn is None:
                raise ValueError(
                    "RolloutCallback has no reward_fn: set `rollout.reward_fn` (e.g. my_pkg.rewards.exact_match), "
                    "or use a datamodule with a `reward_fn` attribute "
                    "(lightning_offpolicy.data.tasks.PromptDataModule; lightning_offpolicy.data.DatasetDataModule with "
                    "`reward_fn` set or a reasoning_gym source)."
                )
        policy_temperature = getattr(pl_module, "temperature", None)
        if policy_temperature is not None and abs(policy_temperature - self.sampling.temperature) > 1e-9:
            raise ValueError(
                f"RolloutCallback.sampling.temperature={self.sampling.temperature} differs from the module's "
                f"temperature={policy_temperature}: the trainer would score another distribution than the "
                "engine samples. Set both to the same value."
            )
        self.asynchrony.check_engine(self.engine)
        self._rank = trainer.global_rank

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._preempted = False  # a preemption during the sanity check still stops the training that follows
        self._rollouter = None  # this fit's module, tokenizer and limits
        # Here, not in setup: configure_model (which loads a model given by name) runs in between.
        # Checks of what would otherwise crash inside generate, after the training started.
        policy = getattr(pl_module, "policy", None)
        if policy is None:
            return
        check_vocab(policy, pl_module.tokenizer)
        self._context_limit = context_limit(policy, self.engine)
        check_context(self.sampling.max_new_tokens, self._context_limit)
        if self.episodes.enabled:
            check_context(
                self.episodes.max_episode_tokens, self._context_limit, setting="rollout.episodes.max_episode_tokens"
            )
        # Every prompt of the data, before the first step (DatasetDataModule: each row named by file and line).
        check_lengths = getattr(trainer.datamodule, "check_prompt_lengths", None)
        if callable(check_lengths) and self._context_limit is not None:
            check_lengths(pl_module.tokenizer, self.sampling.max_new_tokens, self._context_limit)

    def _engine(self, pl_module: LightningModule) -> RolloutEngine:
        if self.engine is None:
            self.engine = HFEngine()
        fill_special_tokens(self.engine, pl_module.policy, pl_module.tokenizer)
        self._tokenizer = pl_module.tokenizer
        return self.engine

    # ------------------------------------------------------------------------------ the step
    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._rollouter = None  # the training's pipeline has the refill prompts and the producer set below
        if self.dapo.dynamic_sampling:
            self._refill_prompts = prompt_batches(
                train_prompt_loader(trainer), trainer.global_rank, trainer.world_size, skip=0, seed=self.seed + 1
            )
        if not self._background:
            return
        # Here, not in on_fit_start: a resumed run's state (policy version, batches trained) is
        # restored by now under every strategy.
        engine = self._engine(pl_module)
        version = int(pl_module.policy_version)
        engine.update_weights(pl_module.policy, version)
        # A loader for the producer thread alone: set_epoch on the fit loop's sampler from this
        # thread would race with the loop.
        self.producer = RolloutProducer(
            produce=self._produce,
            prompt_batches=prompt_batches(
                train_prompt_loader(trainer),
                trainer.global_rank,
                trainer.world_size,
                skip=self.generated_batches,
                seed=self.seed,
            ),
            max_staleness=self.asynchrony.max_staleness,
            steps_per_batch=steps_per_batch(pl_module),
            first_index=self.generated_batches,
            trainer_version=version,
            engine_version=version,
            interrupt=engine.interrupt if self.asynchrony.partial_rollouts else None,
        )
        self._pipeline()  # built in this thread, with the producer's turns, before its first batch
        self.producer.start()

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if not isinstance(batch, PromptBatch):
            raise TypeError(
                f"RolloutCallback expects the train dataloader to yield PromptBatch; got {type(batch).__name__}."
            )
        # A rollout that preempt() stopped is not trained (the checkpoint counts its batch as never
        # started); one that had finished generating when the signal came is, and Lightning stops after it.
        if not self._background:
            rank = trainer.global_rank
            batch.rollout = self._unless_preempted(trainer, lambda: self.generate(pl_module, batch, rank))
            return
        version = int(pl_module.policy_version)
        self._version_at_batch_start = version
        produced, wait_s = self._unless_preempted(trainer, lambda: self._take(version))
        # The loader's batch only paces the steps: train what the producer generated.
        batch.prompts, batch.metadata = produced.prompts.prompts, produced.prompts.metadata
        batch.rollout = produced.rollout
        self.generated_batches += 1
        self.dropped_samples = self.producer.dropped_samples
        self.last_timing = {
            "generate_s": produced.generate_s,
            "tokens": float(produced.tokens),
            "wait_s": wait_s,
            "queue_depth": float(self.producer.queue_depth),
            "dropped_samples": float(self.dropped_samples),
            **self._sampling_stats.pop(produced.index, {}),
        }
        if is_logging_step(trainer, batch_idx, steps_per_batch(pl_module)):
            log_staleness_histogram(trainer, version, produced.rollout)

    def preempt(self) -> None:
        """Cut the rollout in flight short for a preemption (thread-safe; PreemptionCheckpoint calls it on SIGTERM).

        The batch whose rollout was cut is not trained, so the state saved is that of the last
        completed batch (docs/async.md, "Checkpoints, resume, failures").
        """
        self._preempted = True
        if self.producer is not None:
            self.producer.request_stop()  # with partial rollouts this interrupts the request in flight too
        if isinstance(self.engine, InterruptibleEngine):
            self.engine.interrupt()

    def _unless_preempted(self, trainer: Trainer, work: Callable[[], _T]) -> _T:
        """What ``work`` (the batch's generation) returns, or Lightning's ``SIGTERMException`` if :meth:`preempt`
        cut it short on any rank (every rank stops at the same batch, or the others would wait in the step's
        collectives)."""
        try:
            result = work()
        except RolloutStopped:
            if not self._preempted:
                raise
            on_any_rank(trainer, True)
            raise SIGTERMException() from None
        if on_any_rank(trainer, False):
            raise SIGTERMException()
        return result

    def _take(self, version: int) -> tuple[Any, float]:
        """The producer's next rollout for weights of ``version``, and the time waited for it."""
        if self._preempted:
            raise RolloutStopped(_PRODUCER_STOPPED)
        try:
            return self.producer.take(version)
        except RuntimeError as err:
            if self._preempted:  # preempt() stopped the producer: not a failure
                raise RolloutStopped(_PRODUCER_STOPPED) from err
            raise

    def generate(self, pl_module: LightningModule, prompts: PromptBatch, rank: int = 0) -> RolloutBatch:
        """Sample, score and build the rollout batch of ``prompts`` with the module's current weights."""
        engine = self._engine(pl_module)
        started = time.perf_counter()
        engine.update_weights(pl_module.policy, int(pl_module.policy_version))
        sync_s = time.perf_counter() - started
        self._rank = rank
        index = self.generated_batches
        rollout, generate_s = self._produce(prompts, index)
        self.generated_batches += 1
        self.last_timing = {
            "generate_s": generate_s,
            "tokens": float(rollout.num_response_tokens),
            "sync_s": sync_s,
            **self._sampling_stats.pop(index, {}),
        }
        self._record_sync_probe_diff()
        return rollout

    def _record_sync_probe_diff(self) -> None:
        """Log the engine's sync self-check (max |engine - trainer| probe logprob) as ``rollout/sync_probe_diff``."""
        if (diff := getattr(self.engine, "last_sync_check_max_abs_diff", None)) is not None:
            self.last_timing["sync_probe_diff"] = float(diff)

    def _pipeline(self) -> Rollouter:
        """The rollout pipeline, built at its first use in a fit's validation and again at the train start
        (by then the engine and tokenizer are set, a resumed run's seed restored, the refill prompts and the
        producer made)."""
        if self._rollouter is None:
            producer = self.producer
            self._rollouter = Rollouter(
                self.engine,
                self._tokenizer,
                self.reward_fn,
                self.sampling,
                advantage_estimator=self.advantage_estimator,
                seed=self.seed,
                context_limit=self._context_limit,
                success_threshold=self.success_threshold,
                dapo=self.dapo,
                reward_timeout_s=self.reward_timeout_s,
                episodes=self._runner(),
                controls=RolloutControls(
                    more_prompts=None if self._refill_prompts is None else lambda: next(self._refill_prompts),
                    turn=producer.generation_turn if producer is not None and producer.interrupts else None,
                    stop=lambda: self._preempted,
                ),
            )
        return self._rollouter

    def _runner(self) -> EpisodeRunner | None:
        """The episode runner, built once the engine's stop ids are known (``None``: single-turn)."""
        if self._episode_runner is None and self.episodes.enabled:
            stop_ids = list(getattr(self.engine, "stop_ids", None) or [])
            self._episode_runner = EpisodeRunner(self.episodes, self._tokenizer, stop_ids)
        return self._episode_runner

    def _produce(self, prompts: PromptBatch, index: int) -> tuple[RolloutBatch, float]:
        """Generate and score batch ``index`` with the engine's current weights (any thread)."""
        pipeline = self._pipeline()
        rollout, generate_s = pipeline.rollout(prompts, index, self._rank)
        stats = dict(pipeline.last_stats or {})
        if callable(engine_stats := getattr(self.engine, "rollout_stats", None)):
            stats.update(engine_stats())  # e.g. a server pool's requests per server
        if stats:
            self._sampling_stats[index] = stats
        if index == 0:
            rank_zero_info(
                f"RolloutCallback: first rollout: {rollout.num_sequences} completions, "
                f"{rollout.num_response_tokens} tokens"
            )
        return rollout, generate_s

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._background:
            self._after_async_step(pl_module)
        if self.last_timing:
            timing, self.last_timing = self.last_timing, {}
            log_timing(trainer, pl_module, batch_idx, timing)
        if isinstance(batch, PromptBatch) and batch.rollout is not None and batch.rollout.reward_components:
            log_reward_components(trainer, pl_module, batch.rollout.reward_components)
        if isinstance(batch, PromptBatch):
            batch.rollout = None  # free the rollout's tensors before the loader's next batch

    def _after_async_step(self, pl_module: LightningModule) -> None:
        version = int(pl_module.policy_version)
        self.producer.observe_steps_per_batch(version - self._version_at_batch_start)
        if version - self.producer.engine_version < self.asynchrony.sync_every:
            return
        started = time.perf_counter()
        # Waits for the generation request in flight, or interrupts it (partial_rollouts).
        with self.producer.engine_access():
            self.engine.update_weights(pl_module.policy, version)
            self.producer.set_engine_version(version)
        self.last_timing["sync_s"] = time.perf_counter() - started
        self._record_sync_probe_diff()

    # ------------------------------------------------------------------------------ held-out evaluation
    @override
    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._evaluated_version = None  # push the current weights before the first batch

    @override
    def on_validation_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if not isinstance(batch, PromptBatch):
            raise TypeError(
                "RolloutCallback evaluates validation batches of PromptBatch (prompts and reward metadata); "
                f"val_dataloader() yielded {type(batch).__name__}."
            )
        batch.evaluation = self._unless_preempted(trainer, lambda: self.evaluate(pl_module, batch))

    def evaluate(self, pl_module: LightningModule, prompts: PromptBatch) -> EvaluationBatch:
        """Greedy and sampled completions of ``prompts`` with the module's current weights, scored.

        Touches nothing of the training stream (seeds, prompt order, ``generated_batches``).
        """
        # Lightning validates under inference mode; a tensor an engine created there (its first
        # private weight copy) could never be updated in place by the training-time pushes.
        with torch.inference_mode(False), torch.no_grad():
            if self.producer is None:  # synchronous mode, the sanity check, trainer.validate
                return self._evaluate_now(pl_module, prompts)
            with self.producer.engine_access():  # between two generation requests of the producer
                return self._evaluate_now(pl_module, prompts)

    def _evaluate_now(self, pl_module: LightningModule, prompts: PromptBatch) -> EvaluationBatch:
        engine = self._engine(pl_module)
        version = int(pl_module.policy_version)
        if self._evaluated_version != version:
            if self.producer is None or self.producer.engine_version != version:
                engine.update_weights(pl_module.policy, version)
            if self.producer is not None:
                self.producer.set_engine_version(version)  # the producer's next batches are fresher
            self._evaluated_version = version
        return self._pipeline().evaluate(prompts)

    # ------------------------------------------------------------------------------ state
    @override
    def state_dict(self) -> dict[str, Any]:
        # Queued and in-flight rollouts are not saved: a resumed run generates them again with the
        # restored weights, so it starts within the staleness bound (no burst of old samples).
        return {"generated_batches": self.generated_batches, "seed": self.seed}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.generated_batches = int(state_dict["generated_batches"])
        self.seed = int(state_dict.get("seed", self.seed))
        self._rollouter = None  # rebuilt with the restored seed

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._shutdown()

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._shutdown()

    def _shutdown(self) -> None:
        # The engine's processes and memory end with the fit (vLLM would otherwise outlive it).
        producer, self.producer = self.producer, None
        if producer is not None:
            producer.request_stop()
        if self.engine is not None:
            self.engine.close()  # also wakes a vLLM request in flight
        if producer is not None:
            producer.close()
        if self._episode_runner is not None:
            self._episode_runner.close()
