"""Request keys from verl's agent loop (verl/seeding.py): every sample of a group gets its own key
on both of verl 0.9.1's paths — the classic worker (the batch repeated n times, rollout_n 0..n-1)
and the TransferQueue worker (one trajectory per prompt, n sessions; a prompt repeated in the batch
too) — and the same sample the same key each time. A collision would draw one response n times:
zero GRPO advantages."""
import asyncio
import types

from omegaconf import OmegaConf

from true_on_policy import scheme
from true_on_policy.verl import seeding
from verl.experimental.agent_loop.agent_loop import get_trajectory_info


def _worker(seed):
    """A stand-in AgentLoopWorker whose loop returns the key its request carries."""
    class AgentLoopWorker:
        config = OmegaConf.create({"true_on_policy": {"seed": seed}})

        async def _run_agent_loop(self, sampling_params, trajectory, **kwargs):
            return (sampling_params.get("extra_args") or {}).get(scheme.SEED_KEY)

    module = types.SimpleNamespace(AgentLoopWorker=AgentLoopWorker)
    seeding.patch_agent_loop(module)
    seeding.patch_agent_loop(module)          # idempotent
    return AgentLoopWorker()


def _keys(worker, calls):
    async def go():
        return await asyncio.gather(*(worker._run_agent_loop({}, t, **kw) for t, kw in calls))
    return [tuple(k) if k else k for k in asyncio.run(go())]


def test_every_sample_of_a_group_has_its_own_key_on_both_verl_paths():
    n, prompts = 4, [7, 3, 3]                          # 3 twice in a row: verl counts it on in rollout_n
    worker = _worker(5)
    repeated = asyncio.run(get_trajectory_info(2, [p for p in prompts for _ in range(n)], False))
    classic = _keys(worker, [(t, {}) for t in repeated])
    once = asyncio.run(get_trajectory_info(2, prompts, False))
    sessions = _keys(worker, [(t, {"session_id": i}) for t in once for i in range(n)])
    for keys in classic, sessions:
        assert len(set(keys)) == len(keys) == n * len(prompts)
        assert [k[2] for k in keys] == [p for p in prompts for _ in range(n)]
        assert all(k[:2] == (5, 2) and k[4] == 0 and not scheme.seed_key_problems(list(k)) for k in keys)
    assert sessions == _keys(worker, [(t, {"session_id": i}) for t in once for i in range(n)])


def test_unseeded_jobs_send_no_key():
    worker = _worker(None)
    (trajectory,) = asyncio.run(get_trajectory_info(1, [0], False))
    assert _keys(worker, [(trajectory, {"session_id": 1})]) == [None]
