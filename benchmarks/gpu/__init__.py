"""GPU checks and benchmarks (issue 8): run on a lent GPU machine through benchmarks/gpu/run.sh."""
