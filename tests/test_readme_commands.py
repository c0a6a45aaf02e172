"""Issue 32: every command README.md shows is run by a test as written, or named here as
needing hardware or a network this CI lacks, with the reason. The tests take their command
line from the README (tests/readme.py: ``readme_command``), so it is not copied, and add only
the model, the step count, output paths and what they measure with (a graded reward, the
sync checksum); a command changed in the README changes what they run. A new README command
in neither list fails here, named."""
import ast
import re
import subprocess
from pathlib import Path

import pytest

import readme

TESTS = Path(__file__).parent
# README command -> the test that runs it (its line taken through readme_command), or the
# script that runs it as written (CI runs .ci/run; .ci/run runs scripts/test.sh).
RUN = {
    "bash scripts/demo.sh": "tests/test_recipe_e2e.py::test_grpo_three_steps_top_p_top_k_then_resume",
    "python -m true_on_policy.main_ppo": "tests/test_recipe_e2e.py::test_grpo_three_steps_top_p_top_k_then_resume",
    "python -m true_on_policy.main_ppo [hydra overrides]": "tests/test_recipe_e2e.py::test_bad_setting_fails_fast",
    "python -m true_on_policy.main_ppo algorithm.adv_estimator=gae critic.enable=true critic.model.path=...":
        "tests/test_recipe_e2e.py::test_ppo_with_critic_two_steps",
    "TRUE_ON_POLICY=1 python -m verl.trainer.main_ppo <your usual overrides>":
        "tests/test_recipe_e2e.py::test_swap_in_stock_verl_job",
    "python -m true_on_policy.main_ppo preset=tiny_grpo_tools":
        "tests/test_recipe_e2e.py::test_multi_turn_tool_agent_loop_is_exact_on_every_turn",
    "TRUE_ON_POLICY=0 python -m true_on_policy.main_ppo": "tests/test_verl_cpu.py::test_stock_grpo_dense",
    "TRUE_ON_POLICY=1 .venv-megatron/bin/python -m true_on_policy.main_ppo preset=tiny_grpo_megatron":
        "tests/test_megatron_e2e.py::test_grpo_megatron_exact_every_step_and_sync",
    "python -m true_on_policy.check":
        "tests/test_vllm_engine.py::test_moe_tp2_topk_topp_chunked_prefix_cached_weight_update_is_exact",
    "python -m true_on_policy.check --stock --temperature 0.7": "tests/test_vllm_engine.py::test_stock_vllm_differs",
    "python -m true_on_policy.check --model M --localize":
        "tests/test_vllm_engine.py::test_localize_names_the_op_broken_in_the_rollout",
    "python -m consistent_ops.probe": "tests/test_probe.py::test_probe_passes_on_reference",
    "python -m true_on_policy.make_tiny_model --arch {qwen3,qwen3_moe} --out DIR [size flags]":
        "tests/test_make_tiny_model.py::test_cli_rebuild_is_byte_identical",
    "python -m true_on_policy.make_tiny_model --arch qwen3_moe --out DIR --no-weights [size flags]":
        "tests/test_make_tiny_model.py::test_no_weights_writes_the_full_shape_without_its_tensors",
    "bash scripts/ascend_compile_check.sh":
        "tests/test_ascend.py::test_every_ascend_kernel_compiles_with_triton_ascend",
    "python -m true_on_policy.verl.cpu_support N":
        "tests/test_readme_commands.py::test_cpu_support_prints_the_cpu_overrides",
    "python benchmarks/bench_cpu_dot.py": "tests/test_bench_cpu_dot.py::test_bench_cpu_dot_times_every_shape_against_torch",
    "python benchmarks/bench_cpu_step.py": "tests/test_bench_cpu_step.py::test_every_case_at_every_thread_count",
    "bash scripts/test.sh": ".ci/run",
    "bash scripts/setup_megatron.sh": "scripts/test.sh",
    "bash scripts/amx_probe.sh --self-test": "tests/test_amx_probe.py::test_self_test_tells_every_candidate_apart",
    "H200_PACKS=vllm026 bash scripts/h200_vllm_env.sh":
        "tests/test_h200_cpu_scripts.py::test_env_step_assembles_only_the_packs_named",
}
# README command -> why this CI (2 CPU cores, no accelerator, no downloads in tests) does not run it.
NOT_HERE = {
    "CONSISTENT_OPS_BACKEND=ascend python -m consistent_ops.probe": "needs an Ascend NPU (torch_npu, CANN)",
    "pip install torch==2.10.0 torch-npu==2.10.0.post4 triton-ascend==3.2.0 vllm==0.23.0 vllm-ascend==0.23.0":
        "the NPU environment: pip downloads, for an Ascend host",
    "bash scripts/gpu_suite.sh $OUT": "needs a CUDA GPU (the H200, through the device tool)",
    "bash scripts/gpu_vllm_suite.sh STEP... $OUT": "needs a CUDA GPU (the H200) and the vLLM 0.26 environment there",
    "bash scripts/gpu_vllm_suite.sh tail $OUT": "needs a CUDA GPU (the H200) and the vLLM 0.26 environment there",
    "bash scripts/gpu_vllm_suite.sh tail48 $OUT": "needs a CUDA GPU (the H200) and the vLLM 0.26 environment there",
    "python -m true_on_policy.check --cuda-graphs --enable-prefix-caching":
        "needs a CUDA GPU (without one: exit 2, tested in test_check_cli.py)",
    'run(carry=[".h200/MANIFEST", ".h200/vllm026.tar.xz.part-aa"], command="bash scripts/h200_vllm_env.sh")':
        "a device-tool call on the H200",
    "bash scripts/h200_vllm_pack.sh": "downloads 69 wheels from PyPI (network)",
    "bash scripts/h200_vllm_pack.sh scripts/h200_verl.lock": "downloads 16 distributions from PyPI (network)",
    'run(carry=[".h200/MANIFEST", ".h200/vllm026.tar.xz.part-ac", ".h200/verl091.tar.xz.part-aa"], '
    'command="bash scripts/h200_vllm_env.sh")': "a device-tool call on the H200",
    "bash scripts/h200_vllm_pack.sh scripts/h200_vllm.lock scripts/h200_vllmcpu.lock":
        "downloads 70 wheels from PyPI (network)",
    'run(carry=[".h200/MANIFEST", ".h200/vllm026.tar.xz.part-ac", ".h200/vllmcpu026.tar.xz.part-aa"], '
    'command="bash scripts/h200_vllm_env.sh")': "a device-tool call on the H200",
    "bash scripts/h200_cpu_bench.sh $OUT": "the H200 host's Xeon (AVX512_BF16) and both packs there; "
                                           "its refusals and site: tests/test_h200_cpu_scripts.py",
    "bash scripts/gpu_verl_suite.sh STEP... $OUT":
        "needs a CUDA GPU (the H200) and the vLLM 0.26 + verl 0.9.1 environment there",
    "bash scripts/gpu_verl_suite.sh sync stock $OUT":
        "needs a CUDA GPU (the H200) and the vLLM 0.26 + verl 0.9.1 environment there",
    "bash scripts/test_vllm_cpu.sh 0.23": "downloads a second environment, ~6 GB (network)",
    "scripts/vllm_cpu_env.sh 0.23": "downloads a second environment, ~6 GB (network)",
    "bash scripts/test_vllm_cpu.sh 0.26": "downloads a second environment (network)",
    "scripts/vllm_cpu_env.sh 0.26": "downloads a second environment (network)",
    'PY=$(bash scripts/vllm_cpu_env.sh 0.26); $PY -m pytest tests/test_vllm_plugin.py -k "not verl_preflight"':
        "downloads a second environment (network)",
    'run(command="bash scripts/amx_probe.sh")': "the device machine host's Xeon (AMX-BF16), a device-tool call; "
                                                "without AMX: exit 3, tested in test_amx_probe.py",
    "python benchmarks/bench_rollout.py --modes plugin,stock --rounds 2 --repeats 3":
        "a benchmark, not a check: 4 vLLM engines timed for minutes (figures in benchmarks/RESULTS.md)",
}


