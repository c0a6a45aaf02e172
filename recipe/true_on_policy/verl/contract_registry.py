"""Which numerics contract each engine really ran: the ``true_on_policy/contract_match`` metric.

Two engines agree bitwise only when they run the same contract (same fingerprint,
consistent_ops/contract.py). The processes that compute log-probs report the fingerprint
they ran into Ray's cluster key-value store, under the job's id (a long-lived cluster
keeps other jobs' entries apart):

- ``trainer``: each FSDP worker, the first time it computes log-probs through the contract;
- ``rollout``: each vLLM server, for every worker of its engine (asked with vLLM's
  ``collective_rpc`` once the engine is up; a worker running a stock model class reports
  ``None``).

The driver reads them every step: ``contract_match`` is 1.0 only when both roles reported
and every fingerprint is one and the same string.
"""
import json
import os
import socket

NAMESPACE = "true_on_policy"
ROLES = ("trainer", "rollout")


def _prefix() -> str | None:
    """The key prefix of this job, or None outside a Ray job (nothing to report to)."""
    import ray
    if not ray.is_initialized():
        return None
    return f"contract/{ray.get_runtime_context().get_job_id()}/"


def publish(role: str, fingerprints: list) -> None:
    """Report the fingerprint(s) this process (or the engine it drives) ran as ``role``."""
    from ray.experimental import internal_kv
    prefix = _prefix()
    if prefix is None:
        return
    key = f"{prefix}{role}/{socket.gethostname()}-{os.getpid()}"
    internal_kv._internal_kv_put(key, json.dumps(list(fingerprints)), overwrite=True, namespace=NAMESPACE)
    # start-up progress on the job's console (Ray forwards a worker's stdout to the driver)
    print(f"[true_on_policy] {role} runs contract {', '.join(sorted(set(map(str, fingerprints))))}",
          flush=True)


def collect() -> dict[str, list]:
    """{role: [fingerprint, ...]} over every reporting process of this job."""
    from ray.experimental import internal_kv
    prefix = _prefix()
    found = {role: [] for role in ROLES}
    if prefix is None:
        return found
    for key in internal_kv._internal_kv_list(prefix, namespace=NAMESPACE):
        key = key.decode() if isinstance(key, bytes) else key
        role = key[len(prefix):].split("/", 1)[0]
        value = internal_kv._internal_kv_get(key, namespace=NAMESPACE)
        if role in found and value is not None:
            found[role].extend(json.loads(value))
    return found


def compare(found: dict[str, list]) -> tuple[bool, str]:
    """(match, why not): both roles reported and all fingerprints are one string."""
    missing = [role for role in ROLES if not found.get(role)]
    if missing:
        return False, (f"no contract fingerprint from the {' and '.join(missing)} "
                       "(the true_on_policy plugin did not reach that engine's processes)")
    values = {role: sorted(set(map(str, found[role]))) for role in ROLES}
    if len({fp for v in values.values() for fp in v}) == 1:
        return True, ""
    return False, "the engines run different contracts: " + "; ".join(
        f"{role} {', '.join(v)}" for role, v in values.items())
