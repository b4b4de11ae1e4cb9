"""The weight-sync conformance matrix: does each engine have the trainer's weights after a sync?

For one model (a tiny random model of a family, or of the user's own config), every cell moves
every parameter of the trainer's copy, syncs it into an engine, and compares what the engine
computes with what the trainer computes:

* vLLM engines (in-process, each transport; LoRA merged): the engine's temperature-1 logprobs of
  the sync probe against the trainer's (float32 engine: within :data:`FLOAT32_ATOL`), and the two
  transports bit-identical on the same weights;
* the trainer's own forwards (packed micro-batches, the fused head: what changes how the trainer
  scores a sequence) against a float64 reference of the model's logits;
* vLLM applying a LoRA adapter itself (``weight_sync.lora="adapter"``: the base once, then the adapter);
* a local ``vllm serve`` (:func:`~lightning_offpolicy.rollout.vllm.server.launch_local_server`) synced by
  :class:`~lightning_offpolicy.rollout.RemoteVLLMEngine` through files, the same probe comparison;
* the embedded HF engines (:class:`~lightning_offpolicy.rollout.HFEngine`,
  :class:`~lightning_offpolicy.rollout.HFProcessEngine`): every engine tensor equal to the
  trainer's cast to the engine's dtype.

A cell that raises is reported with its reason, never skipped silently; a setting the kit refuses up
front (a ``ValueError`` naming it) reads ``refused``, with the reason. The why and the families
checked: docs/training.md, "Weight sync across model families".
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from lightning_offpolicy.rollout.vllm.settings import RemoteWeightSyncSettings, StartSettings, WeightSyncSettings
from lightning_offpolicy.rollout.vllm.sync.check import trainer_probe_logprobs

__all__ = [
    "CELLS",
    "FLOAT32_ATOL",
    "Cell",
    "MATRIX_START",
    "check_hf_engines",
    "check_lora_adapter",
    "check_server",
    "check_trainer_paths",
    "check_vllm",
    "move_every_parameter",
]

#: Largest accepted |engine - trainer| probe logprob with both in float32 (nats).
FLOAT32_ATOL = 1e-4

#: Every cell, in the order of the table (``check_vllm`` fills the first four).
CELLS = (
    "vllm memory",
    "vllm file",
    "vllm memory == file",
    "vllm lora merged",
    "vllm lora adapter",
    "vllm server file",
    "hf bfloat16",
    "hf-process",
    "trainer packed / fused head",
)


@dataclass
class Cell:
    """One engine x transport (or option) of one model: ``ok``, or why not.

    Attributes:
        name: The cell, one of :data:`CELLS`.
        ok: Whether the engine had the trainer's weights, or the kit refused the cell's setting up front
            (``detail`` starts with ``refused:`` and names it).
        max_abs_diff: Largest |engine - trainer| probe logprob (nats; for tensor checks, the largest
            element difference); ``None`` where nothing was compared.
        detail: Why not (the error or the measured excess), or a note.
    """

    name: str
    ok: bool
    max_abs_diff: float | None = None
    detail: str = ""


#: How the matrix's engines and server start: float32, a small context and cache (CPU-friendly).
MATRIX_START = StartSettings(dtype="float32", max_model_len=256)


@torch.no_grad()
def move_every_parameter(model: torch.nn.Module, seed: int, scale: float = 0.05) -> None:
    """Add seeded noise of relative size ``scale`` to every floating parameter (tied ones once).

    Relative to each tensor's own spread, so norms near 1 and small projections all move visibly.
    """
    generator = torch.Generator().manual_seed(seed)
    seen: set[int] = set()
    for param in model.parameters():  # shared parameters are listed once
        if not param.is_floating_point() or id(param) in seen:
            continue
        seen.add(id(param))
        spread = float(param.float().std()) if param.numel() > 1 else 0.0
        noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
        param.add_((noise * scale * (spread if spread > 0 else 1.0)).to(param.dtype))


def _probe_cell(name: str, engine_lp: torch.Tensor, trainer_lp: torch.Tensor, atol: float) -> Cell:
    diff = float((engine_lp - trainer_lp).abs().max())
    ok = math.isfinite(diff) and diff <= atol
    return Cell(name, ok, diff, "" if ok else f"engine and trainer differ by {diff:.3g} nats (accepted {atol:g})")


#: What a cell reads as the kit refusing a setting up front (named in the message), not as a failure.
REFUSED = (ValueError, NotImplementedError)


def _attempt(name: str, run: Callable[[], Cell | list[Cell]]) -> list[Cell]:
    try:
        out = run()
    except REFUSED as err:  # refused clearly before anything ran: the cell passes, saying so
        return [Cell(name, True, None, f"refused: {err}".splitlines()[0][:300])]
    except Exception as err:  # noqa: BLE001 - every failure is a row of the table, with its reason
        return [Cell(name, False, None, f"{type(err).__name__}: {err}".splitlines()[0][:300])]
    return out if isinstance(out, list) else [out]


def check_vllm(
    model: torch.nn.Module,
    start: StartSettings = MATRIX_START,
    lora: bool = True,
    engine: object | None = None,
) -> list[Cell]:
    """The vLLM cells of ``model`` (float32): memory, file, memory == file, LoRA merged.

    One in-process engine serves every cell (started from ``model`` unless ``engine`` is given;
    it is closed at the end only if started here). ``model`` is moved in place.
    """
    from lightning_offpolicy.rollout.vllm.inprocess import VLLMEngine

    own = engine is None
    if engine is None:
        engine = VLLMEngine(
            model=None,
            start=start,
            eos_token_id=0,
            weight_sync=WeightSyncSettings(check=False),  # the matrix measures the difference itself
        )
    cells: list[Cell] = []
    try:
        (started,) = _attempt("vllm start", lambda: _start(engine, model))
        if not started.ok or started.detail.startswith("refused:"):  # every cell of this engine, for that reason
            return [Cell(name, started.ok, None, started.detail) for name in CELLS[: 4 if lora else 3]]
        probe = engine._probe()

        def sync(transport: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
            move_every_parameter(model, seed)
            engine.weight_transport = transport
            engine.update_weights(model, seed)
            return engine._engine_probe_logprobs(probe), trainer_probe_logprobs(model, probe)

        state_before: dict[str, torch.Tensor] = {}

        def file_then_memory() -> list[Cell]:
            file_engine, file_trainer = sync("file", 1)
            state_before.update({k: v.clone() for k, v in model.state_dict().items()})
            memory_engine, memory_trainer = sync("memory", 2)
            out = [
                _probe_cell("vllm memory", memory_engine, memory_trainer, FLOAT32_ATOL),
                _probe_cell("vllm file", file_engine, file_trainer, FLOAT32_ATOL),
            ]
            # The file sync's weights again, through memory: the same engine, bit for bit.
            model.load_state_dict(state_before)
            engine.weight_transport = "memory"
            engine.update_weights(model, 3)
            again = engine._engine_probe_logprobs(probe)
            same = torch.equal(again, file_engine)
            worst = float((again - file_engine).abs().max())
            out.append(Cell("vllm memory == file", same, worst, "" if same else f"differ by {worst:.3g} nats"))
            return out

        cells += _attempt("vllm memory", file_then_memory)
        if lora:
            cells += _attempt("vllm lora merged", lambda: _lora_merged(engine, model, probe))
    finally:
        if own:
            engine.close()
    return cells


def _start(engine: object, model: torch.nn.Module) -> Cell:
    begin = time.perf_counter()
    engine.update_weights(model, 0)
    return Cell("vllm start", True, None, f"{time.perf_counter() - begin:.0f} s")


def _with_lora(model: torch.nn.Module, attention_only: bool, seed: int) -> torch.nn.Module:
    """A peft LoRA copy of ``model`` (rank 8) on its decoder's projections, with non-zero adapters."""
    import copy

    from peft import LoraConfig, get_peft_model

    targets = sorted(
        {
            name.rsplit(".", 1)[-1]
            for name, module in model.named_modules()
            if _is_projection(name, module) and (".self_attn." in name or not attention_only)
        }
    )
    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(r=8, lora_alpha=16, target_modules=targets))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:  # peft starts B at zero: give the adapter something to apply
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    return peft_model


