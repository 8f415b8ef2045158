"""Configuration: one pydantic model per TOML table, strict, with environment overrides.

Where settings come from, highest priority first:

1. command-line shortcuts (``--model PATH`` sets ``model.path``);
2. environment variables ``MOE_SERVICE__<TABLE>__<KEY>`` (e.g. ``MOE_SERVICE__SERVE__PORT=9000``;
   lists and tables as JSON, e.g. ``MOE_SERVICE__PIPELINE__STAGES='["fastload"]'``);
3. the TOML file: ``--config FILE``, else ``$MOE_SERVICE_CONFIG``, else ``configs/default.toml``
   (looked up in the current directory, then next to this package's source tree); when none
   exists, the built-in defaults, which equal ``configs/default.toml``;
4. each field's default.

Unknown tables and unknown keys are errors, in the file and in the environment. Every error
names its source and the dotted key, e.g. ``configs/x.toml: fastload.threads: must be >= 1 (got 0)``.
"""

from __future__ import annotations

import contextvars
import difflib
import json
import os
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from moe_service.errors import ConfigError
from moe_service.sizes import GiB, MiB

ENV_PREFIX = "MOE_SERVICE__"
ENV_CONFIG_PATH = "MOE_SERVICE_CONFIG"
REPO_DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "default.toml"

WORK_CHUNK_BYTES = 64 * MiB
"""Default unit of load work (fastload.chunk_bytes) and of copy work (replication.chunk_bytes)."""


class _Table(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Table):
    """[model]: which GGUF file to serve."""

    path: str = Field(
        "",
        description="GGUF file to serve: a single file or any shard of a split set "
        "(NAME-0000k-of-0000N.gguf). Empty: the embedded demo model that `moe-service demo-model` "
        "builds in the cache dir ($CACHE_DIRECTORY, else $XDG_CACHE_HOME/moe-service, else "
        "~/.cache/moe-service). `~` and $VARS are expanded.",
    )
    name: str = Field(
        "",
        description="Model id served at /v1/models and checked in requests. Empty: the file name "
        "without `.gguf` and without the `-0000k-of-0000N` shard suffix.",
    )
    context_tokens: int = Field(
        0,
        ge=0,
        description="Context length per sequence in tokens (prompt + completion). 0: the model's "
        "trained context length, capped by what engine.kv_cache_gib holds for serve.parallel "
        "sequences (rounded down to 256). The KV cache is sized from it and serve.parallel; "
        "`moe-service plan` shows the numbers and preflight refuses a context that does not fit.",
    )


class NumaConfig(_Table):
    """[numa]: where each expert lives."""

    policy: Literal["expert_shard", "interleave", "mirror", "local"] = Field(
        "expert_shard",
        description="expert_shard: expert e of each layer on node e*n_nodes//n_experts, computed "
        "by that node's cores; interleave: every tensor page-interleaved over the nodes; mirror: "
        "a full copy on every node; local: no binding (first touch decides).",
    )
    nodes: list[int] = Field(
        default_factory=list,
        description="NUMA nodes to use. Empty: every node that has memory and usable CPUs.",
    )
    expert_homes: Literal["contiguous", "round_robin"] = Field(
        "contiguous",
        description="Which node is each expert's home under expert_shard: contiguous: expert e on "
        "node e*n_nodes//n_experts (one run of the file per node); round_robin: expert e on node "
        "e % n_nodes (spreads each group of consecutive experts over every node, which balances "
        "group-limited routers better; see `moe-service bench placement`).",
    )
    node_reserve_gib: float = Field(
        1.0,
        ge=0,
        description="GiB of each node's free memory the plan leaves for everything else (KV cache, "
        "buffers, the OS) when it checks that the node can hold its share. Not applied to "
        "hugetlb pools (fastload.pages = 2m or 1g), which hold nothing else. engine.kv_cache_gib = "
        "auto leaves it free on the KV cache's node too: raise it to leave more to other processes.",
    )
    sysfs_root: str = Field(
        "/",
        description="Root under which /sys and /proc are read for the topology (tests point it at "
        "a fake tree; leave `/` in production).",
    )


