"""Shared builders for the module tests: a tiny model, a rollout batch, a float64 reference step."""

from __future__ import annotations

import copy
import math

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_offpolicy.batch import RolloutBatch
from lightning_offpolicy.data.tokenizers import CharTokenizer
from lightning_offpolicy.demo.tiny import build_tiny_llama

TOKENIZER = CharTokenizer()

#: How the in-process 2-rank tests start their ranks: forked from the test process, which has imported
#: torch, Lightning, transformers and the kit already. Spawned ranks import them again (~8 s of CPU
#: each on 2 cores); the ranks and their gloo collectives are the same. tests/test_async_rollout.py
#: keeps ``ddp_spawn`` (the module, the callback and its engine pickled to the ranks), and the CLI
#: tests start ``ddp`` ranks as new processes, as a user's run does.
TWO_RANK_STRATEGY = "ddp_fork"
TWO_RANK_START_METHOD = "fork"


def make_rollout(model: torch.nn.Module, seed: int = 0, rows: int = 6, mismatch: float = 0.3) -> RolloutBatch:
    """Random prompts / responses of varied lengths; rollout logprobs = model logprobs + noise."""
    gen = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for _ in range(rows):
        p_len = int(torch.randint(2, 6, (1,), generator=gen))
        r_len = int(torch.randint(1, 7, (1,), generator=gen))
        prompts.append(torch.randint(3, 60, (p_len,), generator=gen).tolist())
        responses.append(torch.randint(3, 60, (r_len,), generator=gen).tolist())
    true_lp = [reference_logprobs(model, p, r).float() for p, r in zip(prompts, responses, strict=True)]
    rollout_lp = [(lp + mismatch * torch.randn(lp.shape, generator=gen)).tolist() for lp in true_lp]
    rewards = torch.rand(rows, generator=gen)
    advantages = torch.randn(rows, generator=gen)
    return RolloutBatch.from_sequences(
        prompt_ids=prompts,
        response_ids=responses,
        rewards=rewards,
        advantages=advantages,
        group_ids=list(range(rows)),
        policy_versions=[0] * rows,
        rollout_logprobs=rollout_lp,
        pad_token_id=TOKENIZER.pad_token_id,
    )


def reference_logprobs(model: torch.nn.Module, prompt: list[int], response: list[int]) -> torch.Tensor:
    """One unpadded row, teacher-forced, in the model's own dtype (no batching, no chunking)."""
    ids = torch.tensor([prompt + response])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def rows_of(batch: RolloutBatch) -> list[tuple[list[int], list[int], torch.Tensor, float]]:
    """(prompt, response, rollout logprobs, advantage) per row, unpadded."""
    out = []
    for i in range(batch.num_sequences):
        prompt = batch.input_ids[i, : batch.prompt_length][batch.attention_mask[i, : batch.prompt_length].bool()]
        n = int(batch.response_mask[i].sum())
        response = batch.input_ids[i, batch.prompt_length : batch.prompt_length + n]
        out.append(
            (
                prompt.tolist(),
                response.tolist(),
                batch.rollout_logprobs[i, :n].double(),
                float(batch.advantages[i, 0]),
            )
        )
    return out


def reference_decoupled_sgd(
    model: torch.nn.Module,
    batch: RolloutBatch,
    minibatches: list[list[int]],
    lr: float,
    tis_cap: float,
    eps_low: float,
    eps_high: float,
) -> torch.nn.Module:
    """Hand-written decoupled PPO with token TIS, token-mean, plain SGD, in float64.

    pi_prox is the model before the first update; every mini-batch is one SGD step normalised by
    its own response-token count.
    """
    ref = copy.deepcopy(model).double()
    rows = rows_of(batch)
    with torch.no_grad():
        prox = [reference_logprobs(ref, p, r) for p, r, _, _ in rows]
    for minibatch in minibatches:
        ref.zero_grad()
        total = torch.zeros((), dtype=torch.float64)
        count = sum(len(rows[i][1]) for i in minibatch)
        for i in minibatch:
            prompt, response, rollout, adv = rows[i]
            logp = reference_logprobs(ref, prompt, response)
            for t in range(len(response)):
                w = min(math.exp(float(prox[i][t] - rollout[t])), tis_cap)
                ratio = torch.exp(logp[t] - prox[i][t])
                clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
                total = total + w * torch.maximum(-adv * ratio, -adv * clipped)
        (total / count).backward()
        with torch.no_grad():
            for param in ref.parameters():
                if param.grad is not None:
                    param -= lr * param.grad
    return ref


def identity(x):
    return x


def fit_on(module: L.LightningModule, batches: list, max_steps: int, **trainer_kwargs) -> L.Trainer:
    ckpt_path = trainer_kwargs.pop("ckpt_path", None)  # for fit; the rest are the Trainer's
    trainer = L.Trainer(
        accelerator="cpu",
        devices=trainer_kwargs.pop("devices", 1),
        max_steps=max_steps,
        logger=trainer_kwargs.pop("logger", False),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_kwargs,
    )
    trainer.fit(module, DataLoader(batches, batch_size=None, collate_fn=identity), ckpt_path=ckpt_path)
    return trainer


def fused_step_on_aot_eager(monkeypatch) -> None:
    """The module's fused step traced and differentiated as always (dynamo, AOT autograd) but run op by op
    (``aot_eager``): for tests of what the module does with the fused step. What inductor's generated code
    computes is tests/test_fused_correction.py's (every preset) and one inductor fit of test_module.py's."""
    import functools

    import lightning_offpolicy.train.micro_step as micro_step
    from lightning_offpolicy.correction.fused import FusedCorrectionStep

    monkeypatch.setattr(micro_step, "FusedCorrectionStep", functools.partial(FusedCorrectionStep, backend="aot_eager"))


def tiny_model(seed: int = 0) -> torch.nn.Module:
    model = build_tiny_llama(seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # a peaked policy, like a trained model
    return model


@torch.no_grad()
def argmax_completion(model: torch.nn.Module, prompt: list[int], max_new_tokens: int, eos: int) -> list[int]:
    """Greedy decoding by hand: one unpadded row, no KV cache, the argmax of the last logits step by step."""
    ids, out = list(prompt), []
    for _ in range(max_new_tokens):
        token = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
        ids.append(token)
        out.append(token)
        if token == eos:
            break
    return out


def perturbed(model: torch.nn.Module, scale: float, seed: int = 1) -> torch.nn.Module:
    """A copy of ``model`` with Gaussian noise of ``scale`` added to every parameter (another policy version)."""
    other = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(scale * torch.randn(p.shape, generator=generator))
    return other
