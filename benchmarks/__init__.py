"""The benchmarks as one suite: every script of this folder, what it measures, where it runs and where
its figures are written up. ``python -m benchmarks`` lists them; ``python -m benchmarks NAME [ARGS]``
runs one (benchmarks/__main__.py).

Why an index: the folder grew one script per question, several named after the round that asked it,
and nothing said which script answers which question, on which machine, or where its last answer
is. ``tests/test_benchmarks.py`` holds the index and the folder to each other (every script listed,
every entry a script, every PERF.md section a heading of benchmarks/PERF.md), so a new script
cannot land unlisted.

Devices are the lent machine kinds: ``cpu`` (the 2-core CPU machine: any machine does), ``nvidia-h200``
(one GPU; the figures so far are an H200's, an H100 runs what fits its 80 GB), ``nvidia-h200-x2`` and
``nvidia-h200-x4`` (2 and 4 GPUs of one host, NCCL). The first device listed is where the figures
come from; a second one runs the same code path (e.g. a GPU benchmark's CPU smoke flags).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
PERF = HERE / "PERF.md"
DEVICES = ("cpu", "nvidia-h200", "nvidia-h200-x2", "nvidia-h200-x4")


@dataclass(frozen=True)
class Benchmark:
    """One script of the suite.

    ``perf``: the heading (without its ``#``) of the benchmarks/PERF.md section where its figures
    are written up, the latest or the one its later figures extend; None where none is yet, and
    ``elsewhere`` then says where its output goes instead (a table in conf/, a pass/fail line)."""

    name: str  # python -m benchmarks NAME
    script: str  # the file in benchmarks/
    measures: str  # one line
    devices: tuple[str, ...]
    usage: str = ""  # typical arguments
    perf: str | None = None
    elsewhere: str = ""

    @property
    def command(self) -> str:
        runner = "bash" if self.script.endswith(".sh") else "python"
        return f"{runner} benchmarks/{self.script}" + (f" {self.usage}" if self.usage else "")


CPU, GPU, GPU2, GPU4 = ("cpu",), ("nvidia-h200",), ("nvidia-h200-x2",), ("nvidia-h200-x4",)
GPU_OR_CPU = ("nvidia-h200", "cpu")

# PERF.md sections named more than once.
PLANNER = "The planner's step-time model (issue 15): predicted against measured"
FLOAT8_12 = "Round 12 (session 4): float8 training (torchao 0.18.0), and a stronger hand loop"
FLOAT8_SEEDS = "Round 15 (session 6): float8 loss parity over three seeds, and the gradients' float8 format"
FA4 = "Round 15 (session 6), attention: FlashAttention-4 through torch's flash-attention registry"
CP_ONE_GPU = "Round 15 (session 6): context parallelism on the one lent GPU, and cp x pp in the planner"
LLAMA8B = "Session 10: Llama-3-8B at 8K on one H200 (issue 28), through `python train.py`"
MOE = "Session 11: MoE on one H200 (issue 25 point 6), through `python train.py`"
STRUCTURE = "The checkout's structure, measured (benchmarks/structure.py, benchmarks/cfg_flow.py)"
ATTN_8K = "Session 16: the 8K rows in cost_check, and where the planner's 8K error comes from (CPU machine)"

KERNELS = "Session 17: kernel tables on the H100, the planner priced per GEMM, and 82 rows it never saw (issue 38)"
FIRST_HOUR = "A user's first hour (issue 44), CPU machine (2 cores, shared with other jobs)"
BENCHMARKS: tuple[Benchmark, ...] = (
    # -- training speed on the GPU ---------------------------------------------------------------
    Benchmark("gpu_bench", "gpu_bench.py",
              "tokens/s, step time, MFU, peak memory and first-step time of train.py beside a hand-written loop",
              GPU, "--models llama_125m,llama1b --modes eager,compile,cudagraphs",
              "Where it stands against the issue's targets (end of session 3)"),
    Benchmark("before_after", "before_after.sh",
              "a change that should not move the numbers: gpu_bench lines from two source trees, interleaved",
              GPU, "BEFORE_DIR AFTER_DIR VARIANTS_FILE [STEPS]",
              "Session 9: issue 29 points 2-5 (family folders, resolve once, construction, callbacks), before vs after"),
    Benchmark("compile_cache_bench", "compile_cache_bench.sh",
              "time to first step with an empty Inductor cache: no cache dir, cold and warm executor.cache_dir",
              GPU_OR_CPU, "[OVERRIDE ...]",
              "Round 8 (session 3): the median step, the 7B with the optimiser in backward, time to first step"),
    Benchmark("gpu_smoke", "gpu_smoke.sh", "the suite's CUDA-only tests and a few 125M steps through train.py",
              GPU, "", None, "pass/fail and the runs' logs in $OUT: no figures"),
    Benchmark("multi_gpu", "multi_gpu.sh",
              "every sharding option on NCCL through train.py: loss, tokens/s and peak memory against the plan",
              GPU2, "NGPU STEPS [CASE ...]",
              "Multi-GPU, session 2 (nvidia-h200-x2): every sharding option on NCCL, verification, a killed rank"),
    Benchmark("cp_gpu", "cp_gpu.sh",
              "context parallelism through the launcher: each step's loss and grad norm against one process",
              GPU4, "[STEPS] [CASE ...]", CP_ONE_GPU),
    Benchmark("llama8b_8k", "llama8b_8k.sh",
              "Llama-3-8B at 8K context on one 141 GB GPU: train.py beside the hand loop, bf16 and float8",
              GPU, "PHASE ...", LLAMA8B),
    Benchmark("llama8b_8k_parts", "llama8b_8k.py",
              "llama8b_8k.sh's parts: the documents, the attention kernels at the shape, the hand loop, the table",
              GPU, "docs|attn|hand|table ...", LLAMA8B),
    Benchmark("lora_gpu", "lora_gpu.sh", "LoRA against full fine-tuning of the 8B shape: peak memory and tokens/s",
              GPU, "", LLAMA8B),
    Benchmark("moe_gpu", "moe_gpu.sh",
              "an MoE recipe's shape: train.py beside the hand loop and torchtitan's model code, grouped GEMM and loop",
              GPU, "PHASE ...", MOE),
    Benchmark("moe_gpu_parts", "moe_gpu.py",
              "moe_gpu.sh's parts: the MoE hand loop with the grouped GEMM's share of the step, the table",
              GPU, "hand|table ...", MOE),
    Benchmark("titan_peer", "titan_peer.py",
              "torchtitan 0.2.2's own model code (qwen3, deepseek_v3, gpt_oss) for a recipe's shape, same loop",
              GPU, "--recipe moonlight_16b_a3b --layers 4 --pattern 'dense x1, moe x3' --out t.json", MOE),
    # -- float8 ------------------------------------------------------------------------------------
    Benchmark("float8_gpu", "float8_gpu.sh",
              "float8 speed beside bf16 and the hand loop, float8 loss parity, what closes the parity gap",
              GPU, "PHASE ... (smoke speed rowwise 7b fused_ce parity diag parity_levers)", FLOAT8_12),
    Benchmark("float8_seeds", "float8_seeds.sh",
              "float8 loss parity over seeds: bf16, tensorwise e5m2 and e4m3 gradients, 500 steps of the 125M",
              GPU, "(OUT=DIR DEADLINE_S=N SEEDS='0 1 2')", FLOAT8_SEEDS),
    Benchmark("float8_seeds_table", "float8_seeds.py",
              "float8_seeds.sh's table and plot: each numerics' loss against bf16's, per seed and over seeds",
              CPU, "ROOT --out parity.png", FLOAT8_SEEDS),
    Benchmark("float8_parity", "float8_parity.py",
              "the loss curves and final losses of runs that differ only in model.float8, against the first",
              CPU, "--out parity.png bf16=RUN_DIR tensorwise=RUN_DIR",
              "Loss parity (llama_125m, bytes of the standard library's source, b16 x 2048, 500 steps)"),
    Benchmark("float8_grad_range", "float8_grad_range.py",
              "what a tensorwise float8 cast loses of each Linear's output gradient, e4m3 against e5m2",
              CPU, "[--recipe llama_125m] [--steps 0]", FLOAT8_SEEDS),
    # -- kernels -----------------------------------------------------------------------------------
    Benchmark("kernel_tables", "kernel_tables.py",
              "the planner's kernel tables: measured GEMM, grouped GEMM and attention rates by shape",
              GPU_OR_CPU, "--out conf/mesh/hardware/tables/NAME.json (--smoke --device cpu: the code path)",
              KERNELS, "conf/mesh/hardware/tables/NAME.json, which a profile names with kernel_table: NAME"),
    Benchmark("attn_sweep", "attn_sweep.py",
              "causal attention's forward + backward rate by head dim and sequence length, per SDPA backend",
              GPU_OR_CPU, "(--device cpu --seqs 64,128 --head-dims 16 --tokens 256 --peak 1)", ATTN_8K),
    Benchmark("fa4_gpu", "fa4_gpu.sh",
              "FlashAttention-4 installed from carried wheels, its kernels at the 1B's shape, the speed rows",
              GPU, "install check speed", FA4),
    Benchmark("fa4_check", "fa4_check.py",
              "FlashAttention-4 against SDPA and FlashAttention-2: kernel time at the 1B's shape, parity",
              GPU, "--out fa4_check.md", FA4),
    Benchmark("grouped_mm_probe", "grouped_mm_probe.py",
              "what grouped_mm accepts on this torch and device, and its speed against a per-expert loop",
              GPU_OR_CPU, "[--device cuda]", MOE),
    Benchmark("moe_cpu", "moe_cpu.py",
              "the MoE experts' grouped GEMM against the per-expert loop, forward and forward + backward",
              ("cpu", "nvidia-h200"), "[--tokens 2048 --experts 16 --top-k 2] [--device cuda]",
              None, "its table on stdout; not written up yet"),
    Benchmark("host_link_probe", "host_link_probe.py",
              "pinned host <-> device copy bandwidth, the link the planner's activation-offload term uses",
              GPU, "",
              "Session 14: document masks on FlashAttention-4's variable-length kernel (issue 28), one H200"),
    Benchmark("gloo_cuda_probe", "gloo_cuda_probe.py",
              "which collectives gloo runs on CUDA tensors when ranks share one GPU",
              GPU, "[WORLD]", CP_ONE_GPU),
    # -- the planner (no training) -------------------------------------------------------------------
    Benchmark("cost_check", "cost_check.py",
              "the planner's predicted step time against the measured GPU runs of PERF.md", CPU, "", PLANNER),
    Benchmark("cpu_layouts", "cpu_layouts.py",
              "rank layouts on 4 gloo ranks: the planner's predicted step time against the measured one",
              CPU, "[--steps 6] [--ranks 4]", "Layout ranking on 4 gloo ranks (CPU)"),
    Benchmark("published", "published.py",
              "the planner against nine published large H100 runs, each layout forced, beside sharding=auto",
              CPU, "", "Session 9: the planner against published large runs (issue 26)"),
    Benchmark("published_sources", "published_sources.py",
              "the planner out of sample: 82 published H100 / H200 rows, error per source and class",
              CPU, "[--list]", KERNELS, "its table on stdout; the rows and sources: benchmarks/published_rows.md"),
    Benchmark("dry_run_bench", "dry_run_bench.py",
              "dry-run time and planned against measured parameter bytes of a 70B shape at 128 to 8192 ranks",
              CPU, "[--worlds 16x8,128x8,1024x8]",
              "Context parallelism and the 405B at 16,384 ranks (issue 15, CPU machine)"),
    # -- the CPU machine ---------------------------------------------------------------------------------
    Benchmark("data_bench", "data_bench.py",
              "loader throughput: tokens/s delivered per rank, packed jsonl, token files, prepare",
              CPU, "[--mb 50 --seq-len 2048]", "Data loader (issue 14): the 2-core CPU machine, then the GPU machine"),
    Benchmark("checkpoint_bench", "checkpoint_bench.py",
              "checkpoint save throughput against a raw write, time blocked per async mode, time to resume",
              CPU, "[--dir DIR] [--skip-125m]", None, "its table on stdout (docs/performance.md); not written up yet"),
    Benchmark("threads_bench", "threads_bench.py",
              "a CPU run's wall time with and without a competing busy process, by OMP_NUM_THREADS",
              CPU, "", "Threads under contention (issue 24 point 5)"),
    Benchmark("verify_hooks_bench", "verify_hooks_bench.py",
              "what the default verification hooks cost: the default run with them on and off",
              CPU, "[--repeats 3]", "Verification hooks on by default (issue 24 point 5), CPU machine"),
    Benchmark("fault_campaign", "fault_campaign.py",
              "faults survived bitwise: seeded random kills, signals, full disk, spoiled checkpoints, deleted run dir, racing resumes",
              CPU, "--seed 0 --faults 36", "Fault campaign (issue 40 point 6), CPU machine"),
    Benchmark("startup_bench", "startup_bench.py",
              "wall time of the answers that need no training (help, a typo, a refused value), and whether torch was imported",
              CPU, "[--repeat 5] [--root DIR ...]", FIRST_HOUR),
    Benchmark("install_size", "install_size.py",
              "how many distributions the base install and each extra pull in",
              CPU, "[EXTRAS ...]", FIRST_HOUR),
    # -- the code itself -----------------------------------------------------------------------------
    Benchmark("structure", "structure.py",
              "modules, import edges, cycles, depth, upward imports; the call path of a real run to its first step",
              CPU, "[ROOT ...]", STRUCTURE),
    Benchmark("cfg_flow", "cfg_flow.py",
              "how far the config travels from the entry point, the call sites of the planner's resolvers, and "
              "the rank-side files naming the config and reading each derived value (issue 41)",
              CPU, "[ROOT]", STRUCTURE),
)  # fmt: skip

BY_NAME = {b.name: b for b in BENCHMARKS}