DEFAULT_STAGES = ["fastload", "placement", "replication", "pin", "engine", "warmup", "serve"]


class PipelineConfig(_Table):
    """[pipeline]: the declared stage list and how long stages talk to systemd."""

    stages: list[str] = Field(
        default_factory=lambda: list(DEFAULT_STAGES),
        description="Stages to run, in order. Validated before anything runs: unknown stages, "
        "duplicates, missing prerequisites and broken orderings are refused (see `moe-service "
        "config validate`).",
    )
    extend_after_s: float = Field(
        5.0,
        ge=0,
        description="A stage running longer than this starts sending EXTEND_TIMEOUT_USEC to systemd.",
    )
    extend_interval_s: float = Field(
        10.0, gt=0, description="Seconds between EXTEND_TIMEOUT_USEC messages while a stage runs."
    )
    extend_timeout_s: float = Field(
        30.0,
        gt=0,
        description="Extension asked for in each EXTEND_TIMEOUT_USEC message; must exceed "
        "extend_interval_s so that the next message always arrives in time.",
    )

    stall_limit_s: dict[str, float] = Field(
        default_factory=dict,
        description="Per stage (e.g. {fastload = 60}): most seconds without progress (bytes loaded, a "
        "new phase) before EXTEND_TIMEOUT_USEC stops and systemd's start timeout ends a hung start. "
        "Unset stages use their own limit: fastload 60, engine and warmup 900 (a first kernel "
        "compile reports nothing for minutes), others 600.",
    )

    @model_validator(mode="after")
    def _extension_outlasts_interval(self) -> PipelineConfig:
        if self.extend_timeout_s <= self.extend_interval_s:
            raise ValueError(
                f"extend_timeout_s ({self.extend_timeout_s}) must exceed extend_interval_s "
                f"({self.extend_interval_s}), or systemd times out between two extensions"
            )
        return self


