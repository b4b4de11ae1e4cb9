"""Self-check: every correction preset on real model outputs, with a real training-inference gap.

A tiny Llama-architecture model (built from a config, no download) samples completions as the
"engine" in bfloat16 with slightly older weights; the "trainer" re-scores them in float32 with
the current weights. That is the gap the kit corrects: precision mismatch plus staleness. For
each preset (with the PPO loss), and for the DPPO losses of :data:`LOSS_CHECKS`, the check runs
``compute_correction`` -> ``policy_loss`` -> backward through the model -> metrics, verifies the
invariants a user relies on, prints a table and writes TensorBoard events.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

import torch

from lightning_offpolicy.batch import RolloutBatch
from lightning_offpolicy.correction import PRESETS, PolicyLossConfig, compute_correction, policy_loss
from lightning_offpolicy.demo.tiny import build_tiny_llama
from lightning_offpolicy.logprobs import causal_lm_token_logprobs
from lightning_offpolicy.metrics.correction import CorrectionMetrics, PolicyLossMetrics
from lightning_offpolicy.rollout import HFEngine, SamplingConfig

PAD_ID, EOS_ID = 0, 2

LOSS_CHECKS: dict[str, tuple[str, PolicyLossConfig]] = {
    # prime-rl's default loss: DPPO-TV against pi_rollout (bypass) plus its squared log ratio (k2).
    "bypass+dppo_tv": ("bypass", PolicyLossConfig(loss_type="dppo_tv", rollout_kl_coef=2e-3)),
    # verl's dppo_kl: against pi_prox, the ratio capped at its clip_ratio_c, times a token TIS weight.
    "token_tis+dppo_kl": (
        "token_tis",
        PolicyLossConfig(loss_type="dppo_kl", dppo_delta_low=0.05, dppo_delta_high=0.05, dppo_ratio_cap=3.0),
    ),
}
"""The policy losses checked besides PPO: row name -> (correction preset, loss)."""


def sharpened_tiny_llama(seed: int = 0, sharpness: float = 60.0) -> torch.nn.Module:
    """The kit's tiny Llama, its output layer scaled to the confidence of a trained model.

    A freshly initialised model is nearly uniform, so a weight gap would barely show in its logprobs.
    """
    model = build_tiny_llama(seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpness)
    return model


def sample_rollout(
    trainer_model: torch.nn.Module, batch: int, prompt_length: int, new_tokens: int, staleness_noise: float, seed: int
) -> RolloutBatch:
    """Completions from a bfloat16 engine holding older weights, with parity rewards and advantages."""
    stale = copy.deepcopy(trainer_model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        # Older weights: a perturbation standing in for optimizer steps not yet pushed to the engine.
        for param in stale.parameters():
            param.add_(staleness_noise * param.std() * torch.randn(param.shape, generator=generator))
    engine = HFEngine(dtype="bfloat16", pad_token_id=PAD_ID, eos_token_id=EOS_ID)
    engine.update_weights(stale, version=0)
    vocab = trainer_model.config.vocab_size
    prompts = torch.randint(3, vocab, (batch, prompt_length), generator=generator).tolist()
    completions = engine.generate(prompts, SamplingConfig(max_new_tokens=new_tokens, samples_per_prompt=1), seed=seed)
    rewards = torch.tensor([float(sum(t % 2 == 0 for t in c.token_ids)) for c in completions])
    return RolloutBatch.from_sequences(
        prompt_ids=prompts,
        response_ids=[c.token_ids for c in completions],
        rewards=rewards,
        advantages=(rewards - rewards.mean()) / (rewards.std() + 1e-6),
        group_ids=[0] * batch,
        policy_versions=[0] * batch,
        rollout_logprobs=[c.logprobs for c in completions],
        pad_token_id=PAD_ID,
    )


def response_logprobs(model: torch.nn.Module, rollout: RolloutBatch) -> torch.Tensor:
    return causal_lm_token_logprobs(model, rollout.input_ids, rollout.attention_mask, rollout.prompt_length)


def run(batch: int, prompt_length: int, new_tokens: int, staleness_noise: float, seed: int, logdir: str | None) -> int:
    trainer_model = sharpened_tiny_llama(seed=seed)
    rollout = sample_rollout(trainer_model, batch, prompt_length, new_tokens, staleness_noise, seed)
    with torch.no_grad():
        prox = response_logprobs(trainer_model, rollout)
    advantages = rollout.advantages

    writer = None
    if logdir:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(logdir)
    width = max(len(name) for name in [*PRESETS, *LOSS_CHECKS]) + 2
    header = f"{'preset':<{width}}" + (
        f"{'kl':>10}{'chi2_tok':>10}{'ess':>7}{'w_mean':>8}{'reject':>8}{'loss':>10}{'grad':>9}{'ms':>7}"
    )
    print(
        f"tiny Llama: {sum(p.numel() for p in trainer_model.parameters()) / 1e6:.2f}M params | "
        f"{batch} completions x {new_tokens} tokens | engine bf16 + stale weights (noise {staleness_noise})"
    )
    print(header)
    print("-" * len(header))
    failures: list[str] = []
    rows = [(name, make, PolicyLossConfig(rollout_kl_coef=0.01)) for name, make in PRESETS.items()]
    rows += [(name, PRESETS[correction], loss_cfg) for name, (correction, loss_cfg) in LOSS_CHECKS.items()]
    for step, (name, make, loss_cfg) in enumerate(rows):
        cfg = make()
        trainer_model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        logprobs = response_logprobs(trainer_model, rollout)
        out = compute_correction(
            cfg.ratio_numerator(prox, logprobs), rollout.rollout_logprobs, rollout.response_mask, cfg
        )
        loss, info = policy_loss(
            logprobs,
            None if cfg.bypass_mode else prox,
            rollout.rollout_logprobs,
            advantages,
            rollout.response_mask,
            loss_cfg,
            correction=out,
        )
        loss.backward()
        elapsed_ms = 1e3 * (time.perf_counter() - start)
        grad_norm = torch.sqrt(sum(p.grad.square().sum() for p in trainer_model.parameters() if p.grad is not None))
        corr, ppo = CorrectionMetrics(cfg), PolicyLossMetrics(cfg)
        corr.update(stats=out.stats)
        ppo.update(info=info)
        values = {k: float(v) for k, v in {**corr.compute(), **ppo.compute()}.items()}
        # Every mask, the loss's OPSM included: the response tokens that did not reach the loss.
        reject = 1.0 - float(info.kept_tokens) / max(float(info.response_tokens), 1.0)
        failures += _invariants(name, out, loss, grad_norm, rollout.response_mask)
        print(
            f"{name:<{width}}{values['rollout_corr/kl']:>10.2e}{values['rollout_corr/chi2_token']:>10.4f}"
            f"{values['rollout_corr/ess']:>7.3f}{values['rollout_corr/is_weight_mean']:>8.3f}"
            f"{reject:>8.3f}{float(loss.detach()):>10.4f}{float(grad_norm):>9.4f}"
            f"{elapsed_ms:>7.1f}"
        )
        if writer is not None:
            for key, value in values.items():
                writer.add_scalar(f"{name}/{key}", value, step)
            writer.add_scalar(f"{name}/loss", float(loss.detach()), step)
    if writer is not None:
        writer.close()
        print(f"TensorBoard events: {logdir}  (tensorboard --logdir {logdir})")
    if failures:
        print("\nFAILED invariants:\n  " + "\n  ".join(failures))
        return 1
    print(
        f"\nall {len(PRESETS)} presets passed, and the DPPO losses ({', '.join(LOSS_CHECKS)}): finite loss and "
        "gradients, detached weights, masks only remove"
    )
    return 0


def _invariants(name, out, loss, grad_norm, response_mask) -> list[str]:
    problems = []
    if not torch.isfinite(loss):
        problems.append(f"{name}: loss is not finite ({float(loss)})")
    if not torch.isfinite(grad_norm):
        problems.append(f"{name}: gradient is not finite")
    if out.weights.requires_grad:
        problems.append(f"{name}: IS weights carry gradient")
    if bool((out.mask > response_mask).any()):
        problems.append(f"{name}: a mask added tokens")
    if not torch.isfinite(out.weights).all():
        problems.append(f"{name}: IS weights are not finite")
    return problems


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, default=64, help="number of sampled completions")
    parser.add_argument("--prompt-length", type=int, default=8, help="random prompt tokens per completion")
    parser.add_argument("--new-tokens", type=int, default=48, help="tokens sampled per completion")
    parser.add_argument("--staleness-noise", type=float, default=0.01, help="relative weight gap of the engine")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--logdir", default="runs/selfcheck", help="TensorBoard directory ('' to skip)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lightning-offpolicy selfcheck", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    return run(args.batch, args.prompt_length, args.new_tokens, args.staleness_noise, args.seed, args.logdir or None)


if __name__ == "__main__":
    sys.exit(main())
