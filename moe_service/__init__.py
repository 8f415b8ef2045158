"""moe-service: serve huge Mixture-of-Experts GGUF models from multi-socket NUMA hosts.

See DESIGN.md for the run path (config -> preflight -> plan -> fastload -> placement ->
replication -> pin -> warmup -> serve). `pipeline` depends on this package, never the reverse.
"""

__version__ = "0.1.0"
