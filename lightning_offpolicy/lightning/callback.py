"""``RolloutCallback``: turns the run's prompts into scored rollouts for ``training_step``.

Two ways of running, chosen by ``max_staleness``:

* **Synchronous** (``max_staleness=0``, the default). In ``on_train_batch_start`` (after the
  previous optimizer step, so with the weights of this very step) it pushes the weights to the
  engine, generates ``samples_per_prompt`` completions per prompt, scores them with the reward
  function, computes group advantages and attaches the
  :class:`~lightning_offpolicy.batch.RolloutBatch` to the step's
  :class:`~lightning_offpolicy.batch.PromptBatch`. Generating here rather than in the DataLoader
  matters: Lightning reads the loader one batch ahead, so a loader that generated would always
  train one version stale.
* **Asynchronous** (``max_staleness=k > 0``). A background thread
  (:class:`~lightning_offpolicy.rollout.producer.RolloutProducer`) generates from its own copy of
  the train prompts while the trainer trains, admitting a batch only when it will be trained at
  most ``k`` policy versions after the weights that generate it (admission control, nothing
  generated is discarded). In ``on_train_batch_start`` the callback swaps the next finished
  batch (prompts and rollout) into the loader's ``PromptBatch``: the loader's own batches only pace
  the steps and epochs, so Lightning's one-batch read-ahead does not count against the bound.
  Weights are pushed every ``sync_every`` optimizer steps, between two generation requests.

Held-out evaluation: when the datamodule has a ``val_dataloader()`` of ``PromptBatch``, Lightning's
validation loop runs (``val_check_interval``, ``check_val_every_n_epoch``, ``limit_val_batches``,
the sanity check). In ``on_validation_batch_start`` the callback pushes the trainer's current
weights, generates one greedy and ``samples_per_prompt`` sampled completions per prompt, scores
them and attaches an :class:`~lightning_offpolicy.metrics.evaluation.EvaluationBatch`; the module logs
``val/*`` (see :mod:`lightning_offpolicy.metrics.evaluation`). Evaluation leaves training as it is: no
seed, prompt or counter of the training stream moves. In asynchronous mode it runs between two
generation requests of the producer (``engine_access``) and tells the producer that its engine
now holds the current weights.

What it needs from the LightningModule (``OffPolicyRLModule`` has all of it):

* ``policy``: the causal LM to sample with (shared with ``HFEngine``, no copy);
* ``tokenizer``: ``encode_prompt(prompt) -> list[int]`` (or ``encode(text)``; see
  :func:`~lightning_offpolicy.data.tokenizers.encode_prompt`), ``decode(ids) -> str``, ``pad_token_id``,
  ``eos_token_id``. Engines stop on its eos and on every eos id of ``policy.generation_config``;
* ``policy_version``: the number of optimizer steps taken, stamped on every generated token;
* optionally ``optimizer_steps_per_batch`` (default 1): policy versions one batch advances, for the
  admission rule of the asynchronous mode.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from lightning_offpolicy.argcheck import is_int, is_number, is_real
from lightning_offpolicy.batch import PromptBatch, RolloutBatch
from lightning_offpolicy.data.rewards import DEFAULT_REWARD_TIMEOUT_S, RewardSpec, resolve_reward
from lightning_offpolicy.lightning.log_steps import is_logging_step
from lightning_offpolicy.lightning.preemption import on_any_rank
from lightning_offpolicy.metrics.evaluation import EvaluationBatch
from lightning_offpolicy.preflight import check_context, check_group_size, check_vocab, context_limit
from lightning_offpolicy.rollout.advantages import ADVANTAGE_ESTIMATORS
from lightning_offpolicy.rollout.dapo import DAPOSettings
from lightning_offpolicy.rollout.engine import InterruptibleEngine, RolloutEngine, SamplingConfig, generation_eos_ids
from lightning_offpolicy.rollout.hf.engine import HFEngine
from lightning_offpolicy.rollout.partial import RolloutStopped
from lightning_offpolicy.rollout.producer import RolloutProducer
from lightning_offpolicy.rollout.prompt_source import prompt_batches
from lightning_offpolicy.rollout.rollouter import Rollouter

_T = TypeVar("_T")
_PRODUCER_STOPPED = "the rollout producer was stopped (a preemption)"


class RolloutCallback(Callback):
    """Generate, score and attach rollouts for every training batch, synchronously or in the background.

    Args:
        engine: The rollout engine; ``None`` builds an :class:`HFEngine` that shares the module's
            weights. ``HFEngine(dtype="bfloat16")`` samples from a bfloat16 copy (a real
            training-inference mismatch, as with vLLM).
        reward_fn: ``(prompts, completions, metadata) -> rewards`` (one float per completion): a
            callable, an import path (``my_pkg.rewards.exact_match`` or ``my_pkg.rewards:exact_match``),
            or a list of ``{"fn": path, "weight": w, "name": n}`` / paths whose weighted sum is the
            reward, each part logged as ``reward/<name>`` (see
            :func:`lightning_offpolicy.data.rewards.resolve_reward`). ``None`` takes the datamodule's
            ``reward_fn``.
        reward_timeout_s: Longest one call of the reward function on a batch may take (each part
            of a weighted reward is one call; seconds). The call runs in a worker thread; past the
            limit it is abandoned and the fit stops with a ``RewardError`` naming the reward and
            the row it was scoring. A call still running after 10 s (or half the limit, if
            shorter) is reported in the log, again at 20 s, 40 s, ... ``None``: no limit, and the
            reward runs on the calling thread (for rewards that must run on the main thread).
        max_new_tokens: Maximum tokens generated per completion.
        temperature: Sampling temperature (the module scores with its own ``temperature``: keep
            them equal).
        top_k: Top-k filter of the sampler (0: off).
        top_p: Nucleus filter of the sampler (1.0: off).
        sampling_mask: Under top-k / top-p, renormalize the trainer's ``pi_prox`` / ``pi_theta`` /
            reference logprobs over the tokens the engine kept at each position, as the engine's
            own logprobs are (DeepSeek-V3.2's keep-sampling-mask; docs/off_policy_correction.md,
            "Sampling masks"). ``False`` scores over the whole vocabulary: every importance ratio
            then carries the log of the mass cut off; for comparisons only.
        samples_per_prompt: Completions per prompt (the advantage group).
        advantage_estimator: ``"grpo"``, ``"dr_grpo"``, ``"rloo"`` or ``"reinforce"``.
        seed: Base seed of the sampler; batch ``j`` on rank ``r`` uses a seed derived from (seed, j, r).
        max_staleness: Most policy versions (optimizer steps) between the weights that generate a
            token and the step that trains it. 0: synchronous generation with the step's own
            weights; ``k > 0``: generation runs in a background thread, up to ``k`` versions ahead
            (the engine must keep its own weights: vLLM, or ``HFEngine(dtype=...)``).
        sync_every: Push the weights to the engine every this many optimizer steps (asynchronous
            mode; at batch boundaries). Needs ``max_staleness >= sync_every - 1``, or no batch
            could ever be admitted.
        success_threshold: Held-out evaluation: a prompt passes (``val/pass@k``) when one of its
            ``samples_per_prompt`` sampled completions gets a reward ``>= success_threshold``.
        dynamic_sampling: DAPO's dynamic sampling: drop the groups whose rewards all equal each other
            (zero advantage) and refill the batch with groups of further train prompts (a second pass
            over the train dataloader); logs ``rollout/groups_dropped``, ``rollout/refill_batches``
            and ``rollout/groups_short``.
        max_refill_batches: Most extra generation calls per batch for the refill (then the batch
            trains with fewer groups).
        overlong_filter: DAPO's overlong filtering: completions cut at ``max_new_tokens`` stay in
            their group's baseline but leave the loss (``rollout/overlong_filtered``).
        overlong_buffer: DAPO's soft overlong punishment: within the last ``overlong_buffer`` tokens
            before ``max_new_tokens`` the reward is lowered linearly, by up to
            ``overlong_penalty_factor`` (logged as ``reward/overlong_penalty``); 0: off.
        overlong_penalty_factor: The punishment at ``max_new_tokens``.
        partial_rollouts: Asynchronous mode: a weight push interrupts the generation request in
            flight instead of waiting for it, and the interrupted completions are continued from
            their tokens so far under the new weights (each token keeps the version and logprob of
            the weights that sampled it; AReaL's, slime's and SkyRL's partial rollouts). Needs
            ``max_staleness >= 1`` and an engine with ``interrupt()`` (HFEngine, HFProcessEngine,
            VLLMEngine, RemoteVLLMEngine). Logs ``rollout/interrupted_frac``,
            ``rollout/continuation_calls`` and ``rollout/tokens_per_version``. Worth it when
            completions are long against a training step (docs/reports/performance_async.md).
    """

    def __init__(
        self,
        engine: RolloutEngine | None = None,
        reward_fn: RewardSpec = None,
        max_new_tokens: int = 16,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        sampling_mask: bool = True,
        samples_per_prompt: int = 4,
        advantage_estimator: str = "grpo",
        seed: int = 0,
        max_staleness: int = 0,
        sync_every: int = 1,
        success_threshold: float = 1.0,
        dynamic_sampling: bool = False,
        max_refill_batches: int = 4,
        overlong_filter: bool = False,
        overlong_buffer: int = 0,
        overlong_penalty_factor: float = 1.0,
        partial_rollouts: bool = False,
        reward_timeout_s: float | None = DEFAULT_REWARD_TIMEOUT_S,
    ) -> None:
        if advantage_estimator not in ADVANTAGE_ESTIMATORS:
            raise ValueError(
                f"RolloutCallback.advantage_estimator={advantage_estimator!r} is not known; allowed: "
                f"{', '.join(ADVANTAGE_ESTIMATORS)}."
            )
        if not is_int(max_staleness) or max_staleness < 0:
            raise ValueError(
                f"RolloutCallback.max_staleness={max_staleness!r} must be an int >= 0 (0: synchronous rollouts)."
            )
        if not is_int(sync_every) or sync_every < 1:
            raise ValueError(f"RolloutCallback.sync_every={sync_every!r} must be an int >= 1.")
        if max_staleness < sync_every - 1:
            raise ValueError(
                f"RolloutCallback.sync_every={sync_every} needs max_staleness >= sync_every - 1 = {sync_every - 1} "
                f"(got max_staleness={max_staleness}): between two pushes the engine falls up to sync_every - 1 "
                "versions behind, so no batch could be admitted. Raise max_staleness or lower sync_every."
            )
        if not is_real(success_threshold):
            raise ValueError(
                f"RolloutCallback.success_threshold={success_threshold!r} must be a number (the reward a sample "
                "needs for its prompt to count in val/pass@k)."
            )
        if not isinstance(partial_rollouts, bool):
            raise ValueError(f"RolloutCallback.partial_rollouts={partial_rollouts!r} must be True or False.")
        if partial_rollouts and max_staleness < 1:
            raise ValueError(
                "RolloutCallback.partial_rollouts=True needs max_staleness >= 1: synchronous rollouts never push "
                "weights while a request is in flight, so there is nothing to interrupt."
            )
        if reward_timeout_s is not None and not (is_number(reward_timeout_s) and reward_timeout_s > 0):
            raise ValueError(
                f"RolloutCallback.reward_timeout_s={reward_timeout_s!r} must be > 0 (seconds per reward call) or "
                "None (no limit)."
            )
        check_group_size(samples_per_prompt, advantage_estimator)
        self.dapo = DAPOSettings(
            dynamic_sampling=bool(dynamic_sampling),
            max_refill_batches=max_refill_batches,
            overlong_filter=bool(overlong_filter),
            overlong_buffer=overlong_buffer,
            overlong_penalty_factor=overlong_penalty_factor,
        )
        self.dapo.check("RolloutCallback", max_new_tokens)
        if dynamic_sampling and samples_per_prompt < 2:
            raise ValueError(
                "RolloutCallback.dynamic_sampling=True needs samples_per_prompt >= 2: a group of one sample "
                "always has equal rewards, so every group would be dropped."
            )
        self.engine = engine
        self.reward_fn = resolve_reward(reward_fn, "RolloutCallback.reward_fn")
        self.sampling = SamplingConfig(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            samples_per_prompt=samples_per_prompt,
            sampling_mask=sampling_mask,
        )
        self.advantage_estimator = advantage_estimator
        self.seed = seed
        self.max_staleness = max_staleness
        self.sync_every = sync_every
        self.success_threshold = float(success_threshold)
        self.partial_rollouts = partial_rollouts
        self.reward_timeout_s = None if reward_timeout_s is None else float(reward_timeout_s)
        # Policy version whose weights the current validation epoch pushed (None: not pushed yet).
        self._evaluated_version: int | None = None
        #: Batches handed to training so far (restored from checkpoints; numbers the seeds).
        self.generated_batches = 0
        #: Samples generated but too stale to train (regenerated; 0 unless the module takes more
        #: optimizer steps per batch than its ``optimizer_steps_per_batch`` announces).
        self.dropped_samples = 0
        self.last_timing: dict[str, float] = {}
        self.producer: RolloutProducer | None = None
        self._preempted = False  # preempt() was called: the next batch start stops the fit
        # Asynchronous machinery for max_staleness=0 too: the tests use it to prove both modes agree.
        self._background = max_staleness > 0
        self._tokenizer: Any = None
        self._rank = 0
        self._version_at_batch_start = 0
        self._context_limit: tuple[int, str] | None = None
        # Dynamic sampling: the refill prompts (a second pass over the train prompts) and, per batch
        # index, the counts of its rollout until the batch is trained.
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
                f"RolloutCallback.temperature={self.sampling.temperature} differs from the module's "
                f"temperature={policy_temperature}: the trainer would score another distribution than the "
                "engine samples. Set both to the same value."
            )
        if self._background and (self.engine is None or getattr(self.engine, "share_weights", False)):
            raise ValueError(
                f"RolloutCallback(max_staleness={self.max_staleness}) generates in the background while the trainer "
                "updates the weights, so the engine needs its own copy of them: use HFProcessEngine (generation in "
                "its own process, the fastest on a CPU with a core to spare), VLLMEngine, or "
                "HFEngine(dtype='float32' / 'bfloat16') instead of an HFEngine that shares the module's weights."
            )
        if self.partial_rollouts and not callable(getattr(self.engine, "interrupt", None)):
            raise ValueError(
                f"RolloutCallback.partial_rollouts=True needs an engine that can be interrupted (an `interrupt()` "
                f"method); {type(self.engine).__name__} has none. Use HFProcessEngine, HFEngine(dtype=...), "
                "VLLMEngine or RemoteVLLMEngine, or set partial_rollouts=False."
            )
        self._rank = trainer.global_rank

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._preempted = False  # a preemption during the sanity check still stops the training that follows
        # Here, not in setup: configure_model (which loads a model given by name) runs in between.
        # Checks of what would otherwise crash inside generate, after the training started.
        policy = getattr(pl_module, "policy", None)
        if policy is None:
            return
        check_vocab(policy, pl_module.tokenizer)
        self._context_limit = context_limit(policy, self.engine)
        check_context(self.sampling.max_new_tokens, self._context_limit)
        # Every prompt of the data, before the first step (DatasetDataModule: each row named by file and line).
        check_lengths = getattr(trainer.datamodule, "check_prompt_lengths", None)
        if callable(check_lengths) and self._context_limit is not None:
            check_lengths(pl_module.tokenizer, self.sampling.max_new_tokens, self._context_limit)

    def _engine(self, pl_module: LightningModule) -> RolloutEngine:
        if self.engine is None:
            self.engine = HFEngine()
        if hasattr(self.engine, "set_special_tokens"):
            # Stop where the model's generation config says (a chat model's end-of-turn id included),
            # as transformers and vLLM do, besides the tokenizer's eos.
            eos_ids = generation_eos_ids(pl_module.policy)
            eos = pl_module.tokenizer.eos_token_id
            self.engine.set_special_tokens(
                pl_module.tokenizer.pad_token_id,
                eos if eos is not None else (eos_ids[0] if eos_ids else None),
                stop_token_ids=eos_ids,
            )
        self._tokenizer = pl_module.tokenizer
        return self.engine

    # ------------------------------------------------------------------------------ the step
    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.dapo.dynamic_sampling:
            refill_source = trainer.fit_loop._data_source.dataloader()
            self._refill_prompts = prompt_batches(
                refill_source, trainer.global_rank, trainer.world_size, skip=0, seed=self.seed + 1
            )
        if not self._background:
            return
        # Here, not in on_fit_start: a resumed run's state (policy version, batches trained) is
        # restored by now under every strategy.
        engine = self._engine(pl_module)
        version = int(pl_module.policy_version)
        engine.update_weights(pl_module.policy, version)
        # A fresh loader of the same dataset and sampler settings, for the producer thread alone:
        # `trainer.train_dataloader` is the fit loop's own, and set_epoch on its DistributedSampler
        # from this thread would race with the loop. Lightning has no public way to ask for another.
        source = trainer.fit_loop._data_source.dataloader()
        self.producer = RolloutProducer(
            produce=self._produce,
            prompt_batches=prompt_batches(
                source, trainer.global_rank, trainer.world_size, skip=self.generated_batches, seed=self.seed
            ),
            max_staleness=self.max_staleness,
            steps_per_batch=_steps_per_batch(pl_module),
            first_index=self.generated_batches,
            trainer_version=version,
            engine_version=version,
            interrupt=engine.interrupt if self.partial_rollouts else None,
        )
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
        if is_logging_step(trainer, batch_idx, _steps_per_batch(pl_module)):
            self._log_staleness_histogram(trainer, version, produced.rollout)

    def preempt(self) -> None:
        """Cut the rollout in flight short for a preemption (thread-safe; PreemptionCheckpoint calls it on SIGTERM).

        The engine's ``generate`` call in flight returns at once where the engine is interruptible
        (a remote request that hangs too), the background producer starts no new request, and the batch
        whose rollout was cut is not trained: its ``on_train_batch_start`` raises Lightning's
        ``SIGTERMException``, so the state saved is that of the last completed batch.
        """
        self._preempted = True
        if self.producer is not None:
            self.producer.request_stop()  # with partial rollouts this interrupts the request in flight too
        if isinstance(self.engine, InterruptibleEngine):
            self.engine.interrupt()

    def _unless_preempted(self, trainer: Trainer, work: Callable[[], _T]) -> _T:
        """What ``work`` (the batch's generation) returns; if :meth:`preempt` cut it short, raise Lightning's
        ``SIGTERMException`` instead (the batch is not trained, nothing of it logged).

        Under several ranks every rank stops at the same batch: a rank whose generation was cut would
        otherwise leave the others waiting in the training step's collectives. A rank the signal did not
        reach finishes its generation first.
        """
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
        """Log the sync self-check's max |engine - trainer| probe logprob difference as ``rollout/sync_probe_diff``."""
        diff = getattr(self.engine, "last_sync_check_max_abs_diff", None)
        if diff is not None:
            self.last_timing["sync_probe_diff"] = float(diff)

    def _pipeline(self) -> Rollouter:
        """The rollout pipeline with the callback's current settings (the seed is restored on resume)."""
        return Rollouter(
            self.engine,
            self._tokenizer,
            self.reward_fn,
            self.sampling,
            advantage_estimator=self.advantage_estimator,
            seed=self.seed,
            context_limit=self._context_limit,
            success_threshold=self.success_threshold,
            dapo=self.dapo,
            more_prompts=None if self._refill_prompts is None else lambda: next(self._refill_prompts),
            turn=self.producer.generation_turn if self.producer is not None and self.producer.interrupts else None,
            reward_timeout_s=self.reward_timeout_s,
            stop=lambda: self._preempted,
        )

    def _produce(self, prompts: PromptBatch, index: int) -> tuple[RolloutBatch, float]:
        """Generate and score batch ``index`` with the engine's current weights (any thread)."""
        pipeline = self._pipeline()
        rollout, generate_s = pipeline.rollout(prompts, index, self._rank)
        if pipeline.last_stats:
            self._sampling_stats[index] = pipeline.last_stats
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
            self._log_timing(trainer, pl_module, batch_idx)
        if isinstance(batch, PromptBatch) and batch.rollout is not None and batch.rollout.reward_components:
            self._log_reward_components(trainer, pl_module, batch.rollout.reward_components)
        if isinstance(batch, PromptBatch):
            batch.rollout = None  # free the rollout's tensors before the loader's next batch

    def _log_timing(self, trainer: Trainer, pl_module: LightningModule, batch_idx: int) -> None:
        """``rollout/*`` timings on the batches whose values reach the logger; the progress bar's every batch."""
        timing = dict(self.last_timing)
        self.last_timing = {}
        generate_s = max(timing.pop("generate_s"), 1e-9)
        tokens_per_s = timing.pop("tokens") / generate_s
        # The step already ran: global_step counts its optimizer steps.
        logging = is_logging_step(trainer, batch_idx, _steps_per_batch(pl_module), steps_done=True)
        if logging or trainer.progress_bar_callback is not None:
            pl_module.log("gen_tok/s", tokens_per_s, prog_bar=True, batch_size=1, logger=False)
        if not logging:
            return
        values = {"rollout/generate_s": generate_s, "rollout/tokens_per_s": tokens_per_s}
        values.update({f"rollout/{name}": value for name, value in timing.items()})
        pl_module.log_dict(values, on_step=True, on_epoch=False, batch_size=1)

    def _log_reward_components(
        self, trainer: Trainer, pl_module: LightningModule, components: dict[str, torch.Tensor]
    ) -> None:
        """``reward/<name>``: each weighted part's mean over the step's completions of every rank (exact)."""
        sums = torch.stack([v.double().sum() for v in components.values()])
        counts = torch.tensor([float(v.numel()) for v in components.values()], dtype=torch.float64)
        totals = torch.cat([sums, counts]).to(pl_module.device)
        if trainer.world_size > 1:  # every rank has the same parts, in the same order
            totals = trainer.strategy.reduce(totals, reduce_op="sum")
        means = totals[: len(components)] / totals[len(components) :].clamp(min=1)
        for name, mean in zip(components, means, strict=True):
            pl_module.log(f"reward/{name}", mean.float(), on_step=True, on_epoch=False, batch_size=1, sync_dist=False)

    def _after_async_step(self, pl_module: LightningModule) -> None:
        version = int(pl_module.policy_version)
        self.producer.observe_steps_per_batch(version - self._version_at_batch_start)
        if version - self.producer.engine_version < self.sync_every:
            return
        started = time.perf_counter()
        # Waits for the generation request in flight, or interrupts it (partial_rollouts).
        with self.producer.engine_access():
            self.engine.update_weights(pl_module.policy, version)
            self.producer.set_engine_version(version)
        self.last_timing["sync_s"] = time.perf_counter() - started
        self._record_sync_probe_diff()

    def _log_staleness_histogram(self, trainer: Trainer, version: int, rollout: RolloutBatch) -> None:
        tokens = rollout.response_mask.bool()
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger) and tokens.any():
                staleness = (version - rollout.policy_version[tokens]).float()
                logger.experiment.add_histogram("staleness/hist", staleness, global_step=trainer.global_step)

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


def _steps_per_batch(pl_module: LightningModule) -> int:
    """Policy versions one training batch advances (the module's ``optimizer_steps_per_batch``, default 1)."""
    return int(getattr(pl_module, "optimizer_steps_per_batch", 1))
