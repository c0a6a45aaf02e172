"""python -m true_on_policy.check: is the rollout's log-prob the trainer's, token by token?

    cli.py       arguments, configuration errors (exit 2), the run, the summary
    rollout.py   the vLLM child process (the only module here that imports vLLM)
    worker.py    functions run inside vLLM's workers (weight update, capture)
    trainer.py   the trainer's recomputation (and the stock HF one)
    report.py    statistics, the summary table and its JSON (stable keys)
    prompts.py   deterministic probe prompts
    capture.py   per-op activation capture (--localize), localize.py compares them
    perturb.py   test-only: break one op in the rollout to test --localize
"""
