"""The same processor for vLLM's V2 model runner (CUDA default in vLLM 0.31).

V2 runs custom processors after bias/penalties and before temperature, min-p and
top-k/top-p, and skips the temperature kernel when every request is at 0 or 1, so
the scheme of sampling.py (temperature, truncation, seeded draws) carries over unchanged. Kept
apart because the V2 interface module does not exist in older vLLM (e.g. the 0.23
that vLLM-Ascend uses).
"""
import torch

import consistent_ops as co

from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsProcessor

from true_on_policy import scheme, seeded_draw

from .sampling import (contract_logprobs, rollout_seed_key, rollout_temperature, rollout_truncation,
                       tokenizer_length, validate)


class ContractLogProbsV2(LogitsProcessor):
    @classmethod
    def validate_params(cls, sampling_params):
        validate(sampling_params)

    def __init__(self, vllm_config, req_states):
        self.vocab_limit = tokenizer_length(vllm_config.model_config)
        n = req_states.max_num_reqs
        self.staged = torch.ones(n, dtype=torch.float32)   # slot -> T (host)
        self.temperature = self.staged.to(req_states.device)
        # slot -> (top_k, top_p, min_p) (host, then device); off until a request truncates
        self.staged_cut = (torch.zeros(n, dtype=torch.int64), torch.ones(n, dtype=torch.float64),
                           torch.zeros(n, dtype=torch.float32))
        self.cut = tuple(t.to(req_states.device) for t in self.staged_cut)
        self.any_cut = False
        # slot -> seed key words and whether the slot's draws are seeded (host, then device)
        self.staged_keys = torch.zeros(n, scheme.SEED_WORDS, dtype=torch.int64)
        self.staged_seeded = torch.zeros(n, dtype=torch.bool)
        self.keys, self.seeded = self.staged_keys.to(req_states.device), self.staged_seeded.to(req_states.device)
        self.any_seeded = False

    def add_request(self, req_idx: int, sampling_params) -> bool:
        self.staged[req_idx] = scheme.logprob_temperature(rollout_temperature(sampling_params))
        settings = rollout_truncation(sampling_params)
        for column, value in zip(self.staged_cut, settings):
            column[req_idx] = value
        self.any_cut = self.any_cut or co.truncation_active(*settings)
        key = rollout_seed_key(sampling_params)
        self.staged_seeded[req_idx] = key is not None
        if key is not None:
            self.staged_keys[req_idx] = torch.tensor(key, dtype=torch.int64)
            self.any_seeded = True
        return True   # every row must become the contract's log-probs

    def apply_staged_writes(self) -> None:
        self.temperature.copy_(self.staged, non_blocking=True)
        for dst, src in zip(self.cut, self.staged_cut):
            dst.copy_(src, non_blocking=True)
        self.keys.copy_(self.staged_keys, non_blocking=True)
        self.seeded.copy_(self.staged_seeded, non_blocking=True)

    def apply(self, logits: torch.Tensor, ctx) -> torch.Tensor:
        rows = ctx.expanded_idx_mapping
        cut = tuple(c[rows] for c in self.cut) if self.any_cut else None
        logp = contract_logprobs(logits, self.temperature[rows], self.vocab_limit, cut)
        if not self.any_seeded:
            return logp
        # ctx.pos: the row's last input token; the drawn token goes one further (as on V1)
        return seeded_draw.pin(logp, self.keys[rows], ctx.pos.to(torch.int64) + 1, self.seeded[rows])