class FastloadConfig(_Table):
    """[fastload]: reading the GGUF into placed anonymous memory."""

    threads: int = Field(
        16,
        ge=1,
        description="Load threads (populate + pread), capped by the usable CPUs. More threads than "
        "that evict a cold page cache faster than they fill memory.",
    )
    pages: Literal["thp", "2m", "1g", "4k"] = Field(
        "thp",
        description="Pages backing the weights. thp: anonymous memory with madvise(MADV_HUGEPAGE), "
        "transparent 2 MiB pages where the kernel has them; 2m / 1g: hugetlb pages "
        "(MAP_HUGETLB) taken from each node's pool, which must be reserved beforehand "
        "(/sys/devices/system/node/nodeN/hugepages/hugepages-{2048,1048576}kB/nr_hugepages; the "
        "Ansible role `hugepages` does it) and which preflight checks node by node; regions are "
        "then aligned to the page size (1g: each region takes whole GiB); 4k: ordinary pages "
        "(MADV_NOHUGEPAGE), for comparisons.",
    )
    populate: Literal["auto", "madvise", "touch"] = Field(
        "auto",
        description="How pages are faulted in before the reads: madvise(MADV_POPULATE_WRITE), "
        "touching one byte per page, or auto (madvise, falling back to touch where the kernel "
        "lacks it).",
    )
    chunk_bytes: int = Field(
        WORK_CHUNK_BYTES, ge=2 * MiB, description="Bytes per unit of load work (2 MiB aligned)."
    )
    max_read_bytes: int = Field(
        0x7FFFF000,
        ge=4096,
        le=0x7FFFF000,
        description="Most bytes one pread call asks for (Linux moves at most 0x7ffff000 per call).",
    )
    progress_interval_s: float = Field(
        2.0, gt=0, description="Seconds between progress log events and STATUS updates."
    )
    prefetch: bool = Field(
        False,
        description="One read-ahead thread that asks the kernel (posix_fadvise WILLNEED) for the file "
        "ranges a few chunks ahead of the load threads, so a cold file is read as one stream "
        "(buffered reads only: direct reads bypass the page cache). "
        "Off: the kernel's own read-ahead did as well on the hosts measured; try it where "
        "read_ahead_kb is small (`moe-service bench fastload`).",
    )
    io: Literal["auto", "buffered", "direct"] = Field(
        "auto",
        description="How the model file is read. buffered: through the page cache (a second copy "
        "of the model stays cached after the load); direct: O_DIRECT reads from the device "
        "straight into the arena, no page cache copy (filesystems that refuse O_DIRECT, e.g. "
        "tmpfs before Linux 6.6 or some network filesystems, are read buffered, logged once); "
        "auto: buffered when the file is already in the page cache (or smaller than "
        "direct_above_free_fraction of MemAvailable), else direct.",
    )
    direct_above_free_fraction: float = Field(
        0.0,
        ge=0,
        description="io = auto reads a file that is not cached with direct I/O when it is larger "
        "than this fraction of MemAvailable (/proc/meminfo) at the start of the load; 0: "
        "whenever it is not cached (the fastest cold start; the next restart is cold too).",
    )
    pipeline: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Populate chunks in separate threads ahead of the reader threads, so that "
        "page faulting and zeroing hide behind the I/O. auto: on, except for buffered reads of "
        "a file already in the page cache (there the load is copies, and populating and "
        "filling each 2 MiB in the same thread keeps the zeroed page in the CPU cache).",
    )
    populate_threads: int = Field(
        0,
        ge=0,
        description="Threads populating ahead of the readers in a pipelined load; 0: a quarter of "
        "the usable CPUs, at least 1.",
    )
    direct_threads: int = Field(
        4,
        ge=1,
        description="Reader threads of a direct (O_DIRECT) load, not capped by the CPUs: they sleep "
        "on the device. Each read asks for 8 MiB, which the block layer cuts into several "
        "requests in flight together.",
    )


class PlacementConfig(_Table):
    """[placement]: verifying and repairing where pages landed."""

    verify: bool = Field(True, description="Check residency of every region with move_pages.")
    migrate: bool = Field(
        True, description="Move pages found on the wrong node to their planned node (MPOL_MF_MOVE)."
    )
    sample_stride_bytes: int = Field(
        2 * MiB,
        ge=4096,
        description="Check one page per this many bytes of each region.",
    )
    strict: bool = Field(
        True,
        description="Fail the start when sampled pages are still on another node after migration, "
        "or were never written; false: log it and go on.",
    )
    interleave_tolerance: float = Field(
        0.10,
        ge=0,
        description="Warn when a node's share of an interleaved region is off the even share by more "
        "than this fraction of it (0.10: 10%).",
    )


class ReplicationConfig(_Table):
    """[replication]: extra copies of experts on other nodes."""

    replicas: int = Field(
        0,
        ge=0,
        description="Extra copies of each expert (0..n_nodes-1), on the farthest nodes by the "
        "distance matrix. Ignored with numa.policy = mirror (every node has everything).",
    )
    threads: int = Field(
        0, ge=0, description="Copy threads; 0: one per usable CPU of the destination nodes."
    )
    chunk_bytes: int = Field(
        WORK_CHUNK_BYTES, ge=2 * MiB, description="Bytes per unit of copy work (one memmove)."
    )


class PinConfig(_Table):
    """[pin]: cudaHostRegister of the placed regions."""

    mode: Literal["auto", "required", "off"] = Field(
        "auto",
        description="auto: pin when a CUDA device exists, else skip with a logged reason; "
        "required: a start without CUDA fails; off: never pin.",
    )
    chunk_bytes: int = Field(
        64 * GiB,
        ge=2 * MiB,
        le=64 * GiB,
        description="Largest single cudaHostRegister call (recent drivers fail at >= 512 GiB).",
    )


