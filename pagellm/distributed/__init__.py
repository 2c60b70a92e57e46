"""Beyond one machine: engine cores on other nodes (--headless nodes, headless.py; Ray
actors, ray_engines.py). One model split across processes of one machine (tensor
parallelism) lives below the engine: core/tensor_parallel.py runs the ranks,
model_executor/parallel_state.py holds their groups, shards and collectives."""
