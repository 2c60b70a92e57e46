"""Beyond one machine: how engine cores on other nodes are started and supervised
(--headless nodes today; Ray and tensor parallelism are not built yet)."""
