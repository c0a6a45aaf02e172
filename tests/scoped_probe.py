"""Run by test_scoped_patches.py in a fresh process (TRUE_ON_POLICY as the test sets it):
builds verl's real FSDP engines (one-rank gloo group) for the actor (language model) and
the critic (value model), and a Qwen3 model outside them, then prints, as one JSON line,
which class each is and which verl functions are in place.

    python tests/scoped_probe.py MODEL_DIR
"""
import json
import sys
import tempfile

import torch
import torch.distributed as dist


def engine(model_type, path):
    from verl.workers.config import FSDPEngineConfig, HFModelConfig
    from verl.workers.engine.base import EngineRegistry
    model_config = HFModelConfig(path=path, use_remove_padding=True, override_config={"attn_implementation": "sdpa"})
    model_config.model_type = model_type  # as verl's TrainingWorker sets it
    engine_config = FSDPEngineConfig(strategy="fsdp2", forward_only=True, model_dtype="fp32")
    return EngineRegistry.new(model_type=model_type, backend="fsdp2", model_config=model_config,
                              engine_config=engine_config, optimizer_config=None, checkpoint_config=None)


def linear_count(model):
    return sum(isinstance(m, torch.nn.Linear) for m in model.modules())


def main(path):
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    import transformers
    import verl.trainer.main_ppo  # noqa: F401  (the driver module, as a job imports it)
    import verl.trainer.ppo.ray_trainer as ray_trainer
    import verl.trainer.ppo.v1.trainer_base as trainer_base
    import verl.utils.config as verl_config
    import verl.utils.debug.metrics as debug_metrics
    import verl.utils.torch_functional as verl_F
    import verl.workers.engine.fsdp.transformer_impl as impl

    actor = engine("language_model", path)._build_module()
    critic = engine("value_model", path)._build_module()
    outside = transformers.AutoModelForCausalLM.from_pretrained(path)
    from peft import LoraConfig, get_peft_model
    lora = get_peft_model(outside, LoraConfig(target_modules="all-linear", r=2))
    import vllm
    import verl.workers.rollout.vllm_rollout.vllm_async_server as server
    # verl's request (vllm_async_server.generate) at T = 0.7
    params = server.SamplingParams(max_tokens=8, temperature=0.7, top_p=1.0, top_k=-1, logprobs=0,
                                   repetition_penalty=1.0, ignore_eos=False, seed=3,
                                   extra_args={"kv_transfer_params": {"a": 1}})
    wrapped = {"vllm_async_server.SamplingParams": server.SamplingParams,
               "vLLMHttpServer.run_server": server.vLLMHttpServer.run_server,"validate_config": verl_config.validate_config,
               "engine.logprobs_from_logits": impl.logprobs_from_logits,
               "torch_functional.logprobs_from_logits": verl_F.logprobs_from_logits,
               "FSDPEngine._build_module": impl.FSDPEngine._build_module,
               "debug_metrics.calculate_debug_metrics": debug_metrics.calculate_debug_metrics,
               "RayPPOTrainer.__init__": ray_trainer.RayPPOTrainer.__init__,
               "trainer_base.calculate_debug_metrics": trainer_base.calculate_debug_metrics,
               "PPOTrainer.__init__": trainer_base.PPOTrainer.__init__}
    print(json.dumps({
        "actor": type(actor).__module__ + "." + type(actor).__name__,
        "critic": type(critic).__module__ + "." + type(critic).__name__,
        "outside": type(outside).__module__ + "." + type(outside).__name__,
        "outside_linears": linear_count(outside),
        "lora_layers": sum(type(m).__name__ == "Linear" and hasattr(m, "lora_A") for m in lora.modules()),
        "sampling": [type(params) is vllm.SamplingParams, params.max_tokens, params.logprobs, params.seed,
                     params.extra_args["kv_transfer_params"]],
        "patched": sorted(name for name, fn in wrapped.items() if getattr(fn, "_true_on_policy", False)),
        "auto_mapping_extra": sorted(c.__name__ for c in
                                     transformers.AutoModelForCausalLM._model_mapping._extra_content),
    }))


if __name__ == "__main__":
    main(sys.argv[1])
