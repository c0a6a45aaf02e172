"""vLLM adapter: the only package of true_on_policy that imports vLLM.

Switched on by one channel, ``TRUE_ON_POLICY=1`` in the environment of the vLLM
processes; the ``vllm.general_plugins`` entry point (plugin.register) is inert
without it. When on, Qwen3ForCausalLM and Qwen3MoeForCausalLM run our model class
(model.py: the trainer's layer math, attention backend attention.py), and the
engine config is completed so reported log-probs are the contract's (sampling.py).
The rules it shares with the verl adapter and the check live in true_on_policy.scheme.

    plugin.py         register(): architectures, attention backend, config hook
    engine_config.py  the config hook: pre-flight checks, logprobs mode, processor
    model.py          TrueOnPolicyForCausalLM (models.CausalLM + vLLM plumbing)
    attention.py      backend over consistent_ops.attention_paged, KV layout
    sampling*.py      temperature scheme: contract log-probs as logits processor
    logprob_graphs.py the processor's log-softmax as CUDA-graph replays (the tail)
    ascend.py         vLLM-Ascend specifics
"""
