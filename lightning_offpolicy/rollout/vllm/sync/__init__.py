"""The weight sync of the vLLM engines, trainer side: one place for the path the trainer's weights take.

The weights as the engine loads them (:mod:`.export`, :mod:`.peft_export` for LoRA), the in-process
engine's transports (:mod:`.in_process`: shared memory, :mod:`.shared_weights`, or files), a server's
(:mod:`.remote`: files; :mod:`.transfer`: vLLM's GPU-to-GPU weight transfer), LoRA adapters applied by
vLLM (:mod:`.lora`, :mod:`.remote_lora`), and the self-check after every sync (:mod:`.check`). What a
sync does is set by the engine's ``weight_sync`` settings (:mod:`lightning_offpolicy.rollout.vllm.settings`);
the receiver inside the engine is :mod:`lightning_offpolicy.rollout.vllm.worker_extension`. The flow:
docs/architecture.md.
"""