def _lora_merged(engine: object, model: torch.nn.Module, probe: list[int]) -> Cell:
    """A peft LoRA copy of ``model`` with non-zero adapters, synced merged into the same engine."""
    peft_model = _with_lora(model, attention_only=False, seed=7)
    engine.weight_transport = "memory"
    engine.update_weights(peft_model, 4)
    engine_lp = engine._engine_probe_logprobs(probe)
    cell = _probe_cell("vllm lora merged", engine_lp, trainer_probe_logprobs(peft_model, probe), FLOAT32_ATOL)
    engine.update_weights(model, 5)  # back to the plain model for whatever comes next
    return cell


def _is_projection(name: str, module: torch.nn.Module) -> bool:
    """Attention and MLP linear layers inside the decoder (what LoRA usually targets)."""
    return isinstance(module, torch.nn.Linear) and ".layers." in name and "gate" != name.rsplit(".", 1)[-1]


def check_lora_adapter(model: torch.nn.Module, start: StartSettings = MATRIX_START) -> Cell:
    """The ``vllm lora adapter`` cell: an engine with vLLM's LoRA support started from a peft copy of ``model``
    (LoRA on the attention projections), then a sync of a moved adapter, applied by vLLM (float32)."""
    return _attempt("vllm lora adapter", lambda: _lora_adapter_cell(model, start))[0]


def _lora_adapter_cell(model: torch.nn.Module, start: StartSettings) -> Cell:
    from lightning_offpolicy.rollout.vllm.inprocess import VLLMEngine

    peft_model = _with_lora(model, attention_only=True, seed=8)
    engine = VLLMEngine(
        model=None, start=start, eos_token_id=0, weight_sync=WeightSyncSettings(lora="adapter", check=False)
    )
    try:
        engine.update_weights(peft_model, 0)  # starts from the base, loads the first adapter
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_" in name:
                    param.add_(torch.randn_like(param) * 0.05)
        engine.update_weights(peft_model, 1)
        probe = engine._probe()
        engine_lp = engine._engine_probe_logprobs(probe)
        return _probe_cell("vllm lora adapter", engine_lp, trainer_probe_logprobs(peft_model, probe), FLOAT32_ATOL)
    finally:
        engine.close()


