"""Imported by verl itself in every process that imports verl — driver, TaskRunner,
trainer workers, the vLLM server actor and vLLM's worker subprocesses — through the
``verl.plugins`` entry point (setup.py) or ``VERL_USE_EXTERNAL_MODULES``. verl's hook is
an import, so the registrations run here; each one is idempotent and inert where it
does not apply (cpu_support: only on a host with no accelerator; swap_in: only with
TRUE_ON_POLICY=1).

verl swallows exceptions raised by entry-point plugins (logged at DEBUG), so a failure
is logged here as a warning instead of vanishing.
"""
import logging

log = logging.getLogger("true_on_policy.verl")

try:
    from .. import quiet
    from . import cpu_support, swap_in
    cpu_support.apply()
    swap_in.apply()
    quiet.install()   # only in a job whose driver asked for a quiet console (quiet.py)
except Exception:  # noqa: BLE001 — see the module docstring
    log.warning("true_on_policy: verl registration failed", exc_info=True)
    raise
