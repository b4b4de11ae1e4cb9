"""The GPU check's report: one section per part, its figures against the limits."""

from __future__ import annotations

import math
from typing import Any

from gpu_check_parts import LOGIT_STD, LOGPROB_CHUNK, LOGPROB_GPU, PARTS


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _gb(x: Any) -> str:
    return f"{x / 2**30:.2f}" if _finite(x) else "-"


def _num(x: Any, fmt: str = ".4g") -> str:
    return format(x, fmt) if _finite(x) else "-"


def render(data: dict) -> str:
    h = data["header"]
    out = [f"# {h['title']}", ""]
    out += [
        f"* **Device**: {h.get('device_name') or '-'} ({_gb(h.get('device_memory_bytes'))} GiB), "
        f"torch {h.get('torch_runtime') or h['versions'].get('torch')}, CUDA {h.get('cuda') or '-'}",
        "* **Versions**: " + ", ".join(f"{k} {v}" for k, v in h["versions"].items()),
        f"* **Machine**: {h['machine']}",
        f"* **Date**: {h['date']}; **code**: {h['code']}",
        f"* **Command**: `{h['command']}`",
        f"* **Wall time**: {h['elapsed_s']:.0f} s of a {h['budget_s']:.0f} s budget",
        "",
        "Every part ran in its own subprocess (a fresh CUDA context, so its peak memory is its own). Peak "
        "memory is `torch.cuda.max_memory_allocated()` (on CPU, `--cpu-smoke`: the process's peak RSS). "
        "The model is random-weight, shaped like Qwen2.5-1.5B-Instruct: the figures are about the "
        "machinery (memory, time, finite numbers), not about learning.",
        "",
        "In the fit tables, `loss` is the mean over a batch's optimizer steps of the sum of their micro-batch "
        "losses (the module logs no loss: a wrapper around `lightning_offpolicy.train.step.corrected_loss` records "
        "it). GRPO advantages have zero mean per group and the PPO ratio starts at 1, so the loss is near 0 "
        "by construction; the gradient norm shows that the backward ran. The other columns are the logged "
        "`train/*`, `rollout_corr/kl`, `ppo/*`, `perf/step_s` (the training step), `rollout/generate_s` "
        "scalars; `batch wall s` is the time between two batches' logs.",
        "",
    ]
    parts = data["parts"]
    ck = parts.get("checkpoint", {})
    out += ["## Checkpoint", ""]
    if ck.get("status") == "ok":
        cfg = ck["config"]
        out.append(
            f"Qwen2 {cfg.get('num_hidden_layers')} layers, hidden {cfg.get('hidden_size')}, MLP "
            f"{cfg.get('intermediate_size')}, {cfg.get('num_attention_heads')} heads / "
            f"{cfg.get('num_key_value_heads')} KV heads, vocabulary {cfg.get('vocab_size')}, tied embeddings "
            f"{ck['tied_embeddings']}: {ck['params'] / 1e9:.4g}B parameters, {ck['checkpoint_bytes'] / 1e9:.3g} GB "
            f"on disk (bf16), a {ck['tokenizer_ids']}-id BPE tokenizer with ChatML; built in {ck['total_s']:.1f} s. "
            f"Random weights; the rows beyond the tokenizer zeroed and the final norm scaled by "
            f"{LOGIT_STD / ck['logit_std_before']:.2f} (logit std {ck['logit_std_before']:.2f} -> {LOGIT_STD}): "
            f"next-token entropy on a chat prompt {ck['next_token_entropy']:.2f} nats, "
            f"{ck['next_token_mass_in_tokenizer']:.3f} of the probability on the tokenizer's ids."
        )
    else:
        out.append(_failure(ck))
    out.append("")
    for name, title in (("fsdp", "configs/fsdp.yaml"), ("lora", "configs/lora_single_gpu.yaml")):
        part = parts.get(name, {})
        out += [f"## `{title}`", ""]
        out.append(data["notes"][name])
        out.append("")
        if "rows" not in part:
            out += [_failure(part), ""]
            continue
        if part.get("status") != "ok":
            out += [f"**Problems**: {part.get('error')}", ""]
        out.append(
            f"Fit wall time {part['wall_s']:.1f} s (model load, {part['batches_trained']} batches, the final "
            f"checkpoint of {part['checkpoint_bytes'] / 1e9:.2f} GB); peak allocated "
            f"**{_gb(part['peak_allocated_bytes'])} GiB**, peak reserved {_gb(part.get('peak_reserved_bytes'))} GiB."
        )
        out += [
            "",
            "| batch | optimizer steps | loss | grad norm | reward | rollout_corr/kl | ppo/approx_kl | clip frac "
            "| entropy | resp. len | step s | generate s | batch wall s | train tok/s | generated tok/s |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in part["rows"]:
            out.append(
                f"| {r['batch']} | {_num(r.get('policy_version'), '.0f')} | {_num(r.get('loss'))} "
                f"| {_num(r.get('grad_norm'))} | {_num(r.get('reward'))} | {_num(r.get('rollout_kl'))} "
                f"| {_num(r.get('approx_kl'))} | {_num(r.get('clip_frac'))} | {_num(r.get('entropy'))} "
                f"| {_num(r.get('response_length'), '.1f')} | {_num(r.get('step_s'), '.3f')} "
                f"| {_num(r.get('generate_s'), '.3f')} | {_num(r.get('batch_wall_s'), '.3f')} "
                f"| {_num(r.get('train_tokens_per_s'), '.0f')} | {_num(r.get('generated_tokens_per_s'), '.0f')} |"
            )
        out.append("")
    lp = parts.get("logprobs", {})
    vocab = lp["rows"][0]["vocab"] if lp.get("rows") else LOGPROB_GPU[1]
    out += [f"## Token logprobs at V = {vocab} (hidden states -> logprobs, forward + backward)", ""]
    if "rows" not in lp:
        out += [_failure(lp), ""]
    else:
        out += [
            "bf16 hidden states `[1, T, H]` and head weight `[V, H]` (both requiring grad). eager: "
            "`log_softmax(linear(h, W).float() / t).gather(...)`; lean: `token_logprobs(linear(h, W), ...)` "
            f"(chunk {LOGPROB_CHUNK}, the trainer's fallback); fused: `fused_linear_token_logprobs` (the "
            "trainer's default, no logits). Peak extra: peak allocated during the step minus what was "
            "allocated before it, `hidden.grad` and `weight.grad` included; `x logits`: in units of one bf16 "
            f"`[T, V]` logits tensor. Best of {data['header']['repeats']} steps after a warm-up. "
            "`max |diff|`: against float32 `log_softmax` on the first 64 rows.",
            "",
            "| T | method | time fwd+bwd (ms) | peak extra (GiB) | x logits | max abs diff |",
            "|---:|---|---:|---:|---:|---:|",
        ]
        for r in lp["rows"]:
            if "error" in r:
                out.append(f"| {r['tokens']} | {r['method']} | {r['error']} | | | |")
                continue
            out.append(
                f"| {r['tokens']} | {r['method']} | {r['time_s'] * 1e3:.2f} | {_gb(r['peak_extra_bytes'])} "
                f"| {r['peak_extra_x_logits']:.3f} | {r['max_abs_diff_fp32']:.1e} |"
            )
        out += ["", "| T | eager / fused peak | eager / fused time | lean / fused peak | lean / fused time |"]
        out.append("|---:|---:|---:|---:|---:|")
        for r in lp["ratios"]:
            out.append(
                f"| {r['tokens']} | {_num(r.get('eager_over_fused_peak'), '.2f')} "
                f"| {_num(r.get('eager_over_fused_time'), '.2f')} | {_num(r.get('lean_over_fused_peak'), '.2f')} "
                f"| {_num(r.get('lean_over_fused_time'), '.2f')} |"
            )
        out.append("")
    out += ["## Status", "", "| part | status | seconds | error |", "|---|---|---:|---|"]
    for name in PARTS:
        p = parts.get(name, {"status": "not run"})
        err = (p.get("error") or "").replace("|", "/").replace("\n", " ")[:300]
        out.append(f"| {name} | {p.get('status')} | {_num(p.get('elapsed_s'), '.1f')} | {err} |")
    out.append("")
    return "\n".join(out)


def _failure(part: dict) -> str:
    if not part:
        return "Not run."
    text = f"**{part.get('status', 'not run')}**: {part.get('error', '')}"
    tail = part.get("log_tail")
    if tail:
        text += "\n\n```\n" + "\n".join(tail.strip().splitlines()[-25:]) + "\n```"
    return text
