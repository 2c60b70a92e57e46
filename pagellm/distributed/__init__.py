"""Beyond one process: engine cores on other nodes (--headless nodes, headless.py; Ray
actors, ray_engines.py) and one model split across processes of one machine (tensor
parallelism: tensor_parallel.py, its groups and collectives in parallel_state.py)."""
