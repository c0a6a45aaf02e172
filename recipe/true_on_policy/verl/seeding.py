"""Seeded rollouts for a verl job (README "Reproducible runs").

verl's agent loop knows each request's identity: ``trajectory`` = {step, sample_index (the data
set's ``extra_info.index``), rollout_n (the sample's number in its group), validate}; verl's
TransferQueue worker (``AgentLoopWorkerTQ``, the recipe's default) instead runs the n samples
of one trajectory as sessions (``session_id`` 0..n-1, rollout_n 0). With
``true_on_policy.seed`` set, each request's ``extra_args`` carry the key [seed, step, prompt
index, sample index, phase] (scheme.SEED_KEY), from which the vLLM processor draws every token
(vllm/sampling.py, seeded_draw.py): the tokens no longer depend on which worker, server or batch
served the request. Unset (null), requests are unseeded as in stock verl.
"""
import dataclasses
import functools
import itertools

from .. import scheme
from ..hooks import patch

CONFIG_KEY = "true_on_policy.seed"


def run_seed(config):
    """The job's run seed (an int in [0, 2^32)), or None when draws are unseeded."""
    from omegaconf import OmegaConf
    seed = OmegaConf.select(config, CONFIG_KEY, default=None)
    return None if seed is None else int(seed)


def seed_problems(config) -> list[str]:
    """Preflight: why the configured seed cannot key requests (empty list = it can)."""
    from omegaconf import OmegaConf
    seed = OmegaConf.select(config, CONFIG_KEY, default=None)
    if seed is None or (isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed < 2 ** 32):
        return []
    return [f"{CONFIG_KEY}={seed!r} must be an int in [0, 2^32) (or null: unseeded draws)"]


def seed_data(config) -> None:
    """The run seed also orders the data (verl's ``data.seed``, when the job leaves it null)."""
    seed = run_seed(config)
    if seed is not None and config.data.get("seed") is None:
        config.data.seed = seed


SESSIONS = 1 << 16   # samples a trajectory may run as sessions (sample index = rollout_n * SESSIONS + session)


def request_key(seed: int, trajectory: dict, session_id=None) -> list[int]:
    """[run seed, step, prompt index, sample index, phase] for one request (phase 1 = validation).
    Both of verl's ways to number a group's samples (rollout_n, session_id) enter the sample index."""
    step = max(int(trajectory["step"]), 0)
    sample = int(trajectory["rollout_n"]) * SESSIONS + int(session_id or 0)
    return [seed, step, int(trajectory["sample_index"]), sample, int(bool(trajectory["validate"]))]


def patch_agent_loop(module) -> None:
    """``AgentLoopWorker._run_agent_loop(sampling_params, trajectory, ...)``: add the request's key."""

    def make(run):
        @functools.wraps(run)
        async def _run_agent_loop(self, sampling_params, trajectory, *args, **kwargs):
            seed = run_seed(self.config)
            if seed is not None:
                extra = dict(sampling_params.get("extra_args") or {})
                extra[scheme.SEED_KEY] = request_key(seed, trajectory, kwargs.get("session_id"))
                sampling_params = dict(sampling_params, extra_args=extra)
            return await run(self, sampling_params, trajectory, *args, **kwargs)
        return _run_agent_loop

    patch(module.AgentLoopWorker, "_run_agent_loop", make)


# verl's TransferQueue trainer (verl/trainer/ppo/v1) stores each finished sample under
# "{uid}_{session}_{output}" as it completes and hands the trainer the batch in completion order,
# with uuid4 uids: the same samples reach the actor in another order each run, and its sums
# (gradients, metrics) round differently. Under the plugin, uids count up in the order prompts
# are drawn and the batch is handed over sorted by (uid, session, output): the data's order.
class SequentialIds:
    """Stands in for the ``uuid`` module in verl's v1 trainer: ``uuid4()`` gives 000000000000,
    000000000001, ... (unique in the run, sorting as the prompts were drawn)."""

    def __init__(self):
        self._next = itertools.count()

    def uuid4(self) -> str:
        return f"{next(self._next):012d}"


def patch_trainer(module) -> None:
    """verl.trainer.ppo.v1.trainer_base: its prompts' uids from SequentialIds."""
    if not isinstance(getattr(module, "uuid", SequentialIds), SequentialIds):   # (a verl without it: nothing to do)
        module.uuid = SequentialIds()


def sample_order(key: str) -> tuple:
    """Sort key of a TransferQueue sample key "{uid}_{session}_{output}"."""
    uid, *rest = key.split("_")
    return (uid, *(int(r) if r.isdigit() else -1 for r in rest))


def patch_replay_buffer(module) -> None:
    """verl.trainer.ppo.v1.replay_buffer: every batch handed over in sample_order."""

    def make(materialize):
        @functools.wraps(materialize)
        def _materialize_batch(self, *args, **kwargs):
            meta = materialize(self, *args, **kwargs)
            order = sorted(range(len(meta.keys)), key=lambda i: sample_order(meta.keys[i]))
            return dataclasses.replace(meta, keys=[meta.keys[i] for i in order], tags=[meta.tags[i] for i in order])
        return _materialize_batch

    patch(module.ReplayBuffer, "_materialize_batch", make)