class WarmupConfig(_Table):
    """[warmup]: compile kernels and touch every expert before READY=1."""

    prompt: str = Field(
        "The capital of France is", description="Prompt run through the whole model once."
    )
    max_tokens: int = Field(4, ge=1, description="Tokens decoded after the warmup prompt.")
    touch_experts: bool = Field(
        True, description="Run every expert once (all pages hot, every kernel compiled)."
    )


class EngineConfig(_Table):
    """[engine]: the inference engine."""

    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description="Where the dense part (attention, norms, router, embeddings, output) runs: "
        "auto picks cuda when a CUDA device is present. Routed experts always run on the CPU "
        "nodes that hold them (except big prefills, see offload_min_batch_tokens).",
    )
    threads: int = Field(
        0, ge=0, description="Engine worker threads, one per core, pinned once; 0: every usable core."
    )
    fused_moe: bool = Field(
        True,
        description="Fused MoE kernel (one dispatch per layer for all tokens and experts). false: "
        "the straightforward per-expert path (the test reference).",
    )
    ubatch_tokens: int = Field(
        128, ge=1, description="Prompt tokens computed per forward step during prefill."
    )
    offload_min_batch_tokens: int = Field(
        2048,
        ge=1,
        description="With a GPU: batches of at least this many tokens stream expert slabs to the "
        "GPU over PCIe; smaller ones compute experts on the CPU.",
    )
    experts_per_token: int = Field(
        0,
        ge=0,
        description="Routed experts computed per token; 0: the model's own (expert_used_count). "
        "Fewer (e.g. top-4 of a top-8 model) trades quality for decode speed; more than the "
        "model's experts per layer is refused at check/preflight. Logged (model_routing) and "
        "exported as moe_service_experts_per_token.",
    )
    kv_cache_gib: float | Literal["auto"] = Field(
        "auto",
        description="Memory budget of the KV cache of all serve.parallel sequences, in GiB, or auto: "
        "what the plan leaves free on the KV cache's node (engine.kv_node) after the weights' share, "
        "numa.node_reserve_gib and serve.prefix_cache_gib (as llama.cpp's --fit). It caps the context "
        "when model.context_tokens = 0 (auto: the trained context wherever memory allows); an explicit "
        "context that needs more is refused at preflight. `moe-service plan` shows the budget and the "
        "context it gives.",
    )
    kv_type: Literal["f16", "q8_0"] = Field(
        "f16",
        description="Element format of the KV cache: f16 (2 bytes a value) or q8_0 (ggml Q8_0 blocks, "
        "34 bytes per 32 values, as llama.cpp's -ctk/-ctv q8_0: 1.9x the context in the same memory).",
    )
    kv_node: int = Field(
        -1,
        ge=-1,
        description="NUMA node the KV cache is bound to and populated on; -1: the node of the first "
        "engine worker's CPU (the first node of the plan).",
    )


    @field_validator("kv_cache_gib")
    @classmethod
    def _kv_budget_positive(cls, v: float | str) -> float | str:
        if v != "auto" and not v > 0:
            raise ValueError(f"must be a number of GiB greater than 0, or \"auto\" (got {v})")
        return v


