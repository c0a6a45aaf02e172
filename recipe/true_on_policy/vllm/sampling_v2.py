"""The same processor for vLLM's V2 model runner (CUDA default in vLLM 0.31).

V2 runs custom processors after bias/penalties and before temperature, min-p and
top-k/top-p, and skips the temperature kernel when every request is at 0 or 1, so
the scheme of sampling.py carries over unchanged. Kept apart because the V2
interface module does not exist in older vLLM (e.g. the 0.23 that vLLM-Ascend uses).
"""
import torch

from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsProcessor

from true_on_policy import scheme

from .sampling import contract_logprobs, rollout_temperature, tokenizer_length, validate


class ContractLogProbsV2(LogitsProcessor):
    @classmethod
    def validate_params(cls, sampling_params):
        validate(sampling_params)

    def __init__(self, vllm_config, req_states):
        self.vocab_limit = tokenizer_length(vllm_config.model_config)
        self.staged = torch.ones(req_states.max_num_reqs, dtype=torch.float32)   # slot -> T (host)
        self.temperature = self.staged.to(req_states.device)

    def add_request(self, req_idx: int, sampling_params) -> bool:
        self.staged[req_idx] = scheme.logprob_temperature(rollout_temperature(sampling_params))
        return True   # every row must become the contract's log-probs

    def apply_staged_writes(self) -> None:
        self.temperature.copy_(self.staged, non_blocking=True)

    def apply(self, logits: torch.Tensor, ctx) -> torch.Tensor:
        return contract_logprobs(logits, self.temperature[ctx.expanded_idx_mapping], self.vocab_limit)
