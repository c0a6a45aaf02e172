"""The vLLM model class for Qwen3 / Qwen3-MoE: models.CausalLM plus vLLM's plumbing.

The layer math, parameter names and weight loading are models.CausalLM's, i.e. the
trainer's. What this class adds is only what vLLM needs:
  * the constructor vLLM calls (``vllm_config``), with this rank's TensorParallel
    over vLLM's TP group (row-parallel partials gathered and summed in rank order,
    experts exchanged by owner, vocab shards concatenated: the trainer emulates the
    same k shards in one process, so TP=k equals the trainer bitwise);
  * one vLLM ``Attention`` per layer, built with our backend (attention.py) and
    passed to the shared layers as the ``attend`` callable;
  * plain ``nn.Parameter``s and our own matmuls: no ``quant_method``, so vLLM's CPU
    repacking (which empties ``layer.weight``) never touches them, and verl's
    in-place ``load_weights`` of full HF tensors keeps working after start-up;
  * nothing for the experts: each MoE layer keeps them stacked (models.qwen3.Experts,
    transformers 5's layout), as vLLM's fused MoE does, and the grouped kernels read the
    stacks in place;
  * CUDA graphs: the forward holds no host sync (the attention backend declares which
    batches capture), so vLLM's padded capture sizes replay it.
"""
import logging

import torch

import consistent_ops as co
from consistent_ops.contract import TILED_BACKENDS, attention_scale
from true_on_policy import sync_check
from true_on_policy.models import CausalLM, ModelConfig, TensorParallel
from true_on_policy.models.causal_lm import LM_HEAD, sync_names
from true_on_policy.models.qwen3 import fuse
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size, get_tp_group
from vllm.distributed.kv_transfer import has_kv_transfer_group
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention

from .attention import ConsistentAttentionBackend, ConsistentAttentionMetadata

log = logging.getLogger("vllm.true_on_policy")  # under vLLM's logger: same handler and format

def model_config_from_vllm(vllm_config: VllmConfig) -> ModelConfig:
    """The shared ModelConfig, with the dtype vLLM runs in (the trainer must use the same)."""
    cfg = ModelConfig.from_hf(vllm_config.model_config.hf_config.to_dict())
    cfg.dtype = vllm_config.model_config.dtype
    return cfg


def tensor_parallel_from_vllm() -> TensorParallel:
    size = get_tensor_model_parallel_world_size()
    if size == 1:
        return TensorParallel()
    return TensorParallel(size=size, rank=get_tensor_model_parallel_rank(), group=get_tp_group().device_group)


def _cpu_kernels() -> str:
    """On the reference backend: which build of the CPU kernels runs and on how many threads (a
    slow CPU rollout often means an emulated build or a thread count the binding did not intend)."""
    if co.backend_name() != "reference":
        return ""
    from consistent_ops.reference import native
    return f", CPU kernels {native.build_isa()} ({native.accumulation()}), {torch.get_num_threads()} threads"


