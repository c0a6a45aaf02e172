"""Run by tests/test_megatron.py in .venv-megatron: 2 gloo ranks build Megatron GPTModels from
tiny HF checkpoints (Qwen3-MoE, Qwen3 dense) through Megatron-Bridge, for each trainer layout
(TP, EP) and rollout TP; rank 0 writes JSON comparisons against our rollout model.
Usage: MOE_CKPT DENSE_CKPT OUT.json"""
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

LAYOUTS = {"moe": [(2, 2), (1, 2)], "dense": [(2, 1)]}      # trainer (TP, EP) on 2 ranks
ROLLOUT_TP = [1, 2]
ENGINE_CUT = {2: (0, 0.9, 0.0)}      # trainer TP -> the rollout's (top_k, top_p, min_p) in engine_check
LENS = {0: [5, 7, 4], 1: [3, 9, 4]}   # per data-parallel rank (TP ranks share theirs)


def batch(dp_rank):
    lens = LENS[dp_rank]
    g = torch.Generator().manual_seed(dp_rank)
    ids = torch.randint(0, 1000, (sum(lens),), generator=g)
    return ids, torch.cat([torch.arange(n) for n in lens]), torch.tensor([0] + lens).cumsum(0).int()


def fresh_attention_env():
    """Each GPTModel asserts the NVTE_* variables its attention_backend sets (TE's, unused by
    our spec) are unset or its own; models of different backends are built in one process here."""
    for name in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
        os.environ.pop(name, None)


def build(path, tp, ep, rollout_tp, stock=False):
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection
    from true_on_policy.megatron import env, spec
    bridge_mod = env.import_bridge()
    ps.destroy_model_parallel()
    fresh_attention_env()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    bridge = bridge_mod.AutoBridge.from_hf_pretrained(path)
    provider = bridge.to_megatron_provider(load_weights=False)
    provider.tensor_model_parallel_size, provider.expert_model_parallel_size = tp, ep
    provider.sequence_parallel = tp > 1           # Megatron requires it for MoE with TP
    provider.use_cpu_initialization, provider.params_dtype, provider.bf16 = True, torch.bfloat16, True
    if stock:       # Megatron's own modules (local spec; TE and the alltoall dispatcher need CUDA)
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        provider.transformer_layer_spec = get_gpt_layer_local_spec(
            provider.num_moe_experts, moe_grouped_gemm=False, qk_layernorm=True, normalization="RMSNorm")
        provider.moe_grouped_gemm, provider.moe_permute_fusion = False, False
        provider.moe_token_dispatcher_type, provider.expert_tensor_parallel_size = "allgather", 1
        provider.gradient_accumulation_fusion = False
    else:
        from true_on_policy.models import ModelConfig
        spec.configure_provider(provider, ModelConfig.from_dir(path), rollout_tp)
    provider.finalize()
    provider._pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    model = provider.provide()
    if not stock:
        spec.adopt_output_layer(model)
    bridge.load_hf_weights([model])
    return model.eval(), ps, bridge


def packed(cu):
    from megatron.core.packed_seq_params import PackedSeqParams
    n = int((cu[1:] - cu[:-1]).max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=n, max_seqlen_kv=n)


def megatron_logits(model, ps, ids, pos, cu):
    """Full-vocabulary fp32 logits [T, V] of this rank's (data-parallel) batch."""
    from consistent_ops import parallel
    with torch.no_grad():
        out = model(ids[None], pos[None], None, packed_seq_params=packed(cu))[0].float()
    return parallel.gather_concat(out, -1, ps.get_tensor_model_parallel_group())