class ServeConfig(_Table):
    """[serve]: the HTTP API."""

    host: str = Field("127.0.0.1", description="Listen address.")
    port: int = Field(8000, ge=0, le=65535, description="Listen port (0: any free port).")
    parallel: int = Field(
        4, ge=1, description="Sequences decoded together; they share every expert read."
    )
    queue_size: int = Field(
        16,
        ge=0,
        description="Requests waiting for a free sequence slot; beyond it requests get 429.",
    )
    retry_after_s: int = Field(1, ge=0, description="Retry-After header value on 429 answers.")
    max_tokens_default: int = Field(
        256,
        ge=1,
        description="max_tokens when a /v1/chat/completions or /v1/completions request gives none "
        "(/v1/messages requires max_tokens; a /v1/responses request without max_output_tokens may use "
        "the rest of the context).",
    )
    max_tokens_policy: Literal["auto", "refuse", "clamp"] = Field(
        "auto",
        description="A request whose prompt plus its output limit (max_tokens, max_output_tokens) exceeds "
        "the context: refuse: 400 context_length_exceeded, as the OpenAI API does; clamp: serve what "
        "fits, the answer ends with the protocol's length reason (llama.cpp's behaviour). auto: per "
        "endpoint, refuse on /v1/chat/completions and /v1/completions (OpenAI clients expect it), clamp "
        "on /v1/messages and /v1/responses (agents ask for a fixed large output, Claude Code 32000 tokens, "
        "whatever the model's context). See docs/api.md.",
    )
    model_aliases: list[str] = Field(
        default_factory=list,
        description="Other model names that mean the served model, as exact names or glob patterns "
        "(`claude-*`, `gpt-5*`; fnmatch, case-sensitive): coding agents send their own model names. "
        "Honoured by /v1/chat/completions, /v1/completions, /v1/messages and /v1/responses; the "
        "answer names the served model. Empty: any other name is a 400 naming the served one.",
    )
    prefix_cache_gib: float = Field(
        2.0,
        ge=0,
        description="Host memory for the prefix cache, in GiB: the KV rows (and per-sequence state, "
        "deepseek4) of earlier requests' prompts, kept in blocks of 64 tokens (128 for deepseek4 "
        "with ratio-128 layers) and reused by a request that starts with the same tokens (least "
        "recently used blocks evicted; ring rows captured for prompts in flight count too). 0: off.",
    )
    responses_store_mib: float = Field(
        64.0,
        ge=0,
        description="Host memory for stored Responses API responses, in MiB: a response created with "
        "`store` (the default) is kept with its conversation so that a later request can name it in "
        "`previous_response_id`; least recently used ones are evicted, a restart forgets them all. "
        "0: nothing is stored.",
    )
    prefix_cache_dir: str = Field(
        "",
        description="Where the prefix cache keeps blocks on disk: blocks evicted from memory go there "
        "(up to prefix_cache_disk_gib) and a hit reads them back; at shutdown, after the drain, the "
        "blocks still in memory are written while stop_timeout_s allows, and at start the stored blocks "
        "are indexed, so a restart keeps the cache. A relative path is under the service's cache "
        "directory (the unit's CacheDirectory=, e.g. `prefix` -> /var/cache/moe-service/NAME/prefix); an "
        "absolute one needs ReadWritePaths= in a drop-in. Blocks are keyed by the model file, "
        "engine.kv_type, the context and the engine version. Empty: memory only.",
    )
    prefix_cache_disk_gib: float = Field(
        16.0,
        gt=0,
        description="Disk space for prefix_cache_dir, in GiB (least recently used blocks removed "
        "beyond it); counted by `moe-service plan`, refused at preflight when the file system cannot "
        "hold it.",
    )
    shutdown_grace_s: float = Field(
        30.0,
        ge=0,
        description="On SIGTERM: how long in-flight requests may run before they are cancelled. "
        "Must leave stop_margin_s within stop_timeout_s.",
    )
    api_keys: list[SecretStr] = Field(
        default_factory=list,
        description="API keys accepted as `Authorization: Bearer <key>` or `x-api-key: <key>` (Anthropic's "
        "clients; either admits), compared in constant time. "
        "Empty together with api_key_file: no key needed (a warning is logged when host is not loopback).",
    )
    api_key_file: str = Field(
        "",
        description="File of API keys, one per line (`#` comments), read at start and again on SIGHUP; "
        "keep it 0600. Empty: none.",
    )
    metrics_auth: bool = Field(
        False, description="/metrics needs an API key too (/health is always open for load balancers)."
    )
    allowed_hosts: list[str] = Field(
        default_factory=list,
        description="Host header values accepted (`name`, `*.domain`, `*`), against DNS rebinding; "
        "empty: any. /health is exempt.",
    )
    cors_origins: list[str] = Field(
        default_factory=list,
        description="Origins allowed by CORS (e.g. `https://app.example`, `*`); empty: CORS off, so "
        "browser pages of other origins cannot call the API.",
    )
    stop_timeout_s: float = Field(
        90.0,
        gt=0,
        description="The unit's TimeoutStopSec= (units/moe-service.service ships 90 s): after it "
        "systemd SIGKILLs the service. Set it to the unit's value when a drop-in changes it; "
        "shutdown_grace_s + stop_margin_s must not exceed it, so a promised drain is never killed.",
    )
    stop_margin_s: float = Field(
        15.0,
        ge=0,
        description="Time kept after the drain for stopping the engine thread (up to 10 s for a step "
        "in progress) and closing the stages (unpinning, unmapping) before TimeoutStopSec.",
    )
    max_body_bytes: int = Field(
        8 * MiB,
        ge=0,
        description="Largest request body in bytes; larger ones get 413 before they are read "
        "(0: no limit).",
    )
    max_connections: int = Field(
        512,
        ge=1,
        description="Most open HTTP connections plus running requests (uvicorn's limit_concurrency); "
        "beyond it new requests get 503 at once.",
    )
    header_timeout_s: float = Field(
        10.0,
        gt=0,
        description="A connection must complete a request's headers within this many seconds of "
        "opening (or of its previous response); slower clients are disconnected.",
    )
    body_timeout_s: float = Field(
        30.0,
        gt=0,
        description="Longest wait for the next piece of a request body; a client that stalls "
        "longer gets 408.",
    )
    keepalive_timeout_s: int = Field(
        5,
        ge=1,
        description="Idle keep-alive connections are closed after this many seconds "
        "(uvicorn's timeout_keep_alive).",
    )
    max_failed_steps: int = Field(
        5,
        ge=1,
        description="After this many engine steps in a row fail, /health answers 503 with the "
        "reason and the watchdog stops pinging, so systemd restarts the service.",
    )
    engine_stall_s: float = Field(
        120.0,
        gt=0,
        description="Requests waiting or running but no engine step completed for this many "
        "seconds: /health 503 and no more watchdog pings (a step of a big prefill takes seconds).",
    )

    @model_validator(mode="after")
    def _drain_fits_stop_timeout(self) -> ServeConfig:
        if self.shutdown_grace_s + self.stop_margin_s > self.stop_timeout_s:
            raise ValueError(
                f"shutdown_grace_s ({self.shutdown_grace_s:g}) + stop_margin_s ({self.stop_margin_s:g}) "
                f"exceeds stop_timeout_s ({self.stop_timeout_s:g}, the unit's TimeoutStopSec): systemd "
                "would SIGKILL the drain; lower the grace or raise TimeoutStopSec and stop_timeout_s together"
            )
        return self


