"""moe-service: serve huge Mixture-of-Experts GGUF models from multi-socket NUMA hosts.

README.md ("What `moe-service serve` does") draws the run path (config -> catalog -> topology
-> plan -> preflight -> fastload -> placement -> replication -> pin -> engine -> warmup -> serve).
`pipeline` depends on this package; only the CLI (cli.py) imports `pipeline`, to run it.
"""

__version__ = "0.1.0"
