"""The MoE itself: a decoder with Qwen3-MoE tensor names, so its safetensors load in transformers and vLLM.

    config.py, model.py, layers.py, moe.py   the model (MoEConfig, MoEModel, router with replay)
    fp8.py                                    DeepSeek-V3 block-scaled FP8 (DeepGEMM where installed)
    kvcache.py, cached_forward.py, native.py  the engine's KV-cached decode (forward_cached.c)
    parallelize.py, expert_parallel.py, context_parallel.py   FSDP2, EP and CP plans
    state_dict_adapter.py, weights.py         Hub names and safetensors
    determinism.py                            settings that make a step bitwise reproducible

Model math only: no serving, no bus, no I/O beyond safetensors bytes.
"""
