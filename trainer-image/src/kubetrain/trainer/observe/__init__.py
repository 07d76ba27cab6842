"""What a worker reports: Prometheus metrics, progress records for the backends, TensorBoard scalars,
profiler traces, the flight recorder's dumps and the network transport NCCL chose."""
