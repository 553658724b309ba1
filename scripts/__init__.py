"""The lab's entry points, each run from the repository's root as python -m scripts.NAME: the comparisons
(compare, trend), the forced compromise (compromise), what the routing learned (probe), benchmarks of
lm-evaluation-harness (eval), a checkpoint as a Hugging Face directory (export), the kernels' and the step's
benchmarks (bench_kernel, bench_step, bench_head) and the first GPU run (gpu_check)."""