class LogConfig(_Table):
    """[log]: where log events go."""

    level: Literal["debug", "info", "warning", "error"] = Field("info", description="Lowest level logged.")
    target: Literal["auto", "console", "json", "journald"] = Field(
        "auto",
        description="auto: journald when stderr is the journal (JOURNAL_STREAM), console lines on "
        "a TTY, JSON lines otherwise.",
    )
    journal_socket: str = Field(
        "/run/systemd/journal/socket", description="journald's native protocol socket."
    )


TABLES: dict[str, type[_Table]] = {
    "model": ModelConfig,
    "numa": NumaConfig,
    "pipeline": PipelineConfig,
    "fastload": FastloadConfig,
    "placement": PlacementConfig,
    "replication": ReplicationConfig,
    "pin": PinConfig,
    "warmup": WarmupConfig,
    "engine": EngineConfig,
    "serve": ServeConfig,
    "log": LogConfig,
}

_FILE_DATA: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar("_FILE_DATA", default=None)


class _FileSource(PydanticBaseSettingsSource):
    """The parsed TOML file, lowest priority of the explicit sources."""

    def get_field_value(self, field, field_name):  # pragma: no cover - unused by __call__
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        return _FILE_DATA.get() or {}


class Settings(BaseSettings):
    """The effective configuration: one attribute per TOML table."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="forbid", case_sensitive=False
    )

    model: ModelConfig = Field(default_factory=ModelConfig, description=ModelConfig.__doc__)
    numa: NumaConfig = Field(default_factory=NumaConfig, description=NumaConfig.__doc__)
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig, description=PipelineConfig.__doc__)
    fastload: FastloadConfig = Field(default_factory=FastloadConfig, description=FastloadConfig.__doc__)
    placement: PlacementConfig = Field(default_factory=PlacementConfig, description=PlacementConfig.__doc__)
    replication: ReplicationConfig = Field(
        default_factory=ReplicationConfig, description=ReplicationConfig.__doc__
    )
    pin: PinConfig = Field(default_factory=PinConfig, description=PinConfig.__doc__)
    warmup: WarmupConfig = Field(default_factory=WarmupConfig, description=WarmupConfig.__doc__)
    engine: EngineConfig = Field(default_factory=EngineConfig, description=EngineConfig.__doc__)
    serve: ServeConfig = Field(default_factory=ServeConfig, description=ServeConfig.__doc__)
    log: LogConfig = Field(default_factory=LogConfig, description=LogConfig.__doc__)

    @classmethod
    def settings_customise_sources(
        cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings
    ):
        return (init_settings, env_settings, _FileSource(settings_cls))

    def model_path(self) -> Path:
        """``model.path`` with ``~`` and $VARS expanded; the demo model's path when empty."""
        if not self.model.path:
            from moe_service.paths import demo_model_path

            return demo_model_path()
        return Path(os.path.expandvars(os.path.expanduser(self.model.path)))

    def to_toml_dict(self) -> dict[str, Any]:
        """Plain dict of every table and key (JSON/TOML-serialisable)."""
        return self.model_dump(mode="json")


