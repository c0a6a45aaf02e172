"""vLLM-Ascend (0.23) specifics. Not exercised on this CPU machine; kept small on purpose.

* Model registration order. vLLM-Ascend may register its own Qwen3 / Qwen3-MoE
  classes from its plugins, and plugin order is not defined. ``plugin.register``
  runs vLLM-Ascend's model registration first (when present) and then ours, so
  ours overwrite them in this process whatever the entry-point order was.
* MoE communication. vLLM-Ascend picks ALLGATHER / MC2 / ALLTOALL per step from the
  token count, i.e. batch-dependently; that choice applies to its FusedMoE layers.
  Our model class never builds FusedMoE: its experts are plain stacked parameters, placed whole
  on ranks and their per-(token, slot) contributions are exchanged with an all-gather
  and selected by owner (consistent_ops.parallel.gather_owned), the same for every
  batch. So the batch-independent MoE communication is forced by construction, and
  no vLLM-Ascend setting can change it.
* Attention. The backend is passed to vLLM's Attention directly, so vLLM-Ascend's
  FIA / PagedAttention selection is bypassed; the consistent_ops ``ascend`` backend
  (CONSISTENT_OPS_BACKEND) provides the kernels.
"""
import importlib.util


def register_vllm_ascend_models() -> None:
    if importlib.util.find_spec("vllm_ascend") is None:
        return
    import vllm_ascend
    for name in ("register_model", "register_models"):
        fn = getattr(vllm_ascend, name, None)
        if callable(fn):
            fn()
