"""true_on_policy.vllm without an engine: plugin registration, the attention backend on
vLLM's cache layout, the sampling scheme, pre-flight checks. Fast (no engine start)."""
import json
import math
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

import consistent_ops as co  # noqa: E402
from true_on_policy.models import ModelConfig  # noqa: E402
from true_on_policy.vllm import attention as va  # noqa: E402
from true_on_policy import scheme  # noqa: E402
from true_on_policy.vllm import sampling  # noqa: E402
from true_on_policy.vllm.logprob_graphs import GraphedLogSoftmax  # noqa: E402
from true_on_policy.scheme import tp_problems, valid_tp_sizes  # noqa: E402
from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality  # noqa: E402


# ----------------------------------------------------------------------------- plugin
PLUGIN_SCRIPT = textwrap.dedent("""
    import os, json
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from true_on_policy.vllm import plugin

    def state():
        return {"qwen3": ModelRegistry.models["Qwen3ForCausalLM"].__dict__.get("module_name", "stock"),
                "moe": ModelRegistry.models["Qwen3MoeForCausalLM"].__dict__.get("module_name", "stock"),
                "custom": AttentionBackendEnum.CUSTOM.is_overridden(),
                "hook": "Qwen3MoeForCausalLM" in MODELS_CONFIG_MAP}
    os.environ.pop("TRUE_ON_POLICY", None)
    plugin.register()
    off = state()
    os.environ["TRUE_ON_POLICY"] = "1"
    plugin.register(); plugin.register()
    print(json.dumps({"off": off, "on": state()}))
""")