# ---------------------------------------------------------------------------------------------
# Loading


def resolve_config_path(explicit: str | os.PathLike | None) -> Path | None:
    """The TOML file to read: ``explicit``, else $MOE_SERVICE_CONFIG, else configs/default.toml
    (in the current directory, then in this source tree); None when there is none (defaults)."""
    if explicit:
        return Path(explicit)
    env = os.environ.get(ENV_CONFIG_PATH)
    if env:
        return Path(env)
    for candidate in (Path("configs/default.toml"), REPO_DEFAULT_CONFIG):
        if candidate.is_file():
            return candidate
    return None


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, not a config file") from None
    except PermissionError:
        raise ConfigError(f"{path}: permission denied") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None


def _suggest(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _env_var_for(loc: tuple) -> str | None:
    """The MOE_SERVICE__ variable that set the value at ``loc``, if one did."""
    name = ENV_PREFIX + "__".join(str(p) for p in loc)
    for key in os.environ:
        if key.upper() == name.upper():
            return key
    # a whole table given as JSON
    if loc:
        table = ENV_PREFIX + str(loc[0])
        for key in os.environ:
            if key.upper() == table.upper():
                return key
    return None


def _describe(err: dict[str, Any]) -> str:
    """One pydantic error as ``must be ... (got ...)``."""
    t, ctx, value = err["type"], err.get("ctx") or {}, err.get("input")
    got = f" (got {value!r})" if not isinstance(value, dict | list) else ""
    if t in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        op = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}[t]
        bound = next(iter(ctx.values()))
        return f"must be {op} {bound}{got}"
    if t == "literal_error":
        return f"must be one of {ctx.get('expected')}{got}"
    if t in ("int_parsing", "int_type", "int_from_float"):
        return f"must be an integer{got}"
    if t in ("float_parsing", "float_type"):
        return f"must be a number{got}"
    if t in ("bool_parsing", "bool_type"):
        return f"must be true or false{got}"
    if t in ("string_type",):
        return f"must be a string{got}"
    if t in ("list_type",):
        return f"must be a list{got}"
    if t in ("model_type", "model_attributes_type", "dict_type"):
        return f"must be a table{got}"
    if t == "value_error":
        return str(ctx.get("error", err["msg"]))
    return f"{err['msg']}{got}"


