"""Tools beside the queue: the benchmarks (``pgqueue bench``) and the chaos run."""
