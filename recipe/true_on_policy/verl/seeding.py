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
import functools

from .. import scheme

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
    worker = module.AgentLoopWorker
    run = worker._run_agent_loop
    if getattr(run, "_true_on_policy", False):
        return

    @functools.wraps(run)
    async def _run_agent_loop(self, sampling_params, trajectory, *args, **kwargs):
        seed = run_seed(self.config)
        if seed is not None:
            extra = dict(sampling_params.get("extra_args") or {})
            extra[scheme.SEED_KEY] = request_key(seed, trajectory, kwargs.get("session_id"))
            sampling_params = dict(sampling_params, extra_args=extra)
        return await run(self, sampling_params, trajectory, *args, **kwargs)

    _run_agent_loop._true_on_policy = True
    worker._run_agent_loop = _run_agent_loop