def check_server(model: torch.nn.Module, start: StartSettings = MATRIX_START) -> Cell:
    """The ``vllm server file`` cell: a local server started from ``model``'s checkpoint, then a sync of moved
    weights through :class:`~lightning_offpolicy.rollout.RemoteVLLMEngine` (float32). ``model`` is moved."""
    return _attempt("vllm server file", lambda: _server_cell(model, start))[0]


def _server_cell(model: torch.nn.Module, start: StartSettings) -> Cell:
    import tempfile

    from lightning_offpolicy.rollout.vllm.remote import RemoteVLLMEngine
    from lightning_offpolicy.rollout.vllm.server import launch_local_server

    with tempfile.TemporaryDirectory(prefix="lightning_offpolicy_check_model_") as tmp:
        model.save_pretrained(f"{tmp}/model")
        server = launch_local_server(f"{tmp}/model", start=start)
        try:
            engine = RemoteVLLMEngine(
                server.base_url, weight_sync=RemoteWeightSyncSettings(weights_dir=f"{tmp}/sync", check=False)
            )
            try:
                move_every_parameter(model, 21)
                engine.update_weights(model, 1)
                probe = engine._probe(model)
                return _probe_cell(
                    "vllm server file",
                    engine._engine_probe_logprobs(probe),
                    trainer_probe_logprobs(model, probe),
                    FLOAT32_ATOL,
                )
            finally:
                engine.close()
        finally:
            server.close()


def check_hf_engines(model: torch.nn.Module, which: Iterable[str] = ("hf bfloat16", "hf-process")) -> list[Cell]:
    """The embedded HF engines' cells: after a sync of moved weights, every engine tensor is the trainer's
    (cast to the engine's dtype), tied ones included. ``model`` is moved in place."""
    cells = []
    for name in which:
        cells += _attempt(name, lambda name=name: _hf_cell(name, model))
    return cells


def _hf_cell(name: str, model: torch.nn.Module) -> Cell:
    from lightning_offpolicy.rollout import HFEngine, HFProcessEngine

    if name == "hf bfloat16":
        engine = HFEngine(dtype="bfloat16", eos_token_id=0, pad_token_id=0)
    else:
        engine = HFProcessEngine(eos_token_id=0, pad_token_id=0)
    try:
        engine.update_weights(model, 0)
        move_every_parameter(model, 11)
        engine.update_weights(model, 1)
        worst = 0.0
        stale = []
        engine_state = engine.model.state_dict()
        for key, value in model.state_dict().items():
            theirs = engine_state[key]
            mine = value.to(theirs.dtype)
            if not torch.equal(mine, theirs):
                stale.append(key)
                worst = max(worst, float((mine.float() - theirs.float()).abs().max()))
        return Cell(name, not stale, worst, f"stale: {', '.join(stale[:4])}" if stale else "")
    finally:
        engine.close()


@torch.no_grad()
def check_trainer_paths(model: torch.nn.Module, length: int = 24) -> Cell:
    """The trainer's logprobs of two sequences under every forward it may use (logits or fused head,
    padded or packed) against ``log_softmax`` of the model's own logits in float64.

    A path the model does not allow counts as passed when it is refused with its reason (the kit
    then uses another): the cell's detail names it.
    """
    from lightning_offpolicy.logprobs import causal_lm_token_logprobs

    return _attempt("trainer packed / fused head", lambda: _trainer_paths(model, length, causal_lm_token_logprobs))[0]


def _trainer_paths(model: torch.nn.Module, length: int, score: Callable) -> Cell:
    name = "trainer packed / fused head"
    vocab = int(model.get_input_embeddings().weight.shape[0])
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(0, vocab, (2, length), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, : length // 3] = 0  # a left-padded prompt: packing and position ids matter
    start = length // 2
    model.eval()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits.double()
    reference = logits[:, start - 1 : -1].log_softmax(-1).gather(-1, ids[:, start:, None]).squeeze(-1)
    worst, refused = 0.0, []
    for fused in (False, True):
        for packed in (False, True):
            try:
                lp = score(model, ids, mask, start, fused_head=fused, packed=packed)
            except (ValueError, NotImplementedError) as err:
                refused.append(f"{'fused' if fused else 'logits'}{' packed' if packed else ''}: {err}")
                continue
            worst = max(worst, float((lp.double() - reference).abs().max()))
    ok = worst <= FLOAT32_ATOL
    detail = "" if ok else f"a trainer path differs from the model's logits by {worst:.3g} nats"
    if refused:
        detail = "; ".join([detail, *(f"refused {r}" for r in refused)]).strip("; ")[:300]
    return Cell(name, ok, worst, detail)