class TrueOnPolicyForCausalLM(CausalLM):
    """Registered for Qwen3ForCausalLM and Qwen3MoeForCausalLM when TRUE_ON_POLICY=1."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        cfg, tp = model_config_from_vllm(vllm_config), tensor_parallel_from_vllm()
        super().__init__(cfg, tp)
        for i, layer in enumerate(self.model.layers):
            # Name = the HF-style path, so vLLM finds exactly one layer index in it.
            layer.self_attn.attn = Attention(
                num_heads=cfg.num_heads // tp.size, head_size=cfg.head_dim,
                scale=attention_scale(cfg.head_dim), num_kv_heads=cfg.num_kv_heads // tp.size,
                cache_config=vllm_config.cache_config, prefix=f"model.layers.{i}.self_attn.attn",
                attn_backend=ConsistentAttentionBackend)
            # Python calls, not torch.ops: the opaque op only serves torch.compile, which never traces
            # this eager model, and its dispatch cost ~30 us a layer of a CPU decode step.
            layer.self_attn.attn.use_direct_call = True
        fuse(self.model)      # plain modules here (no trainer wrappers or adapters)
        # CPU decode steps: each layer one native call (co.decode_layer), the cache and metadata read here
        self.layer_calls = co.backend_name() == "reference" and tp.size == 1
        # else decode steps store k and v from the attention prologue where the backend's has that (Triton)
        self.prologue_writes = not self.layer_calls and getattr(co.get_backend(), "qk_norm_rope", None) is not None
        self.paths_logged = set()      # decode paths taken, each logged once (check's plugin_log reads them)
        # reported by the worker (plugin.py); the model's numerics in it, as the trainer's (scoring.Scoring)
        self.contract_fingerprint = co.contract_fingerprint(cfg.numerics())
        self.logits_warm = co.backend_name() not in TILED_BACKENDS   # nothing to compile (warm_logits)
        log.info("true_on_policy: %s TP %d/%d, consistent_ops %s%s", cfg.arch, tp.rank, tp.size,
                 self.contract_fingerprint, _cpu_kernels())

    def load_weights(self, weights):
        """verl's in-place sync lands here too; in debug mode (sync_check) it is checksummed."""
        if not sync_check.enabled():
            return super().load_weights(weights)
        if not hasattr(self, "_sync_receiver"):
            self._sync_receiver = sync_check.Receiver()
        held, stacks = sync_names(self)
        if self.cfg.tie_word_embeddings:
            held.discard(LM_HEAD)       # set from the embedding's tensor
        return super().load_weights(self._sync_receiver.filter(weights, held, lambda n: stacks.get(n, (n,))))

    def _attend(self, layer_idx, q, k, v):
        """[T, Hq, D], [T, Hkv, D] -> [T, Hq, D] through vLLM's Attention (cache write + paged attention)."""
        out = self.model.layers[layer_idx].self_attn.attn(q, k, v)
        return out.view(q.shape)

    def _decode_step(self, layer_idx):
        """(vLLM's Attention layer, its metadata, its slot mapping) for this layer's step when the step is
        a decode step, one attention call over every row (ConsistentAttentionImpl.forward's single group of
        one new token per request), and nothing else hooks the layer's attention (a KV connector: vLLM's
        layer then runs); else None."""
        attn = self.model.layers[layer_idx].self_attn.attn
        ctx = get_forward_context()
        meta, slots = ctx.attn_metadata, ctx.slot_mapping
        if isinstance(meta, dict):
            meta = meta.get(attn.layer_name)
        if (not isinstance(meta, ConsistentAttentionMetadata) or len(meta.groups) != 1 or meta.groups[0].rows is not None
                or meta.groups[0].max_query_len != 1 or not isinstance(slots, dict) or not isinstance(attn.kv_cache, torch.Tensor)):
            return None
        slots = slots.get(attn.layer_name)
        if slots is None or has_kv_transfer_group():
            return None
        return attn, meta, slots

    def _log_path(self, path):
        """Once per path: the engine's log shows it was taken (on the GPU at graph capture)."""
        if path not in self.paths_logged:
            self.paths_logged.add(path)
            log.info("true_on_policy: %s", path)

    def _paged(self, layer_idx):
        """At a decode step (_decode_step's), what vLLM's Attention layer would pass the backend
        (Qwen3Model.forward's paged): (K, V cache views, slot mapping, block table, seq_lens,
        query_start_loc); else None. The layer then writes and reads the cache itself, as
        do_kv_cache_update and forward do."""
        step = self._decode_step(layer_idx)
        if step is None:
            return None
        attn, meta, slots = step
        self._log_path("decode steps run each layer as one native call (co.decode_layer)")
        g = meta.groups[0]
        return (*attn.impl.caches(attn.kv_cache), slots[:meta.num_tokens], g.block_table, g.seq_lens, g.query_start_loc)

    def _cache(self, layer_idx):
        """At a decode step (_decode_step's), the layer's (K, V cache views, slot mapping) as
        do_kv_cache_update gets them (-1 on padded rows): its attention prologue may store k and v there
        (Attention.qkv), and attend then gets k = v = None, which makes vLLM's Attention skip its cache
        update and run the attention alone."""
        step = self._decode_step(layer_idx)
        if step is None:
            return None
        attn, _, slots = step
        self._log_path("decode steps store K/V from the attention prologue (no write_kv_cache launch)")
        return (*attn.impl.caches(attn.kv_cache), slots)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids, self.cfg.dtype)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **_):
        if intermediate_tensors is not None:
            raise NotImplementedError("true_on_policy: pipeline parallelism is not supported")
        return self.model(input_ids, positions, self._attend, hidden=inputs_embeds,
                          paged=self._paged if self.layer_calls else None,
                          cache=self._cache if self.prologue_writes else None)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """fp32 logits, identical on every TP rank (each rank runs the sampler). The first call
        (vLLM's sampler warm-up, before it serves) warms every batch size up to its own first."""
        if not self.logits_warm:
            self.logits_warm = True
            warm_logits(super().compute_logits, hidden_states)
        return super().compute_logits(hidden_states)


def warm_logits(compute_logits, hidden_states):
    """Run the logits and the contract's log-probs at every batch size up to hidden_states'
    rows, so that Triton compiles each kernel variant they take (tile configs chosen by rows,
    rows % 16, one row or many temperatures, vocab limits % 16, the log-softmax's lane groups,
    which change with rows at powers of two) now: they run outside vLLM's CUDA graphs, and on the
    H200 their compiles otherwise landed mid-rollout (vLLM's JIT monitor: `_gemm_kernel`,
    `_log_softmax_kernel`), as the batch shrank through new sizes."""
    n = hidden_states.shape[0]
    if n == 0:
        return
    with torch.no_grad():
        for m in range(1, n + 1):
            logits = compute_logits(hidden_states[:m])
        for rows in sorted({n, *(1 << i for i in range(n.bit_length()))}):   # powers of two <= n, and n
            for vocab_limit in (logits.shape[-1], logits.shape[-1] - 1):
                co.log_softmax(logits[:rows], torch.ones(rows, device=logits.device), vocab_limit)