def _format_errors(exc: ValidationError, source: str) -> list[str]:
    lines = []
    for err in exc.errors():
        loc = tuple(p for p in err["loc"] if p != "__root__")
        dotted = ".".join(str(p) for p in loc)
        where = _env_var_for(loc) or source
        if err["type"] == "extra_forbidden":
            if len(loc) == 1:
                msg = f"unknown table [{loc[0]}]{_suggest(str(loc[0]), TABLES)}"
            else:
                table = TABLES.get(str(loc[0]))
                known = table.model_fields if table else {}
                msg = f"{dotted}: unknown key{_suggest(str(loc[-1]), known)}"
            lines.append(f"{where}: {msg}")
        else:
            lines.append(f"{where}: {dotted}: {_describe(err)}" if dotted else f"{where}: {_describe(err)}")
    return lines


def _unknown_env_tables() -> list[str]:
    """MOE_SERVICE__<TABLE>__... variables whose table does not exist (pydantic-settings
    silently ignores them, which would hide a typo)."""
    lines = []
    for key in os.environ:
        if key.upper().startswith(ENV_PREFIX):
            table = key[len(ENV_PREFIX) :].split("__", 1)[0].lower()
            if table not in TABLES:
                lines.append(f"{key}: unknown table [{table}]{_suggest(table, TABLES)}")
    return lines


def load_config(
    path: str | os.PathLike | None = None, *, model: str | None = None, data: dict | None = None
) -> Settings:
    """Read, merge and validate the configuration (see the module docstring for priorities).

    ``path``: explicit TOML file (``--config``); ``model``: the ``--model`` shortcut;
    ``data``: an already-parsed TOML dict (tests), used instead of a file.
    Returns the :class:`Settings`. Raises ConfigError listing every problem, one line each,
    naming the file or environment variable and the dotted key.
    """
    if data is not None:
        source, file_data = "<config>", data
    else:
        resolved = resolve_config_path(path)
        source = str(resolved) if resolved else "<defaults>"
        file_data = _read_toml(resolved) if resolved else {}
    problems = _unknown_env_tables()
    overrides: dict[str, Any] = {}
    if model is not None:
        overrides["model"] = {"path": model}
    token = _FILE_DATA.set(file_data)
    try:
        settings = Settings(**overrides)
    except ValidationError as e:
        problems += _format_errors(e, source)
    except Exception as e:  # pydantic-settings' own errors, e.g. bad JSON in an env variable
        problems.append(f"environment: {e}")
    finally:
        _FILE_DATA.reset(token)
    if problems:
        raise ConfigError(f"invalid configuration ({len(problems)} problem(s))", problems)
    settings._source = source  # type: ignore[attr-defined]
    return settings


def config_source(settings: Settings) -> str:
    """Where ``settings`` were read from: a file path, ``<defaults>`` or ``<config>``."""
    return getattr(settings, "_source", "<defaults>")


def dump_toml(settings: Settings) -> str:
    """The effective configuration as TOML text (``moe-service config show``)."""
    import tomli_w

    return tomli_w.dumps(settings.to_toml_dict())


def describe_fields() -> dict[str, dict[str, dict[str, Any]]]:
    """Every table -> key -> {default, description}: the reference for docs and tests."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for name, table in TABLES.items():
        defaults = table().model_dump(mode="json")
        out[name] = {
            key: {"default": defaults[key], "description": f.description}
            for key, f in table.model_fields.items()
        }
    return out


def env_json(value: Any) -> str:
    """How to write ``value`` in a MOE_SERVICE__ variable (JSON for lists/tables)."""
    return value if isinstance(value, str) else json.dumps(value)