def test_every_readme_command_is_run_by_a_test_or_named_with_its_reason():
    shown = readme.commands()
    assert not set(RUN) & set(NOT_HERE)
    new = [c for c in shown if c not in RUN and c not in NOT_HERE]
    assert not new, ("README commands neither run by a test (RUN) nor named as needing hardware / a network "
                     f"(NOT_HERE) in tests/test_readme_commands.py: {new}")
    gone = [c for c in [*RUN, *NOT_HERE] if c not in shown]
    assert not gone, f"listed in tests/test_readme_commands.py but no longer in the README: {gone}"
    assert all(NOT_HERE.values())
    indented = [ln for ln in readme.README.read_text().splitlines()
                if re.match(r"^ {4,}([A-Z_]+=\S+ )*(python|bash|pip|\.venv|scripts/)", ln)]
    assert not indented, f"an indented command is not read as one: put it in a ```bash block: {indented}"


def _literals():
    """Every string constant of the test modules (but this one)."""
    for path in TESTS.glob("*.py"):
        if path.name != Path(__file__).name:
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    yield node.value


def test_each_run_command_is_taken_from_the_readme_by_its_test():
    """The named test exists, and test code asks readme_command for this line (a string that
    selects it); a script runs the line as written."""
    shown = readme.commands()
    taken = set()
    for lit in set(_literals()):
        try:
            taken.add(readme.find(lit, shown))
        except LookupError:
            pass
    for command, where in RUN.items():
        path, _, name = where.partition("::")
        source = (readme.ROOT / path).read_text()
        if name:
            assert name in {n.name for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef)}, where
            assert command in taken or path.endswith(Path(__file__).name), f"no test takes {command!r} from the README"
        else:
            assert any(ln.strip() == command or ln.strip().startswith(command + " ") for ln in source.splitlines()), \
                f"{path} does not run {command!r}"


def test_cpu_support_prints_the_cpu_overrides():
    """`python -m true_on_policy.verl.cpu_support N`: the overrides for a stock job on N ranks."""
    _, argv = readme.readme_command("python -m true_on_policy.verl.cpu_support N", fill={"N": 2})
    res = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert "++ray_kwargs.ray_init.num_gpus=2" in lines and "++trainer.device=cpu" in lines


def test_the_parser_reads_commands_not_output_or_file_names():
    text = ("x\n```bash\nA=1 python -m a.b --c   # note\n# comment\n```\n```\nstep | reward\npython -m out.put\n```\n"
            "Run `bash scripts/x.sh 2` or\n`python -m c.d\n--e`; see `scripts/x.sh`, `.venv`, `pip --target`, `a=b`.\n")
    assert readme.commands(text) == ["A=1 python -m a.b --c", "bash scripts/x.sh 2", "python -m c.d --e"]
    with pytest.raises(ValueError, match="not filled"):
        readme.readme_command("python -m true_on_policy.check --model M")