def train_step_check(path):
    """At TP=2/EP=2 (sequence parallel, one shared batch): (1) backward through the spec:
    gradients vs the single-process trainer model's (HF names), as max relative error (not
    a bitwise claim: reduction orders differ; it checks shard slicing, sequence-parallel and
    expert-exchange backward); (2) weight export: bridge's HF export equals the checkpoint,
    and after a sign-SGD step the exported weights, loaded into the rollout model, give
    Megatron's new logits bitwise."""
    from safetensors.torch import load_file
    import consistent_ops as co
    from true_on_policy.megatron import spec
    from true_on_policy.models import ConsistentForCausalLM
    model, ps, bridge = build(path, 2, 2, 2)
    export = lambda: {k: v.clone() for k, v in bridge.export_hf_weights([model], cpu=True, show_progress=False)}
    disk = load_file(os.path.join(path, "model.safetensors"))
    before = export()
    export_exact = sorted(before) == sorted(disk) and all(torch.equal(before[k], disk[k]) for k in disk)
    ids, pos, cu = batch(0)
    labels = torch.cat([ids[1:], ids[:1]])            # any fixed targets
    logits = model(ids[None], pos[None], None, packed_seq_params=packed(cu))[0]
    tp_group = ps.get_tensor_model_parallel_group()
    whole = spec.gather_vocab(logits, tp_group)
    co.token_logprobs(whole.reshape(-1, whole.shape[-1]), labels, 0.7).sum().backward()
    ref = ConsistentForCausalLM.from_pretrained(path, tp_size=2)
    v = ref.cfg.vocab_size
    co.token_logprobs(ref.forward_packed(ids, pos).reshape(-1, v), labels, 0.7).sum().backward()
    g = {k: p.grad for k, p in ref.named_parameters()}
    tp, me = 2, ps.get_tensor_model_parallel_rank()
    first = me * (ref.cfg.num_experts // 2)

    def replicated(p):             # sequence-parallel replicated params: Megatron all-reduces
        t = p.grad.clone()
        dist.all_reduce(t, group=tp_group)
        return t

    L = "decoder.layers.0."
    mp = dict(model.named_parameters())
    pairs = {
        "router": (replicated(mp[L + "mlp.router.weight"]), g["model.layers.0.mlp.gate.weight"]),
        "input_layernorm": (replicated(mp[L + "input_layernorm.weight"]), g["model.layers.0.input_layernorm.weight"]),
        "q_layernorm": (replicated(mp[L + "self_attention.q_layernorm.weight"]),
                        g["model.layers.0.self_attn.q_norm.weight"]),
        "linear_proj": (mp[L + "self_attention.linear_proj.weight"].grad,
                        g["model.layers.0.self_attn.o_proj.weight"].chunk(tp, 1)[me]),
        "expert_fc2": (mp[L + "mlp.experts.local_experts.1.linear_fc2.weight"].grad,
                       g["model.layers.0.mlp.experts.down_proj"][first + 1]),
        "output_layer": (mp["output_layer.weight"].grad, g["lm_head.weight"].chunk(tp, 0)[me]),
        "embedding": (mp["embedding.word_embeddings.weight"].grad, g["model.embed_tokens.weight"].chunk(tp, 0)[me]),
    }
    grads = {k: ((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for k, (a, b) in pairs.items()}
    with torch.no_grad():        # a sign-SGD step (sequence-parallel grads all-reduced, as Megatron does)
        for p in model.parameters():
            if p.grad is not None:
                if getattr(p, "sequence_parallel", False):
                    dist.all_reduce(p.grad, group=tp_group)
                p.add_(p.grad.sign(), alpha=-0.01)
    after = export()
    rollout = ConsistentForCausalLM(ref.cfg, tp_size=2).eval()
    rollout.load_weights(after.items())
    with torch.no_grad():
        got = megatron_logits(model, ps, ids, pos, cu)
        want = rollout.forward_packed(ids, pos)
    return dict(grads=grads, export_exact=export_exact,
                changed=sum(not torch.equal(after[k], disk[k]) for k in disk), total=len(disk),
                synced_equal=torch.equal(got, want), synced_max_abs_diff=(got - want).abs().max().item())


def engine_check(path, tp, ep, cut=None):
    """verl 0.9.1's own Megatron engine (our registered subclass) at T=0.7 and the rollout's
    truncation ``cut`` (top_k, top_p, min_p; carried as the driver carries it, in
    override_config): ``infer_batch`` log-probs == the rollout model's, bitwise; then one ``train_batch`` (forward, backward,
    DDP grad reduce, distributed Adam step), its weights exported by the engine's own
    ``get_per_tensor_param`` into the rollout model, and ``infer_batch`` == rollout again
    with the NEW weights."""
    import consistent_ops as co
    from megatron.core import parallel_state as ps
    from tensordict import TensorDict
    from verl.trainer.config import CheckpointConfig
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import HFModelConfig, McoreEngineConfig, McoreOptimizerConfig
    from true_on_policy import hf_model, truncation
    from true_on_policy.models import ConsistentForCausalLM
    from true_on_policy.verl import megatron_engine
    megatron_engine.install()
    ps.destroy_model_parallel()
    fresh_attention_env()
    carried = dict(zip(truncation.CONFIG_ATTRS, cut or truncation.OFF))
    engine = megatron_engine.TrueOnPolicyMegatronEngine(
        HFModelConfig(path=path, override_config={hf_model.TP_ATTR: tp, **carried}),
        McoreEngineConfig(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                          expert_tensor_parallel_size=1, sequence_parallel=tp > 1, use_distributed_optimizer=True),
        McoreOptimizerConfig(lr=1e-2, clip_grad=1.0, lr_warmup_steps_ratio=0.0, total_training_steps=1),
        CheckpointConfig())
    engine.initialize()
    ids, pos, cu = batch(ps.get_data_parallel_rank())
    spans = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    seqs = [ids[a:b] for a, b in spans]
    nested = lambda ts: torch.nested.nested_tensor(ts, layout=torch.jagged)

    def data():
        d = TensorDict({"input_ids": nested(seqs), "loss_mask": nested([torch.ones_like(t) for t in seqs]),
                        "temperature": torch.full((len(seqs),), 0.7)}, batch_size=[len(seqs)])
        tu.assign_non_tensor(d, use_dynamic_bsz=False, micro_batch_size_per_gpu=len(seqs), calculate_entropy=False)
        return d

    limit = hf_model._tokenizer_length(path)
    ref = ConsistentForCausalLM.from_pretrained(path, tp_size=tp).eval()

    def compare(applied=cut):
        with engine.eval_mode():
            got = engine.infer_batch(data())["model_output"]["log_probs"].unbind()
        with torch.no_grad():
            logits = ref.forward_packed(ids, pos)
        want = [co.token_logprobs(logits[a:b - 1], ids[a + 1:b], 0.7, limit, applied) for a, b in spans]
        diff = max((g[:-1] - w).abs().nan_to_num(posinf=1.0).max().item() for g, w in zip(got, want))  # last: no next token
        return diff, all(torch.equal(g[:-1], w) for g, w in zip(got, want))

    diff, equal = compare()
    untruncated_diff = compare(None)[0] if cut else None    # companion: the rollout's cut ignored

    def nll(model_output, data, dp_group=None):      # any differentiable loss of the (finite) log-probs
        lp = model_output["log_probs"].values()        # truncated: -inf where a random label was cut
        loss = -torch.where(lp.isfinite(), lp, 0).sum() / data["batch_num_tokens"]
        return loss, {"loss": loss.detach().item()}

    before = {k: v.clone() for k, v in ref.state_dict().items()}
    with engine.train_mode():
        out = engine.train_batch(data(), nll)
    stale_diff, _ = compare()              # companion: the rollout still on the old weights
    weights, _ = engine.get_per_tensor_param()
    ref.load_weights(weights)
    changed = sum(not torch.equal(v, before[k]) for k, v in ref.state_dict().items())
    diff_new, equal_new = compare()
    grad_norm = out.get("metrics", {}).get("grad_norm")      # on the src rank only
    return dict(engine=True, tp=tp, ep=ep, cut=cut, untruncated_max_abs_diff=untruncated_diff,
                max_abs_diff=diff, equal=equal, trained_max_abs_diff=diff_new,
                trained_equal=equal_new, stale_max_abs_diff=stale_diff, changed=changed, total=len(before),
                grad_norm=float(grad_norm) if grad_norm is not None else None)


def rank_main(rank, world, port, path, dense_path, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from true_on_policy.megatron import env
    env.import_bridge()
    env.apply_cpu_workarounds()
    from true_on_policy.models import ConsistentForCausalLM
    sys.path.insert(0, os.path.dirname(__file__))
    from helpers import PagedCache, paged_step
    results = []
    for arch, tp, ep in [(a, *layout) for a, layouts in LAYOUTS.items() for layout in layouts]:
        ckpt = path if arch == "moe" else dense_path
        for rollout_tp in ROLLOUT_TP:
            model, ps, _ = build(ckpt, tp, ep, rollout_tp)
            dp = ps.get_data_parallel_rank()
            ids, pos, cu = batch(dp)
            got = megatron_logits(model, ps, ids, pos, cu)
            ref = ConsistentForCausalLM.from_pretrained(ckpt, tp_size=rollout_tp).eval()
            with torch.no_grad():
                want = ref.forward_packed(ids, pos)
                cache = PagedCache(ref.cfg, page_size=4)
                chunks = [(i, ids[a:b], 0) for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist()))]
                rollout = paged_step(ref, cache, chunks)
            results.append(dict(arch=arch, tp=tp, ep=ep, rollout_tp=rollout_tp, rank=rank,
                                max_abs_diff=(got - want).abs().max().item(), equal=torch.equal(got, want),
                                equal_paged_rollout=torch.equal(got, rollout)))
    results.append(dict(train_step=train_step_check(path), rank=rank))
    for tp, ep in LAYOUTS["moe"]:      # TP=2 with the rollout's truncation (vocab shards gathered first)
        results.append(dict(engine_check(path, tp, ep, ENGINE_CUT.get(tp)), rank=rank))
    # Companion: stock Megatron modules at TP=1/EP=2 on one unpacked sequence (its local
    # attention cannot run packed sequences, its torch norm refuses sequence parallel).
    model, ps, _ = build(path, 1, 2, 1, stock=True)
    ids, pos, _ = batch(0)
    from consistent_ops import parallel
    causal = torch.ones(ids.numel(), ids.numel(), dtype=torch.bool).triu(1)[None, None]  # True: masked
    with torch.no_grad():
        out = model(ids[None], pos[None], causal)[0].float()
    got = parallel.gather_concat(out, -1, ps.get_tensor_model_parallel_group())
    with torch.no_grad():
        want = ConsistentForCausalLM.from_pretrained(path, tp_size=1).eval().forward_packed(
            ids, torch.arange(ids.numel()))
    results.append(dict(stock=True, tp=1, ep=2, rollout_tp=1, rank=rank,
                        max_abs_diff=(got - want).abs().max().item(), equal=torch.equal(got, want)))
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump([r for rs in gathered for r in rs], f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(2, port, *sys.argv[1:4]), nprocs=2, join=True)
