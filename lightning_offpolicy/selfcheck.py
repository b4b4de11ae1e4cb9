"""Self-check: every correction preset on real model outputs, with a real training-inference gap.

A tiny Llama-architecture model (built from a config, no download) samples completions as the
"engine" in bfloat16 with slightly older weights; the "trainer" re-scores them in float32 with
the current weights. That is the gap the kit corrects: precision mismatch plus staleness. For
each preset the check runs ``compute_correction`` -> ``policy_loss`` -> backward through the
model -> metrics, verifies the invariants a user relies on, prints a table and writes TensorBoard
events.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from dataclasses import dataclass

import torch

from lightning_offpolicy.correction import PRESETS, PolicyLossConfig, compute_correction, policy_loss
from lightning_offpolicy.metrics import CorrectionMetrics, PolicyLossMetrics


@dataclass
class Rollout:
    """Sampled completions and the per-token logprobs of the engine that sampled them."""

    sequences: torch.Tensor  # [B, P + T]
    prompt_length: int
    response_mask: torch.Tensor  # [B, T]
    rollout_logprobs: torch.Tensor  # [B, T]


def build_tiny_llama(vocab_size: int = 64, seed: int = 0, sharpness: float = 60.0) -> torch.nn.Module:
    """A random 2-layer Llama with head_dim 64 (the shape vLLM's CPU attention accepts)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        # A freshly initialised model is nearly uniform; sharpen it to the confidence of a trained one.
        model.lm_head.weight.mul_(sharpness)
    return model


def token_logprobs(model: torch.nn.Module, sequences: torch.Tensor, prompt_length: int) -> torch.Tensor:
    """Teacher-forced logprobs of the response tokens ``sequences[:, prompt_length:]``."""
    logits = model(input_ids=sequences).logits[:, prompt_length - 1 : -1].float()
    targets = sequences[:, prompt_length:]
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


@torch.no_grad()
def sample(engine: torch.nn.Module, batch: int, prompt_length: int, new_tokens: int, seed: int) -> Rollout:
    """Ancestral sampling at temperature 1, recording the engine's logprob of each sampled token."""
    gen = torch.Generator().manual_seed(seed)
    vocab = engine.config.vocab_size
    sequences = torch.randint(3, vocab, (batch, prompt_length), generator=gen)
    logprobs, finished = [], torch.zeros(batch, dtype=torch.bool)
    mask = []
    past = None
    step_input = sequences
    for _ in range(new_tokens):
        out = engine(input_ids=step_input, past_key_values=past, use_cache=True)
        past = out.past_key_values
        step_logprobs = torch.log_softmax(out.logits[:, -1].float(), dim=-1)
        token = torch.multinomial(step_logprobs.exp(), 1, generator=gen).squeeze(-1)
        mask.append(~finished)
        logprobs.append(step_logprobs.gather(-1, token.unsqueeze(-1)).squeeze(-1))
        token = torch.where(finished, torch.zeros_like(token), token)
        finished |= token == engine.config.eos_token_id
        sequences = torch.cat([sequences, token.unsqueeze(-1)], dim=-1)
        step_input = token.unsqueeze(-1)
    response_mask = torch.stack(mask, dim=-1).float()
    rollout_logprobs = torch.where(response_mask.bool(), torch.stack(logprobs, dim=-1), torch.nan)
    return Rollout(sequences, prompt_length, response_mask, rollout_logprobs)


def run(
    batch: int, prompt_length: int, new_tokens: int, staleness_noise: float, seed: int, logdir: str | None
) -> int:
    trainer_model = build_tiny_llama(seed=seed)
    # The engine: older weights (a perturbation standing in for optimizer steps not yet pushed),
    # run in bfloat16 as inference engines do.
    engine = copy.deepcopy(trainer_model)
    with torch.no_grad():
        for param in engine.parameters():
            param.add_(staleness_noise * param.std() * torch.randn_like(param))
    engine = engine.to(torch.bfloat16)

    rollout = sample(engine, batch, prompt_length, new_tokens, seed)
    with torch.no_grad():
        prox = token_logprobs(trainer_model, rollout.sequences, prompt_length)
    rewards = (rollout.sequences[:, prompt_length:] % 2 == 0).float().mul(rollout.response_mask).sum(-1)
    advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-6)

    writer = None
    if logdir:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(logdir)
    header = (
        f"{'preset':<18}{'kl':>10}{'chi2_tok':>10}{'ess':>7}{'w_mean':>8}{'reject':>8}"
        f"{'loss':>10}{'grad':>9}{'ms':>7}"
    )
    print(
        f"tiny Llama: {sum(p.numel() for p in trainer_model.parameters()) / 1e6:.2f}M params | "
        f"{batch} completions x {new_tokens} tokens | engine bf16 + stale weights (noise {staleness_noise})"
    )
    print(header)
    print("-" * len(header))
    failures: list[str] = []
    for step, (name, make) in enumerate(PRESETS.items()):
        cfg = make()
        trainer_model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        out = compute_correction(
            None if cfg.bypass_mode else prox, rollout.rollout_logprobs, rollout.response_mask, cfg
        )
        logprobs = token_logprobs(trainer_model, rollout.sequences, prompt_length)
        loss, info = policy_loss(
            logprobs,
            None if cfg.bypass_mode else prox,
            rollout.rollout_logprobs,
            advantages,
            rollout.response_mask,
            PolicyLossConfig(rollout_kl_coef=0.01),
            correction=out,
        )
        loss.backward()
        elapsed_ms = 1e3 * (time.perf_counter() - start)
        grad_norm = torch.sqrt(
            sum(p.grad.square().sum() for p in trainer_model.parameters() if p.grad is not None)
        )
        corr, ppo = CorrectionMetrics(cfg), PolicyLossMetrics()
        corr.update(stats=out.stats)
        ppo.update(info=info)
        values = {k: float(v) for k, v in {**corr.compute(), **ppo.compute()}.items()}
        failures += _invariants(name, out, loss, grad_norm, rollout.response_mask)
        print(
            f"{name:<18}{values['rollout_corr/kl']:>10.2e}{values['rollout_corr/chi2_token']:>10.4f}"
            f"{values['rollout_corr/ess']:>7.3f}{values['rollout_corr/is_weight_mean']:>8.3f}"
            f"{values['rollout_corr/total_token_reject_rate']:>8.3f}{float(loss.detach()):>10.4f}{float(grad_norm):>9.4f}"
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
        f"\nall {len(PRESETS)} presets passed: finite loss and gradients, detached weights, masks only remove"
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
    parser.add_argument(
        "--staleness-noise", type=float, default=0.01, help="relative weight gap of the engine"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--logdir", default="runs/selfcheck", help="TensorBoard directory ('' to skip)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="lightning-offpolicy selfcheck", description=__doc__.splitlines()[0]
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    return run(
        args.batch, args.prompt_length, args.new_tokens, args.staleness_noise, args.seed, args.logdir or None
    )


if __name__ == "__main__":
    sys.exit(main())