def test_plugin_is_inert_without_env_and_idempotent_with_it():
    env = {k: v for k, v in os.environ.items() if k != "TRUE_ON_POLICY"}
    res = subprocess.run([sys.executable, "-c", PLUGIN_SCRIPT], capture_output=True, text=True, env=env,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["off"] == {"qwen3": got["off"]["qwen3"], "moe": got["off"]["moe"], "custom": False, "hook": False}
    assert "true_on_policy" not in got["off"]["qwen3"] + got["off"]["moe"]
    assert got["on"] == {"qwen3": "true_on_policy.vllm.model", "moe": "true_on_policy.vllm.model",
                         "custom": True, "hook": True}


HOOK_SCRIPT = textwrap.dedent("""
    import json, sys
    from vllm.engine.arg_utils import EngineArgs
    cfg = EngineArgs(model=sys.argv[1], max_model_len=256).create_engine_config()
    out = {"mode": cfg.model_config.logprobs_mode, "procs": cfg.model_config.logits_processors}
    try:
        EngineArgs(model=sys.argv[1], max_model_len=256, tensor_parallel_size=3).create_engine_config()
    except Exception as e:
        out["tp3"] = str(e)
    print(json.dumps(out))
""")


def test_config_hook_completes_the_engine_config_and_refuses_bad_tp(tmp_path):
    """Runs where vLLM builds its config (front-end): before any engine process starts."""
    from true_on_policy.make_tiny_model import ensure_tiny_model
    model = ensure_tiny_model(tmp_path, "qwen3_moe", hidden_size=64, num_layers=1, head_dim=16)
    env = {**os.environ, "TRUE_ON_POLICY": "1"}
    res = subprocess.run([sys.executable, "-c", HOOK_SCRIPT, str(model)], capture_output=True, text=True,
                         env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["mode"] == "processed_logits" and got["procs"] == [sampling.V1_PROCESSOR]
    assert "num_attention_heads=4 is not divisible by tensor_parallel_size=3" in got["tp3"]
    assert "num_experts=8 is not divisible" in got["tp3"]


def test_v2_runner_without_logits_processors_runs_v1(monkeypatch):
    """vLLM 0.26's V2 runner (its default for dense models) takes no logits processors: the
    hook picks V1 for every process vLLM starts; a V2 runner asked for explicitly is refused."""
    from true_on_policy.vllm import compat
    monkeypatch.setenv(compat.V2_RUNNER_ENV, "1")
    monkeypatch.setattr(compat, "_v2_takes_logits_processors", lambda: False)
    with pytest.raises(ValueError, match=f"{compat.V2_RUNNER_ENV}=1 but this vLLM"):
        compat.use_v2_runner(SimpleNamespace(use_v2_model_runner=True))
    monkeypatch.delenv(compat.V2_RUNNER_ENV)
    assert compat.use_v2_runner(SimpleNamespace(use_v2_model_runner=True)) is False
    assert os.environ[compat.V2_RUNNER_ENV] == "0"
    assert compat.use_v2_runner(SimpleNamespace(use_v2_model_runner=False)) is False
    monkeypatch.setattr(compat, "_v2_takes_logits_processors", lambda: True)   # 0.31: V2 as vLLM chose
    assert compat.use_v2_runner(SimpleNamespace(use_v2_model_runner=True)) is True


V2_SCRIPT = textwrap.dedent("""
    import json, sys
    import vllm.config.vllm as cv
    cv.HAS_TRITON = True    # as on a GPU, where vLLM picks its V2 runner for a dense model
    from vllm.engine.arg_utils import EngineArgs
    cfg = EngineArgs(model=sys.argv[1], max_model_len=256).create_engine_config()
    print(json.dumps(cfg.model_config.logits_processors))
""")


def test_config_hook_names_a_processor_this_vllm_runs(tmp_path):
    """Dense Qwen3 where vLLM would pick its V2 runner: on 0.26 (V2 takes no processors) the
    hook named sampling_v2, a module 0.26 lacks; now it names the V1 processor there."""
    from true_on_policy.make_tiny_model import ensure_tiny_model
    from true_on_policy.vllm import compat
    model = ensure_tiny_model(tmp_path, "qwen3", hidden_size=64, num_layers=1, head_dim=16)
    env = {**os.environ, "TRUE_ON_POLICY": "1"}
    env.pop(compat.V2_RUNNER_ENV, None)
    res = subprocess.run([sys.executable, "-c", V2_SCRIPT, str(model)], capture_output=True, text=True,
                         env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    want = sampling.V2_PROCESSOR if compat._v2_takes_logits_processors() else sampling.V1_PROCESSOR
    assert json.loads(res.stdout.strip().splitlines()[-1]) == [want]


def test_entry_point_is_installed():
    from importlib.metadata import entry_points
    values = [e.value for e in entry_points(group="vllm.general_plugins")]
    assert "true_on_policy.vllm.plugin:register" in values, "pip install -e . (scripts/setup.sh) first"


# ----------------------------------------------------------------------------- preflight
def _cfg(**over):
    base = dict(arch="qwen3_moe", vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=16, intermediate_size=0, num_experts=6, top_k=2, moe_intermediate_size=32,
                moe_layers=[0, 1])
    return ModelConfig(**{**base, **over})


def test_preflight_names_every_indivisible_split():
    cfg = _cfg()
    assert tp_problems(cfg, 2) == [] and valid_tp_sizes(cfg) == [1, 2]
    problems = tp_problems(cfg, 4)
    assert [p.split("=")[0] for p in problems] == ["num_key_value_heads", "num_experts"]
    assert "tensor_parallel_size=4" in problems[0] and "[1, 2]" in problems[0]
    dense = _cfg(arch="qwen3", moe_layers=[], num_experts=0, intermediate_size=96)
    assert [p.split("=")[0] for p in tp_problems(dense, 3)] == ["num_attention_heads", "num_key_value_heads"]


# ----------------------------------------------------------------------------- attention
def _vllm_cache(pages, page, hkv, d, dtype):
    """A per-layer cache exactly as vLLM 0.31 hands it over for the LBHNC layout: logical
    [pages, Hkv, page, 2D], head-major in memory; stale pages hold NaN (never zeroed)."""
    return torch.full((pages, hkv, page, 2 * d), float("nan"), dtype=dtype)


def _metadata(q_lens, seq_lens, tables, slots):
    qsl = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    width = max(map(len, tables))
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        num_reqs=len(q_lens), num_actual_tokens=sum(q_lens), max_query_len=max(q_lens),
        max_seq_len=max(seq_lens), block_table_tensor=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        slot_mapping=slots)


@pytest.mark.parametrize("legacy_shape", [False, True])
def test_backend_mixed_batch_equals_varlen(legacy_shape):
    """Decode + chunked prefill + cache hit in one step, through vLLM's layout, builder and
    impl, equals the trainer's varlen attention over the whole sequences, bitwise."""
    torch.manual_seed(0)
    hq, hkv, d, page, dt = 4, 2, 32, 16, torch.bfloat16
    lens = [70, 150, 33]                       # full sequence lengths
    done = [69, 64, 0]                          # already in the cache (decode, chunk/prefix hit, fresh)
    q = torch.randn(sum(lens), hq, d, dtype=dt)
    k, v = torch.randn(sum(lens), hkv, d, dtype=dt), torch.randn(sum(lens), hkv, d, dtype=dt)
    cu = torch.tensor([0] + lens).cumsum(0)
    ref = co.attention_varlen(q, k, v, cu)
    pages = 64
    cache = (torch.full((2, pages, page, hkv, d), float("nan"), dtype=dt) if legacy_shape
             else _vllm_cache(pages, page, hkv, d, dt))
    order = torch.randperm(pages - 1) + 1       # page 0 is vLLM's null block
    tables, taken = [], 0
    for n in lens:
        m = -(-n // page)
        tables.append(order[taken:taken + m].tolist())
        taken += m
    impl = va.ConsistentAttentionImpl(hq, d, d ** -0.5, hkv)
    builder = va.ConsistentAttentionMetadataBuilder(None, [], None, "cpu")

    def step(new):                              # new[i]: tokens of sequence i in this step
        rows = torch.cat([torch.arange(cu[i] + s, cu[i] + s + n) for i, (s, n) in enumerate(new)])
        pos = [torch.arange(s, s + n) for s, n in new]
        slots = torch.cat([torch.tensor(tables[i])[p // page] * page + p % page for i, p in enumerate(pos)])
        meta = builder.build(0, _metadata([n for _, n in new], [s + n for s, n in new], tables, slots))
        impl.do_kv_cache_update(None, k[rows], v[rows], cache, slots)
        out = torch.empty(len(rows), hq, d, dtype=dt)
        impl.forward(None, q[rows], k[rows], v[rows], cache, meta, out)
        return rows, out

    step([(0, n) for n in done])                # fill the cache
    rows, out = step([(s, n - s) for s, n in zip(done, lens)])
    assert torch.equal(out, ref[rows])
    assert len(builder.build(0, _metadata([1, 86, 33], [70, 150, 33], tables, slots=None)).groups) == 3


def test_triton_backend_builds_any_batch_as_one_call(monkeypatch):
    """On the Triton backend (its grid is sized by shapes) the builder declares ALWAYS and a
    mixed batch is one call over the persistent buffers' views: what a FULL graph replays.
    The reference backend (pads each call to its longest query) keeps bucketing, UNIFORM_BATCH."""
    from vllm.v1.attention.backend import AttentionCGSupport
    meta = _metadata([1, 86, 33, 0], [70, 150, 33, 0], [[1, 2, 3, 4, 5], [6] * 10, [7, 8, 9], [0]], slots=None)
    builder = va.ConsistentAttentionMetadataBuilder(None, [], None, "cpu")
    assert len(builder.build(0, meta).groups) == 3
    monkeypatch.setattr(va.co, "backend_name", lambda: "triton")
    assert va.ConsistentAttentionMetadataBuilder.get_cudagraph_support(None, None) == AttentionCGSupport.ALWAYS
    (group,) = builder.build(0, meta).groups
    assert group.rows is None and group.query_start_loc.data_ptr() == meta.query_start_loc.data_ptr()
    assert group.block_table.data_ptr() == meta.block_table_tensor.data_ptr()


def test_cache_views_follow_the_bound_tensor():
    """The impl splits a layer's cache into K/V views once; another tensor (vLLM rebinding the
    cache) gets its own views, never the old ones."""
    impl = va.ConsistentAttentionImpl(4, 32, 1.0, 2)
    first, second = _vllm_cache(4, 16, 2, 32, torch.bfloat16), _vllm_cache(4, 16, 2, 32, torch.bfloat16)
    k, v = impl.caches(first)
    assert impl.caches(first)[0] is k and k.data_ptr() == first.data_ptr()
    k2, v2 = impl.caches(second)
    assert k2.data_ptr() == second.data_ptr() and v2.data_ptr() == second.data_ptr() + 32 * second.element_size()


def test_warmup_without_metadata_returns_zeros():
    impl = va.ConsistentAttentionImpl(4, 32, 1.0, 2)
    out = torch.full((3, 4, 32), float("nan"))
    assert torch.equal(impl.forward(None, out, out, out, None, None, out), torch.zeros(3, 4, 32))


def test_group_requests_bounds_padding():
    assert va.group_requests([1, 1, 64, 1, 60, 2000, 3, 0]) == [[0, 1, 3], [6], [2, 4], [5]]


def test_impl_refuses_what_the_contract_lacks():
    with pytest.raises(NotImplementedError, match="sliding_window"):
        va.ConsistentAttentionImpl(4, 32, 1.0, 2, sliding_window=128)
    with pytest.raises(NotImplementedError, match="kv_cache_dtype"):
        va.ConsistentAttentionImpl(4, 32, 1.0, 2, kv_cache_dtype="fp8")


# ----------------------------------------------------------------------------- sampling
def test_sampling_params_carry_the_rollout_temperature():
    p = sampling.sampling_params(0.7, max_tokens=3, logprobs=0)
    assert p.temperature == 1.0 and sampling.rollout_temperature(p) == 0.7
    sampling.validate(p)
    sampling.validate(sampling.SamplingParams(temperature=1.0))           # T=1 needs no extra_args
    sampling.validate(sampling.SamplingParams(temperature=0.0))           # greedy


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=0.7), "temperature=0.7"),
    (dict(temperature=1.0, top_p=0.9), "top_p"),
    (dict(temperature=1.0, top_k=20), "top_k"),
    (dict(temperature=1.0, min_p=0.1), "min_p"),
    (dict(temperature=1.0, repetition_penalty=1.1), "repetition_penalty"),
    (dict(temperature=1.0, extra_args={sampling.TEMPERATURE_KEY: 0.0}), "engine samples at 0.0"),
    (dict(temperature=1.0, extra_args={sampling.TEMPERATURE_KEY: -1.0}), "must be a finite number >= 0"),
    (dict(temperature=1.0, top_k=1), "top_k=1"),
])
def test_validate_rejects_what_would_change_the_distribution(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sampling.validate(sampling.SamplingParams(**kwargs))


def test_greedy_requests_are_admitted_and_report_the_t1_logprobs():
    """verl's greedy validation: SamplingParams(temperature=0) through the scheme."""
    p = sampling.sampling_params(0.0, max_tokens=3, logprobs=0)
    assert p.temperature == 0.0 and sampling.rollout_temperature(p) == 0.0
    sampling.validate(p)
    proc, logits = _processor(), torch.randn(2, 100) * 3
    logits[1, 7] = logits[1, 40] = logits[1].max() + 1                # a tie: the lower id wins
    add = lambda i, t: (i, sampling.sampling_params(t), [1], [])
    proc.update_state(BatchUpdate(2, removed=[], added=[add(0, 0.0), add(1, 0.0)], moved=[]))
    from vllm.v1.sample.sampler import Sampler
    rows = proc.apply(logits.clone())
    assert torch.equal(rows, co.log_softmax(logits, 1.0, 90))           # reported: the T = 1 log-probs
    assert Sampler.greedy_sample(rows).tolist() == [int(rows[0].argmax()), 7]


@pytest.mark.parametrize("settings", [
    {}, {"top_k": -1}, {"top_k": 0}, {"top_k": 1}, {"top_k": 20}, {"top_p": 1.0}, {"top_p": 0.9},
    {"min_p": 0.1}, {"repetition_penalty": 1.1}, {"temperature": 0.0}, {"temperature": 0.7}])
def test_verl_preflight_and_vllm_admission_agree(settings):
    """One rule (scheme.sampling_problems): a setting the job's preflight passes is admitted by
    vLLM, and one it rejects is rejected there too (top_k=1 once passed one and failed the other);
    top-k / top-p / min-p are the contract's (issue 14), penalties stay refused."""
    from omegaconf import OmegaConf

    from true_on_policy.verl import preflight
    cfg = OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": "vllm", "val_kwargs": settings}}})
    job_ok = preflight.problems(cfg) == []
    try:
        t = settings.get("temperature", 1.0)
        sampling.validate(sampling.sampling_params(t, **{k: v for k, v in settings.items() if k != "temperature"}))
        engine_ok = True
    except ValueError:
        engine_ok = False
    assert job_ok == engine_ok == ("repetition_penalty" not in settings)


def _processor():
    proc = object.__new__(sampling.ContractLogProbs)
    proc.vocab_limit, proc.temperature, proc.truncation, proc.seeded, proc.rows = 90, {}, {}, {}, None
    proc.graphed = GraphedLogSoftmax(90)
    return proc


def test_v1_processor_rows_are_the_contract_logprobs_after_moves():
    """Each row becomes co.log_softmax at its request's T; the sampler's division by the
    engine temperature 1.0 leaves it bit-identical, and token_logprobs agrees."""
    from vllm.v1.sample.sampler import Sampler
    proc, logits = _processor(), torch.randn(3, 100) * 3
    add = lambda i, t: (i, sampling.sampling_params(t), [1], [])
    proc.update_state(BatchUpdate(3, removed=[], added=[add(0, 0.7), add(1, 1.3), add(2, 1.0)], moved=[]))
    proc.update_state(BatchUpdate(3, removed=[], added=[], moved=[(0, 2, MoveDirectionality.SWAP)]))
    temps = [1.0, 1.3, 0.7]
    out = Sampler.apply_temperature(proc.apply(logits.clone()), torch.ones(3), all_random=True)
    for row, t in enumerate(temps):
        assert torch.equal(out[row], co.log_softmax(logits[row:row + 1], t, 90)[0])
        tok = torch.tensor([5])
        assert torch.equal(out[row, 5:6], co.token_logprobs(logits[row:row + 1], tok, t, vocab_limit=90))
    assert torch.isneginf(out[:, 90:]).all()
    assert math.isclose(float(torch.logsumexp(out[0], 0)), 0.0, abs_tol=1e-5)
    # a step without batch changes reuses the row tensors; a move builds them again
    kept = proc.rows
    proc.update_state(None)
    assert proc.rows is kept and torch.equal(proc.apply(logits.clone()), out)
    proc.update_state(BatchUpdate(3, removed=[], added=[], moved=[(0, 2, MoveDirectionality.SWAP)]))
    assert torch.equal(proc.apply(logits.clone())[2], co.log_softmax(logits[2:3], 1.0, 90)[0])


def _processor_v2(monkeypatch, slots=4):
    pytest.importorskip("vllm.v1.worker.gpu.sample.logits_processor", reason="this vLLM's V2 runner takes none")
    from true_on_policy.vllm import sampling_v2
    monkeypatch.setattr(sampling_v2, "tokenizer_length", lambda _model_config: 90)
    return sampling_v2.ContractLogProbsV2(SimpleNamespace(model_config=None),
                                          SimpleNamespace(max_num_reqs=slots, device="cpu"))


def test_v2_processor_reads_temperature_by_slot(monkeypatch):
    proc = _processor_v2(monkeypatch)
    assert proc.add_request(3, sampling.sampling_params(0.5))
    proc.apply_staged_writes()
    logits = torch.randn(2, 100)
    out = proc.apply(logits.clone(), SimpleNamespace(expanded_idx_mapping=torch.tensor([3, 0])))
    assert torch.equal(out[0], co.log_softmax(logits[:1], 0.5, 90)[0])
    assert torch.equal(out[1], co.log_softmax(logits[1:], 1.0, 90)[0])


def test_seeded_rows_are_pinned_alike_by_the_v1_and_v2_processors(monkeypatch):
    """A seeded request (key in extra_args) runs at engine temperature 0; both processors keep only
    the drawn token's contract log-prob (seeded_draw.pin at the drawn token's sequence position),
    whatever the row order; unseeded rows stay the contract's; greedy sampling takes the token."""
    from vllm.v1.sample.sampler import Sampler

    from true_on_policy import seeded_draw
    key = lambda j: {scheme.SEED_KEY: [4, 2, 9, j, 0]}
    seeded = [sampling.sampling_params(0.7, logprobs=0, extra_args=key(j)) for j in range(2)]
    plain = sampling.sampling_params(0.7, logprobs=0)
    assert seeded[0].temperature == 0.0
    for p in (*seeded, plain):
        sampling.validate(p)
    logits = torch.randn(3, 100) * 3
    logp = co.log_softmax(logits, 0.7, 90)
    want = seeded_draw.pin(logp[:2], torch.tensor([key(0)[scheme.SEED_KEY], key(1)[scheme.SEED_KEY]]),
                           torch.tensor([5 + 3, 5 + 3]), torch.tensor([True, True]))
    v1 = _processor()
    prompt, out = [1] * 5, [2] * 3                                   # the next token is the 9th (position 8)
    v1.update_state(BatchUpdate(3, removed=[], added=[(0, plain, prompt, out), (1, seeded[1], prompt, out),
                                                      (2, seeded[0], prompt, out)], moved=[]))
    rows = v1.apply(logits[[2, 1, 0]].clone())
    assert torch.equal(rows[0], logp[2]) and torch.equal(rows[2], want[0]) and torch.equal(rows[1], want[1])
    assert Sampler.greedy_sample(rows)[1:].tolist() == [int(want[1].argmax()), int(want[0].argmax())]
    v2 = _processor_v2(monkeypatch)
    for slot, p in zip((3, 0, 1), (*seeded, plain)):
        v2.add_request(slot, p)
    v2.apply_staged_writes()
    got = v2.apply(logits[[1, 0, 2]].clone(), SimpleNamespace(expanded_idx_mapping=torch.tensor([0, 3, 1]),
                                                             pos=torch.tensor([7, 7, 7])))
    assert torch.equal(got[0], want[1]) and torch.equal(got[1], want[0]) and torch.equal(got[2], logp[2])


def test_the_input_batch_skips_the_output_ids_wait_for_our_processor_alone():
    """vLLM asks every step for the sampled ids of the last one (a host wait under async scheduling)
    when any custom processor is installed; with ours alone it does not, since a seeded draw needs
    only how many tokens a request has (async scheduling's -1 placeholders give the same rows)."""
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.logits_processor.builtin import MinTokensLogitsProcessor
    from vllm.v1.worker.gpu_input_batch import InputBatch
    assert getattr(InputBatch.__init__, "_true_on_policy", False)     # installed by importing sampling

    def built(*procs):
        def init(self):
            self.logitsprocs, self.logitsprocs_need_output_token_ids = LogitsProcessors(procs), True
        batch = SimpleNamespace()
        sampling._no_output_ids_wait(init)(batch)
        return batch.logitsprocs_need_output_token_ids
    builtin = object.__new__(MinTokensLogitsProcessor)
    assert built(_processor(), builtin) is False
    assert built(builtin) is True                                      # no custom processor: vLLM's own flag
    assert built(_processor(), object.__new__(type("Other", (MinTokensLogitsProcessor,), {}))) is True
    seeded = sampling.sampling_params(0.7, logprobs=0, extra_args={scheme.SEED_KEY: [4, 2, 9, 0, 0]})
    logits = torch.randn(1, 100) * 3
    rows = []
    for out in ([2, 7, 11], [-1, -1, -1]):                             # real ids, async placeholders
        proc = _processor()
        proc.update_state(BatchUpdate(1, removed=[], added=[(0, seeded, [1] * 5, out)], moved=[]))
        rows.append(proc.apply(logits.clone()))
    assert torch.equal(rows[0], rows[1])


@pytest.mark.parametrize("extra, logprobs, match", [
    ([4, 2, 9, 0], 0, "must be 5 ints"), ([4, 2, 9, 0, 0], 5, "logprobs=5: a seeded request")])
def test_validate_rejects_a_bad_seeded_request(extra, logprobs, match):
    with pytest.raises(ValueError, match=match):
        sampling.validate(sampling.sampling_params(0.7, logprobs=logprobs, extra_args={scheme.SEED_KEY: extra}))


def test_padded_decode_batch_is_one_call_over_the_persistent_buffers():
    """What a FULL CUDA graph replays (vLLM pads a decode batch up to a capture size:
    padding requests with no tokens, padding tokens with slot -1): one attention call over
    views of the runner's persistent buffers, launch bound = the query length, and the real
    tokens' outputs equal those of the unpadded step."""
    from vllm.v1.attention.backend import AttentionCGSupport
    assert va.ConsistentAttentionMetadataBuilder.get_cudagraph_support(None, None) == AttentionCGSupport.UNIFORM_BATCH
    torch.manual_seed(1)
    hq, hkv, d, page, dt, pages = 4, 2, 32, 16, torch.bfloat16, 32
    tables, ctx = [[3, 7], [5], [9, 2]], [20, 9, 31]             # 3 real decodes, context incl. this token
    builder = va.ConsistentAttentionMetadataBuilder(None, [], None, "cpu")
    impl = va.ConsistentAttentionImpl(hq, d, d ** -0.5, hkv)
    cache = _vllm_cache(pages, page, hkv, d, dt)
    full_k = torch.randn(pages * page, hkv, d, dtype=dt)
    for t, n in zip(tables, ctx):                                # the cached context
        pos = torch.arange(n - 1)
        slots = torch.tensor(t)[pos // page] * page + pos % page
        impl.do_kv_cache_update(None, full_k[slots], full_k[slots], cache, slots)
    q, k = torch.randn(8, hq, d, dtype=dt), torch.randn(8, hkv, d, dtype=dt)
    slots = torch.tensor([t[(n - 1) // page] * page + (n - 1) % page for t, n in zip(tables, ctx)])
    outs = []
    for size in (3, 8):                                          # unpadded, padded to a capture size of 8
        meta = _metadata([1] * 3 + [0] * (size - 3), ctx + [0] * (size - 3), tables + [[0]] * (size - 3),
                         torch.cat([slots, torch.full((size - 3,), -1)]))
        built = builder.build(0, meta)
        (group,) = built.groups
        assert group.rows is None and group.max_query_len == 1
        assert group.query_start_loc.data_ptr() == meta.query_start_loc.data_ptr()   # views, no copies
        assert group.block_table.data_ptr() == meta.block_table_tensor.data_ptr()
        out = torch.full((size, hq, d), float("nan"), dtype=dt)
        impl.do_kv_cache_update(None, k[:size], k[:size], cache, meta.slot_mapping)
        impl.forward(None, q[:size], k[:size], k[:size], cache, built, out)
        outs.append(out[:3])
    assert torch.equal(outs[0], outs[1]) and not outs[0].isnan().any()


# ----------------------------------------------------------------------------- truncation
CUT = dict(top_k=20, top_p=0.9, min_p=0.02)


def test_sampling_params_move_truncation_to_the_contract():
    """The engine's own top-k/top-p/min-p stay off (vLLM's top-p on the renormalised rows
    would cut again); the contract's settings travel in extra_args."""
    p = sampling.sampling_params(0.7, max_tokens=3, **CUT)
    assert (p.top_k, p.top_p, p.min_p) in ((0, 1.0, 0.0), (-1, 1.0, 0.0))
    assert sampling.rollout_truncation(p) == (20, 0.9, 0.02)
    sampling.validate(p)
    off = sampling.sampling_params(0.7, top_k=-1, top_p=1.0, min_p=0.0)
    assert sampling.rollout_truncation(off) == (0, 1.0, 0.0)
    assert not any(k in off.extra_args for k in sampling.TRUNCATION_KEYS.values())


@pytest.mark.parametrize("kwargs, match", [
    (dict(top_p=1.5), "top_p.*must be in \\(0, 1\\]"), (dict(min_p=-0.5), "min_p.*must be in"),
])
def test_validate_rejects_bad_truncation_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sampling.validate(sampling.sampling_params(1.0, **kwargs))


def test_engine_level_top_p_names_the_contract_channel():
    with pytest.raises(ValueError, match="sampling_params\\(T, top_p=...\\)"):
        sampling.validate(sampling.SamplingParams(temperature=1.0, top_p=0.9))


def test_v1_processor_truncates_per_request():
    """Mixed batch (truncating and plain rows): each row is the contract's truncated
    log-probs of that row alone; vLLM's softmax of it puts no mass outside the kept set."""
    proc, logits = _processor(), torch.randn(3, 100) * 3
    params = [sampling.sampling_params(0.7, **CUT), sampling.sampling_params(1.0),
              sampling.sampling_params(1.3, top_p=0.5)]
    proc.update_state(BatchUpdate(3, removed=[], added=[(i, p, [1], []) for i, p in enumerate(params)], moved=[]))
    out = proc.apply(logits.clone())
    cuts = [(20, 0.9, 0.02), None, (0, 0.5, 0.0)]
    for row, (t, cut) in enumerate(zip([0.7, 1.0, 1.3], cuts)):
        alone = co.log_softmax(logits[row:row + 1], t, 90, cut)[0]
        assert torch.equal(out[row], alone)
        assert torch.equal(out[row, 7:8], co.token_logprobs(logits[row:row + 1], torch.tensor([7]), t, 90, cut))
    assert (out[0] > float("-inf")).sum() <= 20 and torch.equal(out[1], co.log_softmax(logits[1:2], 1.0, 90)[0])
    probs = torch.softmax(out, -1)
    assert torch.all(probs[torch.isneginf(out)] == 0)


def test_v2_processor_truncates_by_slot(monkeypatch):
    proc = _processor_v2(monkeypatch)
    assert proc.add_request(2, sampling.sampling_params(0.5, **CUT))
    proc.apply_staged_writes()
    logits = torch.randn(2, 100)
    out = proc.apply(logits.clone(), SimpleNamespace(expanded_idx_mapping=torch.tensor([2, 0])))
    assert torch.equal(out[0], co.log_softmax(logits[:1], 0.5, 90, (20, 0.9, 0.02))[0])
    assert torch.equal(out[1], co.log_softmax(logits[1:], 1.0, 90)[0])


def test_full_graphs_are_capped_at_max_model_len():
    """vLLM's capture warm-up for a FULL mixed graph of N tokens runs requests of N tokens; with
    max_model_len < N their pages lie past the block table (seen on the H200: an illegal memory
    access in attention_paged). The hook caps the capture at max_model_len; a long enough model,
    eager, or vLLM's own default (piecewise mixed graphs) is left alone."""
    from true_on_policy.vllm.engine_config import cap_graphs_at_model_len

    def config(max_model_len, mode="FULL", max_size=2048, sizes=None, eager=False):
        cc = SimpleNamespace(cudagraph_mode=SimpleNamespace(name=mode) if mode else None,
                             max_cudagraph_capture_size=max_size, cudagraph_capture_sizes=sizes)
        cap_graphs_at_model_len(SimpleNamespace(compilation_config=cc, model_config=SimpleNamespace(
            max_model_len=max_model_len, enforce_eager=eager)))
        return cc.max_cudagraph_capture_size, cc.cudagraph_capture_sizes

    assert config(512) == (512, None)
    assert config(300, max_size=None) == (300, None)                  # vLLM's default max (512) too
    assert config(256, sizes=[1, 8, 256, 512, 1024]) == (256, [1, 8, 256])
    assert config(512, max_size=256, sizes=[1, 8, 256]) == (256, [1, 8, 256])   # all fit: as set
    for unchanged in (config(4096), config(512, max_size=None), config(512, mode="FULL_AND_PIECEWISE"),
                      config(512, mode=None), config(512, eager=True)):
        assert unchanged[0] in (2048, None) and unchanged[1] is None, unchanged


def test_logits_warm_up_runs_every_batch_size_first(monkeypatch):
    """The first compute_logits (vLLM's sampler warm-up) runs rows 1..n and the contract's
    log-probs at every power of two of rows up to n, and n (the log-softmax's lane groups change
    there), for both vocab-limit kinds, so Triton compiles there."""
    import consistent_ops as co
    from true_on_policy.vllm.model import warm_logits
    seen, softmaxed = [], []

    def compute(h):
        seen.append(h.shape[0])
        return torch.randn(h.shape[0], 40)
    monkeypatch.setattr(co, "log_softmax", lambda z, t, limit: softmaxed.append((z.shape[0], limit)))
    warm_logits(compute, torch.zeros(5, 8))
    warm_logits(compute, torch.zeros(0, 8))
    assert seen == [1, 2, 3, 4, 5]
    assert softmaxed == [(r, lim) for r in (1, 2, 4, 5) for lim in (40, 39)]
