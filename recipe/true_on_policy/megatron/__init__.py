"""verl's Megatron actor under TRUE_ON_POLICY=1: a Megatron layer spec on consistent_ops
(spec.py) and the CPU work-arounds Megatron-Bridge needs without Transformer Engine (env.py).
Imported only in the Megatron environment (scripts/setup_megatron.sh)."""
