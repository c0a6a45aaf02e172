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


def test_v1_trainer_batches_in_data_order_whatever_the_completion_order():
    """verl's TransferQueue replay buffer hands over samples as they finished; under the plugin
    the prompts' uids count up as drawn and every batch comes in (uid, session, output) order."""
    import dataclasses as dc

    from transfer_queue import KVBatchMeta

    ids = seeding.SequentialIds()
    uids = [str(ids.uuid4()) for _ in range(3)]
    assert uids == sorted(uids) and len(set(uids)) == 3
    done = [f"{uids[u]}_{s}_0" for u, s in [(2, 1), (0, 10), (1, 0), (0, 2), (2, 0), (0, 0)]]

    class ReplayBuffer:
        def _materialize_batch(self, partition_id, selected, snapshot):
            return KVBatchMeta(partition_id=partition_id, keys=list(done), tags=[{"k": k} for k in done])

    module = types.SimpleNamespace(ReplayBuffer=ReplayBuffer)
    seeding.patch_replay_buffer(module)
    seeding.patch_replay_buffer(module)
    meta = ReplayBuffer()._materialize_batch("train", None, None)
    assert meta.keys == [f"{uids[u]}_{s}_0" for u, s in [(0, 0), (0, 2), (0, 10), (1, 0), (2, 0), (2, 1)]]
    assert [t["k"] for t in meta.tags] == meta.keys and dc.is_dataclass(meta)
    trainer = types.SimpleNamespace(uuid=__import__("uuid"))
    seeding.patch_trainer(trainer)
    assert trainer.uuid.uuid4() == "000000000000"
