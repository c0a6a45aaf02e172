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
    from .. import quiet, tool_calls
    from . import cpu_support, swap_in
    from ..hooks import after_import
    cpu_support.apply()
    swap_in.apply()
    # the synthetic task's tool-call format, for multi-turn jobs with or without the plugin
    after_import("verl.experimental.agent_loop.tool_parser", tool_calls.register_parser)
    quiet.install()   # only in a job whose driver asked for a quiet console (quiet.py)
except Exception:  # noqa: BLE001 — see the module docstring
    log.warning("true_on_policy: verl registration failed", exc_info=True)
    raise
